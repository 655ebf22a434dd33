"""Wire format of the local channel between a vLLM connector and its sidecar.

Every frame is ``<u32 body length><u8 type><u32 seq>`` followed by the body.
``seq == 0`` means fire-and-forget (no reply: the per-layer PUSH and END);
any other seq gets exactly one REPLY frame with the same seq. One stream per
connection, handled in order, so fire-and-forget frames keep their order.

Bodies of frequent frames are fixed binary layouts (struct; strings as
``<u16 len><utf-8>``, id lists as ``<u32 n><u32 * n>``); HELLO and ADMIN,
which happen once per connection or by hand, are JSON.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

from kvpush.contract.target import PushTarget
from kvpush.channel.pool import StagingAllocation, StagingExtent

HEADER = struct.Struct("<IBI")
MAX_BODY = 16 << 20  # a frame larger than this is a bug or an attack

# client -> sidecar
HELLO, BEGIN, PUSH, END, QUERY, SUBSCRIBE, CONSUMED, PING, ADMIN, AWAIT, RECOMPUTED = range(1, 12)
# RECOMPUTED (decode, fire-and-forget): body JSON {"reservation_id", "reason"}; the engine
# computes the prompt itself instead of loading it (the sidecar counts it, by reason).
# sidecar -> client
REPLY, EVENT, RESERVATION = 100, 101, 102
# AWAIT (prefill): body a request id; the reply (JSON) is {"params": the reservation's
# PushParams dict, or null}; when null, one RESERVATION frame (JSON {"request_id",
# "params"}) follows as soon as the sidecar hears of the reservation.

OK, ERROR = 0, 1


class FrameError(ValueError):
    """A frame that does not parse."""


@dataclasses.dataclass(frozen=True)
class BeginRequest:
    """BEGIN: the request and its ``PushTarget`` (the one target shape; the frame is only
    its binary encoding)."""

    request_id: str  # the engine's request
    target: PushTarget  # where it goes (the BEGIN frame carries all but nixl_agent)


@dataclasses.dataclass(frozen=True)
class PushPiece:
    request_id: str
    layer: int
    start: int
    end: int  # 0 means "to the end of the request"


@dataclasses.dataclass(frozen=True)
class EndRequest:
    request_id: str
    aborted: bool
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class StateEvent:
    """A reservation's state: reply to QUERY/SUBSCRIBE/CONSUMED, and EVENT frames
    (decode: landing events; prefill: push outcomes, with ``request_id`` set)."""

    reservation_id: str
    state: str
    reason: str = ""
    request_id: str = ""
    num_tokens: int = 0
    src_tp: int = 1  # LANDED: the prefill engine's TP, which says where each head landed


def frame(kind: int, seq: int, body: bytes = b"") -> bytes:
    return HEADER.pack(len(body), kind, seq) + body


def _s(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 0xFFFF:
        raise FrameError("string too long for a frame")
    return struct.pack("<H", len(raw)) + raw


class _Reader:
    def __init__(self, body: bytes):
        self.body = memoryview(body)
        self.pos = 0

    def take(self, fmt: struct.Struct):
        try:
            values = fmt.unpack_from(self.body, self.pos)
        except struct.error as exc:
            raise FrameError(f"truncated frame: {exc}") from exc
        self.pos += fmt.size
        return values

    def str(self) -> str:
        (n,) = self.take(_U16)
        if self.pos + n > len(self.body):
            raise FrameError("truncated string")
        text = bytes(self.body[self.pos:self.pos + n]).decode()
        self.pos += n
        return text

    def u32s(self) -> tuple[int, ...]:
        (n,) = self.take(_U32)
        end = self.pos + 4 * n
        if end > len(self.body):
            raise FrameError("truncated id list")
        ids = np.frombuffer(self.body[self.pos:end], dtype="<u4")
        self.pos = end
        return tuple(ids.tolist())


_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
_BEGIN_NUMS = struct.Struct("<II")
_PUSH_NUMS = struct.Struct("<HII")
_ALLOC_HEAD = struct.Struct("<IIQQQI")
_EXTENT = struct.Struct("<IIII")
_HEADS = struct.Struct("<HH")


def encode_begin(b: BeginRequest) -> bytes:
    t = b.target
    ids = np.asarray(t.block_ids, dtype="<u4")
    return (_s(b.request_id) + _s(t.reservation_id) + _s(t.engine_id) + _s(t.incarnation)
            + _BEGIN_NUMS.pack(t.block_size, t.num_tokens) + _U32.pack(len(ids)) + ids.tobytes()
            + _U64.pack(max(0, t.deadline_unix_ms)) + _U16.pack(t.tp_size) + _s(t.prefill_incarnation))


def decode_begin(body: bytes) -> BeginRequest:
    r = _Reader(body)
    rid, res, eng, inc = r.str(), r.str(), r.str(), r.str()
    bs, nt = r.take(_BEGIN_NUMS)
    ids = r.u32s()
    (deadline,) = r.take(_U64)  # the sidecar refuses a push into a reservation past it
    (tp,) = r.take(_U16)
    # The sidecar refuses a push named for another life of itself (absent from older connectors).
    prefill_inc = r.str() if r.pos < len(r.body) else ""
    return BeginRequest(rid, PushTarget(res, eng, inc, ids, bs, nt, deadline_unix_ms=deadline, tp_size=tp,
                                        prefill_incarnation=prefill_inc))


def encode_push(p: PushPiece) -> bytes:
    return _s(p.request_id) + _PUSH_NUMS.pack(p.layer, p.start, p.end)


def decode_push(body: bytes) -> PushPiece:
    r = _Reader(body)
    rid = r.str()
    return PushPiece(rid, *r.take(_PUSH_NUMS))


def encode_end(e: EndRequest) -> bytes:
    return _s(e.request_id) + bytes([1 if e.aborted else 0]) + _s(e.reason)


def decode_end(body: bytes) -> EndRequest:
    r = _Reader(body)
    rid = r.str()
    (flag,) = r.take(struct.Struct("<B"))
    return EndRequest(rid, bool(flag), r.str())


def encode_id(reservation_id: str) -> bytes:
    return _s(reservation_id)


def decode_id(body: bytes) -> str:
    return _Reader(body).str()


def encode_state(e: StateEvent) -> bytes:
    return (_s(e.reservation_id) + _s(e.state) + _s(e.reason) + _s(e.request_id) + _U32.pack(e.num_tokens)
            + _U16.pack(e.src_tp))


def decode_state(body: bytes) -> StateEvent:
    r = _Reader(body)
    res, state, reason, rid = r.str(), r.str(), r.str(), r.str()
    (nt,) = r.take(_U32)
    (src_tp,) = r.take(_U16)
    return StateEvent(res, state, reason, rid, nt, src_tp)


def encode_allocs(allocs) -> bytes:
    """A BEGIN's answer: one allocation per head share the rank stages (none: it stages nothing)."""
    out = [_U16.pack(len(allocs))]
    for a in allocs:
        out.append(_ALLOC_HEAD.pack(a.alloc_id, a.num_dest_blocks, a.dest_block_layer_bytes, a.unit_bytes,
                                    a.layer_stride, len(a.extents)) + _HEADS.pack(a.first_head, a.num_heads))
        out.extend(_EXTENT.pack(*dataclasses.astuple(e)) for e in a.extents)
    return b"".join(out)


def decode_allocs(body: bytes) -> tuple[StagingAllocation, ...]:
    r = _Reader(body)
    (count,) = r.take(_U16)
    allocs = []
    for _ in range(count):
        alloc_id, nblocks, blb, unit, stride, n = r.take(_ALLOC_HEAD)
        first_head, num_heads = r.take(_HEADS)
        extents = tuple(StagingExtent(*r.take(_EXTENT)) for _ in range(n))
        allocs.append(StagingAllocation(alloc_id, "", extents, blb, nblocks, unit, stride, first_head, num_heads))
    return tuple(allocs)


def encode_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(body: bytes):
    try:
        return json.loads(body)
    except ValueError as exc:
        raise FrameError(f"bad JSON body: {exc}") from exc


def reply(seq: int, body: bytes = b"", error: str | None = None) -> bytes:
    if error is not None:
        return frame(REPLY, seq, bytes([ERROR]) + error.encode()[:60000])
    return frame(REPLY, seq, bytes([OK]) + body)

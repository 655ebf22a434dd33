"""Channel frames, NIXL notifications and engine records: round trips and refusals."""

from __future__ import annotations

import dataclasses

import pytest

from kvpush.contract.layout import KvLayout
from kvpush.channel import frames as F
from kvpush.sidecar import notify
from kvpush.contract.engine import EngineRecord
from kvpush.contract.target import PushTarget
from kvpush.contract.v1 import types_pb2
from kvpush.channel.pool import StagingAllocation, StagingExtent

LAYOUT = KvLayout(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def test_frames_round_trip():
    begin = F.BeginRequest("req-1", PushTarget("res-1", "decode-0", "inc9", tuple(range(7, 70)), 16, 1000))
    assert F.decode_begin(F.encode_begin(begin)) == begin
    timed = F.BeginRequest("req-2", PushTarget("res-2", "decode-0", "inc9", (1, 2), 16, 20,
                                               deadline_unix_ms=1_790_000_000_123))
    assert F.decode_begin(F.encode_begin(timed)) == timed  # the deadline travels (the sidecar checks it)
    tp = F.BeginRequest("req-3", PushTarget("res-3", "decode-0", "inc9", (1, 2), 16, 20, tp_size=4))
    assert F.decode_begin(F.encode_begin(tp)) == tp  # the decode TP: the prefill plans heads at BEGIN
    named = F.BeginRequest("req-4", PushTarget("res-4", "decode-0", "inc9", (1, 2), 16, 20, prefill_incarnation="p7"))
    assert F.decode_begin(F.encode_begin(named)) == named  # the pusher's life: a later life refuses it
    older = F.encode_begin(F.BeginRequest("req-5", PushTarget("res-5", "decode-0", "inc9", (1, 2), 16, 20)))[:-2]
    assert F.decode_begin(older).target.prefill_incarnation == ""  # a connector that does not say it
    piece = F.PushPiece("req-1", 31, 512, 1000)
    assert F.decode_push(F.encode_push(piece)) == piece
    end = F.EndRequest("req-1", True, "client went away")
    assert F.decode_end(F.encode_end(end)) == end
    state = F.StateEvent("res-1", "LANDED", "", "req-1", 1000)
    assert F.decode_state(F.encode_state(state)) == state
    alloc = StagingAllocation(5, "", (StagingExtent(0, 4, 0, 2), StagingExtent(9, 4, 2, 2)), 4096, 4, 2048, 1 << 20)
    assert F.decode_allocs(F.encode_allocs((alloc,))) == (alloc,)
    shares = (dataclasses.replace(alloc, first_head=0, num_heads=2), dataclasses.replace(alloc, alloc_id=8,
                                                                                         first_head=2, num_heads=2))
    assert F.decode_allocs(F.encode_allocs(shares)) == shares and F.decode_allocs(F.encode_allocs(())) == ()
    assert F.decode_id(F.encode_id("res-ü")) == "res-ü"
    assert len(F.encode_push(piece)) < 32  # the per-layer frame stays tiny


@pytest.mark.parametrize("decoder,body", [(F.decode_push, b"\x05\x00ab"), (F.decode_begin, b"\x01"),
                                          (F.decode_state, b""), (F.decode_json, b"{nope")])
def test_truncated_frames_are_refused(decoder, body):
    with pytest.raises(F.FrameError):
        decoder(body)


def test_notifications_round_trip():
    landed = notify.PushNotice(notify.LANDED, "res-1", "inc", (4, 5, 6, 9, 10, 2), 16, 90, (1, 2, 3, 4, 5, 6))
    assert notify.decode(notify.encode(landed)) == landed
    tp = dataclasses.replace(landed, checksums=None, src_tp=4)  # from a prefill engine of TP 4
    assert notify.decode(notify.encode(tp)) == tp
    begin = notify.PushNotice(notify.BEGIN, "res-1", "inc")
    assert notify.decode(notify.encode(begin)) == begin
    abort = notify.PushNotice(notify.ABORT, "res-1", "inc", reason="peer died")
    assert notify.decode(notify.encode(abort)) == abort
    final = notify.PushNotice(notify.FINAL, "res-1", "inc", eta_s=0.00125)
    assert notify.decode(notify.encode(final)) == final
    # A sender's absurd estimate cannot keep the receiver polling fine for long.
    assert notify.decode(b'KVP1F{"r":"x","i":"y","eta":1e12}').eta_s == 10.0
    assert notify.decode(b'KVP1F{"r":"x","i":"y","eta":-5}').eta_s == 0.0
    # Contiguous ids travel as one run: a big reservation is still a small message.
    big = notify.PushNotice(notify.LANDED, "r", "i", tuple(range(1000, 1512)), 16, 8192)
    assert len(notify.encode(big)) < 100


@pytest.mark.parametrize("message", [b"hello", b"KVP1", b"KVP1X{}", b"KVP1L{\"r\":1}", b"KVP1L[1,2"])
def test_foreign_or_broken_notifications_are_refused(message):
    with pytest.raises(notify.NotifError):
        notify.decode(message)


def record(**changes) -> EngineRecord:
    fields = dict(engine_id="decode-0", role=types_pb2.DECODE, layout=LAYOUT, incarnation="inc1",
                  nixl_agent="decode-0.inc1", nixl_metadata=b"\x00md\xff", num_blocks=100,
                  pool_base_address=140000000000, pool_size_bytes=LAYOUT.pool_bytes(100))
    return EngineRecord(**{**fields, **changes})


def test_engine_record_round_trips_through_dict_json_and_proto():
    rec = record(model="m", pool="p", sidecar_address="unix:/x", registered_ms=5)
    assert EngineRecord.from_dict(rec.to_dict()) == rec
    assert EngineRecord.decode(rec.encode()) == rec
    engine = rec.to_proto()
    assert EngineRecord.from_proto(types_pb2.Engine.FromString(engine.SerializeToString())) == rec
    engine.kv_layout.kv_parts = 0  # proto default means 2
    assert EngineRecord.from_proto(engine).layout.kv_parts == 2


def test_a_pusher_refuses_a_pool_too_small_for_its_blocks():
    assert record().push_problem() == ""
    assert "cannot hold" in record(pool_size_bytes=LAYOUT.pool_bytes(100) - 1).push_problem()
    assert record(nixl_agent="").push_problem()
    assert record(memory_kind="HBM").push_problem()

"""Typed records stored in etcd (as JSON) and their conversion to API messages.

``ReservationRecord`` is the stored reservation: besides its ``PushTarget`` fields
(``kvpush/contract/target.py``) it holds what only the control plane keeps (tenant,
state, deadline, the prefill engine, compressed extents), in the form that is cheapest
to hold 100k of. Engines are stored as the contract's ``EngineRecord``."""

from __future__ import annotations

import dataclasses
import json
import time

import msgspec

from kvpush.contract.states import State
from kvpush.contract.v1 import types_pb2


# msgspec writes and reads the same JSON as the json module, five times faster: two
# records are written and one read per reservation, on every replica's hot path.
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def now_ms() -> int:
    return int(time.time() * 1000)


Extents = tuple[tuple[int, int], ...]


def to_extents(blocks: list[int]) -> Extents:
    """Compress sorted-or-not block ids (kept in order) into (start, count) runs.
    Tuples of ints, not lists: the garbage collector stops tracking them, and a
    replica holding 100k live reservations pays for every tracked object in each
    full collection (102 ms with lists, 21 ms without; see view.py)."""
    extents: list[list[int]] = []
    for b in blocks:
        if extents and extents[-1][0] + extents[-1][1] == b:
            extents[-1][1] += 1
        else:
            extents.append([b, 1])
    return tuple((start, count) for start, count in extents)


def from_extents(extents: Extents) -> list[int]:
    return [start + i for start, count in extents for i in range(count)]


@dataclasses.dataclass(slots=True)
class ReservationRecord:
    id: str
    tenant: str
    request_id: str
    engine_id: str
    incarnation: str
    nixl_agent: str
    extents: Extents
    block_size: int
    num_tokens: int
    model: str
    state: State
    deadline_ms: int
    created_ms: int
    reason: str = ""
    prefill_engine_id: str = ""   # named in Reserve, or set by the PUSHING report
    ended_ms: int = 0             # set when it reaches a terminal state
    prefill_incarnation: str = ""  # with prefill_engine_id ("" from sidecars that do not say)
    moved_from: str = ""          # decode failover: the reservation this one replaces
    moved_to: str = ""            # on the replaced one: its successor
    decode_tp: int = 1            # the decode engine's tensor-parallel ranks
    cached_tokens: int = 0        # leading prompt tokens the engine held in its prefix cache when chosen

    @property
    def blocks(self) -> list[int]:
        return from_extents(self.extents)

    @property
    def num_blocks(self) -> int:
        return sum(count for _, count in self.extents)

    def encode(self) -> bytes:
        # Written out by hand: dataclasses.asdict deep-copies and costs more
        # than the rest of a Reserve on the hot path.
        data = {
            "id": self.id, "tenant": self.tenant, "request_id": self.request_id, "engine_id": self.engine_id,
            "incarnation": self.incarnation, "nixl_agent": self.nixl_agent, "extents": self.extents,
            "block_size": self.block_size, "num_tokens": self.num_tokens, "model": self.model,
            "state": self.state.name, "deadline_ms": self.deadline_ms, "created_ms": self.created_ms,
            "reason": self.reason, "prefill_engine_id": self.prefill_engine_id, "ended_ms": self.ended_ms,
            "prefill_incarnation": self.prefill_incarnation}
        if self.moved_from:  # rare (failover, TP): left out otherwise, as decode defaults them
            data["moved_from"] = self.moved_from
        if self.moved_to:
            data["moved_to"] = self.moved_to
        if self.decode_tp != 1:
            data["decode_tp"] = self.decode_tp
        if self.cached_tokens:
            data["cached_tokens"] = self.cached_tokens
        return _encode(data)

    @classmethod
    def decode(cls, raw: bytes) -> "ReservationRecord":
        data = _decode(raw)
        data["state"] = State[data["state"]]
        data["extents"] = tuple((start, count) for start, count in data["extents"])
        return cls(**data)

    def to_proto(self) -> types_pb2.Reservation:
        return types_pb2.Reservation(
            id=self.id, tenant=self.tenant, request_id=self.request_id, engine_id=self.engine_id,
            nixl_agent=self.nixl_agent, block_ids=self.blocks, block_size=self.block_size,
            num_tokens=self.num_tokens, model=self.model, state=int(self.state),
            deadline_unix_ms=self.deadline_ms, created_unix_ms=self.created_ms, reason=self.reason,
            engine_incarnation=self.incarnation, prefill_engine_id=self.prefill_engine_id,
            ended_unix_ms=self.ended_ms, prefill_engine_incarnation=self.prefill_incarnation,
            moved_from=self.moved_from, moved_to=self.moved_to, decode_tp_size=self.decode_tp,
            cached_tokens=self.cached_tokens)


@dataclasses.dataclass(frozen=True)
class DecodeAlone:
    """A Reserve's answer when nothing is reserved (conditional disaggregation): the decode
    engine lacks so little of the prompt that it computes the rest itself. Never stored."""
    tenant: str
    request_id: str
    engine_id: str
    incarnation: str
    block_size: int
    num_tokens: int
    model: str
    cached_tokens: int

    def to_proto(self) -> types_pb2.Reservation:
        return types_pb2.Reservation(
            tenant=self.tenant, request_id=self.request_id, engine_id=self.engine_id,
            engine_incarnation=self.incarnation, block_size=self.block_size, num_tokens=self.num_tokens,
            model=self.model, cached_tokens=self.cached_tokens, decode_alone=True)


@dataclasses.dataclass
class TenantRecord:
    name: str
    quota_blocks: int
    allowed_pools: list[str]
    token_sha256: str

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "TenantRecord":
        return cls(**json.loads(raw))

    def allows(self, pool: str) -> bool:
        return not self.allowed_pools or pool in self.allowed_pools

    def to_proto(self, reserved_blocks: int = 0, token: str = "") -> types_pb2.Tenant:
        return types_pb2.Tenant(name=self.name, quota_blocks=self.quota_blocks,
                                allowed_pools=self.allowed_pools, token=token,
                                reserved_blocks=reserved_blocks)


@dataclasses.dataclass(frozen=True)
class RequestEntry:
    """A request index value (keys.request): the live reservation a tenant's request id has,
    and its blocks, so that a tenant's usage is the sum over its index alone (request_index.py);
    and the replica whose share of the tenant's quota it was counted in, if any (quota_shares.py)."""
    reservation_id: str
    num_blocks: int
    share: str = ""

    def encode(self) -> bytes:
        if self.share:
            return b"%s %d %s" % (self.reservation_id.encode(), self.num_blocks, self.share.encode())
        return b"%s %d" % (self.reservation_id.encode(), self.num_blocks)

    @classmethod
    def decode(cls, raw: bytes) -> "RequestEntry":
        res_id, _, rest = raw.decode().partition(" ")
        blocks, _, share = rest.partition(" ")
        return cls(res_id, int(blocks or 0), share)


@dataclasses.dataclass(frozen=True)
class ReplicaRecord:
    """A live control-plane replica, kept under its own lease (kvpush/controlplane/ownership.py)."""
    replica_id: str
    address: str
    started_ms: int

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @property
    def reachable(self) -> str:
        """Its address as another replica can dial it; "" when it listens on every interface
        and advertised none (--advertise)."""
        host = self.address.rpartition(":")[0].strip("[]")
        return "" if host in ("", "0.0.0.0", "::") else self.address

    @classmethod
    def decode(cls, raw: bytes) -> "ReplicaRecord":
        fields = json.loads(raw)
        return cls(str(fields["replica_id"]), str(fields.get("address", "")), int(fields.get("started_ms", 0)))


def encode_free(free: dict[str, int]) -> bytes:
    """A replica's own engines' free blocks, as it tells the others (free_summary.py)."""
    return json.dumps(free, separators=(",", ":"), sort_keys=True).encode()


def decode_free(raw: bytes) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads(raw).items()}
    except (ValueError, TypeError, AttributeError):  # a bad summary steers nothing
        return {}

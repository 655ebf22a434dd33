"""Typed records stored in etcd (as JSON) and their conversion to API messages."""

from __future__ import annotations

import base64
import dataclasses
import json
import time

from controlplane.lifecycle_states import State
from kvpush.contract.layout import KvLayout
from kvpush.contract.v1 import types_pb2


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

    @property
    def blocks(self) -> list[int]:
        return from_extents(self.extents)

    @property
    def num_blocks(self) -> int:
        return sum(count for _, count in self.extents)

    def encode(self) -> bytes:
        # Written out by hand: dataclasses.asdict deep-copies and costs more
        # than the rest of a Reserve on the hot path.
        return json.dumps({
            "id": self.id, "tenant": self.tenant, "request_id": self.request_id, "engine_id": self.engine_id,
            "incarnation": self.incarnation, "nixl_agent": self.nixl_agent, "extents": self.extents,
            "block_size": self.block_size, "num_tokens": self.num_tokens, "model": self.model,
            "state": self.state.name, "deadline_ms": self.deadline_ms, "created_ms": self.created_ms,
            "reason": self.reason, "prefill_engine_id": self.prefill_engine_id, "ended_ms": self.ended_ms,
            "prefill_incarnation": self.prefill_incarnation},
            separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "ReservationRecord":
        data = json.loads(raw)
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
            ended_unix_ms=self.ended_ms, prefill_engine_incarnation=self.prefill_incarnation)


@dataclasses.dataclass
class EngineRecord:
    engine_id: str
    role: int  # kvpush.v1.EngineRole
    model: str
    layout: KvLayout
    nixl_agent: str
    nixl_metadata: bytes
    num_blocks: int
    sidecar_address: str
    pool: str
    incarnation: str
    registered_ms: int
    memory_kind: str = "DRAM"
    pool_base_address: int = 0
    pool_size_bytes: int = 0
    device_id: int = 0

    @property
    def is_decode(self) -> bool:
        return self.role == types_pb2.DECODE

    def encode(self) -> bytes:
        data = dataclasses.asdict(self)
        data["layout"] = self.layout.to_dict()
        data["nixl_metadata"] = base64.b64encode(self.nixl_metadata).decode()
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "EngineRecord":
        data = json.loads(raw)
        data["layout"] = KvLayout.from_dict(data["layout"])
        data["nixl_metadata"] = base64.b64decode(data["nixl_metadata"])
        return cls(**data)

    def to_proto(self) -> types_pb2.Engine:
        lay = self.layout
        return types_pb2.Engine(
            engine_id=self.engine_id, role=self.role, model=self.model,
            kv_layout=types_pb2.KvLayout(num_layers=lay.num_layers, block_size=lay.block_size,
                                         num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                                         dtype=lay.dtype, kv_parts=lay.kv_parts),
            nixl_agent=self.nixl_agent, nixl_metadata=self.nixl_metadata, num_blocks=self.num_blocks,
            sidecar_address=self.sidecar_address, pool=self.pool, incarnation=self.incarnation,
            registered_unix_ms=self.registered_ms, memory_kind=self.memory_kind,
            pool_base_address=self.pool_base_address, pool_size_bytes=self.pool_size_bytes,
            device_id=self.device_id)


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


def layout_from_proto(msg: types_pb2.KvLayout, field: str = "kv_layout") -> KvLayout:
    """Raises kvpush.contract.layout.LayoutError naming ``field`` on bad values."""
    from kvpush.contract.layout import LayoutError
    try:
        return KvLayout(num_layers=msg.num_layers, block_size=msg.block_size, num_kv_heads=msg.num_kv_heads,
                        head_dim=msg.head_dim, dtype=msg.dtype or "float32", kv_parts=msg.kv_parts or 2)
    except LayoutError as exc:
        raise LayoutError(str(exc).replace("kv_layout", field, 1)) from None

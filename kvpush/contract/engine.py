"""``EngineRecord``: one engine as the system knows it, the one shape of it in Python.

The control plane stores it in etcd (JSON: ``encode``/``decode``) and serves it as
the ``kvpush.v1.Engine`` message (``to_proto``/``from_proto``); a sidecar builds its
own at start and publishes it, and a prefill sidecar caches its decode peers' records
(``kvpush/sidecar/peers.py``). What a pusher needs of a peer (agent, metadata, pool address
and size, block count, layout, memory kind) is checked by ``push_problem``, not at
construction: the control plane also holds records of simulated engines, which have
no pool behind them.
"""

from __future__ import annotations

import base64
import dataclasses
import json

from kvpush.contract.layout import KvLayout
from kvpush.contract.v1 import types_pb2

MEMORY_KINDS = ("DRAM", "VRAM")  # NIXL's names; one engine's pool is one kind


@dataclasses.dataclass(frozen=True)
class EngineRecord:
    engine_id: str
    role: int  # kvpush.v1.EngineRole (contract.states.role_to_proto / role_from_proto)
    layout: KvLayout
    incarnation: str  # changes at every sidecar start: a new pool, new agent, new blocks
    nixl_agent: str
    nixl_metadata: bytes
    num_blocks: int  # landing blocks (decode) or staging units (prefill)
    model: str = ""
    pool: str = "default"  # the engine pool tenants are allowed (not the memory pool)
    sidecar_address: str = ""
    registered_ms: int = 0  # set by the control plane
    memory_kind: str = "DRAM"
    pool_base_address: int = 0
    pool_size_bytes: int = 0
    device_id: int = 0
    serving_url: str = ""  # its OpenAI server, where routers send its requests
    unavailable: str = ""  # why it cannot serve now ("" = it can); set by its sidecar
    # Tensor parallelism: (base address, device) of each rank's pool, rank order; () when
    # layout.tp_size is 1 (pool_base_address and device_id are the only rank's).
    rank_pools: tuple[tuple[int, int], ...] = ()

    @property
    def is_decode(self) -> bool:
        return self.role == types_pb2.DECODE

    @property
    def expected_rank_pools(self) -> int:
        """How many ``rank_pools`` the record must list: every rank's with TP, none without."""
        return self.layout.tp_size if self.layout.tp_size > 1 else 0

    def rank_pool(self, rank: int) -> tuple[int, int]:
        """(base address, device) of rank ``rank``'s pool."""
        if self.rank_pools:
            return self.rank_pools[rank]
        if rank != 0:
            raise ValueError(f"engine {self.engine_id} has one rank, not {rank + 1}")
        return self.pool_base_address, self.device_id

    def push_problem(self) -> str:
        """Why a prefill sidecar could not write into this engine's pool ("" when it can)."""
        if not self.engine_id or not self.nixl_agent or not self.nixl_metadata:
            return "engine record needs engine_id, nixl_agent and nixl_metadata"
        if self.num_blocks <= 0:
            return f"engine {self.engine_id}: num_blocks must be positive"
        need = self.layout.pool_bytes(self.num_blocks)
        if self.pool_size_bytes < need:
            return (f"engine {self.engine_id}: pool of {self.pool_size_bytes} bytes cannot hold "
                    f"{self.num_blocks} blocks ({need} bytes)")
        if self.memory_kind not in MEMORY_KINDS:
            return f"engine {self.engine_id}: memory_kind must be one of {MEMORY_KINDS}"
        if len(self.rank_pools) != self.expected_rank_pools:
            return (f"engine {self.engine_id}: tp_size {self.layout.tp_size} needs {self.expected_rank_pools} "
                    f"rank pools, has {len(self.rank_pools)}")
        return ""

    # -- the proto edge --------------------------------------------------------------------
    def to_proto(self) -> types_pb2.Engine:
        return types_pb2.Engine(
            engine_id=self.engine_id, role=self.role, model=self.model, kv_layout=self.layout.to_proto(),
            nixl_agent=self.nixl_agent, nixl_metadata=self.nixl_metadata, num_blocks=self.num_blocks,
            sidecar_address=self.sidecar_address, pool=self.pool, incarnation=self.incarnation,
            registered_unix_ms=self.registered_ms, memory_kind=self.memory_kind,
            pool_base_address=self.pool_base_address, pool_size_bytes=self.pool_size_bytes,
            device_id=self.device_id, serving_url=self.serving_url, unavailable=self.unavailable,
            rank_pools=[types_pb2.RankPool(base_address=b, device_id=d) for b, d in self.rank_pools])

    @classmethod
    def from_proto(cls, msg: types_pb2.Engine, field: str = "engine") -> "EngineRecord":
        """Raises ``LayoutError`` (a ValueError) naming ``field.kv_layout`` on a bad layout."""
        return cls(engine_id=msg.engine_id, role=msg.role, layout=KvLayout.from_proto(msg.kv_layout,
                                                                                        f"{field}.kv_layout"),
                   incarnation=msg.incarnation, nixl_agent=msg.nixl_agent, nixl_metadata=bytes(msg.nixl_metadata),
                   num_blocks=msg.num_blocks, model=msg.model, pool=msg.pool, sidecar_address=msg.sidecar_address,
                   registered_ms=msg.registered_unix_ms, memory_kind=msg.memory_kind or "DRAM",
                   pool_base_address=msg.pool_base_address, pool_size_bytes=msg.pool_size_bytes,
                   device_id=msg.device_id, serving_url=msg.serving_url, unavailable=msg.unavailable,
                   rank_pools=tuple((r.base_address, r.device_id) for r in msg.rank_pools))

    # -- JSON (etcd, ready files, the sidecar's admin ops) ----------------------------------------
    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["layout"] = self.layout.to_dict()
        data["nixl_metadata"] = base64.b64encode(self.nixl_metadata).decode()
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "EngineRecord":
        return cls(**{**data, "layout": KvLayout.from_dict(data["layout"]),
                      "nixl_metadata": base64.b64decode(data["nixl_metadata"]),
                      "rank_pools": tuple(tuple(r) for r in data.get("rank_pools", ()))})

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "EngineRecord":
        return cls.from_dict(json.loads(raw))

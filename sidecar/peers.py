"""Remote decode engines as a prefill sidecar sees them: learned once, cached.

An ``EngineRecord`` is the part of the control plane's ``Engine`` message a
pusher needs (agent name and metadata, pool base address and size, block
count, KV layout, incarnation). ``PeerRegistry.add`` turns one into a
``RemotePeer``: it loads the NIXL metadata into our agent once per
``(engine_id, incarnation)`` and starts the connection, so a request never
pays a handshake. A new incarnation of an engine (its sidecar restarted, its
memory and blocks are new) replaces the old entry; a peer whose process went
away is marked dead so later pushes fail at once instead of timing out.

Today records come from wherever the caller got them (tests exchange them
between processes directly); the control-plane registry plugs in as
``PeerRegistry.resolver`` (engine id, incarnation -> record) plus calls to
``add``/``remove`` from its watch stream.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
from typing import Awaitable, Callable

from kvpush.contract.layout import KvLayout, LayoutError

log = logging.getLogger(__name__)


class PeerUnavailable(Exception):
    """No usable peer for this engine/incarnation (unknown, dead or replaced)."""


@dataclasses.dataclass(frozen=True)
class EngineRecord:
    """What a pusher must know of a decode engine (fields of the ``Engine`` proto)."""

    engine_id: str
    incarnation: str
    nixl_agent: str
    nixl_metadata: bytes
    pool_base_address: int
    pool_size_bytes: int
    num_blocks: int
    kv_layout: KvLayout
    memory_kind: str = "DRAM"
    device_id: int = 0

    def __post_init__(self) -> None:
        if not self.engine_id or not self.nixl_agent or not self.nixl_metadata:
            raise ValueError("engine record needs engine_id, nixl_agent and nixl_metadata")
        if self.num_blocks <= 0:
            raise ValueError(f"engine {self.engine_id}: num_blocks must be positive")
        need = self.kv_layout.pool_bytes(self.num_blocks)
        if self.pool_size_bytes < need:
            raise ValueError(f"engine {self.engine_id}: pool of {self.pool_size_bytes} bytes cannot hold "
                             f"{self.num_blocks} blocks ({need} bytes)")
        if self.memory_kind not in ("DRAM", "VRAM"):
            raise ValueError(f"engine {self.engine_id}: memory_kind must be DRAM or VRAM")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["nixl_metadata"] = base64.b64encode(self.nixl_metadata).decode()
        d["kv_layout"] = self.kv_layout.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineRecord":
        return cls(**{**d, "nixl_metadata": base64.b64decode(d["nixl_metadata"]),
                      "kv_layout": KvLayout.from_dict(d["kv_layout"])})

    @classmethod
    def from_proto(cls, engine) -> "EngineRecord":
        """From a ``kvpush.v1.Engine`` message (as published by the control plane)."""
        lo = engine.kv_layout
        try:
            layout = KvLayout(num_layers=lo.num_layers, block_size=lo.block_size, num_kv_heads=lo.num_kv_heads,
                              head_dim=lo.head_dim, dtype=lo.dtype, kv_parts=lo.kv_parts or 2)
        except LayoutError as exc:
            raise ValueError(f"engine {engine.engine_id}: {exc}") from exc
        return cls(engine_id=engine.engine_id, incarnation=engine.incarnation, nixl_agent=engine.nixl_agent,
                   nixl_metadata=bytes(engine.nixl_metadata), pool_base_address=engine.pool_base_address,
                   pool_size_bytes=engine.pool_size_bytes, num_blocks=engine.num_blocks, kv_layout=layout,
                   memory_kind=engine.memory_kind or "DRAM", device_id=engine.device_id)

    def fill_proto(self, engine) -> None:
        """Write our fields into a ``kvpush.v1.Engine`` message (for registration)."""
        engine.engine_id = self.engine_id
        engine.incarnation = self.incarnation
        engine.nixl_agent = self.nixl_agent
        engine.nixl_metadata = self.nixl_metadata
        engine.pool_base_address = self.pool_base_address
        engine.pool_size_bytes = self.pool_size_bytes
        engine.num_blocks = self.num_blocks
        engine.memory_kind = self.memory_kind
        engine.device_id = self.device_id
        for field, value in self.kv_layout.to_dict().items():
            setattr(engine.kv_layout, field, value)


@dataclasses.dataclass
class RemotePeer:
    record: EngineRecord
    agent_name: str  # as NIXL knows it (from the metadata)
    dead_reason: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.record.engine_id, self.record.incarnation)

    @property
    def layout(self) -> KvLayout:
        return self.record.kv_layout

    @property
    def layer_stride(self) -> int:
        return self.record.num_blocks * self.layout.block_layer_bytes

    def layer_base(self, layer: int) -> int:
        return self.record.pool_base_address + layer * self.layer_stride

    def check_blocks(self, block_ids, block_size: int) -> None:
        """Refuse block ids or a block size this engine's pool does not have."""
        if block_size != self.layout.block_size:
            raise ValueError(f"reservation block_size {block_size} != engine {self.record.engine_id} "
                             f"block_size {self.layout.block_size}")
        bad = [b for b in block_ids if not 0 <= b < self.record.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:5]} outside engine {self.record.engine_id}'s "
                             f"{self.record.num_blocks} blocks")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("reservation names a block twice")


Resolver = Callable[[str, str], Awaitable[EngineRecord]]


class PeerRegistry:
    """Cache of remote peers keyed by ``(engine_id, incarnation)``; one NIXL load each."""

    def __init__(self, agent, resolver: Resolver | None = None):
        self.agent = agent
        self.resolver = resolver
        self._by_engine: dict[str, RemotePeer] = {}
        self.loads = 0  # metadata loads, for tests: must not grow per request

    def add(self, record: EngineRecord) -> RemotePeer:
        current = self._by_engine.get(record.engine_id)
        if current is not None and current.record.incarnation == record.incarnation and not current.dead_reason:
            return current
        if current is not None:
            self.remove(record.engine_id)
        name = self.agent.add_remote(record.nixl_metadata)
        self.loads += 1
        if name != record.nixl_agent:
            self.agent.remove_remote(name)
            raise ValueError(f"engine {record.engine_id}: metadata is of agent {name!r}, "
                             f"record says {record.nixl_agent!r}")
        peer = RemotePeer(record, name)
        self._by_engine[record.engine_id] = peer
        try:
            self.agent.connect(name)
        except Exception as exc:  # the first transfer will connect (or fail) instead
            log.warning("early connect to %s failed: %s", name, exc)
        return peer

    def remove(self, engine_id: str) -> None:
        peer = self._by_engine.pop(engine_id, None)
        if peer is not None:
            self.agent.remove_remote(peer.agent_name)

    def mark_dead(self, engine_id: str, incarnation: str, reason: str) -> None:
        peer = self._by_engine.get(engine_id)
        if peer is not None and peer.record.incarnation == incarnation and not peer.dead_reason:
            log.warning("peer %s (%s) marked dead: %s", engine_id, incarnation, reason)
            peer.dead_reason = reason

    def get(self, engine_id: str, incarnation: str) -> RemotePeer:
        """The cached peer, or ``PeerUnavailable`` (never waits)."""
        peer = self._by_engine.get(engine_id)
        if peer is None:
            raise PeerUnavailable(f"engine {engine_id} is not known to this sidecar")
        if incarnation and peer.record.incarnation != incarnation:
            raise PeerUnavailable(f"engine {engine_id} incarnation {incarnation!r} is not the current one "
                                  f"({peer.record.incarnation!r})")
        if peer.dead_reason:
            raise PeerUnavailable(f"engine {engine_id} is gone: {peer.dead_reason}")
        return peer

    def cached(self, engine_id: str, incarnation: str) -> bool:
        peer = self._by_engine.get(engine_id)
        return peer is not None and (not incarnation or peer.record.incarnation == incarnation)

    async def resolve(self, engine_id: str, incarnation: str) -> RemotePeer:
        """Cached peer, or ask the resolver once (the control plane) and cache it."""
        if self.cached(engine_id, incarnation) or self.resolver is None:
            return self.get(engine_id, incarnation)
        record = await self.resolver(engine_id, incarnation)
        if record.engine_id != engine_id:
            raise PeerUnavailable(f"resolver answered engine {record.engine_id!r} for {engine_id!r}")
        self.add(record)
        return self.get(engine_id, incarnation)

    def peers(self) -> list[RemotePeer]:
        return list(self._by_engine.values())

"""Remote decode engines as a prefill sidecar sees them: learned once, cached.

A decode engine's ``EngineRecord`` (``kvpush/contract/engine.py``: agent name and
metadata, pool base address and size, block count, KV layout, incarnation) is
what a pusher needs of it. ``PeerRegistry.add`` turns one into a
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

import dataclasses
import logging
from typing import Awaitable, Callable

from kvpush.contract.engine import EngineRecord
from kvpush.contract.layout import KvLayout
from kvpush.sidecar.transport.base import Transport

log = logging.getLogger(__name__)


class PeerUnavailable(Exception):
    """No usable peer for this engine/incarnation (unknown, dead or replaced)."""


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
        return self.record.layout

    @property
    def layer_stride(self) -> int:
        return self.record.num_blocks * self.layout.block_layer_bytes

    def layer_base(self, layer: int, rank: int = 0) -> int:
        return self.record.rank_pool(rank)[0] + layer * self.layer_stride

    def device(self, rank: int = 0) -> int:
        return self.record.rank_pool(rank)[1]

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

    def __init__(self, transport: Transport, resolver: Resolver | None = None):
        self.transport = transport
        self.resolver = resolver
        self._by_engine: dict[str, RemotePeer] = {}
        self.loads = 0  # metadata loads, for tests: must not grow per request

    def add(self, record: EngineRecord) -> RemotePeer:
        current = self._by_engine.get(record.engine_id)
        if current is not None and current.record.incarnation == record.incarnation and not current.dead_reason:
            return current
        problem = record.push_problem()
        if problem:
            raise ValueError(problem)
        if current is not None:
            self.remove(record.engine_id)
        name = self.transport.add_remote(record.nixl_metadata)
        self.loads += 1
        if name != record.nixl_agent:
            self.transport.remove_remote(name)
            raise ValueError(f"engine {record.engine_id}: metadata is of agent {name!r}, "
                             f"record says {record.nixl_agent!r}")
        peer = RemotePeer(record, name)
        self._by_engine[record.engine_id] = peer
        try:
            self.transport.connect(name)
        except Exception as exc:  # the first transfer will connect (or fail) instead
            log.warning("early connect to %s failed: %s", name, exc)
        return peer

    def remove(self, engine_id: str) -> None:
        peer = self._by_engine.pop(engine_id, None)
        if peer is not None:
            self.transport.remove_remote(peer.agent_name)

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

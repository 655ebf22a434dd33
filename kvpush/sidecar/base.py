"""What every sidecar has, whatever its role: its pool, its transport, the progress
driver and the local channel. ``PrefillSidecar`` (``kvpush/sidecar/prefill.py``) and
``DecodeSidecar`` (``kvpush/sidecar/decode.py``) add their role's half of the channel;
``kvpush/sidecar/service.py`` makes either one a member of the system.

    sidecar = make_sidecar(SidecarConfig(...), on_push_outcome=..., on_landing_event=..., resolver=...)
    await sidecar.start()
    record = sidecar.engine_record()        # -> the Engine proto: record.to_proto()
    sidecar.add_peer(EngineRecord.from_proto(engine))   # prefill: learned from the control plane
    ...
    await sidecar.stop()
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import secrets
from typing import Callable

from kvpush.channel import frames as F
from kvpush.channel.device_memory import check_pool_device
from kvpush.channel.pool import StagingAllocation
from kvpush.contract.engine import EngineRecord
from kvpush.contract.layout import KvLayout
from kvpush.contract.states import DECODE, PREFILL, role_to_proto
from kvpush.trace import Trace
from kvpush.sidecar.channel_server import ChannelHandler, ChannelServer, Connection
from kvpush.sidecar.engine_presence import EnginePresence
from kvpush.sidecar.kv_events import KvEventsSource
from kvpush.sidecar.landing import LandingConfig
from kvpush.sidecar.pools import LayerMajorPool, pool_tag, remove_dead_pools
from kvpush.sidecar.progress import PollPolicy, ProgressDriver
from kvpush.sidecar.push import PushConfig
from kvpush.sidecar.transport.base import Transport
from kvpush.sidecar.transport.nixl import NixlConfig, NixlTransport

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SidecarConfig:
    engine_id: str
    role: str  # "prefill" (staging pool, pushes) or "decode" (landing pool, receives)
    layout: KvLayout
    num_blocks: int  # landing blocks (decode) or staging units of layout.block_size tokens (prefill)
    socket_path: str
    device: int | None = None  # the pool's GPU (its engine's; a VRAM pool), or None: shared memory (DRAM)
    incarnation: str = dataclasses.field(default_factory=lambda: secrets.token_hex(6))
    backends: tuple[str, ...] = ("UCX",)  # NIXL backends (kvpush/sidecar/transport/nixl.py)
    poll: PollPolicy = PollPolicy()
    push: PushConfig = PushConfig()
    landing: LandingConfig = LandingConfig()
    # Unavailable until the engine first connects (kvpush/sidecar/engine_presence.py); without
    # it the engine counts as there from the start, until its connections go away.
    wait_for_engine: bool = False
    engine_grace_s: float = 1.0  # the engine's last connection closed this long: it is gone
    # Decode: follow the engine's prefix-cache events (kvpush/sidecar/kv_events.py); None: not known.
    kv_events: KvEventsSource | None = None

    def __post_init__(self) -> None:
        if self.role not in (PREFILL, DECODE):
            raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {self.role!r}")
        if self.device is not None and self.push.checksums:
            raise ValueError("--checksums reads the pool on the host: not with a VRAM pool (--pool-device cpu)")
        if self.layout.tp_size > 1 and self.push.checksums:
            raise ValueError("--checksums covers engines without tensor parallelism only")
        if self.kv_events is not None and self.role != DECODE:
            raise ValueError("--kv-events is a decode sidecar's: prefill engines' caches are not routed by")

    @property
    def agent_name(self) -> str:
        # One name per incarnation: NIXL refuses to load new metadata under a
        # name it already holds, and a restarted engine is a new peer anyway.
        return f"{self.engine_id}.{self.incarnation}"


def nixl_transport(config: SidecarConfig) -> Transport:
    """The production transport: NIXL on the configured backends."""
    return NixlTransport(NixlConfig(config.agent_name, config.backends))


class SidecarBase(ChannelHandler):
    """The role-independent half of a sidecar, and the ``ChannelHandler`` for the frames
    every sidecar serves (HELLO, ADMIN, disconnects). A frame of the other role's half
    is refused with an error naming it."""

    def __init__(self, config: SidecarConfig, transport_factory: Callable[[SidecarConfig], Transport] | None = None):
        self.config = config
        self.transport_factory = transport_factory or nixl_transport
        self.accepting = True  # False while shutting down: new pushes are refused
        self.pools: list[LayerMajorPool] = []  # one per tensor-parallel rank, rank order
        self.transport: Transport | None = None
        self.driver: ProgressDriver | None = None
        self.server: ChannelServer | None = None
        self.trace = Trace.off()
        self.presence = EnginePresence(config.wait_for_engine, config.engine_grace_s)

    # -- what a role provides -------------------------------------------------------------------
    @abc.abstractmethod
    def _make_pool(self, tag: str, rank: int) -> LayerMajorPool:
        """The role's pool (landing or staging) of one rank, made at start: laid out with
        the engine's layout, whose byte sizes are one rank's; on the rank's GPU for a VRAM
        pool."""

    @property
    def pool(self) -> LayerMajorPool:
        """Rank 0's pool: the only one without tensor parallelism."""
        return self.pools[0]

    def rank_device(self, rank: int) -> int | None:
        """Rank ``rank``'s GPU: ``--pool-device`` is rank 0's, the ranks' are consecutive
        (vLLM gives local rank r the r-th visible GPU)."""
        return None if self.config.device is None else self.config.device + rank

    def _start_role(self) -> None:
        """Pool, transport and driver are up; the channel is not serving yet."""

    def _stop_role(self) -> None:
        pass

    @abc.abstractmethod
    def cancel_reservation(self, reservation_id: str, reason: str = "cancelled", hold: bool = False) -> bool:
        """The control plane ended a reservation (deadline, release): stop/ignore it here.
        ``hold``: it ended FAILED (its decode engine died): a prefill keeps its staging
        for a relocation."""

    @abc.abstractmethod
    def live_reservations(self) -> list[str]:
        """Reservations this sidecar is still working on."""

    @property
    def active_pushes(self) -> int:
        return 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        # A predecessor killed with SIGKILL left its pools (the size of ours) in /dev/shm.
        removed = remove_dead_pools(c.engine_id)
        if removed:
            log.warning("removed %d shared-memory pools left by dead sidecars of %s: %s", len(removed), c.engine_id,
                        " ".join(sorted(removed)))
        try:
            for rank in range(c.layout.tp_size):
                self.pools.append(self._make_pool(pool_tag(c.engine_id, c.role, rank), rank))
            self.transport = self.transport_factory(c)
            for pool in self.pools:
                self.transport.register(pool.memory)
            self.driver = ProgressDriver(self.transport, c.poll)
            self.trace = Trace(f"sidecar-{c.role}-{c.engine_id}")
            self._start_role()
            self.driver.start()
            self.server = ChannelServer(c.socket_path, self)
            await self.server.start()
        except BaseException:
            await self.stop()
            raise
        log.info("sidecar %s (%s, incarnation %s) serving on %s", c.engine_id, c.role, c.incarnation,
                 c.socket_path)

    async def stop(self) -> None:
        self.presence.close()
        if self.server is not None:
            await self.server.close()
            self.server = None
        self._stop_role()
        if self.driver is not None:
            await self.driver.stop()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for pool in self.pools:
            pool.close()
        self.pools = []

    def engine_record(self) -> EngineRecord:
        """This engine as peers must know it (published through the control plane)."""
        c, pool = self.config, self.pool
        return EngineRecord(engine_id=c.engine_id, role=role_to_proto(c.role), layout=c.layout,
                            incarnation=c.incarnation, nixl_agent=c.agent_name, nixl_metadata=self.transport.metadata(),
                            num_blocks=pool.num_units, sidecar_address=f"unix:{c.socket_path}",
                            memory_kind=pool.memory.mem_kind, pool_base_address=pool.base_address,
                            pool_size_bytes=pool.size_bytes, device_id=pool.memory.device_id,
                            unavailable=self.presence.unavailable,
                            rank_pools=tuple((p.base_address, p.memory.device_id) for p in self.pools)
                            if len(self.pools) > 1 else ())

    def stats(self) -> dict:
        return {"role": self.config.role, "engine_id": self.config.engine_id,
                "incarnation": self.config.incarnation, "polls": self.driver.polls,
                "inflight": self.driver.inflight, "engine_links": self.presence.links,
                "engine_unavailable": self.presence.unavailable, "engine_departures": self.presence.departures}

    # -- ChannelHandler: every role ------------------------------------------------------------
    def on_hello(self, conn: Connection, info: dict) -> dict:
        rank, tp = info.get("rank"), self.config.layout.tp_size
        conn.whole_engine = rank is None
        rank = rank or 0
        if not isinstance(rank, int) or not 0 <= rank < tp:
            raise ValueError(f"rank {rank!r}: sidecar {self.config.engine_id} serves an engine of tp_size={tp} "
                             f"(ranks 0..{tp - 1}); the engine's --tensor-parallel-size and the sidecar's "
                             "--kv-layout tp must agree")
        conn.rank = rank
        pool = self.pools[rank]
        # A VRAM pool serves the engine on its GPU only: a worker on another GPU (or none)
        # is refused here, with the fix, rather than failing to map the pool.
        if "cuda_device" in info and pool.memory.mem_kind == "VRAM":
            check_pool_device(pool.info(), info["cuda_device"])
        if info.get("engine"):
            self.presence.connected(conn)
        return {"role": self.config.role, "engine_id": self.config.engine_id,
                "incarnation": self.config.incarnation, "agent": self.config.agent_name,
                "pool": pool.info().to_dict(), "rank": rank, "layout": self.config.layout.to_dict()}

    def on_admin(self, conn: Connection, request: dict):
        op = request.get("op")
        if op == "stats":
            return self.stats()
        if op == "record":
            return self.engine_record().to_dict()
        if op == "cancel":
            return {"cancelled": self.cancel_reservation(request["reservation_id"], request.get("reason", "cancelled"))}
        if op == "drop_rank":  # a drill: the channels of one rank's worker break, as when it dies
            rank = int(request.get("rank", 0))
            dropped = [c for c in self.server.connections if c.rank == rank and c is not conn and c.info.get("engine")]
            for c in dropped:
                c.transport.close()
            return {"dropped": len(dropped)}
        if op == "expect":  # poll hot for a while: a peer is about to work with us (benchmarks)
            self.driver.expect(("admin", request.get("key", "")), float(request.get("seconds", 1.0)))
            return {}
        raise ValueError(f"unknown admin op {op!r}")

    def on_disconnect(self, conn: Connection) -> None:
        self.presence.disconnected(conn)

    # -- ChannelHandler: the other role's frames ---------------------------------------------------
    def _not_served(self, frame_name: str):
        raise ValueError(f"{frame_name} is not served by a {self.config.role} sidecar")

    def on_begin(self, conn: Connection, req: F.BeginRequest) -> StagingAllocation:
        self._not_served("BEGIN")

    def on_push(self, conn: Connection, piece: F.PushPiece) -> None:
        self._not_served("PUSH")

    def on_end(self, conn: Connection, end: F.EndRequest) -> None:
        pass  # an END after a restart of the channel, or to the wrong role: nothing to stop

    def on_await(self, conn: Connection, request_id: str) -> dict | None:
        self._not_served("AWAIT")

    def on_query(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        self._not_served("QUERY")

    def on_subscribe(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        self._not_served("SUBSCRIBE")

    def on_consumed(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        self._not_served("CONSUMED")

    def on_recomputed(self, conn: Connection, reservation_id: str, reason: str) -> None:
        self._not_served("RECOMPUTED")

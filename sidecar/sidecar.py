"""A sidecar process, assembled: pool + NIXL agent + progress + push/landing + channel.

``Sidecar`` wires the pieces for one engine and implements the channel's
``ChannelHandler``. The process main that registers the engine with the
control plane (and reports outcomes to it) is written against this class:

    sidecar = Sidecar(SidecarConfig(...), on_push_outcome=..., on_landing_event=..., resolver=...)
    await sidecar.start()
    record = sidecar.engine_record()        # -> Engine proto: record.to_proto()
    sidecar.add_peer(EngineRecord.from_proto(engine))   # prefill: from the registry watch
    ...
    await sidecar.stop()

``python -m sidecar.sidecar`` runs one for local use and tests: it writes its
``EngineRecord`` as JSON to ``--record-out`` once serving, and peers are
added through the channel's ADMIN ``add_peer``. ``kvpush sidecar``
(``sidecar/service.py``) is the same sidecar wired to the control plane.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import secrets
from typing import Callable

from kvpush.aio import stop_on_signals, write_ready_file
from kvpush.contract.layout import KvLayout
from kvpush.contract.engine import EngineRecord
from kvpush.contract.states import DECODE, PREFILL, role_to_proto
from kvpush.trace import Trace
from engine import frames as F
from sidecar.transport.nixl import AgentConfig, NixlAgent
from sidecar.channel_server import ChannelServer, Connection
from sidecar.handover import Handover
from sidecar.landing import LandingConfig, LandingEvent, LandingTable
from engine.memory import sweep_stale_segments
from sidecar.peers import PeerRegistry, RemotePeer, Resolver
from sidecar.pools import LandingPool, StagingPool
from engine.pool import StagingAllocation
from sidecar.progress import PollPolicy, ProgressDriver
from sidecar.push import PushConfig, PushEngine, PushOutcome

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class SidecarConfig:
    engine_id: str
    role: str  # "prefill" (staging pool, pushes) or "decode" (landing pool, receives)
    layout: KvLayout
    num_blocks: int  # landing blocks (decode) or staging units of layout.block_size tokens (prefill)
    socket_path: str
    incarnation: str = dataclasses.field(default_factory=lambda: secrets.token_hex(6))
    backends: tuple[str, ...] = ("UCX",)
    poll: PollPolicy = PollPolicy()
    push: PushConfig = PushConfig()
    landing: LandingConfig = LandingConfig()

    def __post_init__(self) -> None:
        if self.role not in (PREFILL, DECODE):
            raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {self.role!r}")

    @property
    def agent_name(self) -> str:
        # One name per incarnation: NIXL refuses to load new metadata under a
        # name it already holds, and a restarted engine is a new peer anyway.
        return f"{self.engine_id}.{self.incarnation}"


class Sidecar:
    def __init__(self, config: SidecarConfig,
                 on_push_outcome: Callable[[PushOutcome], None] | None = None,
                 on_landing_event: Callable[[LandingEvent], None] | None = None,
                 resolver: Resolver | None = None,
                 on_push_start: Callable[[str, str], None] | None = None):
        self.config = config
        self.on_push_start = on_push_start  # (reservation_id, request_id): first write posted
        self.accepting = True  # False while shutting down: new pushes are refused
        self.on_push_outcome = on_push_outcome
        self.on_landing_event = on_landing_event
        self.resolver = resolver
        self.pool: LandingPool | StagingPool | None = None
        self.agent: NixlAgent | None = None
        self.driver: ProgressDriver | None = None
        self.peers: PeerRegistry | None = None
        self.pusher: PushEngine | None = None
        self.landing: LandingTable | None = None
        self.server: ChannelServer | None = None
        self._request_owner: dict[str, Connection] = {}
        self._subscriptions: dict[str, list[tuple[str, Callable]]] = {}
        self.handover = Handover()

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        c = self.config
        swept = sweep_stale_segments()
        if swept:
            log.info("removed %d stale shared-memory segments of dead sidecars", len(swept))
        tag = f"{c.engine_id}.{c.role}"
        if c.role == DECODE:
            self.pool = LandingPool.create_shm(tag, c.layout, c.num_blocks)
        else:
            self.pool = StagingPool.create_shm(tag, c.layout, c.num_blocks)
        try:
            self.agent = NixlAgent(AgentConfig(c.agent_name, c.backends))
            self.agent.register(self.pool.memory)
            self.driver = ProgressDriver(self.agent, c.poll)
            if c.role == DECODE:
                self.landing = LandingTable(self.pool, c.incarnation, self.driver, c.landing, self._landing_event)
                self.driver.on_notif = self.landing.handle_notif
            else:
                self.peers = PeerRegistry(self.agent, self.resolver)
                self.pusher = PushEngine(self.agent, self.driver, self.pool, c.layout, self.peers, c.push,
                                         self._push_outcome, self.on_push_start)
                self.driver.on_notif = self._prefill_notif
            trace = Trace(f"sidecar-{c.role}-{c.engine_id}")
            if self.landing is not None:
                self.landing.trace = trace
            else:
                self.pusher.trace = trace
            self.driver.start()
            self.server = ChannelServer(c.socket_path, self)
            await self.server.start()
        except BaseException:
            await self.stop()
            raise
        log.info("sidecar %s (%s, incarnation %s) serving on %s", c.engine_id, c.role, c.incarnation,
                 c.socket_path)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None
        if self.landing is not None:
            self.landing.close()
        if self.driver is not None:
            await self.driver.stop()
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.pool is not None:
            self.pool.close()

    # -- what the process main needs ----------------------------------------------------------
    def engine_record(self) -> EngineRecord:
        """This engine as peers must know it (publish it through the control plane)."""
        c, pool = self.config, self.pool
        return EngineRecord(engine_id=c.engine_id, role=role_to_proto(c.role), layout=c.layout,
                            incarnation=c.incarnation, nixl_agent=c.agent_name, nixl_metadata=self.agent.metadata(),
                            num_blocks=pool.num_units, sidecar_address=f"unix:{c.socket_path}",
                            memory_kind=pool.memory.mem_kind, pool_base_address=pool.base_address,
                            pool_size_bytes=pool.size_bytes, device_id=pool.memory.device_id)

    def add_peer(self, record: EngineRecord) -> RemotePeer:
        if self.peers is None:
            raise RuntimeError("only a prefill sidecar pushes to peers")
        return self.peers.add(record)

    def cancel_reservation(self, reservation_id: str, reason: str = "cancelled") -> bool:
        """The control plane ended a reservation (deadline, release): stop/ignore it here."""
        if self.pusher is not None:
            return self.pusher.cancel_reservation(reservation_id, reason)
        return self.landing.cancel(reservation_id, reason)

    def live_reservations(self) -> list[str]:
        """Reservations this sidecar is still working on (pushing, or awaiting/holding a landing)."""
        if self.pusher is not None:
            return self.pusher.live_reservations()
        return self.landing.live_reservations() if self.landing is not None else []

    def stats(self) -> dict:
        out = {"role": self.config.role, "engine_id": self.config.engine_id,
               "incarnation": self.config.incarnation, "polls": self.driver.polls,
               "inflight": self.driver.inflight}
        if self.pusher is not None:
            out.update(self.handover.stats())
            out.update(active=self.pusher.active, staging_free_units=self.pool.free_units,
                       staging_units=self.pool.num_units, staging_allocations=self.pool.live_allocations,
                       peer_loads=self.peers.loads, **dict(self.pusher.counters))
        if self.landing is not None:
            out.update(self.landing.counters)
        return out

    # -- events -------------------------------------------------------------------------------
    def _push_outcome(self, outcome: PushOutcome) -> None:
        conn = self._request_owner.pop(outcome.request_id, None)
        if conn is not None:
            conn.send_event(F.StateEvent(outcome.reservation_id, outcome.state.value, outcome.reason,
                                         outcome.request_id))
        if self.on_push_outcome is not None:
            self.on_push_outcome(outcome)

    def _landing_event(self, event: LandingEvent) -> None:
        if self.on_landing_event is not None:
            self.on_landing_event(event)

    def _prefill_notif(self, sender: str, message: bytes) -> None:
        log.debug("prefill sidecar ignores a notification from %s", sender)

    # -- ChannelHandler -------------------------------------------------------------------------
    def on_hello(self, conn: Connection, info: dict) -> dict:
        return {"role": self.config.role, "engine_id": self.config.engine_id,
                "incarnation": self.config.incarnation, "agent": self.config.agent_name,
                "pool": self.pool.info().to_dict()}

    def on_begin(self, conn: Connection, req: F.BeginRequest) -> StagingAllocation:
        self._need(self.pusher, "BEGIN")
        if not self.accepting:
            raise ValueError(f"sidecar {self.config.engine_id} is shutting down; not accepting pushes")
        target = req.target
        self._request_owner[req.request_id] = conn
        try:
            return self.pusher.begin(req.request_id, target, owner=conn.owner)
        except Exception:
            self._request_owner.pop(req.request_id, None)
            raise

    def on_push(self, conn: Connection, piece: F.PushPiece) -> None:
        self._need(self.pusher, "PUSH")
        self.pusher.push(piece.request_id, piece.layer, piece.start, piece.end or None)

    def on_end(self, conn: Connection, end: F.EndRequest) -> None:
        if self.pusher is not None:
            self.pusher.end(end.request_id, end.aborted, end.reason)

    def on_query(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        self._need(self.landing, "QUERY")
        return self._state(self.landing.expect(reservation_id))

    def on_subscribe(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        self._need(self.landing, "SUBSCRIBE")

        def deliver(event: LandingEvent) -> None:
            subs = self._subscriptions.get(conn.owner, [])
            if (reservation_id, deliver) in subs:
                subs.remove((reservation_id, deliver))
            conn.send_event(self._state(event))
            if self.landing is not None:
                self.landing.trace("event_sent", reservation_id, event.state.value)

        self._subscriptions.setdefault(conn.owner, []).append((reservation_id, deliver))
        return self._state(self.landing.subscribe(reservation_id, deliver))

    def handover_trace(self, reservation_id: str, request_id: str) -> None:
        if self.pusher is not None:
            self.pusher.trace("handover_heard", reservation_id, request_id)

    def on_await(self, conn: Connection, request_id: str) -> dict | None:
        self._need(self.pusher, "AWAIT")
        return self.handover.ask(request_id, conn)

    def on_consumed(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        self._need(self.landing, "CONSUMED")
        self.landing.consume(reservation_id)
        return self._state(self.landing.query(reservation_id))

    def on_admin(self, conn: Connection, request: dict):
        op = request.get("op")
        if op == "stats":
            return self.stats()
        if op == "record":
            return self.engine_record().to_dict()
        if op == "add_peer":
            peer = self.add_peer(EngineRecord.from_dict(request["record"]))
            return {"agent": peer.agent_name, "loads": self.peers.loads}
        if op == "cancel":
            return {"cancelled": self.cancel_reservation(request["reservation_id"], request.get("reason", "cancelled"))}
        if op == "expect":  # poll hot for a while: a peer is about to work with us (benchmarks)
            self.driver.expect(("admin", request.get("key", "")), float(request.get("seconds", 1.0)))
            return {}
        if op == "bench_pull":  # the pull baseline of bench/push.py; not part of kvpush
            from bench.pull_baseline import pull
            return pull(self.agent, self.driver, request, self.config.push.transfer_timeout_s)
        raise ValueError(f"unknown admin op {op!r}")

    def on_disconnect(self, conn: Connection) -> None:
        if self.pusher is not None:
            self.pusher.drop_owner(conn.owner)
            for rid in [r for r, c in self._request_owner.items() if c is conn]:
                del self._request_owner[rid]
        for rid, callback in self._subscriptions.pop(conn.owner, []):
            self.landing.unsubscribe(rid, callback)
        self.handover.forget(conn)

    @staticmethod
    def _state(event: LandingEvent) -> F.StateEvent:
        return F.StateEvent(event.reservation_id, event.state.value, event.reason, "", event.num_tokens)

    def _need(self, part, frame_name: str) -> None:
        if part is None:
            raise ValueError(f"{frame_name} is not served by a {self.config.role} sidecar")


# -- process main for local runs and tests ---------------------------------------------------------
def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kvpush sidecar (local run: peers added over the channel)")
    p.add_argument("--role", choices=[PREFILL, DECODE], required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--layout", required=True, help="layers=32,block=16,heads=8,dim=128,dtype=bfloat16")
    p.add_argument("--blocks", type=int, required=True, help="landing blocks / staging units")
    p.add_argument("--socket", required=True)
    p.add_argument("--record-out", help="write this engine's record (JSON) here once serving")
    p.add_argument("--incarnation", default=None)
    p.add_argument("--checksums", action="store_true", help="send per-block CRC32 with each push")
    p.add_argument("--transfer-timeout", type=float, default=2.0)
    p.add_argument("--idle-interval", type=float, default=PollPolicy.idle_interval_s)
    p.add_argument("--hot-interval", type=float, default=PollPolicy.hot_interval_s)
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    extra = {"incarnation": args.incarnation} if args.incarnation else {}
    config = SidecarConfig(args.engine_id, args.role, KvLayout.parse(args.layout), args.blocks, args.socket,
                           poll=PollPolicy(hot_interval_s=args.hot_interval, idle_interval_s=args.idle_interval),
                           push=PushConfig(transfer_timeout_s=args.transfer_timeout, checksums=args.checksums),
                           **extra)
    sidecar = Sidecar(config)
    stop = stop_on_signals()
    await sidecar.start()
    try:
        write_ready_file(args.record_out, json.dumps(sidecar.engine_record().to_dict()))
        await stop.wait()
    finally:
        await sidecar.stop()


def main(argv=None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()

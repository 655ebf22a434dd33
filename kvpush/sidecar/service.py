"""``kvpush sidecar``: a sidecar wired to the control plane.

One process, one sidecar from ``kvpush.sidecar.sidecar.make_sidecar`` (``PrefillSidecar`` or
``DecodeSidecar``: pool, transport, progress, push or landing, local channel), plus what makes it a member of the
system:

* ``Membership`` registers the engine (``Registry.RegisterEngine``: NIXL
  metadata and pool address published once), keeps a ``Heartbeat`` stream
  beating every TTL/3 and registers again, with the same incarnation so its
  reservations survive, whenever the stream breaks (control-plane restart,
  network, a replica that stopped answering). Retries back off exponentially
  with jitter and always sleep: never a busy loop.
* ``ControlPlaneLink`` owns the gRPC channel. After a failure it makes a new
  channel, so a restarted control plane is reached at once instead of after
  gRPC's own reconnect backoff (which grows to minutes).
* the resolver (``Registry.GetEngine``) gives ``PeerRegistry`` a decode
  engine's record the first time a reservation names it; the registry caches
  it per (engine id, incarnation), so no request pays a handshake.
* ``Reporter`` sends lifecycle reports (PUSHING, LANDED, CONSUMED, FAILED)
  from a queue, in order per reservation, on a few background tasks: a push
  or a landing never waits on an RPC. A report answered FAILED_PRECONDITION
  or NOT_FOUND means the reservation already ended: its local work is cancelled.
* ``ReservationWatch`` follows ``Registry.WatchEngineReservations`` and
  cancels local pushes and landings of reservations that end (RELEASED,
  EXPIRED, FAILED). After a break it subscribes again with a snapshot and
  checks every local reservation missing from it (``LookupReservation``).
* SIGTERM/SIGINT: refuse new pushes, let running ones finish (bounded), flush
  reports (bounded), ``DeregisterEngine`` (its reservations end FAILED), end
  the heartbeat stream, stop the agent and free the shared memory.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time

import grpc

from kvpush.channel.device_memory import parse_device
from kvpush.channel.memory import PoolMapError
from kvpush import log as klog
from kvpush.aio import tune_gc, write_ready_file
from kvpush.contract.layout import KvLayout, LayoutError
from kvpush.contract.target import PushTarget
from kvpush.contract.transfer_params import PushParams
from kvpush.contract.v1 import registry_pb2, types_pb2
from kvpush.sidecar import kv_events
from kvpush.sidecar.landing import LandingConfig, LandingEvent
from kvpush.contract.engine import EngineRecord
from kvpush.sidecar.peers import PeerUnavailable
from kvpush.sidecar.progress import PollPolicy
from kvpush.sidecar.push import PushConfig, PushOutcome
from kvpush.sidecar.base import SidecarConfig
from kvpush.sidecar.sidecar import make_sidecar
from kvpush.sidecar.transport.base import TransportUnavailable
from kvpush.sidecar.transport.nixl import parse_backends
from kvpush.contract.states import DECODE, PREFILL, PushState, State, reported

from kvpush.sidecar.metrics import SidecarMetrics
from kvpush.sidecar.membership import (ControlPlaneLink, FatalError, Membership, ServiceConfig, guarded, rpc_error_text,
                            status_code)
from kvpush.sidecar.availability import AvailabilityReport
from kvpush.sidecar.prefix_report import PrefixReporter
from kvpush.sidecar.reporter import Reporter
from kvpush.sidecar.reservation_watch import ReservationWatch
from kvpush.sidecar.serving_probe import ServingProbe

log = logging.getLogger("kvpush.sidecar")




# -- the service ------------------------------------------------------------------------------------
class SidecarService:
    def __init__(self, sidecar_config: SidecarConfig, config: ServiceConfig):
        self.sidecar_config = sidecar_config
        self.config = config
        self.engine_id = sidecar_config.engine_id
        self.sidecar = make_sidecar(sidecar_config, on_push_outcome=self._on_push_outcome,
                                    on_landing_event=self._on_landing_event, resolver=self._resolve,
                                    on_push_start=self._on_push_start)
        self.link: ControlPlaneLink | None = None
        self.membership: Membership | None = None
        self.reporter: Reporter | None = None
        self.watch: ReservationWatch | None = None
        self.availability: AvailabilityReport | None = None
        self.probe: ServingProbe | None = None  # with --probe-serving
        self.prefix_report: PrefixReporter | None = None  # a decode engine followed with --kv-events
        self._ended_remotely: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._started = False
        self.resolves = 0
        self.metrics = SidecarMetrics(sidecar_config.role, self.stats)
        self.metrics_port = 0  # bound, once serving

    # -- what the control plane sees of us --------------------------------------------------------
    def engine_proto(self) -> types_pb2.Engine:
        record = dataclasses.replace(self.sidecar.engine_record(), model=self.config.model, pool=self.config.pool,
                                     serving_url=self.config.serving_url)
        return record.to_proto()

    # -- hooks of the data plane (called from the loop, never blocking) ---------------------------
    def _on_push_start(self, reservation_id: str, request_id: str) -> None:
        self.reporter.report(reservation_id, State.PUSHING, hold_s=self.config.pushing_report_after_s)

    def _on_push_outcome(self, outcome: PushOutcome) -> None:
        self.metrics.on_push(outcome)
        # Outcomes are terminal. A FAILED report replaces a PUSHING still held; otherwise
        # PUSHING is moot (decode reports LANDED, or the control plane ended it, and then
        # a push it cancelled is not a failure to report).
        state = reported(outcome.state)
        if outcome.state == PushState.CANCELLED and outcome.reservation_id in self._ended_remotely:
            state = None
        if state is None:
            self.reporter.withdraw(outcome.reservation_id, State.PUSHING)
        else:
            what = "push cancelled: " if outcome.state == PushState.CANCELLED else ""
            self.reporter.report(outcome.reservation_id, state, f"prefill {self.engine_id}: {what}{outcome.reason}")

    def _on_landing_event(self, event: LandingEvent) -> None:
        self.metrics.on_landing(event)
        state = reported(event.state)
        if state is not None:
            reason = f"decode {self.engine_id}: {event.reason}" if event.reason else ""
            hold = self.config.report_hold_s if state in (State.LANDED, State.CONSUMED) else 0.0
            self.reporter.report(event.reservation_id, state, reason, hold_s=hold)

    def _reserved(self, res: types_pb2.Reservation) -> None:
        """A reservation the router named this prefill engine for: hold it for the request;
        one that replaces a reservation it pushed (decode failover): push it again."""
        if self._started and res.moved_from:
            why = self.sidecar.relocate(res.moved_from, PushTarget.from_proto(res))
            if why:  # the decode engine waiting for it recomputes now, not at its timeout
                self.reporter.report(res.id, State.FAILED, f"prefill {self.engine_id}: {why}")
        elif self._started:
            params = PushParams.from_reservation(res, PREFILL).to_dict()
            self.sidecar.offer_reservation(params, res.request_id, res.id, res.deadline_unix_ms)

    def _ended(self, reservation_id: str, reason: str, state: State | None = None) -> None:
        """The control plane says the reservation is over: stop local work for it (a
        prefill keeps a FAILED one's staging for a relocation, and drops a CONSUMED one's)."""
        prefill = self.sidecar.config.role == PREFILL
        if state == State.CONSUMED:
            if prefill and self._started:
                self.sidecar.release_held(reservation_id)
            return
        self._ended_remotely[reservation_id] = None
        while len(self._ended_remotely) > 65536:
            self._ended_remotely.popitem(last=False)
        if not self._started:
            return
        try:
            if self.sidecar.cancel_reservation(reservation_id, reason, hold=prefill and state == State.FAILED):
                log.info("cancelled local work for %s: %s", reservation_id, reason)
        except Exception:
            log.exception("cancelling %s failed", reservation_id)

    async def _resolve(self, engine_id: str, incarnation: str) -> EngineRecord:
        client = self.link.client
        self.resolves += 1
        try:
            engine = await guarded(client.registry.GetEngine(registry_pb2.GetEngineRequest(engine_id=engine_id),
                                                             metadata=client.metadata,
                                                             timeout=self.config.rpc_timeout_s))
        except Exception as exc:
            if status_code(exc) == grpc.StatusCode.NOT_FOUND:
                raise PeerUnavailable(f"engine {engine_id} is not registered") from None
            raise PeerUnavailable(f"control plane could not resolve engine {engine_id}: {rpc_error_text(exc)}") from None
        if engine.role != types_pb2.DECODE:
            raise PeerUnavailable(f"engine {engine_id} is not a decode engine")
        if incarnation and engine.incarnation != incarnation:
            raise PeerUnavailable(f"engine {engine_id} incarnation {incarnation!r} is not the current one "
                                  f"({engine.incarnation!r})")
        return EngineRecord.from_proto(engine)

    def _on_ready(self, resp: registry_pb2.RegisterEngineResponse) -> None:
        self.availability.registered(resp.engine)
        if self.prefix_report is not None:
            self.prefix_report.on_registered()
        if self.membership.registrations > 1:
            log.info("registered again (registration %d)", self.membership.registrations)
            return
        log.info("sidecar %s (%s) registered with %s and serving on %s", self.engine_id, self.sidecar_config.role,
                 self.config.controlplane, self.sidecar_config.socket_path)
        tune_gc()
        if self.config.ready_file:
            record = self.sidecar.engine_record().to_dict()
            record.update(model=self.config.model, lease_id=resp.lease_id,
                          pid=os.getpid(), socket=self.sidecar_config.socket_path)
            write_ready_file(self.config.ready_file, json.dumps(record))

    def stats(self) -> dict:
        out = self.sidecar.stats()
        m = self.membership
        out.update(registrations=m.registrations, beats=m.beats, connected=m.connected.is_set(),
                   last_break=m.last_break, reconnects=self.link.reconnects, resolves=self.resolves,
                   watch_subscriptions=self.watch.subscriptions, watch_subscribed=self.watch.subscribed.is_set(),
                   watch_events=self.watch.events, availability_reports=self.availability.reports,
                   serving_probes=self.probe.probes if self.probe is not None else 0,
                   prefix_reports=dict(self.prefix_report.counters) if self.prefix_report is not None else {},
                   reports={k: v for k, v in self.reporter.counters.items()})
        return out

    # -- run ---------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self.link = ControlPlaneLink(self.config)
        self.reporter = Reporter(self.link, self.config, self.engine_id, self._ended,
                                 incarnation=self.sidecar_config.incarnation)
        self.membership = Membership(self.link, self.config, self.engine_proto, self._on_ready)
        self.watch = ReservationWatch(self.link, self.config, self.engine_id, self.membership,
                                      self.sidecar.live_reservations, self._ended,
                                      self._reserved if self.sidecar.config.role == PREFILL else None)
        probe = None
        if self.config.probe_serving_s > 0 and self.config.serving_url:
            probe = self.probe = ServingProbe(self.config.serving_url, self.config.probe_serving_s)
        self.availability = AvailabilityReport(
            self.link, self.config, self.engine_id, self.sidecar_config.incarnation,
            lambda: self.sidecar.presence.unavailable or (probe.unavailable if probe is not None else ""))
        self.sidecar.presence.on_change = self.availability.changed
        if probe is not None:
            probe.on_change = self.availability.changed
        original_admin = self.sidecar.on_admin

        def on_admin(conn, request):  # the channel's ADMIN "service" op: our own state
            return self.stats() if request.get("op") == "service" else original_admin(conn, request)

        self.sidecar.on_admin = on_admin
        code = 0
        try:
            await self.sidecar.start()
            self._started = True
            if self.config.metrics_port:
                self.metrics_port = self.metrics.serve(self.config.metrics_host, self.config.metrics_port)
                log.info("metrics on http://%s:%d/metrics", self.config.metrics_host, self.metrics_port)
            self.reporter.start()
            held = getattr(self.sidecar, "held", None)
            if held is not None:  # a decode engine whose KV events we follow
                self.prefix_report = PrefixReporter(self.link, self.config, self.engine_id,
                                                    self.sidecar_config.incarnation, held,
                                                    self.sidecar_config.layout.block_size)
                self.sidecar.on_prefix_change = self.prefix_report.changed
            member = loop.create_task(self.membership.run(), name="membership")
            self._tasks = [member, loop.create_task(self.watch.run(), name="watch"),
                           loop.create_task(self.availability.run(), name="availability")]
            if self.prefix_report is not None:
                self._tasks.append(loop.create_task(self.prefix_report.run(), name="prefix-report"))
            if probe is not None:
                self._tasks.append(loop.create_task(probe.run(), name="serving-probe"))
            stopper = loop.create_task(stop.wait())
            await asyncio.wait([*self._tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            # Membership and the watch run until we stop them: one that ends by itself
            # would leave an engine that looks alive but is not, so exit for a restart.
            ended = next((t for t in self._tasks if t.done()), None)
            if ended is not None:
                exc = None if ended.cancelled() else ended.exception()
                if isinstance(exc, FatalError):
                    log.error("%s", exc)
                    code = 1
                else:
                    log.error("%s ended unexpectedly (%r); exiting", ended.get_name(), exc or "cancelled")
                    code = 2
        finally:
            await self.shutdown()
        return code

    async def shutdown(self) -> None:
        c = self.config
        self.sidecar.accepting = False
        t0 = time.monotonic()
        while self.sidecar.active_pushes and time.monotonic() - t0 < c.drain_s:
            await asyncio.sleep(0.02)
        if self.reporter is not None:
            await self.reporter.flush(1.0)
        if self.membership is not None and self.membership.connected.is_set():
            client = self.link.client
            try:
                resp = await guarded(client.registry.DeregisterEngine(
                    registry_pb2.DeregisterEngineRequest(engine_id=self.engine_id,
                                                         incarnation=self.sidecar_config.incarnation),
                    metadata=client.metadata, timeout=2.0))
                log.info("deregistered; %d reservations ended FAILED", resp.reservations_failed)
            except Exception as exc:
                log.warning("DeregisterEngine failed (%s); the lease ends it", rpc_error_text(exc))
        if self.membership is not None:
            self.membership.stop()
        if self.availability is not None:
            self.availability.stop()
        if self.prefix_report is not None:
            self.prefix_report.stop()
        if self.watch is not None:
            await self.watch.close()
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=3.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.reporter is not None:
            await self.reporter.close()
        if self._started:
            self._started = False
            await self.sidecar.stop()
        if self.link is not None:
            await self.link.close()
        if self.config.ready_file:
            try:
                os.unlink(self.config.ready_file)
            except FileNotFoundError:
                pass
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        if others:
            log.warning("threads still running at exit: %s", others)
        log.info("sidecar %s stopped", self.engine_id)


# -- command line ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=[PREFILL, DECODE], required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--controlplane", default=os.environ.get("KVPUSH_CONTROLPLANE", "127.0.0.1:50051"),
                   help="host:port of a control-plane replica")
    p.add_argument("--token", default=os.environ.get("KVPUSH_ENGINE_TOKEN", ""),
                   help="engine bearer token (default: $KVPUSH_ENGINE_TOKEN)")
    p.add_argument("--kv-layout", required=True, help="layers=32,block=16,heads=8,dim=128,dtype=bfloat16")
    p.add_argument("--num-blocks", type=int, required=True, help="landing blocks (decode) or staging units (prefill)")
    p.add_argument("--model", required=True)
    p.add_argument("--socket", required=True, help="Unix socket of the local channel to the engine")
    p.add_argument("--pool", default="default", help="engine pool name (tenants are allowed pools)")
    p.add_argument("--backends", default="UCX", help="NIXL backends, comma-separated")
    p.add_argument("--pool-device", default="cpu",
                   help="where the pool lives: cpu (shared memory, DRAM) or cuda:N, the engine's GPU (VRAM)")
    p.add_argument("--incarnation", default=None, help="default: a fresh random one per start")
    p.add_argument("--lease-ttl", type=int, default=10, help="engine lease TTL in seconds; beats every TTL/3")
    p.add_argument("--transfer-timeout", type=float, default=PushConfig.transfer_timeout_s)
    p.add_argument("--failover-hold", type=float, default=PushConfig.hold_s,
                   help="prefill: keep a pushed request's staged KV this long (s) until decode consumed it, to push "
                        "it again if its decode engine dies (0: free it at once; room for new pushes comes first)")
    p.add_argument("--landing-timeout", type=float, default=60.0,
                   help="decode: FAILED when nothing landed this long after a push began (0: off)")
    p.add_argument("--checksums", action="store_true", help="send per-block CRC32 with each push (debug)")
    p.add_argument("--drain-timeout", type=float, default=2.0, help="on SIGTERM, running pushes may finish this long")
    p.add_argument("--report-hold", type=float, default=ServiceConfig.report_hold_s,
                   help="hold LANDED/CONSUMED reports this long, so a CONSUMED replaces its LANDED (0: send at once)")
    p.add_argument("--pushing-report-after", type=float, default=ServiceConfig.pushing_report_after_s,
                   help="report PUSHING only for pushes still running this long after they began (0: at once)")
    p.add_argument("--idle-interval", type=float, default=PollPolicy.idle_interval_s)
    p.add_argument("--hot-interval", type=float, default=PollPolicy.hot_interval_s)
    p.add_argument("--tls-ca", default="")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-server-name", default="")
    p.add_argument("--serving-url", default="",
                   help="the engine's OpenAI server (http://host:port), published for routers that discover engines")
    p.add_argument("--probe-serving", type=float, default=0.0, metavar="SECONDS",
                   help="ask --serving-url's /health this often; unavailable after 3 failures in a row (0: off)")
    p.add_argument("--wait-for-engine", action="store_true",
                   help="register as unavailable until the engine connects (no reservation lands while it loads)")
    p.add_argument("--engine-grace", type=float, default=SidecarConfig.engine_grace_s,
                   help="the engine's last connection closed this long (s): report it unavailable")
    kv_events.add_arguments(p)
    p.add_argument("--ready-file", default="", help="write this engine's record (JSON) here once registered")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="the metrics endpoint's bind address")
    p.add_argument("--log-level", default=os.environ.get("KVPUSH_LOG_LEVEL", "INFO"))


def configs_from_args(args: argparse.Namespace) -> tuple[SidecarConfig, ServiceConfig]:
    if not args.token:
        raise ValueError("an engine token is required (--token or $KVPUSH_ENGINE_TOKEN)")
    if args.num_blocks <= 0:
        raise ValueError("--num-blocks must be positive")
    try:
        layout = KvLayout.parse(args.kv_layout)
    except LayoutError as exc:
        raise ValueError(f"--kv-layout: {exc}") from None
    backends = parse_backends(args.backends)
    device = parse_device(args.pool_device)
    extra = {"incarnation": args.incarnation} if args.incarnation else {}
    sidecar = SidecarConfig(args.engine_id, args.role, layout, args.num_blocks, args.socket, device, backends=backends,
                            poll=PollPolicy(hot_interval_s=args.hot_interval, idle_interval_s=args.idle_interval),
                            push=PushConfig(transfer_timeout_s=args.transfer_timeout, checksums=args.checksums,
                                            hold_s=max(0.0, args.failover_hold)),
                            landing=LandingConfig(landing_timeout_s=args.landing_timeout),
                            wait_for_engine=args.wait_for_engine, engine_grace_s=max(0.0, args.engine_grace),
                            kv_events=kv_events.source_from_args(args), **extra)
    service = ServiceConfig(controlplane=args.controlplane, token=args.token, model=args.model, pool=args.pool,
                            lease_ttl_s=args.lease_ttl, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                            tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                            drain_s=args.drain_timeout, ready_file=args.ready_file,
                            report_hold_s=max(0.0, args.report_hold),
                            pushing_report_after_s=max(0.0, args.pushing_report_after),
                            metrics_host=args.metrics_host, metrics_port=args.metrics_port,
                            serving_url=args.serving_url.rstrip("/"), probe_serving_s=max(0.0, args.probe_serving))
    return sidecar, service


def run(args: argparse.Namespace) -> int:
    klog.configure("sidecar", args.log_level)  # JSON lines, as every kvpush service writes
    try:
        sidecar_config, service_config = configs_from_args(args)
    except ValueError as exc:
        print(f"kvpush sidecar: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(SidecarService(sidecar_config, service_config).run())
    except TransportUnavailable as exc:
        print(f"kvpush sidecar: --backends {args.backends}: {exc}", file=sys.stderr)
        return 2
    except (PoolMapError, MemoryError) as exc:
        print(f"kvpush sidecar: --pool-device {args.pool_device} --num-blocks {args.num_blocks}: {exc}",
              file=sys.stderr)
        return 2


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="kvpush sidecar", description="kvpush sidecar wired to the control plane")
    add_arguments(p)
    sys.exit(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()

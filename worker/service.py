"""``kvpush sidecar``: a sidecar wired to the control plane.

One process, one NIXL agent, one ``worker.sidecar.Sidecar`` (pool, agent,
progress, push/landing, local channel), plus what makes it a member of the
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
import random
import signal
import sys
import threading
import time
from typing import Callable

import grpc

from controlplane.client import ControlPlaneClient
from kvpush.layout import KvLayout, LayoutError
from kvpush.v1 import registry_pb2, scheduler_pb2, types_pb2
from worker.landing import LandingConfig, LandingEvent, LandingState
from worker.peers import EngineRecord, PeerUnavailable
from worker.progress import PollPolicy
from worker.push import PushConfig, PushOutcome, PushState
from worker.sidecar import DECODE, PREFILL, Sidecar, SidecarConfig

log = logging.getLogger("kvpush.sidecar")

S = types_pb2  # reservation states and roles
ENDED_BY_CONTROL_PLANE = (S.RELEASED, S.EXPIRED, S.FAILED)
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED}
FATAL_AT_START = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}


class FatalError(Exception):
    """The control plane refused this sidecar for good (bad token, bad record)."""


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    controlplane: str
    token: str
    model: str
    pool: str = "default"
    lease_ttl_s: int = 10
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    rpc_timeout_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    report_workers: int = 4
    report_queue_max: int = 100_000
    report_give_up_s: float = 30.0  # a report still failing after this is dropped
    drain_s: float = 2.0  # on shutdown: running pushes may finish this long
    ready_file: str = ""  # written (engine record + lease, JSON) once registered and beating


class Backoff:
    """Exponential backoff with jitter; ``next()`` is never below ``initial``."""

    def __init__(self, initial: float, maximum: float):
        self.initial, self.maximum = initial, maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self.initial


def _printable(text: str, limit: int = 1000) -> str:
    return "".join(c if c.isprintable() else " " for c in text)[:limit]


def _code(exc: BaseException) -> grpc.StatusCode:
    """The status of a failed call; anything that is not an RPC error (a call on a
    channel just closed by a reconnect raises ``UsageError``) counts as UNAVAILABLE."""
    return exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE


def _details(exc: BaseException) -> str:
    return (exc.details() or "") if isinstance(exc, grpc.aio.AioRpcError) else f"{type(exc).__name__}: {exc}"


def _rpc_error(exc: BaseException) -> str:
    return f"{_code(exc).name}: {_details(exc)}"


# -- the channel ----------------------------------------------------------------------------------
class ControlPlaneLink:
    """The current control-plane client; ``reconnect`` swaps in a fresh channel."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.client = self._new()
        self.epoch = 0
        self.reconnects = 0
        self._closing: set[asyncio.Task] = set()

    def _new(self) -> ControlPlaneClient:
        c = self.config
        return ControlPlaneClient(c.controlplane, c.token, c.tls_ca, c.tls_cert, c.tls_key, c.tls_server_name)

    def reconnect(self, epoch: int) -> None:
        """A new channel, unless someone already replaced the one of ``epoch``."""
        if epoch != self.epoch:
            return
        old, self.client = self.client, self._new()
        self.epoch += 1
        self.reconnects += 1
        task = asyncio.get_running_loop().create_task(old.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await self.client.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


# -- registration and heartbeat -----------------------------------------------------------------
class Membership:
    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine: Callable[[], types_pb2.Engine],
                 on_ready: Callable[[registry_pb2.RegisterEngineResponse], None] | None = None):
        self.link = link
        self.config = config
        self.engine = engine
        self.on_ready = on_ready
        self.connected = asyncio.Event()  # registered and the heartbeat stream answers
        self.lease_id = 0
        self.ttl_s = 0
        self.registrations = 0
        self.beats = 0
        self.last_break = ""
        self._stopping = False
        self._end_stream: asyncio.Event | None = None
        self._wake = asyncio.Event()
        self._stale_call = None  # a heartbeat stream that stopped answering, ended only once replaced

    async def run(self) -> None:
        # Retry often enough to be back before a lease that outlived its replica runs out.
        backoff = Backoff(self.config.backoff_initial_s,
                          max(self.config.backoff_initial_s,
                              min(self.config.backoff_max_s, self.config.lease_ttl_s / 4)))
        while not self._stopping:
            client, epoch = self.link.client, self.link.epoch
            request = registry_pb2.RegisterEngineRequest(engine=self.engine(),
                                                          lease_ttl_seconds=self.config.lease_ttl_s)
            try:
                resp = await client.registry.RegisterEngine(request, metadata=client.metadata,
                                                            timeout=self.config.rpc_timeout_s)
            except Exception as exc:
                self._drop_stale_call()
                if not self.registrations and _code(exc) in FATAL_AT_START:
                    raise FatalError(f"control plane at {self.config.controlplane} refused the registration: "
                                     f"{_rpc_error(exc)}") from None
                self.last_break = f"RegisterEngine: {_rpc_error(exc)}"
                log.warning("registration failed (%s); retrying", self.last_break)
                self.link.reconnect(epoch)
                await self._pause(backoff.next())
                continue
            # Registered on a new lease (the control plane revoked the old one itself), so the
            # stream that stopped answering can go now without taking the engine with it.
            self._drop_stale_call()
            self.registrations += 1
            self.lease_id, self.ttl_s = resp.lease_id, resp.lease_ttl_seconds
            log.info("engine %s registered (lease %x, ttl %d s, registration %d)", resp.engine.engine_id,
                     resp.lease_id, resp.lease_ttl_seconds, self.registrations)
            reason, healthy = await self._beat(client, resp)
            self.connected.clear()
            if self._stopping:
                break
            self.last_break = reason
            if healthy:
                backoff.reset()
            log.warning("heartbeat stream broke (%s); registering again", reason)
            if self._stale_call is not None:
                continue  # make before break: register again at once, on the same channel
            self.link.reconnect(epoch)
            await self._pause(backoff.next())

    def _drop_stale_call(self) -> None:
        if self._stale_call is not None:
            self._stale_call.cancel()
            self._stale_call = None

    async def _beat(self, client: ControlPlaneClient, resp) -> tuple[str, bool]:
        """Beat until the stream breaks or we end it; (why it ended, whether it ever answered)."""
        interval = max(resp.lease_ttl_seconds / 3, 0.5)
        patience = interval + max(resp.lease_ttl_seconds / 3, 1.0)  # no answer this long: hung
        end = self._end_stream = asyncio.Event()
        ping = registry_pb2.HeartbeatPing(engine_id=resp.engine.engine_id, lease_id=resp.lease_id)

        async def pings():
            while True:
                yield ping
                try:
                    await asyncio.wait_for(end.wait(), interval)
                    return  # half-close: the control plane ends the engine's lease
                except asyncio.TimeoutError:
                    pass

        call = None
        answered = False
        try:
            call = client.registry.Heartbeat(pings(), metadata=client.metadata)
            while True:
                read = asyncio.ensure_future(call.read())
                try:
                    pong = await asyncio.wait_for(asyncio.shield(read), patience)
                except asyncio.TimeoutError:
                    # Hung, not closed: cancelling (the call, or even its read) would make a
                    # replica that is merely slow revoke our lease. Keep the stream open
                    # until we are registered again.
                    read.add_done_callback(lambda f: f.cancelled() or f.exception())
                    self._stale_call, call = call, None
                    return f"no heartbeat answer within {patience:.1f} s", answered
                if pong is grpc.aio.EOF:
                    return "stream closed by the control plane", answered
                self.beats += 1
                if not answered:
                    answered = True
                    self.connected.set()
                    if self.on_ready is not None:
                        self.on_ready(resp)
        except Exception as exc:
            return _rpc_error(exc), answered
        finally:
            self._end_stream = None
            if call is not None:
                call.cancel()

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def stop(self) -> None:
        """End the heartbeat stream cleanly (half-close) and stop registering."""
        self._stopping = True
        self._wake.set()
        if self._end_stream is not None:
            self._end_stream.set()


# -- lifecycle reports -----------------------------------------------------------------------------
@dataclasses.dataclass
class _Report:
    state: int
    reason: str
    queued: float


class Reporter:
    """Lifecycle reports, off the critical path: ``report`` only queues.

    Reports of one reservation go out in order (one at a time); different
    reservations go out concurrently on ``workers`` tasks. Transient errors are
    retried with backoff for up to ``report_give_up_s``.
    """

    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine_id: str,
                 on_ended: Callable[[str, str], None]):
        self.link = link
        self.config = config
        self.engine_id = engine_id
        self.on_ended = on_ended
        self._pending: dict[str, collections.deque[_Report]] = {}
        self._ready: collections.deque[str] = collections.deque()
        self._busy: set[str] = set()
        self._queued = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._tasks: list[asyncio.Task] = []
        self.counters = collections.Counter()

    def start(self) -> None:
        self._tasks = [asyncio.get_running_loop().create_task(self._worker(), name=f"reporter-{n}")
                       for n in range(self.config.report_workers)]

    def report(self, reservation_id: str, state: int, reason: str = "") -> None:
        if self._closing:
            return
        if self._queued >= self.config.report_queue_max:
            self.counters["overflow"] += 1
            log.warning("report queue full: %s %s not reported", reservation_id, S.ReservationState.Name(state))
            return
        item = _Report(state, _printable(reason), time.monotonic())
        queue = self._pending.get(reservation_id)
        if queue is None:
            queue = self._pending[reservation_id] = collections.deque()
            if reservation_id not in self._busy:
                self._ready.append(reservation_id)
        queue.append(item)
        self._queued += 1
        self._idle.clear()
        self._wake.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until every queued report has been sent or dropped."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _worker(self) -> None:
        while True:
            while not self._ready:
                self._wake.clear()
                await self._wake.wait()
            rid = self._ready.popleft()
            self._busy.add(rid)
            try:
                queue = self._pending.get(rid)
                while queue:
                    item = queue.popleft()
                    self._queued -= 1
                    try:
                        sent = await self._send(rid, item)
                    except Exception:
                        log.exception("report %s for %s failed", S.ReservationState.Name(item.state), rid)
                        sent = True
                    if not sent:
                        self._queued -= len(queue)  # it ended: later reports of it are moot
                        queue.clear()
                self._pending.pop(rid, None)
            finally:
                self._busy.discard(rid)
                if not self._queued and not self._busy:
                    self._idle.set()

    async def _send(self, rid: str, item: _Report) -> bool:
        """Send one report; False when the reservation turned out to have ended."""
        backoff = Backoff(self.config.backoff_initial_s, min(2.0, self.config.backoff_max_s))
        request = registry_pb2.ReportStateRequest(reservation_id=rid, state=item.state, reason=item.reason,
                                                  engine_id=self.engine_id)
        name = S.ReservationState.Name(item.state)
        while True:
            client = self.link.client
            try:
                await client.registry.ReportState(request, metadata=client.metadata,
                                                  timeout=self.config.rpc_timeout_s)
                self.counters["sent"] += 1
                log.debug("reported %s %s", rid, name)
                return True
            except Exception as exc:
                code = _code(exc)
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    # Usually: the reservation already ended. Make sure before cancelling work
                    # (NOT_FOUND may also mean our own engine is not registered right now).
                    ended = await self._ended_at_control_plane(rid)
                    if ended:
                        self.counters["already_ended"] += 1
                        log.info("report %s %s refused (%s): the reservation has ended", rid, name,
                                 _rpc_error(exc))
                        self.on_ended(rid, f"reservation ended at the control plane: {ended}")
                        return False
                    if code == grpc.StatusCode.FAILED_PRECONDITION or ended is None:
                        self.counters["dropped"] += 1
                        log.warning("report %s %s dropped: %s", rid, name, _rpc_error(exc))
                        return True
                    code = grpc.StatusCode.UNAVAILABLE  # live reservation, NOT_FOUND engine: retry
                if code not in RETRYABLE or time.monotonic() - item.queued > self.config.report_give_up_s:
                    self.counters["dropped"] += 1
                    log.warning("report %s %s dropped: %s", rid, name, _rpc_error(exc))
                    return True
                self.counters["retried"] += 1
                await asyncio.sleep(backoff.next())


    async def _ended_at_control_plane(self, rid: str) -> str | None:
        """Why ``rid`` is over ("" while it is live; None if we cannot tell)."""
        client = self.link.client
        try:
            res = await client.registry.LookupReservation(registry_pb2.LookupReservationRequest(reservation_id=rid),
                                                          metadata=client.metadata, timeout=self.config.rpc_timeout_s)
        except Exception as exc:
            return "it no longer exists" if _code(exc) == grpc.StatusCode.NOT_FOUND else None
        if res.state in (S.RESERVED, S.PUSHING, S.LANDED):
            return ""
        return S.ReservationState.Name(res.state) + (f": {res.reason}" if res.reason else "")


# -- the reservation watch -------------------------------------------------------------------------
class ReservationWatch:
    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine_id: str, membership: Membership,
                 live_reservations: Callable[[], list[str]], on_ended: Callable[[str, str], None]):
        self.link = link
        self.config = config
        self.engine_id = engine_id
        self.membership = membership
        self.live_reservations = live_reservations
        self.on_ended = on_ended
        self.subscribed = asyncio.Event()  # the snapshot is in: changes from here on are seen
        self.subscriptions = 0
        self.events = 0
        self._stopping = False
        self._call = None
        self._wake = asyncio.Event()
        self._reconciling: set[asyncio.Task] = set()

    async def run(self) -> None:
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self._stopping:
            await self._until_connected()
            if self._stopping:
                break
            client = self.link.client
            snapshot: set[str] = set()
            try:
                self._call = call = client.registry.WatchEngineReservations(
                    registry_pb2.WatchEngineReservationsRequest(engine_id=self.engine_id, include_snapshot=True),
                    metadata=client.metadata)
                async for event in call:
                    self.events += 1
                    if event.kind == scheduler_pb2.ReservationEvent.SNAPSHOT:
                        snapshot.add(event.reservation.id)
                        self._apply(event.reservation)
                    elif event.kind == scheduler_pb2.ReservationEvent.SNAPSHOT_END:
                        self.subscriptions += 1
                        self.subscribed.set()
                        backoff.reset()
                        self._spawn(self._reconcile(snapshot))
                    else:
                        self._apply(event.reservation)
                why = "stream ended"
            except Exception as exc:
                why = _rpc_error(exc)
                if _code(exc) == grpc.StatusCode.UNIMPLEMENTED:
                    backoff = Backoff(30.0, 30.0)  # an older control plane: ask again now and then
            finally:
                self._call = None
                self.subscribed.clear()
            if self._stopping:
                break
            log.warning("reservation watch broke (%s); subscribing again", why)
            try:
                await asyncio.wait_for(self._wake.wait(), backoff.next())
            except asyncio.TimeoutError:
                pass

    async def _until_connected(self) -> None:
        if self.membership.connected.is_set():
            return
        waits = [asyncio.ensure_future(self.membership.connected.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _apply(self, reservation: types_pb2.Reservation) -> None:
        if reservation.state in ENDED_BY_CONTROL_PLANE:
            state = S.ReservationState.Name(reservation.state)
            self.on_ended(reservation.id, f"reservation {state}" + (f": {reservation.reason}"
                                                                    if reservation.reason else ""))

    async def _reconcile(self, snapshot: set[str]) -> None:
        """Local work for reservations the snapshot does not list may have ended while
        we were not subscribed: ask about each."""
        client = self.link.client
        for rid in [r for r in self.live_reservations() if r not in snapshot]:
            try:
                res = await client.registry.LookupReservation(
                    registry_pb2.LookupReservationRequest(reservation_id=rid), metadata=client.metadata,
                    timeout=self.config.rpc_timeout_s)
            except Exception as exc:
                if _code(exc) == grpc.StatusCode.NOT_FOUND:
                    self.on_ended(rid, "reservation no longer exists")
                elif _code(exc) != grpc.StatusCode.INVALID_ARGUMENT:
                    log.info("could not check reservation %s: %s", rid, _rpc_error(exc))
                continue
            self._apply(res)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._reconciling.add(task)
        task.add_done_callback(self._reconciling.discard)

    async def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._call is not None:
            self._call.cancel()
        for task in list(self._reconciling):
            task.cancel()
        await asyncio.gather(*self._reconciling, return_exceptions=True)


# -- the service ------------------------------------------------------------------------------------
class SidecarService:
    def __init__(self, sidecar_config: SidecarConfig, config: ServiceConfig):
        self.sidecar_config = sidecar_config
        self.config = config
        self.engine_id = sidecar_config.engine_id
        self.sidecar = Sidecar(sidecar_config, on_push_outcome=self._on_push_outcome,
                               on_landing_event=self._on_landing_event, resolver=self._resolve,
                               on_push_start=self._on_push_start)
        self.link: ControlPlaneLink | None = None
        self.membership: Membership | None = None
        self.reporter: Reporter | None = None
        self.watch: ReservationWatch | None = None
        self._ended_remotely: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tasks: list[asyncio.Task] = []
        self._started = False
        self.resolves = 0

    # -- what the control plane sees of us --------------------------------------------------------
    def engine_proto(self) -> types_pb2.Engine:
        c = self.config
        engine = types_pb2.Engine(role=S.PREFILL if self.sidecar_config.role == PREFILL else S.DECODE,
                                  model=c.model, pool=c.pool,
                                  sidecar_address=f"unix:{self.sidecar_config.socket_path}")
        self.sidecar.engine_record().fill_proto(engine)
        return engine

    # -- hooks of the data plane (called from the loop, never blocking) ---------------------------
    def _on_push_start(self, reservation_id: str, request_id: str) -> None:
        self.reporter.report(reservation_id, S.PUSHING)

    def _on_push_outcome(self, outcome: PushOutcome) -> None:
        if outcome.state == PushState.FAILED:
            self.reporter.report(outcome.reservation_id, S.FAILED, f"prefill {self.engine_id}: {outcome.reason}")
        elif outcome.state == PushState.CANCELLED and outcome.reservation_id not in self._ended_remotely:
            self.reporter.report(outcome.reservation_id, S.FAILED,
                                 f"prefill {self.engine_id}: push cancelled: {outcome.reason}")

    def _on_landing_event(self, event: LandingEvent) -> None:
        state = {LandingState.LANDED: S.LANDED, LandingState.CONSUMED: S.CONSUMED,
                 LandingState.FAILED: S.FAILED}.get(event.state)
        if state is not None:
            reason = f"decode {self.engine_id}: {event.reason}" if event.reason else ""
            self.reporter.report(event.reservation_id, state, reason)

    def _ended(self, reservation_id: str, reason: str) -> None:
        """The control plane says the reservation is over: stop local work for it."""
        self._ended_remotely[reservation_id] = None
        while len(self._ended_remotely) > 65536:
            self._ended_remotely.popitem(last=False)
        if not self._started:
            return
        try:
            if self.sidecar.cancel_reservation(reservation_id, reason):
                log.info("cancelled local work for %s: %s", reservation_id, reason)
        except Exception:
            log.exception("cancelling %s failed", reservation_id)

    async def _resolve(self, engine_id: str, incarnation: str) -> EngineRecord:
        client = self.link.client
        self.resolves += 1
        try:
            engine = await client.registry.GetEngine(registry_pb2.GetEngineRequest(engine_id=engine_id),
                                                     metadata=client.metadata, timeout=self.config.rpc_timeout_s)
        except Exception as exc:
            if _code(exc) == grpc.StatusCode.NOT_FOUND:
                raise PeerUnavailable(f"engine {engine_id} is not registered") from None
            raise PeerUnavailable(f"control plane could not resolve engine {engine_id}: {_rpc_error(exc)}") from None
        if engine.role != S.DECODE:
            raise PeerUnavailable(f"engine {engine_id} is not a decode engine")
        if incarnation and engine.incarnation != incarnation:
            raise PeerUnavailable(f"engine {engine_id} incarnation {incarnation!r} is not the current one "
                                  f"({engine.incarnation!r})")
        return EngineRecord.from_proto(engine)

    def _on_ready(self, resp: registry_pb2.RegisterEngineResponse) -> None:
        if self.membership.registrations > 1:
            log.info("registered again (registration %d)", self.membership.registrations)
            return
        log.info("sidecar %s (%s) registered with %s and serving on %s", self.engine_id, self.sidecar_config.role,
                 self.config.controlplane, self.sidecar_config.socket_path)
        if self.config.ready_file:
            record = self.sidecar.engine_record().to_dict()
            record.update(role=self.sidecar_config.role, model=self.config.model, lease_id=resp.lease_id,
                          pid=os.getpid(), socket=self.sidecar_config.socket_path)
            tmp = self.config.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, self.config.ready_file)  # atomic: readers never see half a record

    def stats(self) -> dict:
        out = self.sidecar.stats()
        m = self.membership
        out.update(registrations=m.registrations, beats=m.beats, connected=m.connected.is_set(),
                   last_break=m.last_break, reconnects=self.link.reconnects, resolves=self.resolves,
                   watch_subscriptions=self.watch.subscriptions, watch_subscribed=self.watch.subscribed.is_set(),
                   watch_events=self.watch.events,
                   reports={k: v for k, v in self.reporter.counters.items()})
        return out

    # -- run ---------------------------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        self.link = ControlPlaneLink(self.config)
        self.reporter = Reporter(self.link, self.config, self.engine_id, self._ended)
        self.membership = Membership(self.link, self.config, self.engine_proto, self._on_ready)
        self.watch = ReservationWatch(self.link, self.config, self.engine_id, self.membership,
                                      self.sidecar.live_reservations, self._ended)
        original_admin = self.sidecar.on_admin

        def on_admin(conn, request):  # the channel's ADMIN "service" op: our own state
            return self.stats() if request.get("op") == "service" else original_admin(conn, request)

        self.sidecar.on_admin = on_admin
        code = 0
        try:
            await self.sidecar.start()
            self._started = True
            self.reporter.start()
            member = loop.create_task(self.membership.run(), name="membership")
            self._tasks = [member, loop.create_task(self.watch.run(), name="watch")]
            stopper = loop.create_task(stop.wait())
            await asyncio.wait([member, stopper], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if member.done() and not member.cancelled() and member.exception() is not None:
                exc = member.exception()
                log.error("%s", exc)
                code = 1 if isinstance(exc, FatalError) else 2
        finally:
            await self.shutdown()
        return code

    async def shutdown(self) -> None:
        c = self.config
        self.sidecar.accepting = False
        t0 = time.monotonic()
        if self.sidecar.pusher is not None:
            while self.sidecar.pusher.active and time.monotonic() - t0 < c.drain_s:
                await asyncio.sleep(0.02)
        if self.reporter is not None:
            await self.reporter.flush(1.0)
        if self.membership is not None and self.membership.connected.is_set():
            client = self.link.client
            try:
                resp = await client.registry.DeregisterEngine(
                    registry_pb2.DeregisterEngineRequest(engine_id=self.engine_id,
                                                         incarnation=self.sidecar_config.incarnation),
                    metadata=client.metadata, timeout=2.0)
                log.info("deregistered; %d reservations ended FAILED", resp.reservations_failed)
            except Exception as exc:
                log.warning("DeregisterEngine failed (%s); the lease ends it", _rpc_error(exc))
        if self.membership is not None:
            self.membership.stop()
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
    p.add_argument("--incarnation", default=None, help="default: a fresh random one per start")
    p.add_argument("--lease-ttl", type=int, default=10, help="engine lease TTL in seconds; beats every TTL/3")
    p.add_argument("--transfer-timeout", type=float, default=PushConfig.transfer_timeout_s)
    p.add_argument("--landing-timeout", type=float, default=60.0,
                   help="decode: FAILED when nothing landed this long after a push began (0: off)")
    p.add_argument("--checksums", action="store_true", help="send per-block CRC32 with each push (debug)")
    p.add_argument("--drain-timeout", type=float, default=2.0, help="on SIGTERM, running pushes may finish this long")
    p.add_argument("--idle-interval", type=float, default=PollPolicy.idle_interval_s)
    p.add_argument("--hot-interval", type=float, default=PollPolicy.hot_interval_s)
    p.add_argument("--tls-ca", default="")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-server-name", default="")
    p.add_argument("--ready-file", default="", help="write this engine's record (JSON) here once registered")
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
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    extra = {"incarnation": args.incarnation} if args.incarnation else {}
    sidecar = SidecarConfig(args.engine_id, args.role, layout, args.num_blocks, args.socket, backends=backends,
                            poll=PollPolicy(hot_interval_s=args.hot_interval, idle_interval_s=args.idle_interval),
                            push=PushConfig(transfer_timeout_s=args.transfer_timeout, checksums=args.checksums),
                            landing=LandingConfig(landing_timeout_s=args.landing_timeout), **extra)
    service = ServiceConfig(controlplane=args.controlplane, token=args.token, model=args.model, pool=args.pool,
                            lease_ttl_s=args.lease_ttl, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                            tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                            drain_s=args.drain_timeout, ready_file=args.ready_file)
    return sidecar, service


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        sidecar_config, service_config = configs_from_args(args)
    except ValueError as exc:
        print(f"kvpush sidecar: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(SidecarService(sidecar_config, service_config).run())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="kvpush sidecar", description="kvpush sidecar wired to the control plane")
    add_arguments(p)
    sys.exit(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()

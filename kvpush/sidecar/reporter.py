"""Lifecycle reports (PUSHING, LANDED, CONSUMED, FAILED) from a queue, in order
per reservation, on a few background tasks: a push or a landing never waits on
an RPC. A report answered FAILED_PRECONDITION or NOT_FOUND means the reservation
already ended (checked with ``LookupReservation``): its local work is cancelled.

A report may be *held* for a moment before it is queued (``hold_s``): the next
report of the same reservation, if it comes meanwhile, replaces it. A decode
sidecar's LANDED is then folded into its CONSUMED (sent with ``landed``: one
control-plane write instead of two), and a prefill's PUSHING is withdrawn when the
push finishes first. Besides the writes, this keeps the control plane, etcd and
the watch fan-out off the CPU while the request's last layer and first token are
on the critical path.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Callable

import grpc

from kvpush.client.report_stream import StreamReporter
from kvpush.contract.states import LIVE, State
from kvpush.contract.v1 import registry_pb2

from kvpush.sidecar.membership import (Backoff, ControlPlaneLink, RETRYABLE, ServiceConfig, guarded, printable, rpc_error_text,
                            status_code)

log = logging.getLogger("kvpush.sidecar")


@dataclasses.dataclass
class _Report:
    state: int
    reason: str
    queued: float
    landed: bool = False  # CONSUMED with a LANDED folded into it


@dataclasses.dataclass
class _Held:
    report: _Report
    timer: asyncio.TimerHandle


class Reporter:
    """Lifecycle reports, off the critical path: ``report`` only queues.

    Reports of one reservation go out in order (one at a time); different
    reservations go out concurrently on ``workers`` tasks. Transient errors are
    retried with backoff for up to ``report_give_up_s``.
    """

    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine_id: str,
                 on_ended: Callable[..., None], incarnation: str = ""):
        self.link = link
        self.config = config
        self.engine_id = engine_id
        self.incarnation = incarnation  # sent with PUSHING: which life of the engine pushes
        self.on_ended = on_ended
        self._pending: dict[str, collections.deque[_Report]] = {}
        self._held: dict[str, _Held] = {}
        self._ready: collections.deque[str] = collections.deque()
        self._busy: set[str] = set()
        self._queued = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._tasks: list[asyncio.Task] = []
        self.counters = collections.Counter()
        self._reports: StreamReporter | None = None   # every report on one stream (kvpush/client/report_stream.py)
        self._closing_streams: set[asyncio.Future] = set()

    def start(self) -> None:
        self._tasks = [asyncio.get_running_loop().create_task(self._worker(), name=f"reporter-{n}")
                       for n in range(self.config.report_workers)]

    def report(self, reservation_id: str, state: int, reason: str = "", hold_s: float = 0.0) -> None:
        """Queue a report; with ``hold_s``, hold it that long first (a later report
        of the reservation replaces it)."""
        if self._closing:
            return
        if self._queued + len(self._held) >= self.config.report_queue_max:
            self.counters["overflow"] += 1
            log.warning("report queue full: %s %s not reported", reservation_id, State(state).name)
            return
        item = _Report(state, printable(reason), time.monotonic())
        held = self._held.pop(reservation_id, None)
        if held is not None:
            held.timer.cancel()
            self.counters["folded"] += 1
            item.landed = state == State.CONSUMED and (held.report.landed or held.report.state == State.LANDED)
        if hold_s > 0:
            timer = asyncio.get_running_loop().call_later(hold_s, self._release_held, reservation_id)
            self._held[reservation_id] = _Held(item, timer)
            self._idle.clear()
            return
        self._enqueue(reservation_id, item)

    def withdraw(self, reservation_id: str, state: int) -> bool:
        """Drop a held ``state`` report of the reservation (it became moot)."""
        held = self._held.get(reservation_id)
        if held is None or held.report.state != state:
            return False
        del self._held[reservation_id]
        held.timer.cancel()
        self.counters["withdrawn"] += 1
        self._maybe_idle()
        return True

    def _release_held(self, reservation_id: str) -> None:
        held = self._held.pop(reservation_id, None)
        if held is not None:
            self._enqueue(reservation_id, held.report)

    def _release_all_held(self) -> None:
        for rid in list(self._held):
            self._held[rid].timer.cancel()
            self._release_held(rid)

    def _maybe_idle(self) -> None:
        if not self._queued and not self._busy and not self._held:
            self._idle.set()

    def _enqueue(self, reservation_id: str, item: _Report) -> None:
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
        """Wait (bounded) until every queued report has been sent or dropped; held
        reports go out now."""
        self._release_all_held()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self) -> None:
        self._closing = True
        for held in self._held.values():
            held.timer.cancel()
        self._held.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reports is not None:
            await self._reports.close()
        await asyncio.gather(*self._closing_streams, return_exceptions=True)

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
                        log.exception("report %s for %s failed", State(item.state).name, rid)
                        sent = True
                    if not sent:
                        self._queued -= len(queue)  # it ended: later reports of it are moot
                        queue.clear()
                self._pending.pop(rid, None)
            finally:
                self._busy.discard(rid)
                self._maybe_idle()

    async def _send(self, rid: str, item: _Report) -> bool:
        """Send one report; False when the reservation turned out to have ended."""
        backoff = Backoff(self.config.backoff_initial_s, min(2.0, self.config.backoff_max_s))
        request = registry_pb2.ReportStateRequest(reservation_id=rid, state=item.state, reason=item.reason,
                                                  engine_id=self.engine_id, landed=item.landed,
                                                  incarnation=self.incarnation if item.state == State.PUSHING else "")
        name = State(item.state).name
        while True:
            try:
                await guarded(self._stream().report(request, timeout=self.config.rpc_timeout_s))
                self.counters["sent"] += 1
                log.debug("reported %s %s", rid, name)
                return True
            except Exception as exc:
                code = status_code(exc)
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    # Usually: the reservation already ended. Make sure before cancelling work
                    # (NOT_FOUND may also mean our own engine is not registered right now).
                    ended, state = await self._ended_at_control_plane(rid)
                    if ended:
                        self.counters["already_ended"] += 1
                        log.info("report %s %s refused (%s): the reservation has ended", rid, name,
                                 rpc_error_text(exc))
                        self.on_ended(rid, f"reservation ended at the control plane: {ended}", state)
                        return False
                    if code == grpc.StatusCode.FAILED_PRECONDITION or ended is None:
                        self.counters["dropped"] += 1
                        log.warning("report %s %s dropped: %s", rid, name, rpc_error_text(exc))
                        return True
                    code = grpc.StatusCode.UNAVAILABLE  # live reservation, NOT_FOUND engine: retry
                if code not in RETRYABLE or time.monotonic() - item.queued > self.config.report_give_up_s:
                    self.counters["dropped"] += 1
                    log.warning("report %s %s dropped: %s", rid, name, rpc_error_text(exc))
                    return True
                self.counters["retried"] += 1
                await asyncio.sleep(backoff.next())


    def _stream(self) -> StreamReporter:
        """The reports' stream on the link's current channel (a new one after a reconnect)."""
        if self._reports is None or self._reports.client is not self.link.client:
            old, self._reports = self._reports, StreamReporter(self.link.client)
            if old is not None:
                self._closing_streams.add(asyncio.ensure_future(old.close()))
        return self._reports

    async def _ended_at_control_plane(self, rid: str) -> tuple[str | None, State | None]:
        """Why ``rid`` is over ("" while it is live; None if we cannot tell), and how it
        ended (None: live, gone or unknown)."""
        client = self.link.client
        try:
            res = await guarded(client.registry.LookupReservation(
                registry_pb2.LookupReservationRequest(reservation_id=rid), metadata=client.metadata,
                timeout=self.config.rpc_timeout_s))
        except Exception as exc:
            return ("it no longer exists" if status_code(exc) == grpc.StatusCode.NOT_FOUND else None), None
        if res.state in LIVE:
            return "", None
        return State(res.state).name + (f": {res.reason}" if res.reason else ""), State(res.state)

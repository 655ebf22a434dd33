"""Lifecycle reports (PUSHING, LANDED, CONSUMED, FAILED) from a queue, in order
per reservation, on a few background tasks: a push or a landing never waits on
an RPC. A report answered FAILED_PRECONDITION or NOT_FOUND means the reservation
already ended (checked with ``LookupReservation``): its local work is cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Callable

import grpc

from kvpush.v1 import registry_pb2

from worker.cp_link import (Backoff, ControlPlaneLink, RETRYABLE, S, ServiceConfig, guarded, printable, rpc_error_text,
                            status_code)

log = logging.getLogger("kvpush.sidecar")


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
        item = _Report(state, printable(reason), time.monotonic())
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
                await guarded(client.registry.ReportState(request, metadata=client.metadata,
                                                          timeout=self.config.rpc_timeout_s))
                self.counters["sent"] += 1
                log.debug("reported %s %s", rid, name)
                return True
            except Exception as exc:
                code = status_code(exc)
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                    # Usually: the reservation already ended. Make sure before cancelling work
                    # (NOT_FOUND may also mean our own engine is not registered right now).
                    ended = await self._ended_at_control_plane(rid)
                    if ended:
                        self.counters["already_ended"] += 1
                        log.info("report %s %s refused (%s): the reservation has ended", rid, name,
                                 rpc_error_text(exc))
                        self.on_ended(rid, f"reservation ended at the control plane: {ended}")
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


    async def _ended_at_control_plane(self, rid: str) -> str | None:
        """Why ``rid`` is over ("" while it is live; None if we cannot tell)."""
        client = self.link.client
        try:
            res = await guarded(client.registry.LookupReservation(
                registry_pb2.LookupReservationRequest(reservation_id=rid), metadata=client.metadata,
                timeout=self.config.rpc_timeout_s))
        except Exception as exc:
            return "it no longer exists" if status_code(exc) == grpc.StatusCode.NOT_FOUND else None
        if res.state in (S.RESERVED, S.PUSHING, S.LANDED):
            return ""
        return S.ReservationState.Name(res.state) + (f": {res.reason}" if res.reason else "")

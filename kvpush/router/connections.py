"""The router's client connections, bounded in time. aiohttp reads a request's headers
for as long as the client likes, so connections that never finish theirs pile up until
the router's file descriptors run out and new clients are refused, with nothing logged.
Here a connection must finish a request's headers within ``header_timeout_s`` (from its
start, or from the first byte after an idle spell) and may sit idle between requests for
``keepalive_timeout_s``; past either it is closed ("shed"), counted in
``kvpush_router_connections_shed_total{reason}`` and logged (one line per
``SHED_LOG_INTERVAL_S`` at most, however many). (A request's body is bounded by the
handler's ``--body-timeout``; an HTTPS handshake by asyncio's, 60 s.)

aiohttp has no per-connection hook for this, so the runner makes its server's
connections ``GuardedHandler``s (aiohttp's own handler, timed); ``middleware`` tells a
connection when a request has begun (its headers are whole)."""

from __future__ import annotations

import asyncio
import collections
import math

from aiohttp import web

from kvpush import log
from kvpush.router import metrics

_log = log.get("router")
SHED_LOG_INTERVAL_S = 10.0
HEADERS, IDLE = "header_timeout", "idle"  # what a connection is waiting for: the reasons it is shed for


class ConnectionGuard:
    """The limits every connection of one router keeps, and the one place their shedding
    is counted and logged."""

    def __init__(self, header_timeout_s: float, keepalive_timeout_s: float,
                 log_interval_s: float = SHED_LOG_INTERVAL_S) -> None:
        self.timeouts = {HEADERS: header_timeout_s, IDLE: keepalive_timeout_s}
        self.log_interval_s = log_interval_s
        self._unlogged: collections.Counter[str] = collections.Counter()
        self._last_log = -math.inf
        self._flush: asyncio.TimerHandle | None = None

    def shed(self, reason: str) -> None:
        metrics.CONNECTIONS_SHED.labels(reason=reason).inc()
        self._unlogged[reason] += 1
        # Thousands at once are one attack (or one broken proxy), not thousands of events:
        # the first is logged at once, the rest summed into a line per interval.
        loop = asyncio.get_running_loop()
        due = self._last_log + self.log_interval_s
        if loop.time() >= due:
            self._log()
        elif self._flush is None:
            self._flush = loop.call_at(due, self._log)

    def _log(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self._unlogged:
            return
        _log.warning("connections shed: no request within the connection timeouts",
                     header_timeout=self._unlogged[HEADERS], idle=self._unlogged[IDLE],
                     header_timeout_s=self.timeouts[HEADERS], keepalive_timeout_s=self.timeouts[IDLE],
                     hint="counted in kvpush_router_connections_shed_total; raise --header-timeout or "
                          "--keepalive-timeout only if real clients are among them")
        self._unlogged.clear()
        self._last_log = asyncio.get_running_loop().time()

    def close(self) -> None:
        self._log()


class GuardedHandler(web.RequestHandler):
    """aiohttp's connection handler, closed when it waits longer than the guard allows
    for a request (its headers) or between requests (idle)."""

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for = ""  # HEADERS, IDLE, or "" while a request is being served
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        metrics.OPEN_CONNECTIONS.inc()
        self._counted = True
        self._wait_for(HEADERS)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_waiting()
        if self._counted:
            metrics.OPEN_CONNECTIONS.dec()
            self._counted = False
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # The first byte after an idle spell begins the next request's headers: they have
        # the header timeout from now, not what is left of the idle one. (Later bytes do
        # not extend it: trickling them is how a client holds a connection.)
        if self._waiting_for == IDLE and data:
            self._wait_for(HEADERS)
        super().data_received(data)

    def request_began(self) -> None:
        """A request's headers are whole: no deadline while it is served. Called in the
        request's task, whose end (the answer written) starts the idle wait."""
        self._stop_waiting()
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(self._request_ended)

    def _request_ended(self, _task: asyncio.Task) -> None:
        if self.transport is not None:
            self._wait_for(IDLE)

    def _wait_for(self, what: str) -> None:
        self._stop_waiting()
        self._waiting_for = what
        self._deadline = self._loop.call_later(self._guard.timeouts[what], self._expire)

    def _stop_waiting(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_for = ""

    def _expire(self) -> None:
        reason, self._deadline = self._waiting_for, None
        if self.transport is None:
            return
        self._guard.shed(reason)
        self.force_close()  # what aiohttp's own keep-alive timer does with an idle connection


class _GuardedServer(web.Server):
    """The app's own server, as aiohttp built it (its handler, request factory and
    handler settings), making guarded connection handlers."""

    def __init__(self, guard: ConnectionGuard, plain: web.Server) -> None:
        super().__init__(plain.request_handler, request_factory=plain.request_factory,
                         handler_cancellation=plain.handler_cancellation, loop=plain._loop, **plain._kwargs)
        self.guard = guard

    def __call__(self) -> GuardedHandler:
        return GuardedHandler(self, self.guard, loop=self._loop, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose connections keep ``guard``'s limits."""

    def __init__(self, app: web.Application, guard: ConnectionGuard, **kwargs) -> None:
        # aiohttp's own keep-alive timer (which counts nothing) stays behind the guard's,
        # a backstop that never fires first.
        backstop = sum(guard.timeouts.values()) + 5.0
        super().__init__(app, keepalive_timeout=backstop, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        return _GuardedServer(self.guard, await super()._make_server())

    async def cleanup(self) -> None:
        await super().cleanup()
        self.guard.close()


@web.middleware
async def middleware(request: web.Request, handler) -> web.StreamResponse:
    """Tells a guarded connection its request has begun (on any router, guarded or not)."""
    if isinstance(request.protocol, GuardedHandler):
        request.protocol.request_began()
    return await handler(request)

"""Reserve over one long-lived ReserveStream: the client side of group commit.

A unary Reserve costs the control plane (and the caller) a whole gRPC call, which
in Python is several times the work of the reservation itself. ``StreamReserver``
keeps one stream open and sends every ask that is ready in one message: while one
message is being written, the next ones queue and go out together, so under load
a message carries many asks, and one answer message comes back for each group
commit. A lone ask still goes out at once (no timer, no added latency).

Failures keep the unary call's meaning: a refused ask raises ``ReserveRefused``
with the status code the unary call would have ended with; a broken stream fails
every ask in flight with UNAVAILABLE (Reserve is idempotent per request_id, so a
caller may retry), and the next ask opens a new stream (never a retry loop of its own). An ask whose caller
stopped waiting (timeout, cancellation) is released if it is granted after all,
so giving up never leaks blocks until the deadline.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from client.control_plane import ControlPlaneClient
from kvpush import log
from kvpush.contract.limits import MAX_ASKS_PER_MESSAGE
from kvpush.contract.v1 import scheduler_pb2, types_pb2

_log = log.get("reserve_stream")


class ReserveRefused(Exception):
    """The control plane's answer to one ask was not a reservation."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_STREAM_REFUSALS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNIMPLEMENTED}


class StreamReserver:
    def __init__(self, client: ControlPlaneClient) -> None:
        self._client = client
        self._tags = itertools.count(1)
        self._outbox: list[scheduler_pb2.ReserveAsk] = []
        self._pending: dict[int, asyncio.Future] = {}
        self._abandoned: set[int] = set()
        self._wake = asyncio.Event()
        self._call = None
        self._tasks: list[asyncio.Task] = []
        self._releasing: set[asyncio.Task] = set()
        self._closed = False
        self.streams_opened = 0
        self.abandoned_released = 0

    async def reserve(self, request: scheduler_pb2.ReserveRequest, timeout: float | None = None
                      ) -> types_pb2.Reservation:
        """The reservation, or ReserveRefused with the code a unary Reserve would have had."""
        if self._closed:
            raise ReserveRefused(grpc.StatusCode.UNAVAILABLE, "reserver is closed")
        if self._call is None:
            self._open()
        loop = asyncio.get_running_loop()
        tag = next(self._tags)
        fut = loop.create_future()
        self._pending[tag] = fut
        self._outbox.append(scheduler_pb2.ReserveAsk(tag=tag, reserve=request))
        self._wake.set()
        # A timer on the loop rather than asyncio.wait_for: this is the hot path of
        # a router reserving thousands of times a second.
        timer = loop.call_later(timeout, self._expire, tag, timeout) if timeout is not None else None
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            if not fut.done() or fut.cancelled():
                self._give_up(tag)

    def _expire(self, tag: int, timeout: float) -> None:
        fut = self._pending.get(tag)
        if fut is not None and not fut.done():
            self._give_up(tag)
            fut.set_exception(ReserveRefused(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:g} s"))

    def _give_up(self, tag: int) -> None:
        """The caller stopped waiting: an ask not sent yet is dropped, and a grant that
        still comes for one already sent is released."""
        if self._pending.pop(tag, None) is None:
            return
        unsent = [i for i, ask in enumerate(self._outbox) if ask.tag == tag]
        if unsent:
            del self._outbox[unsent[0]]
        else:
            self._abandoned.add(tag)

    def _open(self) -> None:
        self._call = self._client.scheduler.ReserveStream(metadata=self._client.metadata)
        self.streams_opened += 1
        call = self._call
        self._tasks = [asyncio.create_task(self._write(call), name="reserve-stream-write"),
                       asyncio.create_task(self._read(call), name="reserve-stream-read")]

    async def _write(self, call) -> None:
        try:
            while True:
                if not self._outbox:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                asks = self._outbox[:MAX_ASKS_PER_MESSAGE]
                del self._outbox[:MAX_ASKS_PER_MESSAGE]
                # While this write is in flight, newer asks pile up for the next message.
                await call.write(scheduler_pb2.ReserveStreamRequest(asks=asks))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the same break and fails what is pending
            _log.debug("reserve stream write ended", error=str(exc))

    async def _read(self, call) -> None:
        reason, code = "the control plane ended the stream", grpc.StatusCode.UNAVAILABLE
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                for ans in msg.answers:
                    self._deliver(ans)
        except asyncio.CancelledError:
            reason = "reserver closed"
            raise
        except grpc.aio.AioRpcError as exc:
            # A refusal of the whole stream (a bad token, say) keeps its code; anything
            # else is a broken stream. (A write racing the server's end is reported by
            # grpc's client as INTERNAL "Internal error from Core".)
            reason = f"stream ended: {exc.code().name}: {exc.details()}"
            code = exc.code() if exc.code() in _STREAM_REFUSALS else grpc.StatusCode.UNAVAILABLE
        finally:
            self._broken(call, reason, code)

    def _deliver(self, ans: scheduler_pb2.ReserveAnswer) -> None:
        fut = self._pending.pop(ans.tag, None)
        if fut is None:
            if ans.tag in self._abandoned:
                self._abandoned.discard(ans.tag)
                if ans.code == 0:
                    task = asyncio.get_running_loop().create_task(self._release(ans.reservation.id))
                    self._releasing.add(task)
                    task.add_done_callback(self._releasing.discard)
            return
        if fut.done():
            return
        if ans.code == 0:
            fut.set_result(ans.reservation)
        else:
            fut.set_exception(ReserveRefused(_CODES.get(ans.code, grpc.StatusCode.UNKNOWN), ans.message))

    async def _release(self, reservation_id: str) -> None:
        try:
            await self._client.scheduler.Release(
                scheduler_pb2.ReleaseRequest(reservation_id=reservation_id, reason="caller stopped waiting"),
                metadata=self._client.metadata, timeout=5)
            self.abandoned_released += 1
        except grpc.aio.AioRpcError as exc:
            _log.warning("release of an abandoned reservation failed", reservation_id=reservation_id,
                         code=exc.code().name)

    def _broken(self, call, reason: str, code: grpc.StatusCode) -> None:
        if call is not self._call:
            return
        self._call = None
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        call.cancel()
        unsent = {ask.tag for ask in self._outbox}
        self._outbox.clear()
        for tag, fut in list(self._pending.items()):
            if not fut.done():
                fut.set_exception(ReserveRefused(code, f"{reason}; nothing was reserved" if tag in unsent else
                                                 f"{reason}; the outcome is unknown: retry with the same request_id"))
        self._pending.clear()
        self._abandoned.clear()

    async def close(self) -> None:
        self._closed = True
        call, tasks = self._call, self._tasks
        self._call = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._releasing, return_exceptions=True)
        if call is not None:
            call.cancel()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ReserveRefused(grpc.StatusCode.UNAVAILABLE, "reserver closed"))
        self._pending.clear()

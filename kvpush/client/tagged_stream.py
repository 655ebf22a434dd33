"""Many unary-like calls over one long-lived bidi stream: the client side of group commit.

A unary gRPC call costs the control plane (and the caller) several times the work of
a Reserve or a report in Python. A ``TaggedStream`` keeps one stream open and sends
every item that is ready in one message: while one message is being written, the next
ones queue and go out together, so under load a message carries many items, and answers
come back many to a message. A lone item still goes out at once (no timer, no added
latency). Each item carries a tag; its answer, with the same tag, resolves its caller.

A broken stream fails every item in flight (``_failure``, with UNAVAILABLE unless the
stream itself was refused) and the next call opens a new stream; there is no retry
loop here. Subclasses say what the stream is (``_open_call``), how items and messages
are built (``_item``, ``_message``), how answers are read (``_answers``, ``_outcome``)
and what happens to an answer whose caller stopped waiting (``_unclaimed``).
"""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc

from kvpush import log
from kvpush.contract.limits import MAX_ASKS_PER_MESSAGE

_log = log.get("tagged_stream")
CODES = {c.value[0]: c for c in grpc.StatusCode}
STREAM_REFUSALS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                   grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.UNIMPLEMENTED}


class TaggedStream:
    name = "stream"

    def __init__(self) -> None:
        self._tags = itertools.count(1)
        self._outbox: list = []
        self._pending: dict[int, asyncio.Future] = {}
        self._abandoned: set[int] = set()
        self._wake = asyncio.Event()
        self._call = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self.streams_opened = 0
        self.last_heard = 0.0  # (monotonic) when the last message came from the other side

    # -- what a subclass says ---------------------------------------------------------------------
    def _open_call(self):
        raise NotImplementedError

    def _item(self, tag: int, request):
        raise NotImplementedError

    def _message(self, items: list):
        raise NotImplementedError

    def _answers(self, msg):
        return msg.answers

    def _outcome(self, answer):
        """The caller's result, or raise the exception the caller gets."""
        raise NotImplementedError

    def _failure(self, code: grpc.StatusCode, details: str) -> Exception:
        raise NotImplementedError

    def _unclaimed(self, answer) -> None:
        """An answer to an item whose caller stopped waiting after it was sent."""

    def _dropped(self, result) -> None:
        """A result (``_outcome``'s) delivered to a caller cancelled before it could take it."""

    # -- calls ------------------------------------------------------------------------------------
    async def call(self, request, timeout: float | None = None):
        if self._closed:
            raise self._failure(grpc.StatusCode.UNAVAILABLE, f"{self.name} is closed")
        if self._call is None:
            self._open()
        loop = asyncio.get_running_loop()
        tag = next(self._tags)
        fut = loop.create_future()
        self._pending[tag] = fut
        self._outbox.append(self._item(tag, request))
        self._wake.set()
        # A timer on the loop rather than asyncio.wait_for: this is the hot path of
        # a router reserving thousands of times a second.
        timer = loop.call_later(timeout, self._expire, tag, timeout) if timeout is not None else None
        try:
            return await fut
        except asyncio.CancelledError:
            # Cancelled after the answer arrived but before this task resumed: the answer
            # (a grant) would be lost with nobody to release it; it is unclaimed instead.
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._dropped(fut.result())
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if not fut.done() or fut.cancelled():
                self._give_up(tag)

    def _expire(self, tag: int, timeout: float) -> None:
        fut = self._pending.get(tag)
        if fut is not None and not fut.done():
            self._give_up(tag)
            fut.set_exception(self._failure(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:g} s"))

    def _give_up(self, tag: int) -> None:
        """The caller stopped waiting: an item not sent yet is dropped; the answer to one
        already sent goes to ``_unclaimed``."""
        if self._pending.pop(tag, None) is None:
            return
        unsent = [i for i, item in enumerate(self._outbox) if item.tag == tag]
        if unsent:
            del self._outbox[unsent[0]]
        else:
            self._abandoned.add(tag)

    def _open(self) -> None:
        self._call = self._open_call()
        self.streams_opened += 1
        call = self._call
        self._tasks = [asyncio.create_task(self._write(call), name=f"{self.name}-write"),
                       asyncio.create_task(self._read(call), name=f"{self.name}-read")]

    async def _write(self, call) -> None:
        try:
            while True:
                if not self._outbox:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                items = self._outbox[:MAX_ASKS_PER_MESSAGE]
                del self._outbox[:MAX_ASKS_PER_MESSAGE]
                # While this write is in flight, newer items pile up for the next message.
                await call.write(self._message(items))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the reader sees the same break and fails what is pending
            _log.debug("stream write ended", stream=self.name, error=str(exc))

    async def _read(self, call) -> None:
        reason, code = "the control plane ended the stream", grpc.StatusCode.UNAVAILABLE
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                self.last_heard = time.monotonic()
                for answer in self._answers(msg):
                    self._deliver(answer)
        except asyncio.CancelledError:
            reason = f"{self.name} closed"
            raise
        except grpc.aio.AioRpcError as exc:
            # A refusal of the whole stream (a bad token, say) keeps its code; anything
            # else is a broken stream. (A write racing the server's end is reported by
            # grpc's client as INTERNAL "Internal error from Core".)
            reason = f"stream ended: {exc.code().name}: {exc.details()}"
            code = exc.code() if exc.code() in STREAM_REFUSALS else grpc.StatusCode.UNAVAILABLE
        finally:
            self._broken(call, reason, code)

    def _deliver(self, answer) -> None:
        fut = self._pending.pop(answer.tag, None)
        if fut is None:
            if answer.tag in self._abandoned:
                self._abandoned.discard(answer.tag)
                self._unclaimed(answer)
            return
        if fut.done():
            # Cancelled, its caller not yet resumed to give it up: nobody takes this answer.
            if fut.cancelled():
                self._unclaimed(answer)
            return
        try:
            fut.set_result(self._outcome(answer))
        except Exception as exc:
            fut.set_exception(exc)

    def _unsent_note(self, unsent: bool) -> str:
        return "it was not sent" if unsent else "the outcome is unknown"

    def _broken(self, call, reason: str, code: grpc.StatusCode) -> None:
        if call is not self._call:
            return
        self._call = None
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        call.cancel()
        unsent = {item.tag for item in self._outbox}
        self._outbox.clear()
        for tag, fut in list(self._pending.items()):
            if not fut.done():
                fut.set_exception(self._failure(code, f"{reason}; {self._unsent_note(tag in unsent)}"))
        self._pending.clear()
        self._abandoned.clear()

    async def close(self) -> None:
        self._closed = True
        call, tasks = self._call, self._tasks
        self._call = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if call is not None:
            call.cancel()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._failure(grpc.StatusCode.UNAVAILABLE, f"{self.name} closed"))
        self._pending.clear()

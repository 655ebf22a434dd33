"""Server-sent events both ways: the stream the router writes to its client, and
the one it reads from a decode engine."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kvpush import log
from kvpush.router.errors import error_event

_log = log.get("router")
DONE = b"data: [DONE]\n\n"
# Set on a request whose stream began and then ended with an error event (``end_with_error``).
ENDED_WITH_ERROR = web.RequestKey("ended_with_error", str)


class DecodeStreamError(Exception):
    """Decode's stream broke or sent an error: the request failed after its first token."""


class ClientTooSlow(ConnectionResetError):
    """The client did not take what it was sent within the write timeout: the request is
    over (decode's request closed; decode streamed, so its sidecar ends the reservation)
    and the router's handler aborts the connection."""


class BoundedStream(web.StreamResponse):
    """A streamed answer each of whose writes the client must take within ``timeout_s``:
    one that stops reading is cut off, rather than holding a handler, an engine request
    and a reservation for as long as it likes. (A write waits only once aiohttp's buffer
    is full, so a client that reads, however slowly, is never cut.)

    Its headers go out with its first write (one system call and one wakeup of the
    client fewer per request): every caller writes as soon as it has prepared it, or
    has nothing for the client before its engine's first bytes anyway."""

    _send_headers_immediately = False  # (aiohttp's switch: web.Response's is False too)

    def __init__(self, timeout_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.timeout_s = timeout_s

    async def _bounded(self, write) -> None:
        try:
            await asyncio.wait_for(write, self.timeout_s)
        except asyncio.TimeoutError:
            raise ClientTooSlow(f"the client took nothing for {self.timeout_s:g} s") from None

    async def write(self, data) -> None:
        # A write waits only while the connection is paused (its transport's buffer went past
        # the high-water mark and has not yet fallen below the low one): when it is not, and
        # this write cannot take the buffer past the mark, no timer is worth arming for it.
        req = self._req
        transport = req.transport if req is not None else None
        if transport is not None and not req.protocol.writing_paused and \
                transport.get_write_buffer_size() + len(data) + 64 < transport.get_write_buffer_limits()[1]:
            await super().write(data)
        else:
            await self._bounded(super().write(data))

    async def write_eof(self, data: bytes = b"") -> None:
        await self._bounded(super().write_eof(data))


async def sse_response(request: web.Request, timeout_s: float) -> web.StreamResponse:
    out = BoundedStream(timeout_s, status=200)
    out.content_type = "text/event-stream"
    out.headers["Cache-Control"] = "no-cache"
    await out.prepare(request)
    return out


async def end_with_error(request: web.Request, out: web.StreamResponse, message: str,
                         status: int = 502) -> web.StreamResponse:
    """End a stream already begun whose engine failed, as vLLM's server ends one: an error
    event, then ``[DONE]``. The client reads an error it can report (an OpenAI client raises
    it), not a connection cut mid-answer; the answer is counted as the engine's failure
    (``kvpush_router_requests_total{outcome="upstream_error"}``)."""
    request[ENDED_WITH_ERROR] = message
    _log.warning("stream ended with an error event", path=request.path, error=message)
    await out.write_eof(error_event(message, status) + DONE)
    return out


# The most of an event not yet whole held back (a stream that never ends one is passed on as it comes).
HELD_MAX = 1 << 16


def split_whole(data: bytes) -> tuple[bytes, bytes]:
    """``data`` as (its whole server-sent events, up to the blank line that ends the last;
    the start of one not yet whole), that start held back up to HELD_MAX bytes."""
    lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
    whole = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    if len(data) - whole > HELD_MAX:
        return data, b""
    return data[:whole], data[whole:]


class EventStream:
    """Decode's events as they arrive: for each read, the payloads (after ``data:``) of the
    events it completed, up to ``[DONE]``. One read often holds several events, and
    handling them together costs one wakeup and one write to the client. ``pending``:
    the start of an event not yet whole."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.pending = b""

    def __aiter__(self):
        return self._batches()

    async def _batches(self):
        try:
            async for data in self.resp.content.iter_any():
                self.pending += data
                if b"\n\n" not in self.pending:
                    continue
                *events, self.pending = self.pending.split(b"\n\n")
                batch = []
                for e in events:
                    e = e.strip()
                    if not e.startswith(b"data:"):
                        continue
                    e = e[5:].lstrip()
                    if e == b"[DONE]":
                        if batch:
                            yield batch
                        return
                    batch.append(e)
                if batch:
                    yield batch
            last = self.pending.strip()   # an event its stream ended without the blank line after
            if last.startswith(b"data:") and last[5:].lstrip() != b"[DONE]":
                self.pending = b""
                yield [last[5:].lstrip()]
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise DecodeStreamError(f"decode's stream broke: {type(exc).__name__}: {exc}") from None

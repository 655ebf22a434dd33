"""Server-sent events both ways: the stream the router writes to its client, and
the one it reads from a decode engine."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web


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

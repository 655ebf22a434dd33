"""The router's HTTP to its engines: a whole answer passed through to the client
(streamed or not), a POST read whole, and how many requests each engine has."""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import web

from kvpush.router import ask as asks
from kvpush.router import metrics
from kvpush.router.errors import silent_engine
from kvpush.router.relay import WholeEvents
from kvpush.router.streams import BoundedStream, end_with_error, split_whole


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, write_timeout_s: float) -> None:
        self.session = session
        self.write_timeout_s = write_timeout_s  # a client must take each streamed write within this
        self.outstanding: dict[str, int] = {}  # engine URL -> requests the router has on it
        self._reusing: set[asyncio.Task] = set()

    async def post(self, url: str, endpoint: str, body: dict, timings: dict) -> tuple[int, bytes]:
        """POST and read the whole answer: (status, body)."""
        self.outstanding[url] = self.outstanding.get(url, 0) + 1
        sent = time.perf_counter()
        try:
            async with self.session.post(f"{url}/v1/{path_of(endpoint)}", json=body) as resp:
                payload = await resp.read()
                timings["prefill_answered"] = time.perf_counter()
                metrics.PREFILL_LATENCY.observe(timings["prefill_answered"] - sent)
                return resp.status, payload
        finally:
            self.outstanding[url] -= 1

    def reuse(self, resp: aiohttp.ClientResponse) -> None:
        """Decode's answer read to its end in the background (``reuse_connection``): the
        client has its whole answer, so its handler ends now, and a client that closes on
        ``[DONE]`` does not cut this read short (which would close decode's connection)."""
        task = asyncio.ensure_future(reuse_connection(resp))
        self._reusing.add(task)
        task.add_done_callback(self._reusing.discard)

    async def close(self) -> None:
        """Stop the background reads (the session is closing)."""
        for task in list(self._reusing):
            task.cancel()
        await asyncio.gather(*self._reusing, return_exceptions=True)

    def answering(self, url: str) -> Answering:
        """Count a continuation on ``url`` until its ``done()``."""
        return Answering(self.outstanding, url)

    async def continuation(self, answering: Answering, url: str, body: dict) -> aiohttp.ClientResponse:
        """POST a continuation to ``url``, which answers it from now on (the caller reads
        and releases the response)."""
        answering.move(url)
        return await self.session.post(f"{url}/v1/completions", json=body)

    async def proxy(self, url: str, endpoint: str, body: dict, request: web.Request, path: str,
                    timings: dict | None = None) -> web.StreamResponse:
        """A whole answer from one engine, streamed or not, as the client gets it."""
        return await self.relay(self.send(url, endpoint, body), request, path, timings)

    def send(self, url: str, endpoint: str, body: dict) -> "Sent":
        """POST now, before deciding to use the answer: the caller ``relay``s it to the
        client or ``withdraw``s it."""
        return Sent(self, url, endpoint, body)

    async def relay(self, sent: "Sent", request: web.Request, path: str,
                    timings: dict | None = None) -> web.StreamResponse:
        """``sent``'s answer, streamed or not, as the client gets it."""
        timings = {} if timings is None else timings
        body = sent.body
        # The client's answer begins with the engine's first bytes, not its headers: an engine
        # sends those at once and may die before its first event (queued, or computing the
        # prompt), and until then the client has nothing, so another engine can still serve it
        # (``nothing_sent``), or it gets an error answer.
        out = None
        try:
            async with await sent.answer as upstream:
                if not body.get("stream") or upstream.status != 200:
                    payload = await upstream.read()
                    timings["decode_done"] = time.perf_counter()
                    metrics.TTFT.labels(path=path).observe(timings["decode_done"] - sent.started)
                    return web.Response(body=payload, status=upstream.status,
                                        content_type=upstream.content_type or "application/json")
                # Server-sent events go on whole: the start of one not yet whole waits for its
                # end, so a stream that breaks ends after a whole event, with an error event.
                # Once the client has the first, the rest is written on from the connection's
                # callback (``relay.WholeEvents``), no wakeup of this coroutine per event.
                events = upstream.content_type == "text/event-stream"
                held, direct = b"", None
                try:
                    async for chunk in upstream.content.iter_any():
                        if out is None:
                            timings["first_chunk"] = time.perf_counter()
                            metrics.TTFT.labels(path=path).observe(timings["first_chunk"] - sent.started)
                            out = await self._begin(upstream, request)
                        if events:
                            chunk, held = split_whole(held + chunk if held else chunk)
                            if not chunk:
                                continue
                        await out.write(chunk)
                        if events and direct is None and not held:
                            direct = WholeEvents.begin(upstream, request, out)
                finally:
                    if direct is not None:
                        held += direct.stop()  # (at the end: the start of an event it never ended)
                timings["decode_done"] = time.perf_counter()
                out = out or await self._begin(upstream, request)
                await out.write_eof(held)
                return out
        except aiohttp.ClientError as exc:  # (its read timeout among them)
            if out is None and not isinstance(exc, aiohttp.ClientConnectorError):
                raise BrokeBeforeAnswering(f"{type(exc).__name__} before the client's first byte: {exc}") from exc
            if out is not None and events:
                # Part of the answer is out, so no other engine can take it over: it ends as
                # vLLM ends a stream whose engine failed (the first-token path resumes instead).
                if isinstance(exc, asyncio.TimeoutError):  # (aiohttp's read timeout: --upstream-timeout)
                    return await end_with_error(request, out, silent_engine(self.session.timeout.sock_read), 504)
                return await end_with_error(request, out, f"the engine's stream broke: {type(exc).__name__}: {exc}")
            raise
        finally:
            sent.done()

    async def _begin(self, upstream: aiohttp.ClientResponse, request: web.Request) -> BoundedStream:
        out = BoundedStream(self.write_timeout_s, status=upstream.status)
        out.content_type = upstream.content_type or "text/event-stream"
        await out.prepare(request)
        return out


class Sent:
    """A POST on its way to an engine (counted on it until ``done``); ``answer`` is its
    response once the headers are in."""

    def __init__(self, up: Upstream, url: str, endpoint: str, body: dict) -> None:
        self.url, self.body = url, body
        self.started = time.perf_counter()
        self._answering: Answering | None = up.answering(url)
        self.answer = asyncio.ensure_future(up.session.post(f"{url}/v1/{path_of(endpoint)}", json=body))

    def done(self) -> None:
        if self._answering is not None:
            self._answering.done()
            self._answering = None

    async def withdraw(self) -> None:
        """Take the request back: its connection is closed, so the engine aborts it (vLLM
        frees a request it held unstarted; one it began stops at its next step)."""
        self.answer.cancel()
        (got,) = await asyncio.gather(self.answer, return_exceptions=True)
        if isinstance(got, aiohttp.ClientResponse):
            got.close()
        self.done()


class Answering:
    """Which engine is answering one continuation: it holds that request's count in
    ``Upstream.outstanding`` (what least-loaded choices read), and the count moves with
    the request when another engine takes it over (a moved reservation, a resume)."""

    def __init__(self, outstanding: dict[str, int], url: str) -> None:
        self._outstanding = outstanding
        self.url = url
        outstanding[url] = outstanding.get(url, 0) + 1

    def move(self, url: str) -> None:
        if url != self.url:
            self._outstanding[self.url] -= 1
            self._outstanding[url] = self._outstanding.get(url, 0) + 1
            self.url = url

    def done(self) -> None:
        self._outstanding[self.url] -= 1


class BrokeBeforeAnswering(aiohttp.ClientPayloadError):
    """An engine's answer failed before its first byte went to the client (before its
    headers, or a stream before its first event): another engine can still serve it.
    (Its cause is aiohttp's error: a read timeout among them.)"""


def nothing_sent(exc: aiohttp.ClientError, ask_or_body) -> bool:
    """Whether a proxied request that failed with ``exc`` sent its client nothing yet: it
    never reached the engine, its stream broke before its first byte, or its answer was
    not streamed (sent only once whole)."""
    body = ask_or_body.body if isinstance(ask_or_body, asks.Ask) else ask_or_body
    return isinstance(exc, (aiohttp.ClientConnectorError, BrokeBeforeAnswering)) or not body.get("stream")


def path_of(endpoint: str) -> str:
    return "chat/completions" if endpoint == "chat" else "completions"


async def reuse_connection(resp: aiohttp.ClientResponse) -> None:
    """Decode's answer read to its end (after ``[DONE]`` only the body's last chunk is
    left), so that its connection goes back to the pool: a new one per request costs the
    router a connect, and the engine an accept, on every request."""
    try:
        if not resp.closed:
            await asyncio.wait_for(resp.content.read(), 1.0)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass
    finally:
        resp.release()

"""Server-sent events both ways: the stream the router writes to its client, and
the one it reads from a decode engine."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web


class DecodeStreamError(Exception):
    """Decode's stream broke or sent an error: the request failed after its first token."""


async def sse_response(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(status=200)
    out.content_type = "text/event-stream"
    out.headers["Cache-Control"] = "no-cache"
    await out.prepare(request)
    return out


async def sse_events(resp: aiohttp.ClientResponse):
    """The JSON objects of a server-sent event stream, up to ``[DONE]``; a stream that
    breaks or does not parse is a failed decode (``DecodeStreamError``)."""
    try:
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise DecodeStreamError(f"decode's stream broke: {type(exc).__name__}: {exc}") from None

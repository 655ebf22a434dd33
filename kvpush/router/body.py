"""A request body, from the wire to a dict, refused with a 400 (413, 408) naming what is
wrong: too large, too slow, not UTF-8, not JSON, nested too deeply, not an object. Never
a crash: the JSON parser recurses once per nesting level, so a body of ``[`` * 100000
would otherwise end in a RecursionError (a 500) rather than an answer."""

from __future__ import annotations

import asyncio
import json
import re

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from kvpush.router.errors import ApiError

MAX_BODY = 8 << 20
# Deeper than any request vLLM takes in earnest (a JSON schema in response_format or
# tools nests two levels per object level), and far from the parser's recursion limit.
MAX_DEPTH = 128

# A JSON string, escapes and all; one left open runs to the end (the parser fails there,
# so nothing after it nests). Always matching from its first quote keeps the scan linear:
# a pattern that could fail there would be retried from every later quote.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_PARENS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _groups(depth: int) -> re.Pattern[bytes]:
    """Balanced groups of ``(`` and ``)`` at most ``depth`` deep. Possessive (``*+``): a
    bracket either opens or closes, there is nothing to try again, so the match runs in
    linear time in C (about 15 ms a MiB) where a Python loop over the brackets took ten
    times that."""
    group = rb"\(\)"
    for _ in range(depth - 1):
        group = rb"\((?:" + group + rb")*+\)"
    return re.compile(rb"(?:" + group + rb")*+")


_WITHIN = _groups(MAX_DEPTH)


def too_deep(raw: bytes) -> bool:
    """Whether the JSON parser would nest deeper than MAX_DEPTH in ``raw``, found without
    recursing: strings removed, then the brackets matched against balanced groups at most
    MAX_DEPTH deep. (False for a body that is invalid before it gets that deep: the
    parser then says what is wrong.)"""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:  # the common case: no need to look closer
        return False
    brackets = _STRING.sub(b"", raw).translate(_PARENS, _NOT_BRACKETS)
    rest = brackets[_WITHIN.match(brackets).end():]
    if not rest or rest.startswith(b")"):  # all within, or a close with nothing open: invalid, not deep
        return False
    # A group that failed either got too deep or was cut off by the end of the body;
    # closed as far as it is open, only the first still fails.
    closed = rest + b")" * (rest.count(b"(") - rest.count(b")"))
    return _WITHIN.fullmatch(closed) is None


def parse(raw: bytes) -> dict:
    """The body as a JSON object, or an ApiError (400) saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(f"body is not valid UTF-8: byte {exc.start} ({raw[exc.start:exc.start + 1]!r}) "
                       f"cannot be decoded ({exc.reason})") from None
    if too_deep(raw):
        raise ApiError(f"body is nested too deeply: more than {MAX_DEPTH} levels of arrays and objects")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(f"body is not JSON: {exc}") from None
    except RecursionError:  # not reached after the check above; a 400 all the same if it is
        raise ApiError(f"body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    if not isinstance(body, dict):
        raise ApiError(f"body must be a JSON object, not {_json_kind(body)}")
    return body


async def read(request: web.Request, timeout_s: float) -> dict:
    """The request's body as a JSON object, whole within ``timeout_s``, or an ApiError."""
    too_large = ApiError(f"request body is larger than {MAX_BODY} bytes", 413)
    if (request.content_length or 0) > MAX_BODY:  # said so up front: refused before a byte is read
        raise too_large
    try:
        # A body trickled in holds a handler and a connection: bounded. (No reservation
        # is made before the body is whole.)
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(f"the request body did not arrive within {timeout_s:g} s", 408) from None
    except web.HTTPRequestEntityTooLarge:  # (chunked or compressed: found as it arrives)
        raise too_large from None
    except RequestPayloadError as exc:  # broken chunked framing, a Content-Encoding that does not decode
        raise ApiError(f"request body could not be read: {exc}") from None
    return parse(raw)


def _json_kind(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)

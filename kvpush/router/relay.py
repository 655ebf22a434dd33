"""Decode's events passed on as bytes once the first-token boundary is settled.

Past the boundary (``first_token.Tail`` says when) decode's text is the text the
aggregated engine would stream, so the router does not make it again: a steady event
(a text, its token ids, nothing finished) is matched as bytes and written back in the
client's shape with one concatenation, its text's JSON string copied as decode's
encoder wrote it (vLLM's, the aggregated engine's too). Anything else (the finishing
event, usage, an error, an event whose shape is not the one expected) is not steady
and goes the parsed way. So a decode engine that writes its events differently costs
CPU, never a wrong answer.

The client's events are written as vLLM's OpenAI server writes them (pydantic's
compact JSON, its field order); ``tests/router/test_first_token_text.py`` holds these
shapes against vLLM's own response classes.

Both these and the streams the router passes through whole (the push path, decode alone:
``WholeEvents``) are written on from the engine connection's own callback (``Direct``),
no coroutine woken per event.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import ClientError, StreamReader

from kvpush import log
from kvpush.router import metrics
from kvpush.router.streams import split_whole

_log = log.get("router")

# What follows the text in a steady completion event of decode (vLLM, return_token_ids).
_STEADY_AFTER_TEXT = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":['
_STEADY_END = b"]}]}"
_TEXT_AT = b',"choices":[{"index":0,"text":'


def js(value) -> bytes:
    """One JSON value as vLLM's encoder writes it (compact, UTF-8 unescaped)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def event(obj: dict) -> bytes:
    return b"data: " + js(obj) + b"\n\n"


class Relay:
    """One answer's steady events, decode's shape to the client's. Keeps the JSON
    string of each text passed and the token ids (digits), in order, for what needs
    them later (the whole answer, a usage count, a resume elsewhere)."""

    def __init__(self, endpoint: str, head_raw: dict, return_token_ids: bool) -> None:
        opening = b'data: {"id":' + js(head_raw.get("id")) + b',"object":'
        opening += b'"text_completion"' if endpoint == "completions" else b'"chat.completion.chunk"'
        opening += b',"created":' + js(head_raw.get("created")) + b',"model":' + js(head_raw.get("model"))
        if endpoint == "completions":
            self._open = opening + _TEXT_AT
            self._ids_open = b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,' \
                             b'"token_ids":'
        else:
            self._open = opening + b',"choices":[{"index":0,"delta":{"content":'
            self._ids_open = b'},"logprobs":null,"finish_reason":null,"token_ids":'
        self._close = b"}]}\n\n"
        self._with_ids = return_token_ids
        self._decode_open: bytes | None = None  # decode's event up to its text: learned from its first
        self.texts: list[bytes] = []            # JSON strings, in order
        self.ids: list[bytes] = []              # "12,13" per event, in order

    def learn(self, payload: bytes) -> None:
        """Decode's opening (its id, created and model), from any event of its stream."""
        if self._decode_open is None:
            at = payload.find(_TEXT_AT)
            if at > 0:
                self._decode_open = payload[:at + len(_TEXT_AT)]

    def steady(self, payload: bytes) -> tuple[bytes, bytes] | None:
        """(the text's JSON string, its token ids) of a steady decode event, else None.
        The text ends where the fields after it begin: they hold quotes, which a JSON
        string cannot hold unescaped, so the last match is theirs."""
        opening = self._decode_open
        if opening is None or not payload.startswith(opening) or not payload.endswith(_STEADY_END):
            return None
        at = payload.rfind(_STEADY_AFTER_TEXT)
        if at < len(opening):
            return None
        return payload[len(opening):at], payload[at + len(_STEADY_AFTER_TEXT):-len(_STEADY_END)]

    def keep(self, text: bytes, ids: bytes) -> None:
        self.texts.append(text)
        self.ids.append(ids)

    def client_event(self, text: bytes, ids: bytes) -> bytes:
        tail = (b"[" + ids + b"]") if self._with_ids else b"null"
        return self._open + text + self._ids_open + tail + self._close

    def take_text(self) -> str:
        """The texts kept so far as one string (and forgotten)."""
        if not self.texts:
            return ""
        joined = b'"' + b"".join(t[1:-1] for t in self.texts) + b'"'
        self.texts.clear()
        return json.loads(joined)

    def take_ids(self) -> list[int]:
        """The token ids kept so far (and forgotten)."""
        kept = b",".join(i for i in self.ids if i)
        self.ids.clear()
        return json.loads(b"[" + kept + b"]") if kept else []

    def count(self) -> int:
        """Token ids kept so far, not parsed."""
        return sum(i.count(b",") + 1 for i in self.ids if i)


_RELAYING: dict[int, "Direct"] = {}  # id(reader) -> what relays it, while on


class _RelayedReader(StreamReader):
    """A response stream whose data goes to its ``Direct`` (aiohttp's StreamReader has
    slots: its class is swapped for this one, of the same layout, while relaying). The end
    of each HTTP chunk would wake the sleeping coroutine for nothing."""
    __slots__ = ()

    def feed_data(self, data: bytes, size: int = 0) -> bool:
        direct = _RELAYING[id(self)]
        direct.fed += 1
        return direct.feed(data)

    def end_http_chunk_receiving(self) -> None:
        return None


class Direct:
    """An engine's stream written on to the client from the connection's own callback.

    Where the router has nothing to decide per event it does not wake a coroutine for
    each: while this is on, what aiohttp's parser hands the engine's response stream
    (``feed_data``) is written to the client's transport at once (in the HTTP chunk framing
    its response uses; ``feed``, a kind's own, says what is written), and the coroutine
    reading the stream sleeps. A client whose buffer is past its high-water mark, a closing
    client, or what the kind cannot pass on hands the stream back to the coroutine
    (``stop``) with every byte not written, in order, and the coroutine's way (with its
    write timeout) takes it from there. Its end and its errors wake the coroutine as ever.
    """

    KIND = ""  # (the metrics' label)
    _told = False  # (that this aiohttp's objects are not the ones known: logged once a process)

    @classmethod
    def _begin(cls, resp, request, out, *args) -> "Direct | None":
        """Relay ``resp``'s stream to ``request``'s client, whose answer is ``out`` (headers
        sent; ``args``: the kind's own); None where bytes cannot be written past it (another
        reader or writer than aiohttp's plain ones: counted, see ``_declined``; the client gone;
        the stream at its end already: all of it is in the reader, the coroutine has it; or
        broken already: its next read says so)."""
        writer = getattr(out, "_payload_writer", None)  # (aiohttp's; its framing, for the relayed bytes)
        chunked = getattr(writer, "chunked", None)
        if not isinstance(chunked, bool) or getattr(writer, "_compress", None) or type(resp.content) is not StreamReader:
            cls._declined()
            return None
        if request.transport is None or resp.content.is_eof():
            return None
        engine = getattr(getattr(resp, "connection", None), "protocol", None)  # (aiohttp's ResponseHandler)
        try:
            direct = cls(resp.content, request.transport, chunked, *args, engine=engine)
        except ClientError:
            return None
        metrics.DIRECT_RELAYS.labels(kind=cls.KIND).inc()
        return direct

    @classmethod
    def _declined(cls) -> None:
        """Answers still come out the same bytes, each read relayed by a woken coroutine instead
        (more CPU per event): an operator must be able to see that, after an aiohttp upgrade
        say, so it is counted per read and said once."""
        metrics.DIRECT_DECLINED.inc()
        if not Direct._told:
            Direct._told = True
            _log.warning("direct_relay_declined", aiohttp=aiohttp.__version__,
                         why="aiohttp's response writer or stream reader is not the kind this router knows (or the "
                             "answer is compressed): engine streams go through the handler, at more CPU per event")

    def __init__(self, reader, transport, chunked: bool, engine=None) -> None:
        """``engine``: the engine connection's protocol (aiohttp's), whose read timer
        (``--upstream-timeout``) a ``Silence`` stands in for while this is on."""
        self._reader, self._transport, self._chunked = reader, transport, chunked
        self._pending = b""
        self._high = transport.get_write_buffer_limits()[1]
        self.active = True
        self.fed = 0  # reads handed over (what ``Silence`` watches)
        # What the reader holds already came first: relayed before anything newer (else a
        # client would get the newer events ahead of it). (A stream broken already raises.)
        buffered = reader.read_nowait(-1)
        self._silence = Silence.over(engine, self)
        _RELAYING[id(reader)] = self
        reader.__class__ = _RelayedReader
        if buffered:
            self.feed(buffered)

    def feed(self, data: bytes, size: int = 0) -> bool:
        raise NotImplementedError

    def _write(self, body: bytes) -> None:
        if not body or self._transport.is_closing():
            return
        self._transport.write(b"%x\r\n%b\r\n" % (len(body), body) if self._chunked else body)

    def _slowed(self) -> None:
        """Back to the coroutine when the client is not taking what it is sent."""
        if self._transport.is_closing() or self._transport.get_write_buffer_size() > self._high:
            self.stop()

    def stop(self, rest: bytes = b"") -> bytes:
        """Back to the coroutine, with ``rest`` (bytes not relayed) and what was pending, fed
        to the reader again; at the stream's end they are returned instead."""
        if not self.active:
            return b""
        self.active = False
        reader = self._reader
        reader.__class__ = StreamReader
        del _RELAYING[id(reader)]
        if self._silence is not None:
            self._silence.end(still_reading=not reader.is_eof() and reader.exception() is None)
        left = rest or self._pending
        self._pending = b""
        if left and not reader.is_eof():
            reader.feed_data(left)
            return b""
        return left


class Silence:
    """An engine that sends nothing for its read timeout (``--upstream-timeout``), noticed
    while a ``Direct`` relays its stream. aiohttp re-arms that timer on every read, a timer
    cancelled and made again per event (1.5-2.5 us of the router's CPU each, measured
    with uvloop); while relaying, a check every eighth of the timeout sees whether any read
    came since the last, and a stream silent for the whole timeout fails as aiohttp's timer
    would fail it (between the timeout and an eighth more after its last read). Handed
    back, the engine's own timer runs again from then."""

    CHECKS = 8  # per timeout

    @classmethod
    def over(cls, engine, direct: Direct) -> "Silence | None":
        timeout = getattr(engine, "read_timeout", None)
        if not timeout or not hasattr(engine, "_on_read_timeout"):  # (no timer, or not aiohttp's)
            return None
        return cls(engine, direct, timeout)

    def __init__(self, engine, direct: Direct, timeout: float) -> None:
        self._engine, self._direct, self._timeout = engine, direct, timeout
        self._loop = asyncio.get_running_loop()
        self._step = timeout / self.CHECKS
        self._seen, self._quiet = direct.fed, 0
        engine.read_timeout = None
        engine.start_timeout()  # (with no timeout: the armed timer dropped)
        self._check = self._loop.call_later(self._step, self._checked)

    def _checked(self) -> None:
        if self._direct.fed != self._seen:
            self._seen, self._quiet = self._direct.fed, 0
        else:
            self._quiet += 1
            if self._quiet >= self.CHECKS:  # silent the whole timeout: fail the read as aiohttp would
                self._check = None
                self._direct.stop()
                self._engine._on_read_timeout()
                return
        self._check = self._loop.call_later(self._step, self._checked)

    def end(self, still_reading: bool) -> None:
        """The engine's own timer back (armed again when its stream goes on)."""
        if self._check is not None:
            self._check.cancel()
        self._engine.read_timeout = self._timeout
        if still_reading and self._check is not None:
            self._engine.start_timeout()
        self._check = None


class Passthrough(Direct):
    """Decode's steady events, first-token path: each cut out and written in the client's
    shape (``Relay``) once the boundary is settled. The first event that is not steady (the
    last, usage, an error) hands the stream back, from that event on."""

    KIND = "passthrough"

    @classmethod
    def begin(cls, resp, request, out, tail) -> "Passthrough | None":
        """Relay ``resp``'s steady events (decode's) to ``request``'s client, whose answer is
        ``out`` (``tail``: the answer's ``first_token.Tail``, passing); None where this cannot."""
        def counted(n: int) -> None:
            tail.passed_events += n
        return cls._begin(resp, request, out, tail.relay, counted)

    def __init__(self, reader, transport, chunked: bool, relay: Relay, counted, engine=None) -> None:
        self._relay, self._counted = relay, counted
        super().__init__(reader, transport, chunked, engine)

    def feed(self, data: bytes, size: int = 0) -> bool:
        buf = self._pending + data if self._pending else data
        relay, out, start = self._relay, [], 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            event = buf[start:end]
            parts = relay.steady(event[6:]) if event.startswith(b"data: ") else None
            if parts is None:
                self._counted(len(out))
                self._write(b"".join(out))
                self._pending = b""
                self.stop(buf[start:])
                return False
            relay.keep(*parts)
            out.append(relay.client_event(*parts))
            start = end + 2
        self._pending = buf[start:]
        self._counted(len(out))
        self._write(b"".join(out))
        self._slowed()
        return False


class WholeEvents(Direct):
    """An engine's stream passed through as it is (the push path, decode alone), whole
    events at a time: the start of one not yet whole waits for its end, so a stream that
    breaks leaves the client on a whole event (``streams.end_with_error`` then ends it)."""

    KIND = "whole"

    @classmethod
    def begin(cls, resp, request, out) -> "WholeEvents | None":
        return cls._begin(resp, request, out)

    def feed(self, data: bytes, size: int = 0) -> bool:
        body, self._pending = split_whole(self._pending + data if self._pending else data)
        if body:
            self._write(body)
            self._slowed()
        return False

"""``relay.Passthrough`` and ``relay.WholeEvents`` on their own: an engine's bytes as
aiohttp's parser hands them over (events split anywhere), relayed in order; the stream
handed back to the reader at the first event that is not steady (Passthrough), when the
client's buffer is past its high-water mark, and on ``stop``; nothing lost or reordered
on the way back."""

from __future__ import annotations

import asyncio

from aiohttp import StreamReader

from kvpush.router.relay import Passthrough, Relay, WholeEvents
from kvpush.router.streams import HELD_MAX


class Transport:
    def __init__(self, high: int = 1 << 20) -> None:
        self.written: list[bytes] = []
        self.high, self.buffered, self.closing = high, 0, False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def get_write_buffer_limits(self):
        return (0, self.high)

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def is_closing(self) -> bool:
        return self.closing


class Protocol:
    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


def steady(i: int) -> bytes:
    return (b'data: {"id":"cmpl-d","object":"text_completion","created":5,"model":"tiny","choices":[{"index":0,'
            b'"text":"t%d \\"q\\"","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
            b'"token_ids":[%d]}]}\n\n' % (i, i))


LAST = (b'data: {"id":"cmpl-d","object":"text_completion","created":5,"model":"tiny","choices":[{"index":0,'
        b'"text":"end","logprobs":null,"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,'
        b'"token_ids":[9]}]}\n\n')


def relay() -> Relay:
    r = Relay("completions", {"id": "cmpl-p", "created": 1, "model": "tiny"}, False)
    r.learn(steady(0)[6:-2])
    return r


def unchunk(written: list[bytes]) -> bytes:
    out = b""
    for w in written:
        size, rest = w.split(b"\r\n", 1)
        assert int(size, 16) == len(rest) - 2 and rest.endswith(b"\r\n")
        out += rest[:-2]
    return out


async def test_relayed_in_order_and_handed_back_at_the_last_event():
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    t, counted = Transport(), []
    r = relay()
    p = Passthrough(reader, t, True, r, counted.append)
    stream = b"".join(steady(i) for i in range(1, 6)) + LAST
    for k in range(0, len(stream), 37):   # split anywhere, as TCP may
        reader.feed_data(stream[k:k + 37])
    assert not p.active and sum(counted) == 5
    relayed = unchunk(t.written)
    assert relayed == b"".join(r.client_event(b'"t%d \\"q\\""' % i, b"%d" % i) for i in range(1, 6))
    assert b'"id":"cmpl-p"' in relayed and b'"token_ids":null' in relayed
    assert await reader.read(len(LAST)) == LAST   # the last event, whole, for the coroutine
    assert r.take_text() == "".join(f't{i} "q"' for i in range(1, 6)) and r.take_ids() == [1, 2, 3, 4, 5]
    assert type(reader) is StreamReader


async def test_a_client_past_its_high_water_mark_hands_the_stream_back():
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    t = Transport(high=100)
    p = Passthrough(reader, t, False, relay(), lambda n: None)
    reader.feed_data(steady(1) + steady(2)[:20])
    t.buffered = 500                      # the client stopped reading
    reader.feed_data(steady(2)[20:40])
    assert not p.active
    assert len(t.written) == 1            # unframed: the client's response is not chunked
    reader.feed_data(steady(2)[40:])
    assert await reader.read(len(steady(2))) == steady(2)   # nothing lost or doubled


async def test_stop_gives_back_what_was_pending():
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    p = Passthrough(reader, Transport(), True, relay(), lambda n: None)
    reader.feed_data(steady(1)[:50])
    p.stop()
    p.stop()                              # (twice: nothing more)
    assert await reader.read(50) == steady(1)[:50]


async def test_what_the_reader_held_already_goes_first():
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    reader.feed_data(steady(1) + steady(2)[:30])   # arrived before the passthrough began
    t, r = Transport(), relay()
    Passthrough(reader, t, True, r, lambda n: None)
    reader.feed_data(steady(2)[30:] + steady(3))
    assert unchunk(t.written) == b"".join(r.client_event(b'"t%d \\"q\\""' % i, b"%d" % i) for i in (1, 2, 3))


async def test_no_passthrough_on_a_stream_already_at_its_end():
    """Everything decode sent is in the reader already (the client was slow to take the
    last write): the coroutine reads it, finish and usage included."""
    import types
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    reader.feed_data(steady(1) + LAST + b"data: [DONE]\n\n")
    reader.feed_eof()
    writer = types.SimpleNamespace(chunked=True, _compress=None)
    tail = types.SimpleNamespace(relay=relay(), passed_events=0)
    assert Passthrough.begin(types.SimpleNamespace(content=reader), types.SimpleNamespace(transport=Transport()),
                             types.SimpleNamespace(_payload_writer=writer), tail) is None
    assert (await reader.read()).endswith(b"[DONE]\n\n")


async def test_whole_events_are_written_as_they_end_and_the_rest_given_back_at_the_end():
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    reader.feed_data(steady(1)[:10])              # arrived before it began
    t = Transport()
    w = WholeEvents(reader, t, True)
    stream = steady(1)[10:] + steady(2) + LAST + b"data: [DONE]\n\n" + b"data: {\"tail"
    for k in range(0, len(stream), 29):          # split anywhere
        reader.feed_data(stream[k:k + 29])
        assert unchunk(t.written).endswith(b"\n\n") or not t.written   # never part of an event
    assert unchunk(t.written) == steady(1) + steady(2) + LAST + b"data: [DONE]\n\n"
    reader.feed_eof()
    assert w.stop() == b'data: {"tail'           # at the end: returned, not fed
    assert type(reader) is StreamReader and await reader.read() == b""


async def test_whole_events_hand_back_to_a_slow_client_with_nothing_lost():
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    t = Transport(high=100)
    w = WholeEvents(reader, t, False)
    reader.feed_data(steady(1) + steady(2)[:20])
    t.buffered = 500                               # (the write above took it past the mark)
    reader.feed_data(steady(2)[20:] + steady(3)[:5])
    assert not w.active and t.written == [steady(1), steady(2)]
    reader.feed_data(steady(3)[5:])
    assert await reader.read(len(steady(3))) == steady(3)


async def test_an_event_that_never_ends_is_passed_on_as_it_comes():
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    t = Transport()
    WholeEvents(reader, t, True)
    reader.feed_data(b"data: " + b"x" * (HELD_MAX - 6))   # held: as much as is ever held
    assert t.written == []
    reader.feed_data(b"yy")
    assert unchunk(t.written) == b"data: " + b"x" * (HELD_MAX - 6) + b"yy"


class Engine:
    """aiohttp's ResponseHandler as ``relay.Silence`` uses it: its read timeout, its timer
    (re)armed, and the read failed when the timer runs out."""

    def __init__(self, timeout: float) -> None:
        self.read_timeout, self.armed, self.failed_at = timeout, [], None

    def start_timeout(self) -> None:
        self.armed.append(self.read_timeout)

    def _on_read_timeout(self) -> None:
        self.failed_at = asyncio.get_running_loop().time()


async def test_a_stream_silent_for_the_read_timeout_fails_as_aiohttps_timer_would():
    loop = asyncio.get_running_loop()
    reader = StreamReader(Protocol(), 1 << 16, loop=loop)
    engine = Engine(0.5)
    w = WholeEvents(reader, Transport(), True, engine)
    assert engine.read_timeout is None and engine.armed == [None]   # aiohttp's per-read timer off
    for i in range(12):                                # reads every 50 ms for 0.6 s: never silent long enough
        reader.feed_data(steady(i))
        last = loop.time()
        await asyncio.sleep(0.05)
    assert engine.failed_at is None and w.active
    while engine.failed_at is None:
        await asyncio.sleep(0.01)
        assert loop.time() - last < 2.0, "a silent stream was never failed"
    assert 0.5 <= engine.failed_at - last <= 0.5 + 0.5 / 8 + 0.25   # (never early; late by a check, and the loop)
    assert not w.active and engine.read_timeout == 0.5 and engine.armed == [None]   # (not armed again)


async def test_handed_back_the_engines_own_timer_runs_again():
    loop = asyncio.get_running_loop()
    for at_end in (False, True):
        reader = StreamReader(Protocol(), 1 << 16, loop=loop)
        engine = Engine(600.0)
        w = WholeEvents(reader, Transport(), True, engine)
        reader.feed_data(steady(1))
        if at_end:
            reader.feed_eof()
        w.stop()
        assert engine.read_timeout == 600.0
        assert engine.armed == ([None] if at_end else [None, 600.0])   # armed again only for a stream going on


async def test_a_stream_broken_already_leaves_the_engines_timer_alone():
    import pytest
    from aiohttp import ClientPayloadError
    reader = StreamReader(Protocol(), 1 << 16, loop=asyncio.get_running_loop())
    reader.set_exception(ClientPayloadError("gone"))
    engine = Engine(600.0)
    with pytest.raises(ClientPayloadError):
        WholeEvents(reader, Transport(), True, engine)
    assert engine.read_timeout == 600.0 and engine.armed == [] and type(reader) is StreamReader

"""Streams the router passes through whole (the push path, decode alone) and its
first-token path's. One whose engine dies once part of it is out ends, on every path, as
vLLM's own server ends one whose engine failed (the events sent so far, each whole, then
an error event, then ``[DONE]``), never as a connection cut mid-event; an OpenAI client
raises that error with its message; the answer counts as the engine's failure. One whose
client falls behind arrives whole. (Stand-in engines and a real control plane, as in
test_router.)"""

from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest
from aiohttp import StreamReader
from aiohttp.test_utils import TestServer

from kvpush.router import metrics, relay
from kvpush.router.app import build_app
from kvpush.router.tokens import WhitespaceCounter
from tests.router.test_router_limits import requests_total, router_cfg

# What sends a request down each path (``kvpush.router.ask``) on the stack's routers.
PATHS = {
    # the whitespace tokenizer is not a fast detokenizer: the push path, decode streaming every token
    "push": ("url", {}),
    "decode_only": ("url", {"n": 2}),
    # the first-token path, its decode and the engine it resumes on both dying
    "first_token": ("ft_url", {}),
}


def events_of(raw: bytes) -> list:
    """Each event's data, parsed (a partial event would fail here), and the [DONE] as is."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    out = []
    for event in raw.decode().split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("mid_event", [False, True], ids=["between_events", "mid_event"])
@pytest.mark.parametrize("path", list(PATHS))
async def test_a_stream_whose_engine_dies_part_way_ends_with_an_error_event(stack, path, mid_event):
    s = stack
    where, extra = PATHS[path]
    if path == "first_token":
        s["prefill"].mode = s["decode"].mode = "token_ids"
        s["prefill"].break_after = 2  # (the resume's engine: it serves decode alone once decode died)
    s["decode"].break_after = 2
    s["decode"].break_mid_event = s["prefill"].break_mid_event = mid_event
    before = requests_total("completions", "upstream_error")
    body = dict({"model": "tiny", "prompt": "one two", "max_tokens": 8, "stream": True}, **extra)
    async with s["session"].post(s[where] + "/v1/completions", json=body) as r:
        raw = await r.read()  # (a cut connection would raise here)
    assert r.status == 200, raw
    events = events_of(raw)
    *answer, error, done = events
    assert done == "[DONE]"
    assert error["error"]["code"] == 502 and "broke" in error["error"]["message"], error
    assert len(answer) >= 2 and all("choices" in e for e in answer), answer
    assert requests_total("completions", "upstream_error") == before + 1

    # The OpenAI client raises the error with its message (not a protocol error).
    client = openai.AsyncOpenAI(base_url=s[where] + "/v1", api_key="-", max_retries=0)
    try:
        stream = await client.completions.create(model="tiny", prompt="one two", max_tokens=8, stream=True,
                                                 extra_body=extra)
        got = []
        with pytest.raises(openai.APIError, match="stream broke") as raised:
            async for chunk in stream:
                got.append(chunk)
        assert not isinstance(raised.value, openai.APIConnectionError)
        assert len(got) >= 2
    finally:
        await client.close()


@pytest.mark.parametrize("extra", [{}, {"n": 2}], ids=["push", "decode_only"])
async def test_a_stream_whose_engine_goes_silent_part_way_ends_with_a_504_event(stack, extra):
    """Nothing more for --upstream-timeout once the stream began: the same end, its error a
    504 that says how long the engine was silent (as when it is silent before answering)."""
    s = stack
    s["decode"].silent_after = 2
    router = TestServer(build_app(router_cfg(s, upstream_timeout_s=0.5), WhitespaceCounter()),
                        handler_cancellation=True)
    await router.start_server()
    try:
        before = requests_total("completions", "upstream_error")
        body = dict({"model": "tiny", "prompt": "one two", "max_tokens": 8, "stream": True}, **extra)
        async with s["session"].post(str(router.make_url("/v1/completions")), json=body) as r:
            raw = await r.read()
        *answer, error, done = events_of(raw)
        assert r.status == 200 and done == "[DONE]" and len(answer) == 2, raw
        assert error["error"]["code"] == 504, error
        assert error["error"]["message"] == "the engine sent nothing for 0.5 s (--upstream-timeout)", error
        assert requests_total("completions", "upstream_error") == before + 1
    finally:
        s["decode"].silent_after = None
        await router.close()


async def test_a_slow_reader_on_the_push_path_gets_the_whole_stream(stack, monkeypatch):
    """A client that falls behind (a small receive buffer, a pause): the events written on
    from decode's connection (``relay.WholeEvents``) hand the stream back to the handler
    once the client's buffer fills, and the handler's writes wait for it: every event
    arrives whole, once, in order."""
    handed_back = []
    slowed = relay.WholeEvents._slowed

    def watched(self):
        slowed(self)
        if not self.active:
            handed_back.append(True)
    monkeypatch.setattr(relay.WholeEvents, "_slowed", watched)
    s = stack
    # 25 MiB over 4 s: more than the kernel's socket buffers hold while the client pauses
    s["decode"].chunks, s["decode"].chunk_bytes = 400, 64 * 1024
    router = TestServer(build_app(router_cfg(s), WhitespaceCounter()))
    await router.start_server()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (router.host, router.port))
        body = json.dumps({"model": "tiny", "prompt": "a b c", "max_tokens": 8, "stream": True}).encode()
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        raw = bytearray()
        while True:
            got = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 30)
            if not got:
                break
            raw += got
            if len(raw) - len(got) < 16384 <= len(raw):
                await asyncio.sleep(1.0)   # it stops reading a while, decode streaming on
        at = raw.index(b"\r\n\r\n") + 4
        head = bytes(raw[:at])
        assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
        stream = bytearray()
        while True:  # (the HTTP chunks, undone)
            end = raw.index(b"\r\n", at)
            size = int(raw[at:end], 16)
            if size == 0:
                break
            stream += raw[end + 2:end + 2 + size]
            at = end + 4 + size
        stream = bytes(stream)
        *answer, done = events_of(stream)
        assert done == "[DONE]" and [e["choices"][0]["text"] for e in answer] == ["x" * 65536] * 400
        assert handed_back, "the client never fell behind: nothing was handed back"
    finally:
        sock.close()
        await router.close()


@pytest.mark.parametrize("path", ["push", "first_token"])
async def test_without_the_connection_callback_relay_the_answers_are_the_same_bytes(stack, path, monkeypatch):
    """``relay.Direct`` leans on aiohttp's internals and steps aside where it does not find
    them (another aiohttp: pyproject allows any 3.x from 3.14.3): then the handler's own
    reads relay every event, the client's bytes must not change, and /metrics shows it."""
    s = stack
    where, extra = PATHS[path]
    if path == "first_token":
        s["prefill"].mode = s["decode"].mode = "token_ids"
        s["decode"].chunk_delay = 0.005  # (a stream whole before its first read is not relayed so)
    s["decode"].chunks = 12
    bodies = [dict({"model": "tiny", "prompt": "one two", "max_tokens": 12, "stream": True}, **extra),
              dict({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                    "stream": True, "stream_options": {"include_usage": True}}, **extra)]

    async def answers() -> list[bytes]:
        out = []
        for body in bodies:
            endpoint = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            async with s["session"].post(s[where] + endpoint, json=body) as r:
                assert r.status == 200
                out.append(await r.read())
        return out
    began = []  # what Direct._begin gave: one relay per answer, here
    direct_begin = relay.Direct._begin.__func__

    def begin(cls, *args):
        began.append(direct_begin(cls, *args))
        return began[-1]
    monkeypatch.setattr(relay.Direct, "_begin", classmethod(begin))
    kind = "whole" if path == "push" else "passthrough"

    def counted() -> tuple[float, float]:
        value = metrics.REGISTRY.get_sample_value
        return (value("kvpush_router_direct_relays_total", {"kind": kind}) or 0,
                value("kvpush_router_direct_relay_declined_total") or 0)
    before = counted()
    relayed = await answers()
    assert len(began) == 2 and all(began), began
    assert counted() == (before[0] + 2, before[1])

    class Other(StreamReader):  # (another aiohttp's reader, as the relay sees it: not the class it knows)
        pass
    monkeypatch.setattr(relay, "StreamReader", Other)
    handled = await answers()
    assert handled == relayed and all(len(events_of(a)) >= 12 for a in relayed), (handled, relayed)
    after = counted()
    assert after[0] == before[0] + 2 and after[1] >= before[1] + 2, (before, after)  # (declined per read)

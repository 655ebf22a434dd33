"""What the router answers to bodies it cannot take, and to connections that send no
request: every answer on an OpenAI endpoint is a JSON error object with the right status
and is counted in kvpush_router_requests_total; a connection that does not finish its
headers (or idles) is closed and counted in kvpush_router_connections_shed_total, and the
router serves on."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from aiohttp.test_utils import TestServer

from kvpush.app.etcd_server import free_port
from kvpush.router import app as router_app, connections, metrics
from kvpush.router.app import DISPATCHER, build_app, start
from kvpush.router.body import MAX_BODY, MAX_DEPTH
from kvpush.router.config import DecodeEngine, RouterConfig
from kvpush.router.tokens import WhitespaceCounter
from tests.controlplane.helpers import settle
from tests.polling import until

pytestmark = pytest.mark.timeout(60)


def requests_total(endpoint: str, outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "kvpush_router_requests_total", {"endpoint": endpoint, "outcome": outcome}) or 0.0


def shed_total(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvpush_router_connections_shed_total", {"reason": reason}) or 0.0


def router_cfg(s: dict, **changes) -> RouterConfig:
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       decode=(DecodeEngine("decode-0", s["decode_url"]),), max_model_len=1000)
    return dataclasses.replace(cfg, **changes)


async def post(s: dict, path: str, data: bytes, url: str | None = None) -> tuple[int, dict]:
    async with s["session"].post((url or s["url"]) + path, data=data,
                                 headers={"Content-Type": "application/json"}) as r:
        assert r.content_type == "application/json", (r.status, await r.text())
        return r.status, await r.json()


async def test_a_body_nested_too_deeply_is_a_counted_400_that_says_so(stack):
    s = stack
    for path, endpoint, body in (("/v1/completions", "completions", b"[" * 100_000),
                                 ("/v1/chat/completions", "chat", b'{"a":' * 100_000 + b"1" + b"}" * 100_000)):
        before = requests_total(endpoint, "bad_request")
        status, answer = await post(s, path, body)
        assert status == 400 and answer["error"]["code"] == 400, answer
        assert "nested too deeply" in answer["error"]["message"] and str(MAX_DEPTH) in answer["error"]["message"]
        assert requests_total(endpoint, "bad_request") == before + 1
    # As deep as allowed is served (the body is then refused for what it lacks, not its depth).
    status, answer = await post(s, "/v1/completions", json.dumps({"model": "tiny", "prompt": "a b", "max_tokens": 2,
                                                                 "user": "[" * 1000,
                                                                 "x": nested(MAX_DEPTH - 1)}).encode())
    assert status == 200, answer
    assert s["decode"].bodies[-1]["x"] == nested(MAX_DEPTH - 1)


def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_bodies_that_are_not_utf8_json_objects_are_counted_400s_naming_why(stack):
    s = stack
    cases = [(b'{"prompt": "caf\xe9"}', "not valid UTF-8: byte 15"),
             (b'{"prompt": ', "not JSON"),
             (b'["tiny", "a b"]', "must be a JSON object, not an array"),
             (b'"a b"', "must be a JSON object, not a string")]
    for body, says in cases:
        before = requests_total("completions", "bad_request")
        status, answer = await post(s, "/v1/completions", body)
        assert status == 400 and says in answer["error"]["message"], (body, answer)
        assert requests_total("completions", "bad_request") == before + 1


async def test_a_body_over_the_limit_is_a_counted_413(stack):
    s = stack
    async def chunked():  # no Content-Length: the limit holds as the body arrives
        for _ in range(MAX_BODY // (1 << 20) + 1):
            yield b" " * (1 << 20)
    for data in (b" " * (MAX_BODY + 1), chunked()):
        before = requests_total("completions", "bad_request")
        async with s["session"].post(s["url"] + "/v1/completions", data=data) as r:
            assert r.status == 413 and r.content_type == "application/json"
            answer = await r.json()
        assert answer["error"]["code"] == 413 and str(MAX_BODY) in answer["error"]["message"]
        assert requests_total("completions", "bad_request") == before + 1


async def test_a_method_not_allowed_is_a_counted_json_405(stack):
    s = stack
    before = requests_total("chat", "bad_request")
    async with s["session"].get(s["url"] + "/v1/chat/completions") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"
        answer = await r.json()
    assert answer["error"]["code"] == 405 and "use POST" in answer["error"]["message"]
    assert requests_total("chat", "bad_request") == before + 1


class Recorder:
    """Stands in for a module's logger: what it was asked to log."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.lines.append((level, event, fields))


async def test_an_unexpected_failure_is_a_counted_json_500_and_the_router_serves_on(stack, monkeypatch):
    s = stack
    logged = Recorder()
    monkeypatch.setattr(router_app, "_log", logged)
    router = TestServer(build_app(router_cfg(s), WhitespaceCounter()))
    await router.start_server()
    url = str(router.make_url("")).rstrip("/")
    dispatcher = router.app[DISPATCHER]
    handle = dispatcher.handle

    async def broken(endpoint, body, request):
        raise KeyError("a bug")
    try:
        dispatcher.handle = broken
        before = requests_total("completions", "error")
        status, answer = await post(s, "/v1/completions", b'{"prompt": "a b"}', url)
        assert status == 500 and answer["error"]["code"] == 500 and "KeyError" in answer["error"]["message"]
        assert requests_total("completions", "error") == before + 1
        assert [(level, event) for level, event, _ in logged.lines] == [("exception", "request failed unexpectedly")]
        assert "a bug" in logged.lines[0][2]["error"]
        dispatcher.handle = handle
        status, answer = await post(s, "/v1/completions", b'{"prompt": "a b", "max_tokens": 2}', url)
        assert status == 200, answer
    finally:
        await router.close()


async def test_a_connection_trickling_its_headers_is_cut_off_counted_and_the_router_serves_on(stack):
    s = stack
    cfg = router_cfg(s, listen_port=free_port(), header_timeout_s=1.0)
    runner = await start(cfg, WhitespaceCounter())
    before = shed_total("header_timeout")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", cfg.listen_port)
        loop = asyncio.get_running_loop()
        started = loop.time()
        header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 100
        closed_after = None
        for byte in header:  # one byte every 0.5 s: never a whole header
            try:
                writer.write(bytes([byte]))
                await writer.drain()
                if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                    closed_after = loop.time() - started
                    break
            except asyncio.TimeoutError:
                continue
            except ConnectionError:
                closed_after = loop.time() - started
                break
        writer.close()
        assert closed_after is not None and 0.9 < closed_after < 3, closed_after
        assert shed_total("header_timeout") == before + 1
        status, answer = await post(s, "/v1/completions", b'{"prompt": "a b", "max_tokens": 2}',
                                    f"http://127.0.0.1:{cfg.listen_port}")
        assert status == 200, answer
    finally:
        await runner.cleanup()


async def test_an_idle_keepalive_connection_is_closed_and_counted(stack):
    s = stack
    cfg = router_cfg(s, listen_port=free_port(), keepalive_timeout_s=1.0)
    runner = await start(cfg, WhitespaceCounter())
    before = shed_total("idle")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", cfg.listen_port)
        loop = asyncio.get_running_loop()
        for _ in range(2):  # a kept-alive connection serves request after request, each in time
            writer.write(b"GET /live HTTP/1.1\r\nHost: x\r\n\r\n")
            status = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert status.startswith(b"HTTP/1.1 200"), status
            length = int(next(line.split(b":")[1] for line in status.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            await asyncio.sleep(0.5)
        idle_from = loop.time()
        assert await asyncio.wait_for(reader.read(1), 5) == b""
        assert 0.4 < loop.time() - idle_from < 3
        writer.close()
        await until(lambda: shed_total("idle") == before + 1, 5, "the idle connection counted")
        assert metrics.REGISTRY.get_sample_value("kvpush_router_open_connections") == 0
    finally:
        await runner.cleanup()


async def test_shedding_is_logged_at_once_then_summed_once_per_interval(monkeypatch):
    logged = Recorder()
    monkeypatch.setattr(connections, "_log", logged)
    guard = connections.ConnectionGuard(1.0, 2.0, log_interval_s=0.3)
    before = shed_total("header_timeout")
    for _ in range(1000):  # a flood: one line now, one summing up the rest
        guard.shed(connections.HEADERS)
    guard.shed(connections.IDLE)
    assert len(logged.lines) == 1 and logged.lines[0][2]["header_timeout"] == 1
    await until(lambda: len(logged.lines) == 2, 3, "the line summing up the flood")
    level, event, fields = logged.lines[1]
    assert level == "warning" and fields["header_timeout"] == 999 and fields["idle"] == 1
    assert fields["header_timeout_s"] == 1.0 and fields["keepalive_timeout_s"] == 2.0
    assert shed_total("header_timeout") == before + 1000
    guard.close()  # nothing left unlogged: no line
    assert len(logged.lines) == 2


async def test_upstream_timeout_bounds_an_engines_silence_not_an_answers_length(stack):
    """--upstream-timeout is how long an engine may send nothing, not how long an answer may
    take: a stream that outlasts it while its events keep coming arrives whole (a long
    generation is never cut); a decode engine silent that long is replaced by another
    engine; and when every engine that could serve is silent, the client gets a 504 that
    says so, its reservation released."""
    s = stack
    router = TestServer(build_app(router_cfg(s, upstream_timeout_s=0.5), WhitespaceCounter()),
                        handler_cancellation=True)
    await router.start_server()
    url = str(router.make_url("")).rstrip("/") + "/v1/completions"
    body = {"model": "tiny", "prompt": "one two", "max_tokens": 3}
    live = len((await settle(s["etcd"].endpoint)).live)
    try:
        s["decode"].chunks = 80  # 10 ms apart: about 0.8 s in all
        async with s["session"].post(url, json=dict(body, stream=True)) as r:
            text = (await r.read()).decode()
        assert r.status == 200 and text.count("data: {") == 80 and text.endswith("data: [DONE]\n\n"), text[-300:]
        s["decode"].chunks = 3
        s["decode"].stall.clear()  # decode silent: the prefill engine (a whole engine) serves alone
        for stream in (False, True):
            async with s["session"].post(url, json=dict(body, stream=stream)) as r:
                text = (await r.read()).decode()
            assert r.status == 200, text
            assert '"engine": "P"' in text if not stream else text.endswith("data: [DONE]\n\n"), text
        s["prefill"].stall.clear()  # and now every engine
        for stream in (False, True):
            before = requests_total("completions", "upstream_error")
            async with s["session"].post(url, json=dict(body, stream=stream)) as r:
                error = (await r.json())["error"]
            assert r.status == 504 and "sent nothing for 0.5 s" in error["message"], error
            assert requests_total("completions", "upstream_error") == before + 1
        # Only the first request's reservation is live (the stand-in decode never consumes one).
        await settle(s["etcd"].endpoint, until=lambda report: len(report.live) == live + 1)
    finally:
        s["decode"].chunks = 3
        s["decode"].stall.set()
        s["prefill"].stall.set()
        await router.close()


@pytest.mark.parametrize("field, flag", [("upstream_timeout_s", "--upstream-timeout"),
                                         ("reserve_timeout_s", "--reserve-timeout"),
                                         ("header_timeout_s", "--header-timeout"),
                                         ("keepalive_timeout_s", "--keepalive-timeout")])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_a_timeout_that_is_not_a_positive_number_is_refused_by_name(field, flag, value):
    cfg = RouterConfig(controlplane="127.0.0.1:1", token="t", model="tiny", prefill_urls=(), decode=())
    with pytest.raises(ValueError, match=f"{flag} must be a positive number of seconds"):
        dataclasses.replace(cfg, **{field: value})


def test_the_reserve_timeout_flag_reaches_the_router_and_a_bad_one_is_refused_by_name(monkeypatch):
    from kvpush import aio, log
    from kvpush.app import cli
    from kvpush.router import app as router_app
    served = []
    monkeypatch.setattr(log, "configure", lambda *args: None)
    monkeypatch.setattr(router_app, "serve", lambda cfg, ready_file: served.append(cfg))
    monkeypatch.setattr(aio, "run", lambda coro: None)
    base = ["router", "--model", "tiny", "--token", "t"]
    args = cli.build_parser().parse_args(base + ["--reserve-timeout", "2.5"])
    args.fn(args)
    assert served[0].reserve_timeout_s == 2.5
    args = cli.build_parser().parse_args(base)
    args.fn(args)
    assert served[1].reserve_timeout_s == 0.5
    args = cli.build_parser().parse_args(base + ["--reserve-timeout", "0"])
    with pytest.raises(SystemExit, match="--reserve-timeout must be a positive number of seconds"):
        args.fn(args)

"""Hypothesis throws methods, paths, headers and bodies at every router endpoint
(completions, chat, models, health, live, metrics) in front of healthy stand-in
engines and a real control plane. No answer may be a 5xx (the engines never fail
here, so any 5xx is the router's), none may hang, and once quiet nothing is reserved."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpush.contract.v1 import registry_pb2, types_pb2
from tests.controlplane.helpers import settle, stays_reserved

pytestmark = pytest.mark.timeout(300)

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/live", "/metrics"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
          "best_of", "logprobs", "top_logprobs", "echo", "stop", "temperature", "min_tokens", "return_token_ids",
          "kv_transfer_params", "prompt_embeds", "use_beam_search", "include_stop_str_in_output", "role", "content",
          "cache_salt"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=40), st.sampled_from(["tiny", "other", "", "a b c", "user"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4),
    st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), inner, max_size=5)), max_leaves=12)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=8).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({"model": st.just("tiny"), "prompt": st.text(min_size=1, max_size=30),
                           "max_tokens": st.integers(-3, 40), "stream": st.booleans()},
                          optional={"n": st.integers(0, 3), "logprobs": st.integers(-1, 30),
                                    "stop": values, "min_tokens": st.integers(-1, 5),
                                    "stream_options": values,
                                    "cache_salt": st.one_of(values, st.text(max_size=9))}).map(
        lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": st.one_of(st.text(max_size=20),
                                                                                          values)}), max_size=3),
                           "stream": st.booleans()},
                          optional={"max_tokens": st.integers(-1, 20), "n": st.integers(0, 2)}).map(
        lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
    values.map(lambda v: json.dumps(v).encode()))
# Mostly what clients send (POSTs to the OpenAI endpoints), the rest anything.
requests = st.tuples(st.sampled_from(["POST"] * 8 + ["GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
                     st.one_of(st.sampled_from(PATHS[:2] * 6 + PATHS[2:]), st.text(alphabet="/abcv1_-.%",
                                                                                      max_size=20).map(
                         lambda p: "/" + p.lstrip("/"))),
                     st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]),
                     bodies)


async def test_fuzzed_http_gets_no_5xx_no_hang_and_pins_nothing(stack, engine_client):
    s = stack
    loop = asyncio.get_running_loop()
    seen: dict[int, int] = {}
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))

    async def one(method: str, path: str, ctype: str, body: bytes) -> None:
        headers = {"content-type": ctype} if ctype else {}
        async with session.request(method, s["url"] + path, data=body, headers=headers) as r:
            payload = await r.read()
        seen[r.status] = seen.get(r.status, 0) + 1
        assert r.status < 500, f"{method} {path} {body[:200]!r}: {r.status} {payload[:300]!r}"
        if r.status >= 400 and path in PATHS[:2] and method == "POST":
            assert json.loads(payload)["error"]["code"] == r.status  # vLLM's error object

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(requests, min_size=1, max_size=3))
    def run(batch):
        async def together():
            await asyncio.gather(*(one(*req) for req in batch))
        asyncio.run_coroutine_threadsafe(together(), loop).result(60)

    try:
        await asyncio.to_thread(run)
    finally:
        await session.close()
    print("fuzzed statuses:", dict(sorted(seen.items())))
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0, seen
    # The stand-in decode engine loads nothing: report CONSUMED for every reservation the
    # router handed it, as a real decode engine's sidecar would. Every other reservation
    # must have been released by the router itself.
    handed = {b["kv_transfer_params"]["kvpush"]["reservation_id"] for b in s["decode"].bodies
              if isinstance(b.get("kv_transfer_params"), dict) and "reservation_id" in b["kv_transfer_params"].get(
                  "kvpush", {})}
    for res_id in handed:
        try:
            await engine_client.registry.ReportState(registry_pb2.ReportStateRequest(
                reservation_id=res_id, state=types_pb2.CONSUMED, landed=True), metadata=engine_client.metadata,
                timeout=5)
        except grpc.aio.AioRpcError as exc:  # released meanwhile (decode's answer was not a success)
            assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), exc
    report = await settle(s["etcd"].endpoint, quiet=True, until=lambda r: not r.live)
    assert not report.live, report.summary()


async def test_a_body_trickled_in_is_cut_off_and_reserves_nothing(stack):
    """A client that sends its headers and then its body a byte at a time, too slowly, is
    answered 408 within the body timeout; the engines never see it, nothing is reserved."""
    import dataclasses

    from aiohttp.test_utils import TestServer

    from kvpush.router.app import build_app
    from kvpush.router.config import DecodeEngine, RouterConfig
    from kvpush.router.tokens import WhitespaceCounter

    s = stack
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny",
                       prefill_urls=(s["prefill_url"],), decode=(DecodeEngine("decode-0", s["decode_url"]),),
                       max_model_len=1000)
    router = TestServer(build_app(dataclasses.replace(cfg, body_timeout_s=0.5), WhitespaceCounter()))
    await router.start_server()
    before = len(s["prefill"].bodies) + len(s["decode"].bodies)
    try:
        reader, writer = await asyncio.open_connection(router.host, router.port)
        body = json.dumps({"model": "tiny", "prompt": "a b c", "max_tokens": 3}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        await writer.drain()
        started = asyncio.get_running_loop().time()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        waited = asyncio.get_running_loop().time() - started
        assert b" 408 " in status_line and waited < 3, (status_line, waited)
        writer.close()
    finally:
        await router.close()
    assert len(s["prefill"].bodies) + len(s["decode"].bodies) == before
    report = await settle(s["etcd"].endpoint, quiet=True)
    assert not report.live


async def test_a_client_that_stops_reading_is_cut_off_and_decode_s_request_closed(stack):
    """A streamed answer the client does not read: once the buffers are full, a write
    waits; past the write timeout the router aborts the connection and closes decode's
    request, instead of holding both indefinitely. Decode streamed, so it had loaded the
    KV: the reservation is its sidecar's to end CONSUMED (these stand-ins do not), and the
    router does not release it (a release would race that report)."""
    import socket

    from aiohttp.test_utils import TestServer

    from kvpush.router import metrics
    from kvpush.router.app import build_app
    from kvpush.router.config import DecodeEngine, RouterConfig
    from kvpush.router.tokens import WhitespaceCounter

    s = stack
    s["decode"].chunks, s["decode"].chunk_bytes = 400, 64 * 1024  # 25 MiB: more than any socket buffers
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny",
                       prefill_urls=(s["prefill_url"],), decode=(DecodeEngine("decode-0", s["decode_url"]),),
                       max_model_len=1000, write_timeout_s=1.0)
    router = TestServer(build_app(cfg, WhitespaceCounter()))
    await router.start_server()
    def slow() -> float:
        return metrics.REGISTRY.get_sample_value(
            "kvpush_router_requests_total", {"endpoint": "completions", "outcome": "client_too_slow"}) or 0.0
    before = slow()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that takes almost nothing
    try:
        sock.connect((router.host, router.port))
        body = json.dumps({"model": "tiny", "prompt": "a b c", "max_tokens": 8, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = asyncio.get_running_loop().time() + 30
        while slow() == before:  # it reads nothing at all
            assert asyncio.get_running_loop().time() < deadline, "the slow reader was never cut off"
            await asyncio.sleep(0.1)
        for _ in range(100):
            if s["decode"].cancelled:
                break
            await asyncio.sleep(0.05)
        assert s["decode"].cancelled == 1  # decode's request was closed (vLLM would abort it)
        res_id = s["decode"].bodies[-1]["kv_transfer_params"]["kvpush"]["reservation_id"]
        await stays_reserved(s["tenant"], res_id)
    finally:
        sock.close()
        await router.close()

"""The router against a real control plane and etcd, with stand-in engines that
record what they receive (the real engines are exercised in the end-to-end tests)."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from aiohttp.test_utils import TestServer

from kvpush.contract.v1 import scheduler_pb2, types_pb2
from kvpush.router import metrics
from kvpush.router.app import build_app
from kvpush.router.config import DecodeEngine, RouterConfig
from kvpush.router.tokens import WhitespaceCounter
from tests.controlplane.helpers import settle, stays_reserved
from tests.router.fakes import FakeEngine, WordTokenizer


async def test_dispatch_to_prefill_and_decode(stack):
    s = stack
    async with s["session"].post(s["url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": "one two three", "max_tokens": 5}) as resp:
        assert resp.status == 200
        assert (await resp.json())["engine"] == "D"
    await asyncio.sleep(0.05)
    p, d = s["prefill"].bodies[0], s["decode"].bodies[0]
    assert p["max_tokens"] == 1 and p["stream"] is False
    pk, dk = p["kv_transfer_params"]["kvpush"], d["kv_transfer_params"]["kvpush"]
    assert pk["role"] == "prefill" and dk["role"] == "decode"
    assert pk["reservation_id"] == dk["reservation_id"] and pk["engine_id"] == "decode-0"
    assert pk["num_tokens"] == 4 and d["max_tokens"] == 5
    res = await s["tenant"].scheduler.GetReservation(
        scheduler_pb2.GetReservationRequest(reservation_id=pk["reservation_id"]), metadata=s["tenant"].metadata)
    assert res.state == types_pb2.RESERVED  # nothing consumed it: the engines are stand-ins
    async with s["session"].get(s["url"] + "/metrics") as r:
        text = await r.text()
    assert "kvpush_router_prefill_seconds_count" in text and "kvpush_router_reserve_seconds_count" in text


async def test_streaming_passthrough(stack):
    s = stack
    async with s["session"].post(s["url"] + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        text = (await resp.read()).decode()
    assert text.count("data: ") == 4 and text.strip().endswith("[DONE]")
    assert s["prefill"].bodies[0]["stream"] is False


async def fallbacks(s, reason: str = "resource_exhausted") -> float:
    import re
    async with s["session"].get(s["url"] + "/metrics") as r:
        m = re.search(r'kvpush_router_fallbacks_total\{reason="%s"\} (\S+)' % reason, await r.text())
    return float(m.group(1)) if m else 0.0


async def test_fallback_without_capacity(stack):
    s = stack
    before = await fallbacks(s)
    long_prompt = " ".join(["w"] * 400)   # 8 blocks of 16 cannot hold 400 tokens
    async with s["session"].post(s["url"] + "/v1/completions", json={"model": "tiny", "prompt": long_prompt}) as r:
        assert r.status == 200
    assert s["prefill"].bodies == []                      # no prefill engine involved
    assert "kv_transfer_params" not in s["decode"].bodies[0]
    assert await fallbacks(s) == before + 1


async def test_prefill_failure_releases_reservation(stack):
    s = stack
    s["prefill"].fail = True
    async with s["session"].post(s["url"] + "/v1/completions", json={"model": "tiny", "prompt": "a b"}) as r:
        assert r.status == 200     # decode still answers (it recomputes when the KV never lands)
    res_id = s["decode"].bodies[0]["kv_transfer_params"]["kvpush"]["reservation_id"]
    for _ in range(50):
        res = await s["tenant"].scheduler.GetReservation(
            scheduler_pb2.GetReservationRequest(reservation_id=res_id), metadata=s["tenant"].metadata)
        if res.state == types_pb2.RELEASED:
            break
        await asyncio.sleep(0.05)
    assert res.state == types_pb2.RELEASED and "prefill failed" in res.reason


async def test_client_disconnect_aborts_everything(stack):
    s = stack
    s["decode"].stall.clear()
    s["prefill"].stall.clear()
    task = asyncio.create_task(s["session"].post(s["url"] + "/v1/completions",
                                                 json={"model": "tiny", "prompt": "x y", "stream": True}))
    for _ in range(100):
        if s["decode"].bodies and s["prefill"].bodies:
            break
        await asyncio.sleep(0.02)
    res_id = s["decode"].bodies[0]["kv_transfer_params"]["kvpush"]["reservation_id"]
    task.cancel()                      # the client goes away mid-request
    await asyncio.gather(task, return_exceptions=True)
    await settle(s["etcd"].endpoint, quiet=True)      # the reservation was released
    res = await s["tenant"].scheduler.GetReservation(
        scheduler_pb2.GetReservationRequest(reservation_id=res_id), metadata=s["tenant"].metadata)
    assert res.state == types_pb2.RELEASED
    for _ in range(100):
        if s["decode"].cancelled and s["prefill"].cancelled:
            break
        await asyncio.sleep(0.02)
    assert s["decode"].cancelled == 1 and s["prefill"].cancelled == 1


async def test_a_client_gone_in_the_middle_of_the_decode_stream_aborts_decode_and_leaves_it_the_reservation(stack):
    """First-token path: the client reads its first tokens and goes away while decode is
    still streaming. Decode's request is closed (vLLM aborts it). Decode streamed a token,
    so it had loaded the KV: its sidecar ends the reservation CONSUMED (these stand-ins
    do not), and the router does not release it (a release would race that report and,
    winning, end a consumed reservation RELEASED, its blocks quarantined)."""
    s = stack
    s["prefill"].mode = s["decode"].mode = "token_ids"
    s["decode"].chunk_delay = 0.05
    resp = await s["session"].post(s["ft_url"] + "/v1/completions",
                                   json={"model": "tiny", "prompt": "a b", "max_tokens": 40, "stream": True})
    assert resp.status == 200
    seen = 0
    async for line in resp.content:
        seen += line.startswith(b"data: {")
        if seen == 3:  # the prefill engine's token and two of decode's
            break
    res_id = s["decode"].bodies[-1]["kv_transfer_params"]["kvpush"]["reservation_id"]
    resp.close()  # gone, mid-stream
    for _ in range(200):
        if s["decode"].cancelled:
            break
        await asyncio.sleep(0.02)
    assert s["decode"].cancelled == 1
    await stays_reserved(s["tenant"], res_id)


async def test_a_client_gone_once_its_answer_is_whole_releases_nothing(stack):
    """First-token path: the client reads to [DONE] and closes its connection while decode's
    body has not yet ended. Decode finished, so it has the KV: the reservation is decode's
    to end (its sidecar reports CONSUMED), and a release here would race that report (once,
    in CI, it won: the handler, cancelled by the close while it read the end of decode's
    body, released it). The end of decode's body is read in the background, whole, so
    decode's connection is kept for the next request rather than cut."""
    s = stack
    s["prefill"].mode = s["decode"].mode = "token_ids"
    s["decode"].linger = 0.5  # decode's body ends a while after its [DONE]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as once:
        async with once.post(s["ft_url"] + "/v1/completions",
                             json={"model": "tiny", "prompt": "a b", "max_tokens": 4, "stream": True}) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    res_id = s["decode"].bodies[-1]["kv_transfer_params"]["kvpush"]["reservation_id"]
    await stays_reserved(s["tenant"], res_id, checks=10)  # past decode's linger
    assert s["decode"].cancelled == 0  # decode's answer was read to its end


async def test_bad_requests(stack):
    s = stack
    cases = [({"model": "other", "prompt": "x"}, 404), ({"model": "tiny"}, 400), ({"model": "tiny", "prompt": None}, 400),
             ({"model": "tiny", "prompt": 5}, 400), ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400),
             ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400),
             ({"model": "tiny", "prompt": "x", "max_tokens": "abc"}, 400),
             ({"model": "tiny", "prompt": "x", "max_tokens": 10 ** 9}, 400), ({"model": "tiny", "prompt": "x", "n": 0}, 400),
             ({"model": "tiny", "prompt": " ".join(["w"] * 1000)}, 400),   # longer than the 1000-token context
             ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400),
             ({"model": "tiny", "prompt": "x", "temperature": -1}, 400), ({"model": "tiny", "prompt": [1, 5000]}, 400),
             ({"model": "tiny", "prompt": [1, True]}, 400, "/v1/completions", "prompt"),
             ({"model": "tiny", "prompt": [3, -1]}, 400, "/v1/completions", "prompt"),
             ({"model": "tiny", "prompt": [2, 1.5]}, 400, "/v1/completions", "prompt"),
             ({"model": "tiny", "prompt": [[1, 2], [3, False]]}, 400, "/v1/completions", "prompt"),
             ({"model": "tiny", "messages": []}, 400, "/v1/chat/completions"),
             ({"model": "tiny", "prompt": "x", "kv_transfer_params": {}}, 400),
             ({"model": "tiny", "prompt": "x", "cache_salt": ""}, 400, "/v1/completions", "cache_salt"),
             ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "cache_salt": 7}, 400,
              "/v1/chat/completions", "cache_salt")]
    for case in cases:
        body, status = case[0], case[1]
        path = case[2] if len(case) > 2 else "/v1/completions"
        async with s["session"].post(s["ft_url"] + path, json=body) as r:
            assert r.status == status, (body, await r.text())
            err = (await r.json())["error"]
            assert err["code"] == status and err["message"], err
            if len(case) > 3:
                assert err["param"] == case[3], err
    async with s["session"].post(s["url"] + "/v1/completions", data=b"{not json") as r:
        assert r.status == 400 and (await r.json())["error"]["code"] == 400
    async with s["session"].post(s["url"] + "/v1/completions", data=b" " * (9 << 20)) as r:
        assert r.status == 413 and (await r.json())["error"]["code"] == 413
    # Nothing was reserved for any of them, and no engine saw one.
    assert s["prefill"].bodies == [] and s["decode"].bodies == []
    report = await settle(s["etcd"].endpoint)
    assert not report.live, report.summary()
    async with s["session"].get(s["url"] + "/v1/models") as r:
        assert (await r.json())["data"][0]["id"] == "tiny"
    async with s["session"].get(s["url"] + "/health") as r:
        assert r.status == 200


async def test_control_plane_down_serves_without_push(stack):
    """The router's shared ReserveStream breaks with the control plane: requests in
    flight and after are served by decode alone (fallback "unavailable"), none fail."""
    s = stack
    async with s["session"].post(s["url"] + "/v1/completions", json={"model": "tiny", "prompt": "a b"}) as r:
        assert r.status == 200
    assert "kv_transfer_params" in s["decode"].bodies[-1]
    await s["cp"].stop(grace=0)
    for _ in range(2):
        async with s["session"].post(s["url"] + "/v1/completions", json={"model": "tiny", "prompt": "c d"}) as r:
            assert r.status == 200
        assert "kv_transfer_params" not in s["decode"].bodies[-1]
    assert await fallbacks(s, "unavailable") == 2


async def _reservation_state(s, res_id: str, want: int):
    for _ in range(50):
        res = await s["tenant"].scheduler.GetReservation(
            scheduler_pb2.GetReservationRequest(reservation_id=res_id), metadata=s["tenant"].metadata)
        if res.state == want:
            break
        await asyncio.sleep(0.05)
    return res


async def test_first_token_from_prefill_then_decode_continues(stack):
    s = stack
    s["prefill"].mode = s["decode"].mode = "token_ids"
    async with s["session"].post(s["ft_url"] + "/v1/completions", json={
            "model": "tiny", "prompt": "one two", "max_tokens": 4, "return_token_ids": True}) as r:
        assert r.status == 200, await r.text()
        got = await r.json()
    choice = got["choices"][0]
    assert choice["text"] == " w7 w10 w11 w12" and choice["token_ids"] == [7, 10, 11, 12]
    assert got["id"] == "cmpl-P" and choice["finish_reason"] == "length"
    assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    p, d = s["prefill"].bodies[0], s["decode"].bodies[0]
    assert p["max_tokens"] == 1 and p["return_token_ids"] is True and p["stream"] is False
    assert d["prompt"] == [1, 2, 3, 7] and d["max_tokens"] == 3 and d["stream"] is True
    assert p["kv_transfer_params"]["kvpush"]["reservation_id"] == d["kv_transfer_params"]["kvpush"]["reservation_id"]

    # Streamed: the first event carries prefill's token, then decode's, then usage.
    async with s["session"].post(s["ft_url"] + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in (await r.read()).decode().split("\n\n")
                  if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert content == " w7 w10 w11" and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == "cmpl-P" for e in events)


async def test_max_tokens_one_is_prefill_alone_and_n_is_decode_alone(stack):
    s = stack
    async with s["session"].post(s["ft_url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": "a b", "max_tokens": 1}) as r:
        assert r.status == 200
    assert len(s["prefill"].bodies) == 1 and "kv_transfer_params" not in s["prefill"].bodies[0]
    async with s["session"].post(s["ft_url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": ["a b", "c"], "max_tokens": 3}) as r:
        assert r.status == 200
    async with s["session"].post(s["ft_url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": "a b", "max_tokens": 3, "n": 2}) as r:
        assert r.status == 200
    assert len(s["decode"].bodies) == 2 and all("kv_transfer_params" not in b for b in s["decode"].bodies)
    assert len(s["prefill"].bodies) == 1
    report = await settle(s["etcd"].endpoint)
    assert not report.live, report.summary()


async def test_every_unsuccessful_answer_releases(stack):
    """Decode refusing what prefill accepted, prefill's token ending the request, prefill
    refusing: the reservation ends RELEASED at once, never at its deadline."""
    s = stack
    s["prefill"].mode = "token_ids"
    s["decode"].answer = (400, {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": 400}})
    async with s["session"].post(s["ft_url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": "a b", "max_tokens": 5}) as r:
        assert r.status == 400 and (await r.json())["error"]["message"] == "no"
    res_id = s["prefill"].bodies[-1]["kv_transfer_params"]["kvpush"]["reservation_id"]
    assert (await _reservation_state(s, res_id, types_pb2.RELEASED)).state == types_pb2.RELEASED
    # Today's path too (slow tokenizer): decode's refusal releases.
    async with s["session"].post(s["url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": "a b", "max_tokens": 5}) as r:
        assert r.status == 400
    res_id = s["prefill"].bodies[-1]["kv_transfer_params"]["kvpush"]["reservation_id"]
    assert (await _reservation_state(s, res_id, types_pb2.RELEASED)).state == types_pb2.RELEASED
    s["decode"].answer = None
    s["prefill"].finish = "stop"   # the first token is EOS
    async with s["session"].post(s["ft_url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": "a b", "max_tokens": 5}) as r:
        got = await r.json()
    assert got["choices"][0]["finish_reason"] == "stop" and got["choices"][0]["text"] == " w7"
    res_id = s["prefill"].bodies[-1]["kv_transfer_params"]["kvpush"]["reservation_id"]
    assert (await _reservation_state(s, res_id, types_pb2.RELEASED)).state == types_pb2.RELEASED
    s["prefill"].answer = (400, {"error": {"message": "bad field", "type": "BadRequestError", "param": "x",
                                           "code": 400}})
    async with s["session"].post(s["ft_url"] + "/v1/completions",
                                 json={"model": "tiny", "prompt": "a b", "max_tokens": 5}) as r:
        assert r.status == 400 and (await r.json())["error"]["param"] == "x"
    report = await settle(s["etcd"].endpoint, quiet=True)
    assert not report.live, report.summary()


async def test_stop_strings_across_the_first_and_second_tokens(stack):
    """Stop strings are matched on the whole generated text in the router at the boundary,
    and decode is given them for what follows (its text is passed on): one that starts in
    the prefill engine's token and ends in decode's cuts there, one inside decode's text
    ends decode, each with vLLM's truncation, token count and streaming hold-back."""
    s = stack
    s["prefill"].mode = s["decode"].mode = "token_ids"
    cases = [({"stop": " w11"}, " w7 w10", [7, 10, 11], " w11"),        # inside decode's text
             ({"stop": ["zzz", "7 w1"]}, " w", [7, 10], "7 w1"),        # starts in the first token's text
             ({"stop": "7 w1", "include_stop_str_in_output": True}, " w7 w1", [7, 10], "7 w1")]
    for extra, text, ids, reason in cases:
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "a b", "max_tokens": 6, "return_token_ids": True, **extra}
            async with s["session"].post(s["ft_url"] + "/v1/completions", json=dict(body, stream=stream)) as r:
                assert r.status == 200
                if stream:
                    events = [json.loads(line[6:]) for line in (await r.read()).decode().split("\n\n")
                              if line.startswith("data: {")]
                    got_text = "".join(c["text"] for e in events for c in e["choices"])
                    got_ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
                    last = [c for e in events for c in e["choices"]][-1]
                else:
                    last = (await r.json())["choices"][0]
                    got_text, got_ids = last["text"], last["token_ids"]
            assert (got_text, got_ids, last["finish_reason"], last["stop_reason"]) == (text, ids, "stop", reason), \
                (extra, stream)
            assert s["decode"].bodies[-1]["stop"] == extra["stop"]
    # The stand-in decode never consumes its reservations (a real one does on admission):
    # they stay live here, and the registry must still be sound.
    report = await settle(s["etcd"].endpoint)
    assert len(report.live) == 6


async def test_decode_unreachable_after_the_first_token(stack):
    """The first token is out; then the only decode engine cannot be reached: the prefill
    engine (a whole vLLM engine too: the local fallback) continues the request without
    its KV, so the client gets its whole answer, streamed or not, never a 502, and the
    reservation is released."""
    s = stack
    s["prefill"].mode = "token_ids"
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       decode=(DecodeEngine("decode-0", "http://127.0.0.1:9"),), max_model_len=1000)
    router = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
    await router.start_server()
    try:
        url = str(router.make_url("")).rstrip("/")
        async with s["session"].post(url + "/v1/completions",
                                     json={"model": "tiny", "prompt": "a b", "max_tokens": 4, "stream": True}) as r:
            text = (await r.read()).decode()
        events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
        assert r.status == 200 and text.endswith("[DONE]\n\n") and not any("error" in e for e in events), text
        assert events[0]["choices"][0]["text"] == " w7" and len(events) > 1
        async with s["session"].post(url + "/v1/completions",
                                     json={"model": "tiny", "prompt": "a b", "max_tokens": 4}) as r:
            assert r.status == 200, await r.text()
        # Each request: its first token, then its continuation on the prefill engine, plain.
        firsts, continuations = s["prefill"].bodies[-4::2], s["prefill"].bodies[-3::2]
        assert all("kv_transfer_params" not in b and b["max_tokens"] == 3 for b in continuations), continuations
        for body in firsts:
            res_id = body["kv_transfer_params"]["kvpush"]["reservation_id"]
            assert (await _reservation_state(s, res_id, types_pb2.RELEASED)).state == types_pb2.RELEASED
        assert metrics.FALLBACKS.labels(reason="decode_failed")._value.get() >= 2
    finally:
        await router.close()


async def test_a_decode_engine_that_fails_before_answering_is_replaced_by_another(stack):
    """The reservation's decode engine is unreachable, or answers 500, before sending
    anything: the request is served by the other decode engine alone (its KV is lost with
    the first, so the reservation is released), never a 502."""
    s = stack
    spare = FakeEngine("D2")
    spare.mode = "token_ids"
    server = TestServer(spare.app(), handler_cancellation=True)
    await server.start_server()
    spare_url = str(server.make_url("")).rstrip("/")
    routers = []
    try:
        for counter, dead in ((WhitespaceCounter(), True), (WhitespaceCounter(), False), (WordTokenizer(), True),
                              (WordTokenizer(), False)):
            s["prefill"].mode = "token_ids" if isinstance(counter, WordTokenizer) else ""
            s["decode"].fail = not dead
            first = "http://127.0.0.1:9" if dead else s["decode_url"]
            cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny",
                               prefill_urls=(s["prefill_url"],),
                               decode=(DecodeEngine("decode-0", first), DecodeEngine("decode-1", spare_url)),
                               max_model_len=1000)
            router = TestServer(build_app(cfg, counter), handler_cancellation=True)
            await router.start_server()
            routers.append(router)
            before = len(spare.bodies)
            async with s["session"].post(str(router.make_url("")).rstrip("/") + "/v1/completions",
                                         json={"model": "tiny", "prompt": "one two", "max_tokens": 3}) as r:
                assert r.status == 200, await r.text()
            body = spare.bodies[before]
            assert "kv_transfer_params" not in body  # it computes the prompt itself
        await settle(s["etcd"].endpoint, quiet=True)  # every reservation released, none left live
    finally:
        s["decode"].fail = False
        for router in routers:
            await router.close()
        await server.close()


async def test_a_decode_engine_that_dies_after_its_headers_is_replaced_by_another(stack):
    """A streamed answer whose decode engine sends its headers and dies before its first
    event (vLLM's server sends them at once, then computes: queued, or the prompt on the
    way to the first token) has sent the client nothing, so another decode engine serves
    it: the client gets a whole stream, never a cut connection; and where every engine
    that could serve it fails so, a 502 error object, not a connection closed without an
    answer."""
    s = stack
    spare = FakeEngine("D2")
    server = TestServer(spare.app(), handler_cancellation=True)
    await server.start_server()
    spare_url = str(server.make_url("")).rstrip("/")
    routers = []
    try:
        s["prefill"].mode = ""
        s["decode"].break_after = 0
        for engines in ((DecodeEngine("decode-0", s["decode_url"]), DecodeEngine("decode-1", spare_url)),
                        (DecodeEngine("decode-0", s["decode_url"]),)):
            cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny",
                               prefill_urls=(s["prefill_url"],), decode=engines, max_model_len=1000)
            router = TestServer(build_app(cfg, WhitespaceCounter()), handler_cancellation=True)
            await router.start_server()
            routers.append(router)
            url = str(router.make_url("")).rstrip("/")
            s["prefill"].break_after = None if len(engines) == 2 else 0  # (the last engine that could serve)
            for path, body in (("/v1/completions", {"prompt": "one two"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "one two"}]})):
                before = len(spare.bodies)
                async with s["session"].post(url + path, json=dict(body, model="tiny", max_tokens=3, stream=True)) as r:
                    text = (await r.read()).decode()
                if len(engines) == 2:
                    assert r.status == 200 and text.endswith("data: [DONE]\n\n"), (r.status, text)
                    assert len(spare.bodies) == before + 1
                else:
                    assert r.status == 502 and "engine unreachable" in json.loads(text)["error"]["message"], text
        await settle(s["etcd"].endpoint, quiet=True)  # every reservation released, none left live
    finally:
        s["decode"].break_after = s["prefill"].break_after = None
        for router in routers:
            await router.close()
        await server.close()

"""The whole system, real parts only: etcd, a control plane, `kvpush sidecar`
processes, a prefill and a decode vLLM engine with the connector, the router; and
one aggregated engine (no connector) for reference. Greedy outputs through the
router must equal the aggregated engine's, token for token and character for
character, and the decode engine's counters must show the prompt's KV arrived by
push and that decode computed one token of it: the prefill engine's first token,
which the router sent to the client as soon as prefill answered."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvpush.controlplane.invariants import check
from kvpush.app import engines
from kvpush.app.etcd_server import free_port
from kvpush.app.procs import ManagedProcess, http_ok
from kvpush.app.stack import Stack, StackSpec, complete
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model

pytestmark = pytest.mark.timeout(900)

# Token counts come from the tokenizer; these prompts give lengths below, at and
# above multiples of the 32-token block, and two long enough for chunked prefill
# (the prefill engine runs 64-token chunks).
PROMPTS = {
    "short": "The quick brown fox",
    "medium": "Disaggregated serving splits prefill and decode across engines so that each can be sized",
    "long": " ".join(["A longer prompt that spans several blocks of thirty-two tokens."] * 5),
    "chunked": " ".join(["Push each layer while the next one is still being computed."] * 15),
}
MAX_TOKENS = 12


def counters(stack: Stack, engine: str) -> dict:
    return stack.stats().get(engine, {}).get("counters", {})


def with_aggregated(logs: str, spec: StackSpec):
    """The stack of ``spec`` and one aggregated engine beside it (the reference answers):
    yields (stack, the aggregated engine's URL); both stopped after."""
    port = free_port()
    agg = ManagedProcess("vllm-aggregated", engines.vllm_command(spec.model_dir, port, "tiny"),
                         os.path.join(logs, "vllm-aggregated.log"),
                         env=engines.engine_env(ipc_dir=logs), cwd=engines.ROOT)
    stack = Stack(spec, progress=print)
    try:
        stack.start()
        agg.wait_until(http_ok(f"http://127.0.0.1:{port}/health"), 300, "serving")
        yield stack, f"http://127.0.0.1:{port}"
    finally:
        stack.stop()
        agg.stop()


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("e2e-logs"))
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    yield from with_aggregated(logs, StackSpec(model_dir=model, log_dir=logs,
                                               prefill_args=("--max-num-batched-tokens", "64"),
                                               deadline_ms=20_000, quarantine_ms=2_000))


def post(url: str, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, dict | list]:
    """Raw HTTP: (status, the JSON answer, or the list of streamed events)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            if isinstance(body, dict) and body.get("stream"):
                return resp.status, [json.loads(line[6:]) for line in (raw.strip() for raw in resp)
                                     if line.startswith(b"data: {")]
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def streamed(events: list, endpoint: str = "completions") -> dict:
    """What a client puts together from a stream: text, token ids, finish reason, usage."""
    out = {"text": "", "token_ids": [], "finish_reason": None, "usage": None, "texts": []}
    for e in events:
        if e.get("usage"):
            out["usage"] = {k: e["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for c in e.get("choices") or []:
            text = c.get("text", "") if endpoint == "completions" else (c.get("delta") or {}).get("content") or ""
            out["text"] += text
            out["texts"].append(text)
            out["token_ids"] += c.get("token_ids") or []
            out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
    return out


def usage(answer: dict) -> dict:
    return {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def assert_pushed_one_computed(before: dict, after: dict, prompt_tokens: int, what) -> None:
    """One push landed, no recompute, and decode loaded the whole prompt: it computed only
    the prefill engine's first token (its prompt is the prompt plus that token)."""
    assert after.get("loads_landed", 0) == before.get("loads_landed", 0) + 1, (what, after)
    assert after.get("load_errors", 0) == before.get("load_errors", 0), (what, after)
    assert after["tokens_loaded"] - before.get("tokens_loaded", 0) == prompt_tokens, (what, before, after)


def settled(stack: Stack, timeout: float = 30.0):
    """The registry once every reservation has ended: nothing live, the invariants hold."""
    async def wait():
        deadline = time.monotonic() + timeout
        while True:
            report = await check(stack.etcd.endpoint, quiet=True, quarantine_ms=2_000)
            if (report.ok and not report.live) or time.monotonic() > deadline:
                return report
            await asyncio.sleep(0.2)
    report = asyncio.run(wait())
    assert report.ok and not report.live, report.summary()
    return report


def test_lengths_match_aggregated_and_arrive_by_push(system):
    stack, agg = system
    for name, prompt in PROMPTS.items():
        for stream in (False, True):
            # A distinct first block each time: decode's prefix cache would otherwise hold part of it.
            p = ("Streamed: " if stream else "Whole: ") + prompt
            body = {"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "return_token_ids": True}
            before = counters(stack, "decode-0")
            if stream:
                status, events = post(stack.router_url, "/v1/completions",
                                      dict(body, stream=True, stream_options={"include_usage": True}))
                got = streamed(events)
                got_usage = got["usage"]
            else:
                status, answer = post(stack.router_url, "/v1/completions", body)
                got = dict(answer["choices"][0])
                got_usage = usage(answer)
            assert status == 200, (name, got)
            _, want = post(agg, "/v1/completions", body)
            w = want["choices"][0]
            assert got["text"] == w["text"] and got["token_ids"] == w["token_ids"], (name, stream, got, w)
            assert got["finish_reason"] == w["finish_reason"] and got_usage == usage(want), (name, got_usage)
            time.sleep(0.3)
            assert_pushed_one_computed(before, counters(stack, "decode-0"), want["usage"]["prompt_tokens"],
                                       (name, stream))
    pushed = counters(stack, "prefill-0")
    assert pushed.get("requests_pushed", 0) >= 2 * len(PROMPTS)
    settled(stack)


def test_chat_streaming_and_not(system):
    stack, agg = system
    for stream in (False, True):
        before = counters(stack, "decode-0")
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"stream={stream}: {PROMPTS['medium']}"}],
                "max_tokens": MAX_TOKENS, "temperature": 0.0, "return_token_ids": True}
        _, want = post(agg, "/v1/chat/completions", body)
        if stream:
            status, events = post(stack.router_url, "/v1/chat/completions",
                                  dict(body, stream=True, stream_options={"include_usage": True}))
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            got = streamed(events, "chat")
            assert got["usage"] == usage(want)
            assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("chatcmpl-")
        else:
            status, answer = post(stack.router_url, "/v1/chat/completions", body)
            got = {"text": answer["choices"][0]["message"]["content"], "token_ids": answer["choices"][0]["token_ids"],
                   "finish_reason": answer["choices"][0]["finish_reason"]}
            assert answer["object"] == "chat.completion" and usage(answer) == usage(want)
            assert answer["prompt_token_ids"] == want["prompt_token_ids"]
        w = want["choices"][0]
        assert status == 200
        assert (got["text"], got["token_ids"], got["finish_reason"]) == (w["message"]["content"], w["token_ids"],
                                                                         w["finish_reason"]), stream
        time.sleep(0.3)
        assert_pushed_one_computed(before, counters(stack, "decode-0"), want["usage"]["prompt_tokens"], stream)
    settled(stack)


def test_character_split_between_first_and_second_token(system):
    """'é' is two byte tokens in this byte-level BPE. Biasing the logits to those two
    tokens (the bias applies on both engines), find a prompt whose first output token
    is the character's first byte and whose second is its second byte: prefill's text
    for the first token is empty, and decode's text at that boundary is not to be
    trusted (kvpush/router/tokens.py)."""
    stack, agg = system
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(stack.spec.model_dir)
    first, second = tok.encode("é", add_special_tokens=False)
    bias = {str(first): 100, str(second): 100}
    for i in range(64):
        body = {"model": "tiny", "prompt": f"Bytes of one character, try {i}", "max_tokens": 6, "temperature": 0.0,
                "logit_bias": bias, "return_token_ids": True}
        _, want = post(agg, "/v1/completions", body)
        if want["choices"][0]["token_ids"][:2] == [first, second]:
            break
    else:
        pytest.fail("no prompt gave the two bytes of 'é' as its first two tokens")
    assert want["choices"][0]["text"].startswith("é")
    _, got = post(stack.router_url, "/v1/completions", body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    _, events = post(stack.router_url, "/v1/completions", dict(body, stream=True))
    s = streamed(events)
    assert s["text"] == want["choices"][0]["text"] and s["texts"][0] == ""   # nothing to show for half a character
    settled(stack)


def test_logprobs_echo_and_usage_as_one_engine_answers(system):
    """Completion logprobs (the first token's from prefill, the rest from decode, text
    offsets continued), echo (on the push path: decode answers it whole), and usage: as
    one engine answers them (logprob values to float32 rounding: the engines compute
    them in different batches)."""
    stack, agg = system
    for extra in ({"logprobs": 2}, {"echo": True}, {"echo": True, "logprobs": 1}):
        body = {"model": "tiny", "prompt": f"Logprobs {sorted(extra)}: " + PROMPTS["medium"], "max_tokens": 6,
                "temperature": 0.0, **extra}
        _, want = post(agg, "/v1/completions", body)
        _, got = post(stack.router_url, "/v1/completions", body)
        w, g = want["choices"][0], got["choices"][0]
        assert g["text"] == w["text"] and usage(got) == usage(want), extra
        if "logprobs" in extra:
            wl, gl = w["logprobs"], g["logprobs"]
            assert gl["tokens"] == wl["tokens"] and gl["text_offset"] == wl["text_offset"], extra
            assert [set(t or {}) for t in gl["top_logprobs"]] == [set(t or {}) for t in wl["top_logprobs"]]
            assert all((a is None and b is None) or abs(a - b) < 1e-3
                       for a, b in zip(gl["token_logprobs"], wl["token_logprobs"])), extra
    settled(stack)


def test_stop_strings_answered_as_one_engine_answers(system):
    """Stop strings cut from the aggregated engine's own output, at several places (one
    across the first and second tokens when the first token's text is short): the
    router's text, tokens, finish and stop reasons and usage equal that engine's."""
    stack, agg = system
    base = {"model": "tiny", "prompt": "Stop strings: " + PROMPTS["medium"], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "return_token_ids": True}
    _, free = post(agg, "/v1/completions", base)
    whole = free["choices"][0]["text"]
    from transformers import AutoTokenizer
    first_len = len(AutoTokenizer.from_pretrained(stack.spec.model_dir).decode(free["choices"][0]["token_ids"][:1]))
    cuts = [whole[max(0, first_len - 1):first_len + 2], whole[len(whole) // 2:len(whole) // 2 + 3],
            [whole[-2:], "never in it"]]
    for stop in cuts:
        for extra in ({}, {"include_stop_str_in_output": True}):
            body = dict(base, stop=stop, **extra)
            _, want = post(agg, "/v1/completions", body)
            w = want["choices"][0]
            assert w["finish_reason"] == "stop", (stop, w)   # each cut is in the output: the engine stops
            _, got = post(stack.router_url, "/v1/completions", body)
            g = got["choices"][0]
            assert (g["text"], g["token_ids"], g["finish_reason"], g["stop_reason"], usage(got)) == \
                (w["text"], w["token_ids"], w["finish_reason"], w["stop_reason"], usage(want)), (stop, extra)
            _, events = post(stack.router_url, "/v1/completions", dict(body, stream=True))
            st = streamed(events)
            assert (st["text"], st["token_ids"], st["finish_reason"]) == (w["text"], w["token_ids"],
                                                                          w["finish_reason"]), (stop, extra)
    settled(stack)


def test_seeded_sampling_answers_as_the_one_engine_does(system):
    """temperature > 0 with a seed: the aggregated engine's answer, every time. (The
    first-token path would give one consistent sequence, but decode's generator would
    start again at the second token; the push path has decode draw every token from
    the seed, as one engine does.) Unseeded sampling stays on the first-token path.

    The prompt is shorter than the prefill engine's 64-token chunk: vLLM's CPU build
    kills its engine core on a seeded request under chunked prefill (it rewinds the
    request's generator, "CPU Generator does not use offset"), with or without kvpush."""
    stack, agg = system
    for seed in (1234, 7):
        body = {"model": "tiny", "prompt": f"Sampled {seed}: " + PROMPTS["medium"], "max_tokens": 8,
                "temperature": 1.0, "seed": seed, "return_token_ids": True}
        _, want = post(agg, "/v1/completions", body)
        before = counters(stack, "decode-0")
        _, got = post(stack.router_url, "/v1/completions", body)
        w, g = want["choices"][0], got["choices"][0]
        assert (g["text"], g["token_ids"]) == (w["text"], w["token_ids"]), seed
        time.sleep(0.3)
        after = counters(stack, "decode-0")
        assert after.get("loads_landed", 0) == before.get("loads_landed", 0) + 1   # by push
        _, events = post(stack.router_url, "/v1/completions", dict(body, stream=True))
        s = streamed(events)
        assert (s["text"], s["token_ids"]) == (w["text"], w["token_ids"]), seed
    settled(stack)


def test_max_tokens_one_is_served_by_prefill_alone(system):
    stack, agg = system
    before_d, before_p = counters(stack, "decode-0"), counters(stack, "prefill-0")
    body = {"model": "tiny", "prompt": PROMPTS["medium"] + " one token", "max_tokens": 1, "temperature": 0.0}
    _, got = post(stack.router_url, "/v1/completions", body)
    _, want = post(agg, "/v1/completions", body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"] and usage(got) == usage(want)
    time.sleep(0.3)
    after_d, after_p = counters(stack, "decode-0"), counters(stack, "prefill-0")
    assert after_d.get("loads_started", 0) == before_d.get("loads_started", 0)
    assert after_p.get("requests_pushed", 0) == before_p.get("requests_pushed", 0)
    settled(stack)


def test_hostile_inputs_get_engine_errors_and_pin_nothing(system):
    """A new user with the openai client and raw HTTP: every bad request is refused with
    the engines' status code and a JSON error object before anything is reserved; n > 1
    and prompt lists are served at once; afterwards nothing is held in etcd and the next
    request still goes by push."""
    stack, agg = system
    client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(stack.spec.model_dir).encode(PROMPTS["chunked"], add_special_tokens=False)
    long_prompt = (ids * 40)[:1900]     # token ids: exactly 1,900 tokens
    bad = [dict(max_tokens=-1), dict(max_tokens=0), dict(extra_body={"max_tokens": "abc"}), dict(max_tokens=10 ** 9),
           dict(n=0), dict(temperature=-1), dict(top_p=0)]
    for _ in range(3):      # 21 requests that decode would refuse, each with a 1,900-token prompt
        for kw in bad:
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="tiny", prompt=long_prompt, **kw)
            assert err.value.status_code == 400 and err.value.body["message"], kw
    too_long = (ids * 40)[:2100]        # over the model's 2,048-token context
    for _ in range(5):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt=too_long, max_tokens=4)
        assert "maximum context length" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    for body, status, param in ((b'{"model": "tiny", "prompt": null}', 400, "prompt"),
                                (b'{"model": "tiny", "prompt": 5}', 400, "prompt"),
                                (b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "stream_options": {}}', 400,
                                 "stream_options"),
                                (b"[1, 2]", 400, None), (b"{nope", 400, None),
                                (b'{"prompt": "' + b"x" * (9 << 20) + b'"}', 413, None)):
        code, answer = post(stack.router_url, "/v1/completions", body)
        assert code == status and answer["error"]["code"] == status, (body[:60], answer)
        assert param is None or answer["error"]["param"] == param, answer
    settled(stack)

    started = time.monotonic()
    two = client.completions.create(model="tiny", prompt=PROMPTS["medium"], max_tokens=4, n=2, temperature=1)
    assert len(two.choices) == 2 and time.monotonic() - started < 10
    batch = client.completions.create(model="tiny", prompt=[PROMPTS["short"], PROMPTS["medium"]], max_tokens=4,
                                      temperature=0)
    _, want = post(agg, "/v1/completions", {"model": "tiny", "prompt": [PROMPTS["short"], PROMPTS["medium"]],
                                             "max_tokens": 4, "temperature": 0})
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == \
        [c["text"] for c in sorted(want["choices"], key=lambda c: c["index"])]
    settled(stack)

    before = counters(stack, "decode-0")
    ok = client.completions.create(model="tiny", prompt=long_prompt[::-1], max_tokens=4, temperature=0)
    assert ok.choices[0].text and ok.usage.completion_tokens == 4
    time.sleep(0.3)
    assert_pushed_one_computed(before, counters(stack, "decode-0"), ok.usage.prompt_tokens, "after the hostile ones")
    settled(stack)


def test_reserve_refused_after_the_prefill_started_is_still_answered(system):
    """The router sends the prefill request without waiting for the Reserve; here the
    Reserve is refused (the tenant's quota is one block) while the prefill engine holds
    the request for it. The prefill engine still answers the first token (computed
    plain), decode computes the prompt itself, and the text equals one engine's."""
    stack, agg = system
    url = stack.add_router("router-tight", token=stack.create_tenant("tight", quota_blocks=1))
    try:
        before_d, before_p = counters(stack, "decode-0"), counters(stack, "prefill-0")
        for stream in (False, True):
            body = {"model": "tiny", "prompt": f"Over quota ({stream}): " + PROMPTS["long"], "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "return_token_ids": True}
            _, want = post(agg, "/v1/completions", body)
            if stream:
                status, events = post(url, "/v1/completions", dict(body, stream=True))
                got = streamed(events)
            else:
                status, answer = post(url, "/v1/completions", body)
                got = answer["choices"][0]
            assert status == 200
            assert got["text"] == want["choices"][0]["text"] and got["token_ids"] == want["choices"][0]["token_ids"]
        time.sleep(0.3)
        after_d, after_p = counters(stack, "decode-0"), counters(stack, "prefill-0")
        assert after_p.get("requests_pushed", 0) == before_p.get("requests_pushed", 0)   # nothing pushed
        assert after_d.get("loads_started", 0) == before_d.get("loads_started", 0)       # decode computed it
        metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        assert 'kvpush_router_fallbacks_total{reason="resource_exhausted"} 2.0' in metrics
    finally:
        stack.process("router-tight").stop()
    settled(stack)


def test_client_gone_after_first_token_aborts_decode_and_its_reservation_ends_consumed(system):
    """The client reads decode's first token and goes away. Decode had loaded the KV, so
    its reservation ends CONSUMED (its sidecar's report), not RELEASED by the router: a
    release would race that report (held 50 ms before it is sent) and, winning, keep the
    blocks out of use for the quarantine."""
    stack, _agg = system
    before = {r.id for r in settled(stack).terminal}
    body = {"model": "tiny", "prompt": PROMPTS["chunked"] + " then the client leaves", "max_tokens": 1000,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(stack.router_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    lines = iter(resp)
    events = 0
    for line in lines:
        if line.startswith(b"data: {"):
            events += 1
            if events == 2:   # the prefill engine's token and decode's first
                break
    resp.close()
    started = time.monotonic()
    ended = [r for r in settled(stack).terminal if r.id not in before]
    assert time.monotonic() - started < 15   # ended now, not left to its deadline
    assert [r.state.name for r in ended] == ["CONSUMED"], [(r.id, r.state.name, r.reason) for r in ended]


def test_concurrent_batch(system):
    stack, agg = system
    prompts = [f"{p} (request {i})" for i, p in enumerate(list(PROMPTS.values()) * 2)]
    before = counters(stack, "decode-0")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        routed = list(pool.map(lambda p: complete(stack.router_url, p, MAX_TOKENS), prompts))
    for prompt, got in zip(prompts, routed):
        want = complete(agg, prompt, MAX_TOKENS)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    time.sleep(0.5)
    after = counters(stack, "decode-0")
    landed = after.get("loads_landed", 0) - before.get("loads_landed", 0)
    errors = after.get("load_errors", 0) - before.get("load_errors", 0)
    assert landed + errors == len(prompts) and landed >= len(prompts) - 1, after
    report = asyncio.run(check(stack.etcd.endpoint))
    assert report.ok, report.summary()


def test_killed_prefill_sidecar_still_answers_and_registry_ends_clean(system):
    """Last in the module: it takes the prefill sidecar down for good."""
    stack, agg = system
    prompt = PROMPTS["chunked"] + " and then the prefill sidecar dies"
    before = counters(stack, "decode-0")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(complete, stack.router_url, prompt, MAX_TOKENS)
        time.sleep(0.05)
        stack.process("sidecar-prefill").kill()
        got = fut.result(timeout=120)
    want = complete(agg, prompt, MAX_TOKENS)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    time.sleep(0.5)
    after = counters(stack, "decode-0")
    # Either the push had already landed, or decode recomputed: never a wrong answer.
    assert after.get("loads_landed", 0) + after.get("load_errors", 0) == \
        before.get("loads_landed", 0) + before.get("load_errors", 0) + 1

    async def settle():
        deadline = time.monotonic() + 30
        while True:
            report = await check(stack.etcd.endpoint, quiet=True, quarantine_ms=2_000)
            if report.ok or time.monotonic() > deadline:
                return report
            await asyncio.sleep(0.5)
    report = asyncio.run(settle())
    assert report.ok, report.summary()
    assert "prefill-0" not in report.engines

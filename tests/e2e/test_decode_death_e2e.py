"""A decode vLLM engine killed under light load, real parts only: etcd, a control plane,
`kvpush sidecar` processes, a prefill and a decode vLLM engine with the connector, and
a router that finds its engines in the registry (no --prefill/--decode).

The decode engine (its API server and EngineCore, as a container dies) is killed with
-9 while clients keep sending requests, streamed and not. Every request must still be
answered 200 with the same greedy text as before the kill (the router continues a
broken request on the prefill engine, the local fallback, from the tokens already
received); the decode sidecar, still alive, reports its engine unavailable, the router
drops it, and no reservation is left live. The engine then starts again: the sidecar
reports it available, the router serves it again, and its prompts arrive by push."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import threading
import time
import urllib.request

import pytest

from kvpush.app import engines
from kvpush.app.stack import Stack, StackSpec
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
from kvpush.sidecar.engine_presence import GONE
from tests.e2e.test_router_e2e import counters, post, settled, streamed
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "The quick brown fox",
    "Disaggregated serving splits prefill and decode across engines so that each can be sized",
    " ".join(["A longer prompt that spans several blocks of thirty-two tokens."] * 3),
    "When the decode engine dies the router must still answer every request",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("decode-death-logs"))
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, deadline_ms=20_000, quarantine_ms=2_000,
                            discover=True), progress=print)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())




def ask(url: str, prompt: str, stream: bool) -> tuple[int, str, bool]:
    """(status, text, whether a stream carried an error event)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream}
    status, answer = post(url, "/v1/completions", body, timeout=180)
    if status != 200:
        return status, json.dumps(answer), False
    if stream:
        return status, streamed(answer)["text"], any("error" in e for e in answer)
    return status, answer["choices"][0]["text"], False


def router_metric(url: str, name: str, **labels) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else "")) and want in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def engine_record(stack: Stack, engine_id: str):
    import asyncio
    from tests.sidecar.service_helpers import Etcd

    async def read():
        etcd = Etcd(stack.etcd.endpoint)
        try:
            return await etcd.engine(engine_id)
        finally:
            await etcd.close()
    return asyncio.run(read())


def test_a_killed_decode_engine_costs_no_request(system):
    stack = system
    url = stack.router_url
    found = wait_for(lambda: (h := health(url))["decode"] and h["prefill"] and h, 30, "engines discovered")
    assert found["source"] == "registry" and found["decode"] == {"decode-0": stack.decode_url}
    # What each prompt gives, through the whole P/D path (test_router_e2e shows it equals one
    # aggregated engine's answer): the reference for every answer below.
    want = {p: ask(url, p, False)[1] for p in PROMPTS}
    before = counters(stack, "decode-0")
    assert before.get("loads_landed", 0) >= len(PROMPTS) - 1, before

    results: list[tuple[float, int, str, bool, str]] = []
    lock = threading.Lock()
    stop = threading.Event()
    killed_at: list[float] = []

    def client(offset: int) -> None:
        for i in itertools.count(offset):
            if stop.is_set():
                return
            prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 0
            started = time.monotonic()
            status, text, error_event = ask(url, prompt, stream)
            with lock:
                results.append((started, status, text, error_event, prompt))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # light load: two clients, back to back
        futures = [pool.submit(client, k) for k in range(2)]
        time.sleep(3.0)
        stack.process("vllm-decode").kill_group()
        killed_at.append(time.monotonic())
        time.sleep(10.0)
        stop.set()
        for f in futures:
            f.result(timeout=300)

    assert len(results) >= 8 and sum(r[0] >= killed_at[0] for r in results) >= 4, len(results)
    bad = [(status, text[:200], prompt) for _, status, text, error_event, prompt in results
           if status != 200 or error_event or text != want[prompt]]
    assert not bad, bad
    retried = router_metric(url, "kvpush_router_fallbacks_total", reason="decode_failed")
    print(f"{len(results)} requests, {sum(r[0] >= killed_at[0] for r in results)} sent after the kill, "
          f"{retried:.0f} finished on another engine after decode failed; every answer 200 and correct")

    # The sidecar saw its engine go and said so; the router dropped it; nothing is left live.
    rec = wait_for(lambda: (r := engine_record(stack, "decode-0")) and r.unavailable == GONE and r, 10,
                   "decode-0 reported unavailable")
    assert rec.serving_url == stack.decode_url
    wait_for(lambda: not health(url)["decode"], 10, "the router drops decode-0")
    assert router_metric(url, "kvpush_router_requests_total", outcome="upstream_error") == 0
    settled(stack)

    # It comes back: available again, served again, and its prompts arrive by push again.
    os.unlink(os.path.join(stack.stats_dir, "decode-0.json"))  # the new engine counts from zero
    stack.restart_engine("decode")
    wait_for(lambda: engine_record(stack, "decode-0").unavailable == "", 30, "decode-0 available again")
    wait_for(lambda: health(url)["decode"] == {"decode-0": stack.decode_url}, 10, "the router serves decode-0")
    for prompt in PROMPTS:
        status, text, _ = ask(url, prompt, True)
        assert (status, text) == (200, want[prompt])
    time.sleep(0.5)  # the counters file is written at the end of an engine step
    assert counters(stack, "decode-0").get("loads_landed", 0) >= len(PROMPTS) - 1
    settled(stack)


def test_an_api_server_killed_alone_makes_its_engine_unavailable(system):
    """vLLM's API server killed with -9 by itself: its EngineCore lives on, and with it the
    connector's channels to the sidecar, so only the sidecar's probe of the serving URL
    (``--probe-serving``, the stack sets 0.5 s) can tell. The engine is reported unavailable,
    the router drops it, and requests are answered by the local fallback, correctly."""
    stack = system
    url = stack.router_url
    wait_for(lambda: engine_record(stack, "decode-0").unavailable == "", 60, "decode-0 available")
    wait_for(lambda: health(url)["decode"], 30, "the router serves decode-0")
    want = {p: ask(url, p, False)[1] for p in PROMPTS[:2]}
    server = stack.live("vllm-decode")
    server.kill()  # the API server alone
    rec = wait_for(lambda: (r := engine_record(stack, "decode-0")) and "not answering" in r.unavailable and r, 15,
                   "decode-0 reported unavailable by its probe")
    assert stack.decode_url in rec.unavailable
    wait_for(lambda: not health(url)["decode"], 10, "the router drops decode-0")
    for prompt, text in want.items():
        assert ask(url, prompt, True)[:2] == (200, text)
    settled(stack)
    server.kill_group()  # its EngineCore, orphaned, goes too
    stack.restart_engine("decode")
    wait_for(lambda: engine_record(stack, "decode-0").unavailable == "", 60, "decode-0 available again")

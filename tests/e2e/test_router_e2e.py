"""The whole system, real parts only: etcd, a control plane, `kvpush sidecar`
processes, a prefill and a decode vLLM engine with the connector, the router; and
one aggregated engine (no connector) for reference. Greedy outputs through the
router must equal the aggregated engine's, token for token, and the decode
engine's counters must show the prompt's KV arrived by push (not recomputed)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time

import pytest

from controlplane.invariants import check
from kvpush import engines
from kvpush.etcd_server import free_port
from kvpush.procs import ManagedProcess, http_ok
from kvpush.stack import Stack, StackSpec, complete
from kvpush.tiny_model import DEFAULT_DIR, ensure_model

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


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("e2e-logs"))
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    port = free_port()
    agg = ManagedProcess("vllm-aggregated", engines.vllm_command(model, port, "tiny"),
                         os.path.join(logs, "vllm-aggregated.log"),
                         env=engines.engine_env(ipc_dir=logs), cwd=engines.ROOT)
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, prefill_args=("--max-num-batched-tokens", "64"),
                            deadline_ms=20_000, quarantine_ms=2_000), progress=print)
    try:
        stack.start()
        agg.wait_until(http_ok(f"http://127.0.0.1:{port}/health"), 300, "serving")
        yield stack, f"http://127.0.0.1:{port}"
    finally:
        stack.stop()
        agg.stop()


def test_lengths_match_aggregated_and_arrive_by_push(system):
    stack, agg = system
    for name, prompt in PROMPTS.items():
        before = counters(stack, "decode-0")
        got = complete(stack.router_url, prompt, MAX_TOKENS, return_token_ids=True)
        want = complete(agg, prompt, MAX_TOKENS, return_token_ids=True)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], name
        assert got["choices"][0].get("token_ids") == want["choices"][0].get("token_ids"), name
        time.sleep(0.3)
        after = counters(stack, "decode-0")
        assert after.get("loads_landed", 0) == before.get("loads_landed", 0) + 1, (name, after)
        assert after.get("load_errors", 0) == before.get("load_errors", 0), (name, after)
        prompt_tokens = got["usage"]["prompt_tokens"]
        # All but the last prompt token came by push (vLLM computes the last one itself).
        assert after["tokens_loaded"] - before.get("tokens_loaded", 0) >= prompt_tokens - 1, name
    pushed = counters(stack, "prefill-0")
    assert pushed.get("requests_pushed", 0) >= len(PROMPTS)


def test_streaming_and_chat(system):
    stack, agg = system
    got = complete(stack.router_url, PROMPTS["medium"], MAX_TOKENS, stream=True)
    want = complete(agg, PROMPTS["medium"], MAX_TOKENS)
    assert got["text"] == want["choices"][0]["text"] and got["ttft_s"] is not None


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

"""Tensor parallelism through the whole system, real parts only: etcd, a control plane,
`kvpush sidecar` processes (one per engine, a pool per rank), a prefill vLLM engine of
TP 2 and a decode engine of TP 1 (the two prefill ranks' heads merged on one decode
rank), the router, and an aggregated TP 1 engine for the reference answers.

Requests through the router are answered with the aggregated engine's greedy text and
arrive by push; then one prefill rank's channel to its sidecar breaks mid-push (the
sidecar's ``drop_rank`` drill, what a worker whose connection breaks looks like): the
request is still answered correctly (the decode engine computes the prompt itself), the
registry ends clean, and the next request arrives by push again over the rank's new
channel."""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest

from kvpush.app import engines
from kvpush.app.stack import Stack, StackSpec
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
from kvpush.connector.sidecar_client import SidecarClient
from tests.e2e.test_router_e2e import counters, post, settled, with_aggregated

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("tp-e2e-logs"))
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    # Chunked prefill in 64-token steps: a long prompt's push spans many steps.
    yield from with_aggregated(logs, StackSpec(model_dir=model, log_dir=logs, prefill_tp=2, decode_tp=1,
                                               prefill_args=("--max-num-batched-tokens", "64"),
                                               deadline_ms=20_000, quarantine_ms=2_000))


def complete(url: str, prompt: str) -> dict:
    status, answer = post(url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0.0, "return_token_ids": True}, timeout=180)
    assert status == 200, answer
    return answer


def sidecar(stack: Stack, engine_id: str) -> SidecarClient:
    return SidecarClient(os.path.join(stack.run_dir, f"{engine_id}.sock"), timeout_s=10)


def test_answers_equal_aggregated_and_arrive_by_push_into_merged_heads(system):
    stack, agg = system
    for i, prompt in enumerate(["The quick brown fox", " ".join(["Tensor parallel prefill, one decode rank."] * 6)]):
        prompt = f"{i}: {prompt}"
        want = complete(agg, prompt)["choices"][0]["token_ids"]
        before = counters(stack, "decode-0")
        got = complete(stack.router_url, prompt)
        assert got["choices"][0]["token_ids"] == want, prompt
        after = counters(stack, "decode-0")
        assert after["loads_landed"] == before.get("loads_landed", 0) + 1, after
        assert after.get("loads_unshared", 0) == before.get("loads_unshared", 0) + 1, after
        assert after.get("load_errors", 0) == before.get("load_errors", 0), after
    # Both prefill ranks staged and pushed their own heads.
    for name in ("prefill-0", "prefill-0.rank1"):
        assert counters(stack, name).get("requests_pushed", 0) >= 2, (name, stack.stats().get(name))
    settled(stack)


def test_a_prefill_ranks_channel_broken_mid_push_is_recomputed_correctly(system):
    stack, agg = system
    pre = sidecar(stack, "prefill-0")
    try:
        hit = False
        for attempt in range(4):  # the drill must land mid-push; every attempt's answer must be right
            prompt = f"{attempt}: " + " ".join(["A long prompt, pushed in many chunked steps by two ranks."] * 60)
            want = complete(agg, prompt)["choices"][0]["token_ids"]
            failed_before = pre.admin("stats").get("failed", 0)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(complete, stack.router_url, prompt)
                deadline = time.monotonic() + 60
                while pre.admin("stats")["active"] == 0 and not answer.done() and time.monotonic() < deadline:
                    time.sleep(0.005)
                dropped = pre.admin("drop_rank", rank=1)["dropped"]
                got = answer.result()
            assert dropped >= 1
            assert got["choices"][0]["token_ids"] == want, f"attempt {attempt}"
            if pre.admin("stats").get("failed", 0) > failed_before:
                hit = True
                break
        assert hit, "the drill never landed mid-push"
        assert pre.admin("stats")["staging_allocations"] == 0
        settled(stack)
        # The rank's worker connects again: the next request arrives by push.
        time.sleep(1.2)  # (a worker reconnects at most once a second)
        before = counters(stack, "decode-0")
        prompt = "After the drill: " + " ".join(["pushed again"] * 20)
        assert complete(stack.router_url, prompt)["choices"][0]["token_ids"] == \
            complete(agg, prompt)["choices"][0]["token_ids"]
        after = counters(stack, "decode-0")
        assert after["loads_landed"] == before.get("loads_landed", 0) + 1, (before, after)
        settled(stack)
    finally:
        pre.close()

"""End to end on real vLLM: a prefill engine pushes through its sidecar, a decode engine
loads what landed, and greedy output equals one aggregated engine's, token for token.

Processes (started once for the module, all stopped at the end):
    sidecars  D1 (decode: landing pool) and P1 (prefill: staging pool), ``python -m kvpush.sidecar.sidecar``,
              P1 told about D1 through the channel's ADMIN ``add_peer`` (no control plane here)
    engines   AGG (no connector), P (kv_producer, chunked prefill in 64-token steps) and
              D (kv_consumer, recompute on load errors), all on the tiny float32 Llama, block size 32

There is no control plane in this test, so the test plays it: it picks landing block
ids on D1 and hands the same reservation to both engines, as the router would.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import pathlib
import tempfile
import time
import urllib.error

import numpy as np
import pytest

from kvpush.connector.stats import read_counters
from kvpush.contract.transfer_params import PushParams
from tests.engine.conftest import (
    PrivateShm,
    VllmEngine,
    kvpush_transfer_config,
    prompt,
    serve_module,
    sidecar_pair,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAYOUT = "layers=4,block=32,heads=2,dim=64,dtype=float32"  # the tiny model's KV geometry
BS = 32
LENGTHS = [31, 32, 33, 64, 95, 161]  # below, at and above block multiples; 95 and 161 are chunked on P
MAX_TOKENS = 12


class Stack:
    def __init__(self, model: str, workdir: pathlib.Path):
        self.model = model
        self.workdir = workdir
        self.stats = workdir / "stats"
        self.dec = self.pre = None
        self.engines: list[VllmEngine] = []
        self.shm = PrivateShm()
        self._blocks = itertools.count(0)
        self._ids = itertools.count(1)

    def start(self) -> Stack:
        model = self.model
        self.dec, self.pre = sidecar_pair(self.workdir, LAYOUT, d_blocks=512, p_units=512, prefix=self.shm.prefix)
        self.agg = self._engine("AGG", model, None, ("--disable-log-stats",))
        self.p = self._engine("P", model, kvpush_transfer_config("kv_producer", self.pre.socket, str(self.stats), "P"),
                              ("--disable-log-stats", "--max-num-batched-tokens", "64"))
        self.d = self._engine("D", model, kvpush_transfer_config("kv_consumer", self.dec.socket, str(self.stats), "D"),
                              ("--disable-log-stats", "--enable-prompt-tokens-details"))
        for e in self.engines:
            e.wait_ready()
        return self

    def _engine(self, name, model, ktc, extra=()) -> VllmEngine:
        e = VllmEngine(name, model, self.workdir, ktc, extra, prefix=self.shm.prefix)
        self.engines.append(e)
        return e

    def reservation(self, num_tokens: int, deadline_s: float = 60.0, scattered: bool = False, **over) -> PushParams:
        n_blocks = -(-num_tokens // BS)
        ids = [next(self._blocks) for _ in range(n_blocks)]
        if scattered:
            ids = ids[::-1]  # not contiguous: one NIXL descriptor per block
        rec = self.dec.record
        fields = dict(role="prefill", reservation_id=f"res-{next(self._ids)}", engine_id=rec["engine_id"],
                      engine_incarnation=rec["incarnation"], nixl_agent=rec["nixl_agent"],
                      block_ids=tuple(ids), block_size=BS, num_tokens=num_tokens,
                      deadline_unix_ms=int((time.time() + deadline_s) * 1000))
        fields.update(over)
        return PushParams.from_dict(fields)

    def counters(self, name: str) -> dict:
        return read_counters(str(self.stats / f"{name}.json"))

    def stop(self) -> None:
        for e in self.engines:
            e.stop()
        for sc in (self.pre, self.dec):
            if sc is not None:
                sc.stop()
        self.shm.close()


@pytest.fixture(scope="module")
def stack(tiny_model):
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvpe-", dir="/tmp"))
    st = Stack(tiny_model, workdir)
    yield from serve_module(st, workdir, lambda: "\n".join(f"--- {e.name}\n{e.log()}" for e in st.engines))


def tokens_of(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def wait_counter(stack: Stack, engine: str, name: str, at_least: int, timeout_s: float = 10.0) -> dict:
    """The engine's counters once ``name`` reached ``at_least`` (outcomes arrive asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counters = stack.counters(engine)
        if counters.get(name, 0) >= at_least or time.monotonic() > deadline:
            return counters
        time.sleep(0.05)


def push_and_decode(stack: Stack, ids: list[int], params: PushParams, max_tokens: int = MAX_TOKENS,
                    send_prefill: bool = True) -> tuple[dict, float]:
    """What the router does: the prompt to P (max_tokens=1, role prefill) and to D (role decode),
    at once. Returns D's answer and its latency."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        d = pool.submit(stack.d.complete, ids, max_tokens, params.for_role("decode").as_kv_transfer_params())
        if send_prefill:
            p = pool.submit(stack.p.complete, ids, 1, params.as_kv_transfer_params())
        out = d.result(timeout=180)
        elapsed = time.perf_counter() - t0
        if send_prefill:
            p.result(timeout=180)
    return out, elapsed


def test_engines_started(stack):
    for e in stack.engines:
        print(f"{e.name} ready after {e.ready_after_s:.1f} s")


@pytest.mark.parametrize("n", LENGTHS)
def test_pd_greedy_output_equals_aggregated(stack, n):
    ids = prompt(n, seed=n)
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    before_d, before_p = stack.counters("D"), stack.counters("P")
    params = stack.reservation(n, scattered=(n == 95))
    got, elapsed = push_and_decode(stack, ids, params)
    assert tokens_of(got) == want, f"{n}-token prompt: P/D {tokens_of(got)} != aggregated {want}"
    after_d = stack.counters("D")
    after_p = wait_counter(stack, "P", "push_PUSHED", before_p.get("push_PUSHED", 0) + 1)
    delta = lambda a, b, k: a.get(k, 0) - b.get(k, 0)
    # The KV arrived by push: the prompt was loaded but for its last token (vLLM computes that
    # one itself, with the first output token, in the same step), nothing failed.
    assert delta(after_d, before_d, "loads_landed") == 1
    assert delta(after_d, before_d, "tokens_loaded") == n - 1
    assert delta(after_d, before_d, "load_errors") == 0
    assert delta(after_p, before_p, "requests_pushed") == 1
    assert delta(after_p, before_p, "push_PUSHED") == 1
    chunks = -(-n // 64)  # P runs chunked prefill in 64-token steps: one PUSH per layer per chunk
    assert delta(after_p, before_p, "layers_pushed") == 4 * chunks
    assert delta(after_p, before_p, "bytes_staged") == n * 4 * 2 * 2 * 64 * 4
    # vLLM's own accounting on D agrees: every prompt token but the last was "cached" (loaded).
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1
    print(f"\n{n} tokens: P/D answered {MAX_TOKENS} tokens in {elapsed * 1e3:.0f} ms")


def test_prefix_cache_hits_on_either_side(stack):
    """P already holds the first blocks (prefix cache): they are pushed from its cache.
    D already holds the first blocks: it loads only the rest of the prompt."""
    delta = lambda a, b, k: a.get(k, 0) - b.get(k, 0)
    for side, seed in (("P", 21), ("D", 23)):
        ids = prompt(100, seed)
        engine = stack.p if side == "P" else stack.d
        engine.complete(ids[:70], 1)  # caches blocks [0, 64) on that engine
        want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
        before_d = stack.counters("D")
        got, _ = push_and_decode(stack, ids, stack.reservation(100))
        assert tokens_of(got) == want, side
        after_d = stack.counters("D")
        assert delta(after_d, before_d, "loads_landed") == 1
        assert delta(after_d, before_d, "tokens_loaded") == (99 if side == "P" else 35), side
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 99


def test_reservation_shorter_than_prompt_loads_its_tokens_and_computes_the_rest(stack):
    """A router that counted fewer tokens than the engines see: P pushes the reserved prefix,
    D loads it and computes the rest of the prompt itself."""
    ids = prompt(80, seed=31)
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    before = stack.counters("D")
    got, _ = push_and_decode(stack, ids, stack.reservation(64))
    assert tokens_of(got) == want
    after = stack.counters("D")
    assert after["tokens_loaded"] - before["tokens_loaded"] == 64
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_client_gone_while_decode_waits(stack):
    """The request ends while its KV is awaited (it holds no decode blocks meanwhile: it is
    admitted only once landed): its reservation is released, to be consumed if it lands,
    and the engine serves the next request normally."""
    n = 50
    ids = prompt(n, seed=29)
    before = stack.counters("D")
    params = stack.reservation(n, deadline_s=30).for_role("decode").as_kv_transfer_params()
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        stack.d.complete(ids, MAX_TOKENS, params, timeout_s=1.5)  # the client gives up
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    assert tokens_of(stack.d.complete(ids, MAX_TOKENS)) == want
    # Scheduler-side counts reach the stats file with the next step's metadata.
    deadline = time.monotonic() + 20
    while stack.counters("D").get("loads_abandoned", 0) == before.get("loads_abandoned", 0):
        assert time.monotonic() < deadline, "the abandoned request was never counted"
        time.sleep(0.1)
    assert stack.counters("D").get("loads_landed", 0) == before.get("loads_landed", 0)


def test_requests_without_kvpush_params_are_served_normally(stack):
    ids = prompt(50, seed=7)
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    before = stack.counters("D")
    assert tokens_of(stack.d.complete(ids, MAX_TOKENS)) == want
    assert tokens_of(stack.p.complete(ids, MAX_TOKENS)) == want
    after = stack.counters("D")
    assert after.get("requests_plain", 0) - before.get("requests_plain", 0) == 1
    assert after.get("loads_started", 0) == before.get("loads_started", 0)


def test_reservation_never_pushed_is_recomputed_correctly(stack):
    n = 70
    ids = prompt(n, seed=11)
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    before = stack.counters("D")
    params = stack.reservation(n, deadline_s=2.0)
    got, elapsed = push_and_decode(stack, ids, params, send_prefill=False)  # the prefill never happens
    assert tokens_of(got) == want
    after = stack.counters("D")
    assert after["load_error_timeout"] - before.get("load_error_timeout", 0) == 1
    assert after.get("loads_landed", 0) == before.get("loads_landed", 0)
    assert 1.5 < elapsed < 30, elapsed
    print(f"\nnever-pushed reservation: correct answer after {elapsed:.2f} s (deadline 2 s + recompute)")


def test_failed_push_is_recomputed_correctly(stack):
    """P cannot push (the landing blocks lie outside D's pool): the decode side learns it
    only from its deadline here (no control plane to relay P's failure) and recomputes."""
    n = 40
    ids = prompt(n, seed=13)
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    before_p, before_d = stack.counters("P"), stack.counters("D")
    params = stack.reservation(n, deadline_s=3.0, block_ids=(100_000, 100_001))
    got, _ = push_and_decode(stack, ids, params)
    assert tokens_of(got) == want
    after_p, after_d = stack.counters("P"), stack.counters("D")
    assert after_p["push_refused"] - before_p.get("push_refused", 0) == 1
    assert after_d["load_errors"] - before_d.get("load_errors", 0) == 1


def test_reservation_of_another_incarnation_is_recomputed_at_once(stack):
    n = 45
    ids = prompt(n, seed=17)
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    before = stack.counters("D")
    params = stack.reservation(n, engine_incarnation="an-earlier-start")
    got, elapsed = push_and_decode(stack, ids, params, send_prefill=False)
    assert tokens_of(got) == want
    after = stack.counters("D")
    assert after["refused_wrong_engine"] - before.get("refused_wrong_engine", 0) == 1
    assert elapsed < 10


def test_ttft_pd_vs_aggregated(stack):
    """Not a benchmark (2 shared cores, a tiny model, P in 64-token chunks): the numbers show
    the overhead of the push path. Fresh prompts each time: no prefix-cache hits anywhere."""
    seeds = itertools.count(10_000)
    for n in (60, 512):
        agg, pd = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            stack.agg.complete(prompt(n, next(seeds)), 1)
            agg.append(time.perf_counter() - t0)
            _, elapsed = push_and_decode(stack, prompt(n, next(seeds)), stack.reservation(n), max_tokens=1)
            pd.append(elapsed)
        print(f"\nTTFT, {n}-token prompt (median of 3): aggregated {np.median(agg) * 1e3:.0f} ms, "
              f"P/D push {np.median(pd) * 1e3:.0f} ms")


def test_sidecars_restarted_under_running_engines(stack):
    """Both sidecars restart (new incarnations, new pools): the engines reconnect on their
    next request and push again; nothing needs the engines restarted. (Last in the module:
    the stack's sidecars are new afterwards.)"""
    stack.dec.restart()
    stack.pre.restart()
    stack.pre.admin("add_peer", record=stack.dec.record)
    ids = prompt(90, seed=37)
    want = tokens_of(stack.agg.complete(ids, MAX_TOKENS))
    before_d, before_p = stack.counters("D"), stack.counters("P")
    got, _ = push_and_decode(stack, ids, stack.reservation(90))
    assert tokens_of(got) == want
    after_d, after_p = stack.counters("D"), stack.counters("P")
    assert after_d["loads_landed"] - before_d.get("loads_landed", 0) == 1
    assert after_d["sidecar_reconnects"] - before_d.get("sidecar_reconnects", 0) == 1
    assert after_p["sidecar_reconnects"] - before_p.get("sidecar_reconnects", 0) == 1

"""The connector's worker side against real sidecar processes and real NIXL, with paged
caches written by vLLM's own CPU cache kernel (no engine: fast). A prefill worker
stages and pushes, a decode worker waits, copies and consumes; the bytes that end up
in the decode cache are the prefill's, token for token, in vLLM's packed layout."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from connector.cache_codec import BlockCodec
from connector.config import ConnectorConfig
from connector.metadata import (
    KVPushConnectorMetadata,
    LoadSpec,
    PushSpec,
    Release,
    Target,
)
from connector.stats import read_counters
from connector.worker import KVPushWorker

pytestmark = pytest.mark.timeout(120)

BS, HEADS, DIM, LAYERS, NB = 32, 2, 64, 3, 16
LAYOUT = f"layers={LAYERS},block={BS},heads={HEADS},dim={DIM},dtype=float32"
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def layer_index(name: str) -> int:
    return int(name.split(".")[2])


@pytest.fixture(scope="module")
def codec():
    return BlockCodec.probe_cpu_attn(BS, HEADS, DIM, "vec")


def paged_caches():
    return {name: torch.zeros(NB, HEADS, BS, 2 * DIM, dtype=torch.float32) for name in NAMES}


def write_request(caches, block_ids, num_tokens, seed=0):
    """Random K/V for a request's tokens, written with vLLM's CPU cache kernel."""
    from vllm import _custom_ops as ops
    gen = torch.Generator().manual_seed(seed)
    kv = {}
    slots = torch.tensor([block_ids[t // BS] * BS + t % BS for t in range(num_tokens)], dtype=torch.int64)
    for name, cache in caches.items():
        key = torch.randn(num_tokens, HEADS, DIM, generator=gen)
        value = torch.randn(num_tokens, HEADS, DIM, generator=gen)
        view = cache.view(NB, HEADS, 2 * BS, DIM)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec")
        kv[name] = (key.numpy(), value.numpy())
    return kv


def make_worker(sidecar, workdir, codec, name, **cfg):
    config = ConnectorConfig(sidecar_socket=sidecar.socket, stats_dir=str(workdir / "stats"), engine_name=name,
                             connect_timeout_s=10, **cfg)
    w = KVPushWorker(config, BS)
    caches = paged_caches()
    w.register_kv_caches(caches, codec, layer_index)
    return w, caches


def target(dec, res, landing, n):
    return Target(res, dec.record["engine_id"], dec.record["incarnation"], tuple(landing),
                  dec.record["kv_layout"]["block_size"], n)


def load_spec(dec, rid, res, landing, block_ids, n, deadline_ms=0, **over):
    fields = dict(req_id=rid, reservation_id=res, engine_id=dec.record["engine_id"],
                  incarnation=dec.record["incarnation"], landing_block_ids=tuple(landing),
                  landing_block_size=dec.record["kv_layout"]["block_size"],
                  num_tokens=n, block_ids=tuple(block_ids), start=0, end=n, deadline_unix_ms=deadline_ms)
    fields.update(over)
    return LoadSpec(**fields)


def step_prefill(w, pushes, aborts=()):
    w.bind(KVPushConnectorMetadata(pushes=list(pushes), push_aborts=list(aborts)))
    for name in NAMES:  # the forward pass: each attention layer, then its save
        w.save_layer(name)
    w.wait_for_save()
    w.transfer_results()


def wait_loaded(w, rid, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, failed = w.transfer_results()
        if rid in done:
            return rid not in failed
        time.sleep(0.005)
    raise TimeoutError(f"{rid} neither loaded nor failed in {timeout_s} s")


@pytest.mark.parametrize("landing_bs", [BS, 16])
def test_layerwise_chunked_push_lands_in_the_decode_cache_token_for_token(sidecars, workdir, codec, landing_bs):
    """``landing_bs`` != 32: the decode sidecar's landing blocks are smaller than vLLM's, so
    the prefill side re-blocks while staging and the decode side while loading."""
    dec, pre = sidecars(LAYOUT, d_layout=LAYOUT.replace(f"block={BS}", f"block={landing_bs}"))
    pw, pcache = make_worker(pre, workdir, codec, "P")
    dw, dcache = make_worker(dec, workdir, codec, "D")
    try:
        n, p_blocks, d_blocks = 75, [5, 2, 9], [3, 7, 1]
        landing = list(range(40, 40 + -(-n // landing_bs)))
        kv = write_request(pcache, p_blocks, n)
        # The decode side waits first (the router sends both at once).
        dw.start_loads(KVPushConnectorMetadata(loads=[load_spec(dec, "d1", "res-1", landing, d_blocks, n)]))
        assert not dw.transfer_results()[0]
        # Chunked prefill: [0, 40) in one step, [40, 75) in the next.
        step_prefill(pw, [PushSpec("p1", tuple(p_blocks), 0, 40, False, target(dec, "res-1", landing, n))])
        step_prefill(pw, [PushSpec("p1", tuple(p_blocks), 40, n, True)])
        assert wait_loaded(dw, "d1")
        for name in NAMES:
            got = codec.read(dcache[name].view(-1).numpy(), d_blocks, 0, n)
            assert np.array_equal(got[0], kv[name][0]) and np.array_equal(got[1], kv[name][1]), name
        # Untouched blocks stay untouched.
        others = [b for b in range(NB) if b not in d_blocks]
        assert all(not dcache[name][others].any() for name in NAMES)
        assert dec.admin("stats")["landed"] == 1
        with dec.client() as c:
            assert c.query("res-1").state == "CONSUMED"  # landing blocks handed back
        p_counts, d_counts = pw.counters.snapshot(), dw.counters.snapshot()
        assert p_counts["requests_begun"] == p_counts["requests_pushed"] == 1
        assert p_counts["layers_pushed"] == 2 * LAYERS
        assert p_counts["bytes_staged"] == n * LAYERS * 2 * HEADS * DIM * 4
        assert d_counts["loads_started"] == d_counts["loads_landed"] == 1 and d_counts["tokens_loaded"] == n
        assert "load_errors" not in d_counts
        deadline = time.monotonic() + 5
        while pw.counters.get("push_PUSHED") < 1 and time.monotonic() < deadline:
            pw.transfer_results()  # the sidecar's outcome event
            time.sleep(0.01)
        assert pw.counters.get("push_PUSHED") == 1
        # The same numbers, from outside the engine.
        assert read_counters(str(workdir / "stats" / "D.json"))["tokens_loaded"] == n
        assert read_counters(str(workdir / "stats" / "P.json"))["requests_pushed"] == 1
        stats = pre.admin("stats")
        assert stats["staging_allocations"] == 0  # staging freed once the last write was done
    finally:
        pw.close(), dw.close()


def test_push_before_the_decode_asks_and_a_partial_load_past_a_local_hit(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    dw, dcache = make_worker(dec, workdir, codec, "D")
    try:
        n, p_blocks, d_blocks, landing = 64, [0, 1], [8, 9], [10, 11]
        kv = write_request(pcache, p_blocks, n, seed=3)
        step_prefill(pw, [PushSpec("p", tuple(p_blocks), 0, n, True, target(dec, "res-2", landing, n))])
        time.sleep(0.3)  # landed before anyone waits for it
        # The decode engine already has the first block (prefix cache): it loads [32, 64) only.
        dw.start_loads(KVPushConnectorMetadata(loads=[load_spec(dec, "d", "res-2", landing, d_blocks, n, start=32)]))
        assert wait_loaded(dw, "d")
        got = codec.read(dcache[NAMES[1]].view(-1).numpy(), d_blocks, 32, n)
        assert np.array_equal(got[0], kv[NAMES[1]][0][32:]) and not dcache[NAMES[1]][8].any()
        assert dw.counters.get("tokens_loaded") == 32
    finally:
        pw.close(), dw.close()


def test_failures_are_load_errors_never_hangs(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    dw, _ = make_worker(dec, workdir, codec, "D", load_timeout_s=20)
    try:
        now_ms = int(time.time() * 1000)
        t0 = time.monotonic()
        dw.start_loads(KVPushConnectorMetadata(loads=[
            # never pushed: fails at its deadline
            load_spec(dec, "late", "res-never", [0, 1], [0, 1], 40, deadline_ms=now_ms + 1500),
            # a reservation of an earlier incarnation of this engine: fails at once
            load_spec(dec, "stale", "res-stale", [2], [2], 20, incarnation="gone"),
            # cancelled by the control plane while waiting
            load_spec(dec, "cancelled", "res-cancel", [3], [3], 20),
        ]))
        done, failed = dw.transfer_results()
        assert done == failed == {"stale"}
        dec.admin("cancel", reservation_id="res-cancel", reason="deadline")
        assert not wait_loaded(dw, "cancelled", 5)
        assert not wait_loaded(dw, "late", 5)
        elapsed = time.monotonic() - t0
        assert 1.4 < elapsed < 4.0, elapsed
        # The prefill side: a destination outside the decode pool is refused at BEGIN, the step goes on.
        write_request(pcache, [4], 20)
        step_prefill(pw, [PushSpec("bad", (4,), 0, 20, True, target(dec, "res-bad", [10_000], 20))])
        c = dw.counters.snapshot()
        assert c["load_errors"] == 3
        assert (c["load_error_timeout"], c["load_error_wrong_engine"], c["load_error_cancelled"]) == (1, 1, 1)
        assert pw.counters.get("push_refused") == 1 and pw.counters.get("layers_pushed") == 0
    finally:
        pw.close(), dw.close()


def test_abandoned_and_released_reservations_are_consumed_when_they_land(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    dw, dcache = make_worker(dec, workdir, codec, "D")
    try:
        write_request(pcache, [0, 1], 50)
        dw.start_loads(KVPushConnectorMetadata(loads=[load_spec(dec, "gone", "res-a", [5, 6], [5, 6], 50)],
                                               releases=[Release("res-b")]))
        dw.start_loads(KVPushConnectorMetadata(load_aborts=["gone"]))  # the request ended while waiting
        done, failed = dw.transfer_results()
        assert done == {"gone"} and not failed
        step_prefill(pw, [PushSpec("a", (0, 1), 0, 50, True, target(dec, "res-a", [5, 6], 50)),
                          PushSpec("b", (0, 1), 0, 50, True, target(dec, "res-b", [7, 8], 50))])
        deadline = time.monotonic() + 5
        while dw.counters.get("releases_consumed") < 2 and time.monotonic() < deadline:
            dw.transfer_results()
            time.sleep(0.01)
        assert dw.counters.get("releases_consumed") == 2 and dw.counters.get("loads_abandoned") == 1
        assert not any(t.any() for t in dcache.values())  # nothing was copied for them
        with dec.client() as c:
            assert c.query("res-a").state == c.query("res-b").state == "CONSUMED"
    finally:
        pw.close(), dw.close()


def test_a_restarted_sidecar_is_reconnected(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    dw, dcache = make_worker(dec, workdir, codec, "D")
    try:
        kv = write_request(pcache, [0, 1], 40)
        dw.start_loads(KVPushConnectorMetadata(loads=[load_spec(dec, "before", "res-0", [0, 1], [0, 1], 40)]))
        old_incarnation = dec.record["incarnation"]
        dec2 = dec.restart()
        pre2 = pre.restart()
        assert dec2.record["incarnation"] != old_incarnation
        pre2.admin("add_peer", record=dec2.record)
        # The load that waited on the old incarnation fails (and is recomputed) within ~1 s, not at its deadline.
        t0 = time.monotonic()
        assert not wait_loaded(dw, "before", 5)
        assert time.monotonic() - t0 < 3
        # New work goes through the new sidecars: the worker reconnected.
        dw.start_loads(KVPushConnectorMetadata(loads=[load_spec(dec2, "after", "res-1", [2, 3], [4, 5], 40)]))
        step_prefill(pw, [PushSpec("p", (0, 1), 0, 40, True, target(dec2, "res-1", [2, 3], 40))])
        assert wait_loaded(dw, "after")
        got = codec.read(dcache[NAMES[0]].view(-1).numpy(), [4, 5], 0, 40)
        assert np.array_equal(got[1], kv[NAMES[0]][1])
        assert pw.counters.get("sidecar_reconnects") == dw.counters.get("sidecar_reconnects") == 1
    finally:
        pw.close(), dw.close()


def test_an_idle_decode_step_sleeps_until_its_load_lands(sidecars, workdir, codec):
    """A step that runs nothing while a load is in flight blocks on the landing (up to
    idle_wait_s) instead of returning at once: the engine stops spinning through empty
    steps, and the landing is picked up the moment it arrives."""
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    dw, dcache = make_worker(dec, workdir, codec, "D", idle_wait_s=0.1)
    try:
        n, landing = 40, [2, 3]
        kv = write_request(pcache, [0, 1], n, seed=5)
        meta = KVPushConnectorMetadata(loads=[load_spec(dec, "d", "res-idle", landing, [4, 5], n)], scheduled_tokens=0)
        dw.bind(meta)
        dw.start_loads(meta)
        # Nothing lands: an idle step waits its full bound, a busy step not at all.
        t0 = time.monotonic()
        assert dw.transfer_results() == (set(), set())
        idle_s = time.monotonic() - t0
        dw.bind(KVPushConnectorMetadata(scheduled_tokens=3))
        t0 = time.monotonic()
        assert dw.transfer_results() == (set(), set())
        busy_s = time.monotonic() - t0
        assert 0.09 < idle_s < 0.5 and busy_s < 0.05, (idle_s, busy_s)
        # The push lands while the idle step waits: that same step reports it loaded.
        dw.bind(KVPushConnectorMetadata(scheduled_tokens=0))
        timer = threading.Timer(0.02, step_prefill, (pw, [PushSpec("p", (0, 1), 0, n, True,
                                                                    target(dec, "res-idle", landing, n))]))
        timer.start()
        done = set()
        t0 = time.monotonic()
        while "d" not in done and time.monotonic() - t0 < 5:
            done |= dw.transfer_results()[0]
        timer.join()
        assert done == {"d"}
        assert np.array_equal(codec.read(dcache[NAMES[2]].view(-1).numpy(), [4, 5], 0, n)[1], kv[NAMES[2]][1])
        assert dw.counters.get("idle_waits") >= 2
    finally:
        pw.close(), dw.close()

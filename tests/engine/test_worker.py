"""The connector against real sidecar processes and real NIXL, with paged caches written
by vLLM's own CPU cache kernel (no engine: fast). A prefill worker stages and pushes;
on the decode side the real scheduler half (its LandingWatch on the real sidecar)
admits the request once it has landed and the worker copies and consumes; the bytes
that end up in the decode cache are the prefill's, token for token, in vLLM's packed
layout."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvpush.connector.copiers.cache_codec import BlockCodec
from kvpush.connector.copiers.cpu_copier import CpuCopier
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.landing_watch import LandingWatch
from kvpush.connector.metadata import KVPushConnectorMetadata, LoadSpec, PushSpec
from kvpush.contract.target import PushTarget
from kvpush.connector.scheduler import DecodeTiming, KVPushScheduler
from kvpush.connector.sidecar_link import connect
from kvpush.connector.stats import read_counters
from kvpush.connector.worker import KVPushWorker
from kvpush.contract.transfer_params import PushParams

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


def make_worker(sidecar, workdir, codec, name, copier=None, caches=None, **cfg):
    config = ConnectorConfig(sidecar_socket=sidecar.socket, stats_dir=str(workdir / "stats"), engine_name=name,
                             connect_timeout_s=10, **cfg)
    w = KVPushWorker(config, BS)
    caches = paged_caches() if caches is None else caches
    w.register_kv_caches(caches, copier or CpuCopier(codec), layer_index)
    return w, caches


def target(dec, res, landing, n, deadline_ms=0, record=None, **over):
    rec = record or dec.record
    fields = dict(reservation_id=res, engine_id=rec["engine_id"], incarnation=rec["incarnation"],
                  block_ids=tuple(landing), block_size=rec["layout"]["block_size"], num_tokens=n,
                  nixl_agent=rec["nixl_agent"], deadline_unix_ms=deadline_ms)
    return PushTarget(**{**fields, **over})


def load_spec(dec, rid, res, landing, block_ids, n, deadline_ms=0, **over):
    return LoadSpec(rid, target(dec, res, landing, n, deadline_ms, **over), tuple(block_ids), 0, n)


def step_prefill(w, pushes, aborts=()):
    w.bind(KVPushConnectorMetadata(pushes=list(pushes), push_aborts=list(aborts)))
    for name in NAMES:  # the forward pass: each attention layer, then its save
        w.save_layer(name)
    w.wait_for_save()
    w.end_step()


class Req:
    def __init__(self, rid, prompt, params):
        self.request_id, self.num_prompt_tokens, self.kv_transfer_params = rid, prompt, params
        self.num_computed_tokens, self.status = 0, "WAITING"


class Blocks:
    def __init__(self, ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (self.ids,)


class Out:
    def __init__(self, tokens):
        self.num_scheduled_tokens = {}
        self.total_num_scheduled_tokens = tokens


class DecodeEngine:
    """The decode connector's two halves as vLLM drives them, minus the model: the
    scheduler half admits a request when its KV has landed, the worker copies it."""

    def __init__(self, dec, workdir, codec, timing=DecodeTiming(idle_wait_s=0), copier=None, caches=None, **cfg):
        self.dec = dec
        self.worker, self.cache = make_worker(dec, workdir, codec, "D", copier, caches, **cfg)
        self.watch = LandingWatch(lambda: connect(dec.socket, 2, 5, name="test-scheduler"))
        self.sched = KVPushScheduler(self.watch.connect(), BS, produce=False, consume=True,
                                     block_ids_of=lambda rid: [], watch=self.watch, timing=timing)
        self.requests = {}

    def arrive(self, rid, res, landing, n, prompt=None, deadline_ms=0, record=None):
        """A request for ``n`` reserved tokens (prompt n + 1 by default: all n can load)."""
        rec = record or self.dec.record
        params = PushParams("decode", target(self.dec, res, landing, n, deadline_ms, record=rec)
                            ).as_kv_transfer_params()
        req = self.requests[rid] = Req(rid, prompt or n + 1, params)
        self.sched.on_new_request(req)
        return req

    def schedule(self, rid, block_ids, local=0, timeout_s=10.0, step_tokens=0):
        """vLLM's scheduler loop for one waiting request until it is admitted; returns the
        tokens loaded (0: computed locally) after the worker ran the step's loads."""
        req = self.requests[rid]
        deadline = time.monotonic() + timeout_s
        while True:
            count, is_async = self.sched.get_num_new_matched_tokens(req, local)
            assert not is_async
            if count is not None:
                break
            self.step(step_tokens)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{rid} not admitted in {timeout_s} s")
            time.sleep(0.002)
        self.sched.update_state_after_alloc(req, Blocks(block_ids), count)
        self.step(1)
        return count

    def step(self, tokens):
        meta = self.sched.build_connector_meta(Out(tokens))
        self.worker.bind(meta)
        self.worker.start_loads(meta)
        self.worker.end_step()
        return meta

    def finish(self, rid):
        self.sched.request_finished(self.requests.pop(rid))
        self.step(0)

    def close(self):
        self.worker.close()
        self.watch.close()


def gpu_layout_caches(order, fill):
    """Per-layer logical views ``[blocks, kv_heads, block_size, 2 * head_dim]`` of one
    allocation in a GPU backend's physical order (``KVCacheLayout.stride_order``)."""
    logical = (LAYERS, NB, HEADS, BS, 2 * DIM)
    physical = fill(torch.empty([logical[o] for o in order], dtype=torch.float32))
    view = physical.permute(*np.argsort(order).tolist())
    return {name: view[i] for i, name in enumerate(NAMES)}


def push_in_two_pieces(pw, de, dec, res: str, p_blocks, d_blocks, landing, n: int, pcache, dcache) -> None:
    """A request of ``n`` tokens pushed in two pieces (40 tokens, then the rest) and loaded:
    the decode cache holds the prefill's tokens, token for token."""
    req = de.arrive("d1", res, landing, n)
    assert de.sched.get_num_new_matched_tokens(req, 0) == (None, False)
    step_prefill(pw, [PushSpec("p1", tuple(p_blocks), 0, 40, False, target(dec, res, landing, n))])
    step_prefill(pw, [PushSpec("p1", tuple(p_blocks), 40, n, True)])
    assert de.schedule("d1", d_blocks) == n
    for name in NAMES:
        for t in range(n):
            want = pcache[name][p_blocks[t // BS], :, t % BS, :]
            assert torch.equal(dcache[name][d_blocks[t // BS], :, t % BS, :], want), (name, t)


def test_the_same_push_through_the_torch_copier_in_gpu_layouts(sidecars, workdir, codec):
    """The copier a GPU engine uses, on CPU tensors: prefill in FlashAttention's NHD order
    with layers outermost, decode in HND with blocks outermost, through real sidecars."""
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from kvpush.connector.copiers.torch_copier import TorchCopier

    dec, pre = sidecars(LAYOUT, d_layout=LAYOUT.replace(f"block={BS}", "block=16"))
    gen = torch.Generator().manual_seed(5)
    pcache = gpu_layout_caches(KVCacheLayout.LBNHC.stride_order, lambda x: x.normal_(generator=gen))
    dcache = gpu_layout_caches(KVCacheLayout.BLHNC.stride_order, lambda x: x.zero_())
    pw, _ = make_worker(pre, workdir, codec, "P", copier=TorchCopier(BS), caches=pcache)
    de = DecodeEngine(dec, workdir, codec, copier=TorchCopier(BS), caches=dcache)
    try:
        n, p_blocks, d_blocks = 75, [5, 2, 9], [3, 7, 1]
        landing = list(range(40, 40 + -(-n // 16)))
        push_in_two_pieces(pw, de, dec, "res-t", p_blocks, d_blocks, landing, n, pcache, dcache)
        others = [b for b in range(NB) if b not in d_blocks]
        assert all(not dcache[name][others].any() for name in NAMES)
        assert de.worker.counters.get("loads_landed") == 1 and de.worker.counters.get("load_errors") == 0
    finally:
        pw.close()
        de.close()


class LateCopies:
    """A GPU's asynchronous staging, played on the CPU: a layer's bytes reach the pool only
    when its fence is waited on, later and on another thread. A PUSH sent before its fence
    passed would push bytes not yet staged, and the decode cache would not match."""

    def __init__(self, copier):
        self.copier, self.threads = copier, set()

    def __getattr__(self, name):
        return getattr(self.copier, name)

    def stage(self, *args, **kwargs):
        outer = self

        class Late:
            def wait(self):
                time.sleep(0.01)
                outer.threads.add(threading.current_thread().name)
                outer.copier.stage(*args)
        return Late()


def test_pushes_wait_for_the_copies_they_send(sidecars, workdir, codec):
    from kvpush.connector.copiers.torch_copier import TorchCopier

    dec, pre = sidecars(LAYOUT)
    gen = torch.Generator().manual_seed(8)
    pcache = {name: torch.randn(NB, HEADS, BS, 2 * DIM, generator=gen) for name in NAMES}
    late = LateCopies(TorchCopier(BS))
    pw, _ = make_worker(pre, workdir, codec, "P", copier=late, caches=pcache)
    de = DecodeEngine(dec, workdir, codec, copier=TorchCopier(BS), caches=paged_caches())
    try:
        n, p_blocks, d_blocks, landing = 70, [4, 0, 6], [2, 9, 5], [11, 12, 13]
        push_in_two_pieces(pw, de, dec, "res-late", p_blocks, d_blocks, landing, n, pcache, de.cache)
        assert late.threads == {"kvpush-sends"}  # every staging copy finished on the sender's thread
        assert pw.counters.get("requests_pushed") == 1
    finally:
        pw.close()
        de.close()


@pytest.mark.parametrize("landing_bs", [BS, 16])
def test_layerwise_chunked_push_lands_in_the_decode_cache_token_for_token(sidecars, workdir, codec, landing_bs):
    """``landing_bs`` != 32: the decode sidecar's landing blocks are smaller than vLLM's, so
    the prefill side re-blocks while staging and the decode side while loading."""
    dec, pre = sidecars(LAYOUT, d_layout=LAYOUT.replace(f"block={BS}", f"block={landing_bs}"))
    pw, pcache = make_worker(pre, workdir, codec, "P")
    de = DecodeEngine(dec, workdir, codec)
    try:
        n, p_blocks, d_blocks = 75, [5, 2, 9], [3, 7, 1]
        landing = list(range(40, 40 + -(-n // landing_bs)))
        kv = write_request(pcache, p_blocks, n)
        # The decode side waits first (the router sends both at once): not admitted yet.
        req = de.arrive("d1", "res-1", landing, n)
        assert de.sched.get_num_new_matched_tokens(req, 0) == (None, False)
        # Chunked prefill: [0, 40) in one step, [40, 75) in the next.
        step_prefill(pw, [PushSpec("p1", tuple(p_blocks), 0, 40, False, target(dec, "res-1", landing, n))])
        step_prefill(pw, [PushSpec("p1", tuple(p_blocks), 40, n, True)])
        assert de.schedule("d1", d_blocks) == n
        dcache = de.cache
        for name in NAMES:
            got = codec.read(dcache[name].view(-1).numpy(), d_blocks, 0, n)
            assert np.array_equal(got[0], kv[name][0]) and np.array_equal(got[1], kv[name][1]), name
        # Untouched blocks stay untouched.
        others = [b for b in range(NB) if b not in d_blocks]
        assert all(not dcache[name][others].any() for name in NAMES)
        assert dec.admin("stats")["landed"] == 1
        with dec.client() as c:
            deadline = time.monotonic() + 5
            while c.query("res-1").state != "CONSUMED" and time.monotonic() < deadline:
                time.sleep(0.01)  # CONSUMED is fire-and-forget
            assert c.query("res-1").state == "CONSUMED"  # landing blocks handed back
        p_counts, d_counts = pw.counters.snapshot(), de.worker.counters.snapshot()
        assert p_counts["requests_begun"] == p_counts["requests_pushed"] == 1
        assert p_counts["layers_pushed"] == 2 * LAYERS
        assert p_counts["bytes_staged"] == n * LAYERS * 2 * HEADS * DIM * 4
        assert d_counts["loads_started"] == d_counts["loads_landed"] == 1 and d_counts["tokens_loaded"] == n
        assert "load_errors" not in d_counts
        deadline = time.monotonic() + 5
        while pw.counters.get("push_PUSHED") < 1 and time.monotonic() < deadline:
            pw.end_step()  # the sidecar's outcome event
            time.sleep(0.01)
        assert pw.counters.get("push_PUSHED") == 1
        # The same numbers, from outside the engine.
        assert read_counters(str(workdir / "stats" / "D.json"))["tokens_loaded"] == n
        assert read_counters(str(workdir / "stats" / "P.json"))["requests_pushed"] == 1
        stats = pre.admin("stats")
        assert stats["staging_allocations"] == 0  # staging freed once the last write was done
    finally:
        pw.close(), de.close()


def test_push_before_the_decode_asks_and_a_partial_load_past_a_local_hit(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    de = DecodeEngine(dec, workdir, codec)
    try:
        n, p_blocks, d_blocks, landing = 64, [0, 1], [8, 9], [10, 11]
        kv = write_request(pcache, p_blocks, n, seed=3)
        step_prefill(pw, [PushSpec("p", tuple(p_blocks), 0, n, True, target(dec, "res-2", landing, n))])
        time.sleep(0.3)  # landed before anyone waits for it
        # The decode engine already has the first block (prefix cache): it loads [32, 64) only.
        de.arrive("d", "res-2", landing, n)
        assert de.schedule("d", d_blocks, local=32) == 32
        got = codec.read(de.cache[NAMES[1]].view(-1).numpy(), d_blocks, 32, n)
        assert np.array_equal(got[0], kv[NAMES[1]][0][32:]) and not de.cache[NAMES[1]][8].any()
        assert de.worker.counters.get("tokens_loaded") == 32
    finally:
        pw.close(), de.close()


def test_failures_are_recomputed_never_hangs(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    de = DecodeEngine(dec, workdir, codec, timing=DecodeTiming(load_timeout_s=20, deadline_grace_s=0.5,
                                                               idle_wait_s=0))
    try:
        now_ms = int(time.time() * 1000)
        t0 = time.monotonic()
        # never pushed: computed locally once its deadline (+ grace) passes
        de.arrive("late", "res-never", [0, 1], 40, deadline_ms=now_ms + 1000)
        # a reservation of an earlier incarnation of this engine: computed locally at once
        stale = dict(de.dec.record, incarnation="gone")
        de.arrive("stale", "res-stale", [2], 20, record=stale)
        # cancelled by the control plane while waiting
        de.arrive("cancelled", "res-cancel", [3], 20)
        assert de.schedule("stale", [2]) == 0
        dec.admin("cancel", reservation_id="res-cancel", reason="deadline")
        assert de.schedule("cancelled", [3]) == 0
        assert de.schedule("late", [0, 1]) == 0
        elapsed = time.monotonic() - t0
        assert 1.4 < elapsed < 4.0, elapsed
        # The worker: a load it cannot do (a pool of another incarnation) reports the request's
        # blocks as load errors for vLLM to recompute, instead of copying the wrong memory.
        meta = KVPushConnectorMetadata(loads=[load_spec(dec, "odd", "res-odd", [4], [6, 7], 40, incarnation="x")])
        de.worker.bind(meta)
        de.worker.start_loads(meta)
        assert de.worker.load_errors() == {6, 7} and de.worker.load_errors() == set()
        # The prefill side: a destination outside the decode pool is refused at BEGIN, the step goes on.
        write_request(pcache, [4], 20)
        step_prefill(pw, [PushSpec("bad", (4,), 0, 20, True, target(dec, "res-bad", [10_000], 20))])
        de.step(0)
        c = de.worker.counters.snapshot()
        assert c["load_errors"] == 3 and c["refused_wrong_engine"] == 1
        assert (c["load_error_timeout"], c["load_error_cancelled"], c["load_error_copy"]) == (1, 1, 1)
        assert pw.counters.get("push_refused") == 1 and pw.counters.get("layers_pushed") == 0
    finally:
        pw.close(), de.close()


def test_requests_that_end_unloaded_have_their_reservations_consumed_when_they_land(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    de = DecodeEngine(dec, workdir, codec)
    try:
        write_request(pcache, [0, 1], 50)
        de.arrive("gone", "res-a", [5, 6], 50)
        de.arrive("hit", "res-b", [7, 8], 50)
        de.finish("gone")  # the request ended (client gone) while its KV was on its way
        step_prefill(pw, [PushSpec("a", (0, 1), 0, 50, True, target(dec, "res-a", [5, 6], 50)),
                          PushSpec("b", (0, 1), 0, 50, True, target(dec, "res-b", [7, 8], 50))])
        # Landed, but the local prefix cache covers it all: nothing to load, released.
        assert de.schedule("hit", [1, 2], local=50) == 0
        deadline = time.monotonic() + 5
        while de.worker.counters.get("releases_consumed") < 2 and time.monotonic() < deadline:
            de.step(0)
            time.sleep(0.01)
        c = de.worker.counters.snapshot()
        assert c["releases_consumed"] == 2 and c["loads_abandoned"] == 1 and c["load_skipped_local_hit"] == 1
        assert not any(t.any() for t in de.cache.values())  # nothing was copied for them
        with dec.client() as cl:
            assert cl.query("res-a").state == cl.query("res-b").state == "CONSUMED"
    finally:
        pw.close(), de.close()


def test_a_restarted_sidecar_is_reconnected(sidecars, workdir, codec):
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    de = DecodeEngine(dec, workdir, codec)
    try:
        kv = write_request(pcache, [0, 1], 40)
        de.arrive("before", "res-0", [0, 1], 40)
        old_incarnation = dec.record["incarnation"]
        dec2 = dec.restart()
        pre2 = pre.restart()
        assert dec2.record["incarnation"] != old_incarnation
        pre2.admin("add_peer", record=dec2.record)
        # New work for the new incarnation: the scheduler asks its sidecar again, learns it...
        de.arrive("after", "res-1", [2, 3], 40, record=dec2.record)
        assert de.sched.sidecar.incarnation == dec2.record["incarnation"]
        # ... the request that waited on the old incarnation is computed locally at once, not at its deadline.
        t0 = time.monotonic()
        assert de.schedule("before", [0, 1]) == 0
        assert time.monotonic() - t0 < 1
        assert de.worker.counters.get("load_error_restarted") == 1
        # ... and new work goes through the new sidecars: the worker reconnected too.
        step_prefill(pw, [PushSpec("p", (0, 1), 0, 40, True, target(dec2, "res-1", [2, 3], 40))])
        assert de.schedule("after", [4, 5]) == 40
        got = codec.read(de.cache[NAMES[0]].view(-1).numpy(), [4, 5], 0, 40)
        assert np.array_equal(got[1], kv[NAMES[0]][1])
        assert pw.counters.get("sidecar_reconnects") == de.worker.counters.get("sidecar_reconnects") == 1
    finally:
        pw.close(), de.close()


def test_an_idle_decode_engine_sleeps_until_its_request_lands(sidecars, workdir, codec):
    """An engine with nothing to run while a request waits for its KV blocks on the
    landing (up to idle_wait_s) instead of spinning through empty steps, and admits the
    request the moment it lands; an engine that ran tokens in its last step never sleeps."""
    dec, pre = sidecars(LAYOUT)
    pw, pcache = make_worker(pre, workdir, codec, "P")
    de = DecodeEngine(dec, workdir, codec, timing=DecodeTiming(idle_wait_s=0.1))
    try:
        n, landing = 40, [2, 3]
        kv = write_request(pcache, [0, 1], n, seed=5)
        req = de.arrive("d", "res-idle", landing, n)
        de.step(0)  # the engine is idle
        t0 = time.monotonic()
        assert de.sched.get_num_new_matched_tokens(req, 0) == (None, False)
        idle_s = time.monotonic() - t0
        de.step(3)  # a busy step
        t0 = time.monotonic()
        assert de.sched.get_num_new_matched_tokens(req, 0) == (None, False)
        busy_s = time.monotonic() - t0
        assert 0.09 < idle_s < 0.5 and busy_s < 0.05, (idle_s, busy_s)
        # The push lands while the idle engine sleeps: it wakes and admits the request at once.
        de.step(0)
        timer = threading.Timer(0.02, step_prefill, (pw, [PushSpec("p", (0, 1), 0, n, True,
                                                                    target(dec, "res-idle", landing, n))]))
        timer.start()
        t0 = time.monotonic()
        count = None
        while count is None and time.monotonic() - t0 < 5:
            count, _ = de.sched.get_num_new_matched_tokens(req, 0)
            if count is None:
                de.step(0)
        timer.join()
        assert count == n
        de.sched.update_state_after_alloc(req, Blocks([4, 5]), count)
        de.step(1)
        assert np.array_equal(codec.read(de.cache[NAMES[2]].view(-1).numpy(), [4, 5], 0, n)[1], kv[NAMES[2]][1])
        assert de.worker.counters.get("idle_waits") >= 2
    finally:
        pw.close(), de.close()

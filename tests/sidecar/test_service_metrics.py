"""The sidecar's Prometheus endpoint and JSON logs, scraped from real ``kvpush sidecar``
processes after a real push: pushes, bytes, exposed time, landings, pool occupancy,
registration; and a failure counted by its reason class."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpush.app.etcd_server import free_port
from kvpush.contract.states import State
from kvpush.sidecar.metrics import reason_class
from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, layout_pb, record_of

pytestmark = pytest.mark.timeout(90)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_after_a_push_and_json_logs(stack):
    d_port, p_port = free_port(), free_port()
    dec = stack.sidecar("decode", "D1", LAYOUT, 64, "m", "--metrics-port", str(d_port))
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256, "m", "--metrics-port", str(p_port))
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        before = scrape(p_port)
        assert before[("kvpush_sidecar_registered", ())] == 1
        assert before[("kvpush_sidecar_pool_units", (("state", "free"),))] == 256
        tokens = 90
        res = await sched.reserve("m-0", tokens, prefill_layout=layout_pb(LAYOUT))
        decode.client.subscribe(res.id)
        cache_ids = prefill.cache_blocks_for(tokens)
        alloc = prefill.begin("m-0", res.id, record_of(res), res.block_ids, tokens)
        prefill.push_all("m-0", alloc, res.block_size, tokens, cache_ids, chunks=2)
        assert wait_state(decode.client, res.id).state == "LANDED"
        assert wait_state(prefill.client, res.id).state == "PUSHED"
        await etcd.wait_state(res.id, State.LANDED)
        p, d = scrape(p_port), scrape(d_port)
        kv_bytes = 4 * 2 * 2 * 16 * 2 * tokens  # layers x K/V x heads x dim x fp16 x tokens
        assert p[("kvpush_sidecar_pushes_total", (("outcome", "PUSHED"),))] == 1
        assert p[("kvpush_sidecar_push_bytes_total", ())] >= kv_bytes
        assert p[("kvpush_sidecar_push_exposed_seconds_count", ())] == 1
        assert 0 < p[("kvpush_sidecar_push_exposed_seconds_sum", ())] < 5
        assert p[("kvpush_sidecar_pool_units", (("state", "used"),))] == 0  # staging freed after the push
        assert d[("kvpush_sidecar_landings_total", (("state", "LANDED"),))] == 1
        assert d[("kvpush_sidecar_pool_units", (("state", "landed"),))] == len(res.block_ids)
        assert decode.client.consumed(res.id).state == "CONSUMED"
        assert scrape(d_port)[("kvpush_sidecar_pool_units", (("state", "landed"),))] == 0
        # The logs are JSON lines, the component named.
        lines = [json.loads(line) for line in open(pre.log_path) if line.startswith("{")]
        assert lines and all(line["component"] == "sidecar" for line in lines)
        assert any("registered" in line["event"] for line in lines)
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()


def test_failure_reasons_are_counted_by_class():
    assert reason_class("engine D1: write to engine D1 failed: NIXL_ERR_REMOTE_DISCONNECT") == "peer_gone"
    assert reason_class("no landing within 60 s") == "timeout"
    assert reason_class("pusher aborted: staging failed") == "aborted"
    assert reason_class("layer 9 outside [0, 4)") == "other"


def test_prefix_metrics_say_when_the_engines_hashes_cannot_be_matched():
    from kvpush.sidecar.metrics import SidecarMetrics

    state = {"landing_blocks": 8, "landing_blocks_landed": 0, "prefix_blocks_held": 3,
             "prefix_events": {"stored": 3, "gaps": 0}, "prefix_unusable": "", "prefix_reports": {"deltas": 2}}

    def samples() -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in SidecarMetrics("decode", lambda: state).registry.collect() for s in family.samples}

    got = samples()
    assert got[("kvpush_sidecar_prefix_usable", ())] == 1 and got[("kvpush_sidecar_prefix_blocks_held", ())] == 3
    assert got[("kvpush_sidecar_prefix_reports_total", (("kind", "deltas"),))] == 2
    state.update(prefix_blocks_held=0, prefix_unusable="the engine hashes with xxhash")
    assert samples()[("kvpush_sidecar_prefix_usable", ())] == 0
    # A sidecar not following KV events exports none of them.
    del state["prefix_blocks_held"]
    assert not any(name.startswith("kvpush_sidecar_prefix") for name, _ in samples())

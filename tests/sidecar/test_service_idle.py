"""Idle cost of registered ``kvpush sidecar`` processes, heartbeat and watch included."""

from __future__ import annotations

import time

import pytest

from kvpush.contract.states import State
from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, layout_pb, record_of
from tests.sidecar.test_idle_and_channel import cpu_share

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"


def beats(sp) -> int:
    with sp.client() as client:
        return client.admin("service")["beats"]


async def test_registered_idle_sidecars_use_at_most_two_percent_of_a_core(stack):
    # A short lease so that several heartbeats fall inside the measured window.
    dec = stack.sidecar("decode", "D1", LAYOUT, 64, "m", "--lease-ttl", "3")
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256, "m", "--lease-ttl", "3")
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        # Work first (peer resolved, connections up, reports sent), then nothing.
        res = await sched.reserve("r1", 64, prefill_layout=layout_pb(LAYOUT))
        decode.client.subscribe(res.id)
        alloc = prefill.begin("r1", res.id, record_of(res), res.block_ids, 64)
        prefill.push_all("r1", alloc, 16, 64, prefill.cache_blocks_for(64))
        assert wait_state(decode.client, res.id).state == "LANDED"
        assert decode.client.consumed(res.id).state == "CONSUMED"
        await etcd.wait_state(res.id, State.CONSUMED)
        time.sleep(0.3)  # past the warm window
        before = {sp.engine_id: beats(sp) for sp in (dec, pre)}
        shares = cpu_share([dec.pid, pre.pid], 4.0)
        after = {sp.engine_id: beats(sp) for sp in (dec, pre)}
        print(f"\nidle CPU of registered sidecars: decode {shares[dec.pid] * 100:.2f}% of a core, "
              f"prefill {shares[pre.pid] * 100:.2f}% (heartbeats in the window: "
              f"{ {k: after[k] - before[k] for k in after} })")
        assert all(after[k] - before[k] >= 3 for k in after), (before, after)
        assert shares[dec.pid] <= 0.02 and shares[pre.pid] <= 0.02, shares
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()

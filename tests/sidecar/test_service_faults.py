"""``kvpush sidecar`` under faults: incompatible layouts, a prefill sidecar killed
mid-push, a deadline that passes mid-push. Real etcd, a real control-plane process,
real sidecar processes; the etcd invariant checker has the last word."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from kvpush.contract.states import State
from tests.controlplane.helpers import expect_code
from tests.sidecar.engines import SENTINEL, DecodeEngine, PrefillEngine, wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, layout_pb, record_of, settle
from kvpush.connector.sidecar_client import ChannelError

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"
WIDE = "layers=4,block=16,heads=4,dim=16,dtype=float16"  # other head count: cannot take LAYOUT's KV
BIG = "layers=8,block=16,heads=8,dim=128,dtype=float16"  # 64 KiB per block and layer


async def test_incompatible_layouts_are_refused_by_the_control_plane_and_the_sidecar(stack):
    dec = stack.sidecar("decode", "D1", LAYOUT, 32, "m")
    wide = stack.sidecar("decode", "D2", WIDE, 32, "m2")
    pre = stack.sidecar("prefill", "P1", LAYOUT, 128, "m")
    dec.ready(), wide.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(wide.client())
    try:
        decode.fill_sentinel()
        # The scheduler names the prefill layout: no decode engine of model m2 can take it,
        # and the refusal says why, naming both layouts, before any prefill runs.
        details = await expect_code(grpc.StatusCode.FAILED_PRECONDITION,
                                    sched.reserve("r-bad", 40, model="m2", prefill_layout=layout_pb(LAYOUT)))
        assert (f"D2: prefill layout {LAYOUT} cannot feed decode layout {WIDE}: "
                "kv_layout.num_kv_heads differs") in details, details
        # A scheduler that does not say: the reservation is made, but the prefill sidecar
        # refuses to push into it once it has the peer's record, and reports FAILED.
        res = await sched.reserve("r-blind", 40, model="m2")
        assert res.engine_id == "D2"
        alloc = prefill.begin("r-blind", res.id, record_of(res), res.block_ids, 40)
        prefill.push_all("r-blind", alloc, res.block_size, 40, prefill.cache_blocks_for(40))
        event = wait_state(prefill.client, res.id)
        assert event.state == "FAILED" and "num_kv_heads differs" in event.reason, event
        failed = await etcd.wait_state(res.id, State.FAILED)
        assert "num_kv_heads differs" in failed.reason
        # Now the peer is known: the next one is refused at BEGIN, before any staging.
        res2 = await sched.reserve("r-blind-2", 40, model="m2")
        with pytest.raises(ChannelError, match="num_kv_heads differs"):
            prefill.begin("r-blind-2", res2.id, record_of(res2), res2.block_ids, 40)
        await etcd.wait_state(res2.id, State.FAILED)
        stats = prefill.client.admin("stats")
        assert stats["staging_allocations"] == 0 and "transfers" not in stats, stats
        assert np.all(decode.mem == SENTINEL), "nothing may be written into an incompatible engine"
        await settle(stack.etcd.endpoint, quiet=True)
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()


async def test_prefill_sidecar_killed_mid_push_fails_the_reservation_and_frees_its_blocks(stack):
    dec = stack.sidecar("decode", "D1", BIG, 256)
    pre = stack.sidecar("prefill", "P1", BIG, 256)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    decode, prefill = DecodeEngine(dec.client()), PrefillEngine(pre.client(), cache_blocks=128)
    try:
        decode.fill_sentinel()
        tokens = 2000  # 125 blocks, 8 MiB per layer
        res = await sched.reserve("r-kill", tokens, prefill_layout=layout_pb(BIG))
        decode.client.subscribe(res.id)
        ids = prefill.cache_blocks_for(tokens)
        alloc = prefill.begin("k", res.id, record_of(res), res.block_ids, tokens)
        for layer in range(prefill.layout.num_layers - 1):  # every layer but the last
            prefill.stage(alloc, 16, tokens, ids, layer)
            prefill.client.push("k", layer)
        # The control plane knows who is pushing (the prefill sidecar's PUSHING report).
        pushing = await etcd.wait_state(res.id, State.PUSHING)
        assert pushing.prefill_engine_id == "P1" and pushing.prefill_incarnation == pre.record["incarnation"]
        t0 = time.monotonic()
        pre.kill()  # SIGKILL, and reaped
        reaped = time.monotonic() - t0
        failed = await etcd.wait_state(res.id, State.FAILED, timeout_s=10, interval_s=0.01)
        elapsed = time.monotonic() - t0
        print(f"\nprefill sidecar SIGKILLed mid-push: reservation FAILED in etcd at most {elapsed * 1e3:.0f} ms "
              f"after the signal (the process took {reaped * 1e3:.0f} ms to die; {failed.reason})")
        assert elapsed < 5.0
        # The decode sidecar hears of it (watch) and ends the landing: never LANDED.
        event = wait_state(decode.client, res.id, 10)
        assert event.state == "CANCELLED" and "FAILED" in event.reason, event
        report = await settle(stack.etcd.endpoint, quiet=True)
        assert report.engines["D1"].free == set(range(256)) and "P1" not in report.engines
        last = prefill.layout.num_layers - 1
        assert np.all(decode.layer(last)[list(res.block_ids)] == SENTINEL), "the last layer was never pushed"
    finally:
        prefill.staging.close()
        decode.close()
        await sched.close(), await etcd.close()


async def test_deadline_expiry_mid_push_stops_the_push_and_never_lands(stack):
    dec = stack.sidecar("decode", "D1", LAYOUT, 64)
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        decode.fill_sentinel()
        tokens = 64
        res = await sched.reserve("r-late", tokens, deadline_ms=1500, prefill_layout=layout_pb(LAYOUT))
        decode.client.subscribe(res.id)
        ids = prefill.cache_blocks_for(tokens)
        alloc = prefill.begin("late", res.id, record_of(res), res.block_ids, tokens)
        for layer in range(2):  # a slow prefill: half the layers before the deadline
            prefill.stage(alloc, 16, tokens, ids, layer)
            prefill.client.push("late", layer)
        assert (await etcd.wait_state(res.id, State.PUSHING)).prefill_engine_id == "P1"
        expired = await etcd.wait_state(res.id, State.EXPIRED, timeout_s=10)
        # Both sidecars hear of it (their watches) and stop: the push is cancelled...
        event = wait_state(prefill.client, res.id, 5)
        late_ms = time.time() * 1000 - res.deadline_unix_ms
        assert event.state == "CANCELLED" and "EXPIRED" in event.reason, event
        print(f"\ndeadline passed mid-push: EXPIRED in etcd ({expired.reason}); the prefill's push was "
              f"cancelled at most {late_ms:.0f} ms after the deadline (deadline leases have 1 s buckets)")
        # ...late pieces are dropped, and the decode side ends the landing without LANDED.
        for layer in range(2, prefill.layout.num_layers):
            prefill.stage(alloc, 16, tokens, ids, layer)
            prefill.client.push("late", layer)
        prefill.client.ping()
        # (its own watch, or first the pusher's ABORT notice, which carries the reason)
        event = wait_state(decode.client, res.id, 5)
        assert event.state in ("CANCELLED", "FAILED") and "EXPIRED" in event.reason, event
        assert decode.client.query(res.id).state == event.state
        for layer in range(2, decode.layout.num_layers):
            assert np.all(decode.layer(layer)[list(res.block_ids)] == SENTINEL), f"layer {layer} was written"
        stats = prefill.client.admin("stats")
        assert stats.get("cancelled") == 1 and stats["staging_allocations"] == 0, stats
        # The reservation stays EXPIRED (no LANDED report came after it) and its blocks are free.
        assert (await etcd.reservation(res.id)).state == State.EXPIRED
        report = await settle(stack.etcd.endpoint, quiet=True)
        assert report.engines["D1"].free == set(range(64))
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()

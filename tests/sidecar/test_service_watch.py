"""How ``kvpush sidecar`` learns that reservations ended: its watch, the catch-up
after the watch was down, and its own landing timeout."""

from __future__ import annotations

import time

import pytest

from kvpush.contract.states import State
from tests.controlplane.helpers import release
from tests.sidecar.conftest import ControlPlaneProc
from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, layout_pb, record_of, settle

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"


async def test_reservation_ended_while_the_watch_was_down_is_caught_up_after(stack):
    """Replica A (the sidecars') dies; the scheduler releases a reservation through replica
    B meanwhile; when A is back the sidecars subscribe again, see the reservation missing
    from the snapshot, look it up and stop their work for it."""
    other = ControlPlaneProc(stack.etcd.endpoint, stack.workdir).start()
    dec = stack.sidecar("decode", "D1", LAYOUT, 64)
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(other.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        res = await sched.reserve("gone", 64, prefill_layout=layout_pb(LAYOUT))
        decode.client.subscribe(res.id)
        ids = prefill.cache_blocks_for(64)
        alloc = prefill.begin("gone", res.id, record_of(res), res.block_ids, 64)
        for layer in range(2):
            prefill.stage(alloc, 16, 64, ids, layer)
            prefill.client.push("gone", layer)
        await etcd.wait_state(res.id, State.PUSHING)
        awaited = await sched.reserve("awaited", 32, prefill_layout=layout_pb(LAYOUT))  # decode waits, no push
        decode.client.subscribe(awaited.id)
        stack.cp.stop(kill=True)  # the sidecars' replica: their watches go down with it
        for r in (res, awaited):
            await release(sched.tenant, r.id)
            await etcd.wait_state(r.id, State.RELEASED)
        time.sleep(0.5)
        assert decode.client.query(res.id).state == "PUSHING"  # nobody could tell them yet
        assert decode.client.query(awaited.id).state == "EXPECTED"
        stack.cp.start()
        t0 = time.monotonic()
        event = wait_state(prefill.client, res.id, 15)
        assert event.state == "CANCELLED" and "RELEASED" in event.reason, event
        # The decode side stops too: through its own catch-up, or first through the
        # pusher's ABORT notice (which carries the reason).
        event = wait_state(decode.client, res.id, 15)
        assert event.state in ("CANCELLED", "FAILED") and "RELEASED" in event.reason, event
        event = wait_state(decode.client, awaited.id, 15)  # only its own catch-up can tell it
        assert event.state == "CANCELLED" and "RELEASED" in event.reason, event
        print(f"\nreleased while the watch was down: both sidecars stopped {time.monotonic() - t0:.2f} s "
              f"after their control plane came back")
        assert prefill.client.admin("stats")["staging_allocations"] == 0
        await settle(stack.etcd.endpoint, quiet=True)
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()
        other.stop()


async def test_landing_timeout_fails_the_reservation(stack):
    dec = stack.sidecar("decode", "D1", LAYOUT, 64, "m", "--landing-timeout", "1")
    dec.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    decode = DecodeEngine(dec.client())
    try:
        res = await sched.reserve("never", 40, prefill_layout=layout_pb(LAYOUT))
        t0 = time.monotonic()
        assert decode.client.subscribe(res.id).state == "EXPECTED"  # and no prefill ever pushes
        event = wait_state(decode.client, res.id, 5)
        assert event.state == "FAILED" and "nothing landed within 1 s" in event.reason, event
        failed = await etcd.wait_state(res.id, State.FAILED)
        print(f"\nlanding timeout (1 s): FAILED in etcd {time.monotonic() - t0:.2f} s after the engine began waiting")
        assert "nothing landed" in failed.reason
        await settle(stack.etcd.endpoint, quiet=True)
    finally:
        decode.close()
        await sched.close(), await etcd.close()


async def test_prefill_hears_a_reservation_that_names_it(stack):
    """The router's Reserve names the prefill engine; its sidecar hears the grant by watch
    and hands it to the engine's AWAIT, whether the engine asked before or after; one
    never granted is never answered."""
    dec = stack.sidecar("decode", "D1", LAYOUT, 64)
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    engine = pre.client()
    heard: list = []
    engine.on_reservation = lambda key, params: heard.append((key, params))
    try:
        assert engine.await_reservation("rt-first") is None          # asked before the Reserve
        t0 = time.monotonic()
        first = await sched.reserve("rt-first", 40, prefill_engine_id="P1")
        while not heard and time.monotonic() - t0 < 5:
            time.sleep(0.001)
        granted_to_heard = time.monotonic() - t0
        (key, params), = heard
        assert key == "rt-first" and params["reservation_id"] == first.id and params["engine_id"] == "D1"
        assert params["block_ids"] == list(first.block_ids) and params["role"] == "prefill"
        later = await sched.reserve("rt-later", 40, prefill_engine_id="P1")
        # Asked only after the watch brought it: the Reserve's answer can reach us before the
        # sidecar hears the watch, and an AWAIT sent first would be answered by an event instead.
        for _ in range(1000):
            if engine.admin("stats")["handover_offered"] == 2:
                break
            time.sleep(0.01)
        got = engine.await_reservation("rt-later")
        assert got is not None and got["reservation_id"] == later.id
        assert engine.await_reservation("rt-never") is None
        time.sleep(0.2)
        assert [k for k, _ in heard] == ["rt-first"]
        stats = engine.admin("stats")
        assert stats["handover_delivered"] == 2 and stats["handover_waiting"] == 1
        print(f"\nReserve naming the prefill engine -> its engine heard it: {granted_to_heard * 1e3:.1f} ms "
              "after the Reserve was sent")
        for r in (first, later):
            await release(sched.tenant, r.id)
        await settle(stack.etcd.endpoint, quiet=True)
    finally:
        engine.close()
        await sched.close(), await etcd.close()

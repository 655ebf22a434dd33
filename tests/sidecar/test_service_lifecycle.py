"""``kvpush sidecar`` as a service: control-plane restarts, start-up order, bad
credentials, clean exit on SIGTERM. Real etcd, control-plane and sidecar processes."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import numpy as np
import pytest

from kvpush.contract.states import State
from tests.controlplane.helpers import release
from tests.sidecar.conftest import kvpush_segments, segment_owner
from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, layout_pb, record_of, settle
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"


def service_stats(sp) -> dict:
    with sp.client() as client:
        return client.admin("service")




def push_and_land(prefill: PrefillEngine, decode: DecodeEngine, res, request_id: str, tokens: int) -> list[int]:
    decode.client.subscribe(res.id)
    ids = prefill.cache_blocks_for(tokens)
    alloc = prefill.begin(request_id, res.id, record_of(res), res.block_ids, tokens)
    prefill.push_all(request_id, alloc, res.block_size, tokens, ids)
    assert wait_state(decode.client, res.id).state == "LANDED"
    for layer in range(decode.layout.num_layers):
        assert np.array_equal(decode.read_tokens(res.block_ids, layer, tokens), prefill.tokens(ids, layer, tokens))
    return ids


@pytest.mark.parametrize("how", ["crash", "sigterm", "sigterm-new-work"])
async def test_control_plane_restart_sidecars_register_again_and_keep_working(stack, how):
    """crash: SIGKILL, the leases outlive it; sigterm: the same through a graceful stop
    (a replica shutting down leaves the leases to their TTL, so nothing is lost);
    sigterm-new-work: after a graceful stop, only the work that starts afterwards is checked."""
    dec = stack.sidecar("decode", "D1", LAYOUT, 64)
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        first = await sched.reserve("before", 40, prefill_layout=layout_pb(LAYOUT))
        push_and_land(prefill, decode, first, "before", 40)
        await etcd.wait_state(first.id, State.LANDED)
        waiting = await sched.reserve("across", 50, prefill_layout=layout_pb(LAYOUT))  # lives across the restart
        incarnation = (await etcd.engine("D1")).incarnation

        stack.cp.stop(kill=how == "crash")
        t0 = time.monotonic()
        stack.cp.start()
        up = time.monotonic()
        for sp in (dec, pre):
            try:
                wait_for(lambda sp=sp: (s := service_stats(sp))["registrations"] >= 2 and s["connected"]
                         and s["watch_subscribed"], 30, f"{sp.engine_id} registered again")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {service_stats(sp)}\n{sp.log()}") from None
        again = time.monotonic()
        print(f"\ncontrol plane {how.split('-')[0]}: down+restart {up - t0:.2f} s; both sidecars registered and "
              f"subscribed again {again - up:.2f} s after it was serving")
        # Same incarnation: the reservation made before the restart is still live and usable.
        assert (await etcd.engine("D1")).incarnation == incarnation
        if how != "sigterm-new-work":
            assert (await etcd.reservation(waiting.id)).state == State.RESERVED
            push_and_land(prefill, decode, waiting, "across", 50)
            await etcd.wait_state(waiting.id, State.LANDED)
            assert decode.client.consumed(waiting.id).state == "CONSUMED"
            assert decode.client.consumed(first.id).state == "CONSUMED"
            await etcd.wait_state(waiting.id, State.CONSUMED)
            await etcd.wait_state(first.id, State.CONSUMED)
        # And new reservations work as before; the peer was never looked up again. (The tenant's
        # channel, unused since the restart, dials again by itself within its 2 s backoff.)
        await asyncio.wait_for(sched.tenant.channel.channel_ready(), 10)
        third = await sched.reserve("after", 30, prefill_layout=layout_pb(LAYOUT))
        push_and_land(prefill, decode, third, "after", 30)
        await etcd.wait_state(third.id, State.LANDED)
        assert decode.client.consumed(third.id).state == "CONSUMED"
        await etcd.wait_state(third.id, State.CONSUMED)
        stats = service_stats(pre)
        assert stats["resolves"] == 1 and stats["peer_loads"] == 1, stats
        if how == "sigterm-new-work":  # the old work is not checked here: end it
            for rid in (first.id, waiting.id):
                try:
                    await release(sched.tenant, rid)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
        await settle(stack.etcd.endpoint, quiet=True)
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()


async def test_sidecar_started_before_the_control_plane_registers_when_it_comes(stack):
    stack.cp.stop()
    dec = stack.sidecar("decode", "D1", LAYOUT, 16)
    wait_for(lambda: dec.log().count("registration failed") >= 3, 60, "registration attempts")
    time.sleep(1.0)  # retrying with backoff meanwhile, never spinning
    assert dec.proc.poll() is None and not os.path.exists(dec.ready_path)
    assert dec.log().count("registration failed") < 15, "retries must back off"
    stack.cp.start()
    t0 = time.monotonic()
    dec.ready(15)
    print(f"\nregistered {time.monotonic() - t0:.2f} s after the control plane came up")


def test_bad_token_is_fatal_at_start(stack):
    dec = stack.sidecar("decode", "D1", LAYOUT, 16, "m", "--token", "not-the-engine-token")
    assert dec.proc.wait(timeout=15) == 1
    assert "UNAUTHENTICATED" in dec.log()
    assert not [n for n in kvpush_segments() if segment_owner(n) == dec.pid]


async def test_sigterm_exits_cleanly_deregisters_and_leaves_nothing(stack):
    dec = stack.sidecar("decode", "D1", LAYOUT, 64)
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        done = await sched.reserve("done", 40, prefill_layout=layout_pb(LAYOUT))
        push_and_land(prefill, decode, done, "done", 40)
        assert decode.client.consumed(done.id).state == "CONSUMED"
        await etcd.wait_state(done.id, State.CONSUMED)
        pending = await sched.reserve("pending", 40, prefill_layout=layout_pb(LAYOUT))
        prefill.close(), decode.close()
        segments = {sp.engine_id: [n for n in kvpush_segments() if segment_owner(n) == sp.pid] for sp in (dec, pre)}
        assert all(segments.values()), segments
        for sp in (pre, dec):
            t0 = time.monotonic()
            assert sp.terminate(10) == 0, sp.log()
            print(f"\n{sp.engine_id}: SIGTERM -> exit 0 in {(time.monotonic() - t0) * 1e3:.0f} ms")
            await etcd.wait_engine(sp.engine_id, present=False, timeout_s=5)
            assert not [n for n in kvpush_segments() if segment_owner(n) == sp.pid], "shared memory left in /dev/shm"
            assert not os.path.exists(sp.socket) and not os.path.exists(sp.ready_path)
            log = sp.log()
            assert "Traceback" not in log and "threads still running" not in log, log
            assert "stopped" in log
        # The decode engine's reservation ended with it, FAILED, and its blocks are free.
        failed = await etcd.wait_state(pending.id, State.FAILED, timeout_s=5)
        assert "deregistered" in failed.reason
        report = await settle(stack.etcd.endpoint, quiet=True)
        assert not report.engines
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()

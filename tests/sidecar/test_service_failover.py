"""Decode failover through real ``kvpush sidecar`` processes and a real control plane: a
reservation whose decode sidecar died before its KV was loaded is moved
(``Scheduler.Relocate``), and the prefill sidecar pushes the staged KV again into the new
decode engine without the prefill engine staging anything twice."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.contract.states import State
from kvpush.contract.v1 import scheduler_pb2
from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, record_of, settle
from tests.polling import until

pytestmark = pytest.mark.timeout(90)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"


async def relocate(sched: Scheduler, res_id: str):
    return await sched.tenant.scheduler.Relocate(
        scheduler_pb2.RelocateRequest(reservation_id=res_id, reason="decode engine died"),
        metadata=sched.tenant.metadata, timeout=10)


async def test_a_moved_reservation_is_pushed_again_from_staging_and_freed_at_consumed(stack):
    d1 = stack.sidecar("decode", "D1", LAYOUT, 64)
    d2 = stack.sidecar("decode", "D2", LAYOUT, 64)
    pre = stack.sidecar("prefill", "P1", LAYOUT, 256)
    d1.ready(), d2.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill = PrefillEngine(pre.client())
    first, second = DecodeEngine(d1.client()), DecodeEngine(d2.client())
    third = None
    admin = pre.client()
    try:
        second.fill_sentinel()
        tokens = 90
        res = await sched.reserve("req-0", tokens, prefill_engine_id="P1", preferred_engine_id="D1")
        assert res.engine_id == "D1"
        # The prefill sidecar hears the reservation by watch (it names P1): only such a
        # reservation can be moved, so only its staging is held.
        await until(lambda: admin.admin("stats")["handover_offered"] >= 1, what="the handover")
        first.client.subscribe(res.id)
        cache_ids = prefill.cache_blocks_for(tokens)
        alloc = prefill.begin("req-0", res.id, record_of(res), res.block_ids, tokens)
        prefill.push_all("req-0", alloc, res.block_size, tokens, cache_ids, chunks=2)
        assert wait_state(first.client, res.id).state == "LANDED"
        assert wait_state(prefill.client, res.id).state == "PUSHED"
        stats = admin.admin("stats")
        assert stats["staging_held"] == 1 and stats["staging_allocations"] == 1, stats

        # D1 dies before its engine loaded the KV.
        first.close()
        d1.kill()
        moved = await relocate(sched, res.id)
        assert moved.engine_id == "D2" and moved.moved_from == res.id
        second.client.subscribe(moved.id)
        assert wait_state(second.client, moved.id).state == "LANDED"
        # Byte-exact in the new engine's blocks, from staging: the engine staged once.
        for layer in range(prefill.layout.num_layers):
            assert np.array_equal(second.read_tokens(moved.block_ids, layer, tokens),
                                  prefill.tokens(cache_ids, layer, tokens))
        old = await etcd.reservation(res.id)
        assert old.state == State.FAILED and old.moved_to == moved.id
        stats = admin.admin("stats")
        assert stats["relocated"] == 1 and stats["staging_held"] == 1, stats
        # Consumed at D2: the control plane's watch tells the prefill sidecar, which frees it.
        assert second.client.consumed(moved.id).state == "CONSUMED"
        await etcd.wait_state(moved.id, State.CONSUMED)
        await until(lambda: admin.admin("stats")["staging_allocations"] == 0, what="staging freed")
        assert admin.admin("stats")["staging_held"] == 0

        # Moved before its push began (the push path: the router moves it the moment the
        # decode engine refuses, before vLLM has scheduled the prefill): the push the
        # engine then begins, for the old reservation, goes into the successor.
        d3 = stack.sidecar("decode", "D3", LAYOUT, 64)
        d3.ready()
        third = DecodeEngine(d3.client())
        third.fill_sentinel()
        offered = admin.admin("stats")["handover_offered"]
        early = await sched.reserve("req-2", 48, prefill_engine_id="P1", preferred_engine_id="D2")
        await until(lambda: admin.admin("stats")["handover_offered"] > offered, what="the handover")
        moved3 = await relocate(sched, early.id)
        assert moved3.engine_id == "D3"
        await etcd.wait_state(early.id, State.FAILED)
        third.client.subscribe(moved3.id)
        cache_ids = prefill.cache_blocks_for(48)
        alloc = prefill.begin("req-2", early.id, record_of(early), early.block_ids, 48)
        prefill.push_all("req-2", alloc, early.block_size, 48, cache_ids, chunks=2)
        assert wait_state(third.client, moved3.id).state == "LANDED"
        for layer in range(prefill.layout.num_layers):
            assert np.array_equal(third.read_tokens(moved3.block_ids, layer, 48), prefill.tokens(cache_ids, layer, 48))
        assert admin.admin("stats")["handover_known"] == 0  # the push carried its target: no offer kept
        assert third.client.consumed(moved3.id).state == "CONSUMED"
        await etcd.wait_state(moved3.id, State.CONSUMED)

        # A move the prefill sidecar cannot serve (no push of it begins) fails, so the
        # decode engine waiting for it recomputes rather than waiting out its timeout.
        res2 = await sched.reserve("req-1", 32, prefill_engine_id="P1", preferred_engine_id="D2")
        moved2 = await relocate(sched, res2.id)  # nothing is ever staged for it
        gone = await etcd.wait_state(moved2.id, State.FAILED)
        assert "no staged KV" in gone.reason
        await settle(stack.etcd.endpoint, quiet=True)
    finally:
        admin.close()
        prefill.close(), second.close()
        if third is not None:
            third.close()
        await sched.close(), await etcd.close()

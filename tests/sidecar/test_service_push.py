"""``kvpush sidecar`` end to end: real etcd, a real control-plane process, two real
sidecar processes started with the ``kvpush sidecar`` command. The test plays the
scheduler (Reserve) and both vLLM engines (through the local channels)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvpush.contract.states import State
from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, layout_pb, record_of, settle

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block={bs},heads=2,dim=16,dtype=float16"


@contextlib.asynccontextmanager
async def sidecar_pair(stack, p_block: int = 16, d_block: int = 16, landing_blocks: int = 64):
    """A decode sidecar D1 and a prefill sidecar P1 (real processes), the scheduler, etcd,
    and the test's stand-ins for both engines (the decode pool filled with a sentinel)."""
    dec = stack.sidecar("decode", "D1", LAYOUT.format(bs=d_block), landing_blocks)
    pre = stack.sidecar("prefill", "P1", LAYOUT.format(bs=p_block), 256)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        decode.fill_sentinel()
        yield pre, sched, etcd, prefill, decode
    finally:
        prefill.close(), decode.close()
        await sched.close(), await etcd.close()


async def test_push_lands_exactly_and_the_lifecycle_reaches_etcd(stack):
    async with sidecar_pair(stack) as (pre, sched, etcd, prefill, decode):
        pushes = []
        for n, (tokens, chunks) in enumerate([(90, 1), (64, 3)]):
            res = await sched.reserve(f"req-{n}", tokens, prefill_layout=layout_pb(LAYOUT.format(bs=16)))
            assert res.engine_id == "D1" and res.state == State.RESERVED
            decode.client.subscribe(res.id)
            cache_ids = prefill.cache_blocks_for(tokens)
            alloc = prefill.begin(f"req-{n}", res.id, record_of(res), res.block_ids, tokens)
            prefill.push_all(f"req-{n}", alloc, res.block_size, tokens, cache_ids, chunks=chunks)
            assert wait_state(decode.client, res.id).state == "LANDED"
            assert wait_state(prefill.client, res.id).state == "PUSHED"
            # The decode sidecar's report moves the reservation in etcd (the prefill's
            # PUSHING report may or may not come first: both orders are legal).
            landed = await etcd.wait_state(res.id, State.LANDED)
            assert landed.blocks == list(res.block_ids)
            pushes.append((list(res.block_ids),
                           lambda layer, ids=cache_ids, t=tokens: prefill.tokens(ids, layer, t), tokens))
            # Byte-exact in the reserved blocks, every other byte of the landing pool untouched.
            assert np.array_equal(decode.mem, decode.expected_image(pushes))
            assert decode.client.consumed(res.id).state == "CONSUMED"
            consumed = await etcd.wait_state(res.id, State.CONSUMED)
            assert consumed.ended_ms > 0
        stats = pre.client().admin("service")
        # The peer was looked up through the registry once and its metadata loaded once.
        assert stats["resolves"] == 1 and stats["peer_loads"] == 1, stats
        assert stats["staging_allocations"] == 0
        report = await settle(stack.etcd.endpoint, quiet=True)
        assert report.engines["D1"].free == set(range(64))


@pytest.mark.parametrize("p_block,d_block", [(16, 32), (32, 16)])
async def test_reblocking_through_the_control_plane_is_exact(stack, p_block, d_block):
    async with sidecar_pair(stack, p_block, d_block, landing_blocks=32) as (_, sched, etcd, prefill, decode):
        tokens = 150  # a multiple of neither block size
        res = await sched.reserve("rb", tokens, prefill_layout=layout_pb(LAYOUT.format(bs=p_block)))
        assert res.block_size == d_block and len(res.block_ids) == -(-tokens // d_block)
        decode.client.subscribe(res.id)
        cache_ids = prefill.cache_blocks_for(tokens)
        alloc = prefill.begin("rb", res.id, record_of(res), res.block_ids, tokens)
        prefill.push_all("rb", alloc, d_block, tokens, cache_ids, chunks=2)
        assert wait_state(decode.client, res.id).state == "LANDED"
        expected = decode.expected_image([(list(res.block_ids), lambda l: prefill.tokens(cache_ids, l, tokens),
                                           tokens)])
        assert np.array_equal(decode.mem, expected)
        await etcd.wait_state(res.id, State.LANDED)


async def test_a_reservation_named_for_an_earlier_life_of_the_prefill_sidecar_is_not_pushed_into(stack):
    """The control plane fails what a dead prefill life was named for, at once; its queued
    requests reaching the sidecar's next life must write nothing into those blocks."""
    from kvpush.connector.sidecar_client import ChannelError
    async with sidecar_pair(stack) as (pre, sched, etcd, prefill, decode):
        res = await sched.reserve("named", 40, prefill_engine_id="P1")
        mine = res.prefill_engine_incarnation
        assert mine
        with pytest.raises(ChannelError, match="which ended"):
            prefill.begin("named", res.id, record_of(res), res.block_ids, 40, prefill_incarnation="an-earlier-life")
        assert np.array_equal(decode.mem, decode.expected_image([]))  # not a byte written
        assert pre.client().admin("service")["staging_allocations"] == 0
        alloc = prefill.begin("named-2", res.id, record_of(res), res.block_ids, 40, prefill_incarnation=mine)
        assert alloc is not None  # its own life's: begun
        prefill.client.end_request("named-2", aborted=True, reason="test over")  # the push fails the reservation
        await etcd.wait_state(res.id, State.FAILED)
        await settle(stack.etcd.endpoint, quiet=True)


async def test_a_reservation_that_expired_before_its_prefill_began_is_not_pushed_into(stack):
    """Its landing blocks go back to the pool at the deadline (after the quarantine,
    to other requests): a prefill that starts late must write nothing into them."""
    from kvpush.connector.sidecar_client import ChannelError
    async with sidecar_pair(stack) as (pre, sched, etcd, prefill, decode):
        res = await sched.reserve("late", 40, prefill_engine_id="P1", deadline_ms=1000)
        await etcd.wait_state(res.id, State.EXPIRED, timeout_s=20)
        # As the connector sends it (the deadline in BEGIN), and without the deadline (the
        # sidecar heard the expiry by watch): refused either way.
        with pytest.raises(ChannelError, match="past its deadline"):
            prefill.begin("late", res.id, record_of(res), res.block_ids, 40, deadline_unix_ms=res.deadline_unix_ms)
        with pytest.raises(ChannelError, match="has ended"):
            prefill.begin("late-2", res.id, record_of(res), res.block_ids, 40)
        assert np.array_equal(decode.mem, decode.expected_image([]))  # not a byte written
        assert pre.client().admin("service")["staging_allocations"] == 0
        await settle(stack.etcd.endpoint, quiet=True)

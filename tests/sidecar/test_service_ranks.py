"""Tensor-parallel engines through real ``kvpush sidecar`` processes, real NIXL and a real
control plane over etcd: one sidecar per engine with a pool per rank, each rank of each
engine played by its own channel (as each vLLM worker process has its own). Prefill ranks
stage and push only their heads; every decode rank's landing blocks hold exactly its
heads of the model's KV; the reservation is CONSUMED in etcd once every decode rank has
copied its share; a rank's channel that closes mid-push fails the reservation and leaves
nothing reserved."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from kvpush.channel import frames as F
from kvpush.channel import reblock
from kvpush.connector.sidecar_client import ChannelError
from kvpush.channel.head_plan import plan_heads
from kvpush.channel.attach import attach_pool
from kvpush.channel.pool import PoolDescription
from kvpush.contract.layout import KvLayout
from kvpush.contract.states import State
from kvpush.contract.target import PushTarget
from tests.sidecar.engines import wait_state
from tests.sidecar.service_helpers import Etcd, Scheduler, layout_pb, settle
from tests.polling import until

pytestmark = pytest.mark.timeout(90)

HEADS, TOKENS = 4, 150


def layout_text(tp: int, block: int) -> str:
    return f"layers=3,block={block},heads={HEADS},dim=16,dtype=float16,tp={tp}"


class Rank:
    """One rank of an engine: its own channel to the engine's sidecar, its rank's pool."""

    def __init__(self, sidecar, rank: int):
        self.rank = rank
        self.client = sidecar.client()
        hello = self.client.hello(name=f"test-rank-{rank}", rank=rank)
        assert hello["rank"] == rank
        self.info = PoolDescription.from_dict(hello["pool"])
        self.layout = self.info.layout
        self.memory = attach_pool(self.info)

    def close(self) -> None:
        self.client.close()
        self.memory.close()


class PrefillRanks:
    def __init__(self, sidecar, tp: int, seed: int = 1):
        self.ranks = [Rank(sidecar, r) for r in range(tp)]
        lo = self.ranks[0].layout
        rng = np.random.default_rng(seed)
        width = lo.head_dim * lo.itemsize
        self.kv = [rng.integers(0, 256, (2, TOKENS, HEADS, width), dtype=np.uint8) for _ in range(lo.num_layers)]

    def begin(self, request_id: str, res) -> dict:
        target = PushTarget.from_proto(res)
        return {r.rank: r.client.begin_shares(F.BeginRequest(request_id, target)) for r in reversed(self.ranks)}

    def push_layer(self, request_id: str, allocs: dict, rank: Rank, layer: int, block_size: int) -> None:
        mine = self.kv[layer][:, :, list(rank.layout.rank_heads(rank.rank))]
        for alloc in allocs[rank.rank]:
            geom = reblock.share_geometry(rank.layout, alloc, block_size, TOKENS)
            reblock.stage_tokens(rank.memory.host_view(), alloc, geom, layer, reblock.share_heads(mine, alloc),
                                 0, TOKENS)
        rank.client.push(request_id, layer)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


@contextlib.asynccontextmanager
async def ranked(stack, p_tp: int, d_tp: int):
    dec = stack.sidecar("decode", "D1", layout_text(d_tp, 16), 64)
    pre = stack.sidecar("prefill", "P1", layout_text(p_tp, 32), 128)
    dec.ready(), pre.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    prefill, decode = PrefillRanks(pre, p_tp), [Rank(dec, r) for r in range(d_tp)]
    try:
        yield pre, dec, sched, etcd, prefill, decode
    finally:
        prefill.close()
        for r in decode:
            r.close()
        await sched.close(), await etcd.close()


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2), (2, 2)])
async def test_each_rank_pushes_its_heads_and_every_decode_rank_holds_its_own(stack, p_tp, d_tp):
    async with ranked(stack, p_tp, d_tp) as (pre, dec, sched, etcd, prefill, decode):
        src = KvLayout.parse(layout_text(p_tp, 32))
        res = await sched.reserve("tp-1", TOKENS, prefill_layout=layout_pb(layout_text(p_tp, 32)))
        assert res.engine_id == "D1" and res.decode_tp_size == d_tp
        decode[0].client.subscribe(res.id)
        allocs = prefill.begin("tp-1", res)
        assert sum(len(a) for a in allocs.values()) == len(plan_heads(src, decode[0].layout).shares)
        for layer in range(src.num_layers):
            for rank in prefill.ranks:  # ranks interleave, as workers do
                prefill.push_layer("tp-1", allocs, rank, layer, res.block_size)
        for rank in prefill.ranks:
            rank.client.end_request("tp-1")
        assert wait_state(decode[0].client, res.id).state == "LANDED"
        assert wait_state(prefill.ranks[0].client, res.id).state == "PUSHED"
        await etcd.wait_state(res.id, State.LANDED)
        plan = plan_heads(src, decode[0].layout)
        nb = len(res.block_ids)
        for d, rank in enumerate(decode):
            pool = rank.memory.host_view()
            lo = rank.layout
            stride = 64 * lo.block_layer_bytes
            for layer in range(src.num_layers):
                blocks = pool[layer * stride:(layer + 1) * stride].reshape(64, -1)[list(res.block_ids)]
                canon = plan.unshare(d, np.ascontiguousarray(blocks).reshape(-1), TOKENS)
                got = canon.transpose(1, 0, 2, 3, 4).reshape(2, nb * lo.block_size, lo.local_kv_heads, -1)
                want = prefill.kv[layer][:, :, list(lo.rank_heads(d))]
                np.testing.assert_array_equal(got[:, :TOKENS], want, err_msg=f"decode rank {d} layer {layer}")
        # CONSUMED in etcd only once every decode rank has copied its share out; the engine's
        # scheduler (a channel naming no rank) gives back the whole engine's at once.
        if (p_tp, d_tp) == (1, 2):
            scheduler = dec.client()
            scheduler.hello(name="vllm-scheduler")
            assert scheduler.consumed(res.id).state == "CONSUMED"
            scheduler.close()
        else:
            for rank in decode[:-1]:
                assert rank.client.consumed(res.id).state == "LANDED"
            assert decode[-1].client.consumed(res.id).state == "CONSUMED"
        await etcd.wait_state(res.id, State.CONSUMED)
        stats = pre.client().admin("stats")
        assert stats["staging_allocations"] == 0, stats
        await settle(stack.etcd.endpoint, quiet=True)


async def test_a_ranks_channel_closing_mid_push_fails_the_reservation_and_frees_it(stack):
    async with ranked(stack, 2, 1) as (pre, dec, sched, etcd, prefill, decode):
        res = await sched.reserve("tp-kill", TOKENS, prefill_layout=layout_pb(layout_text(2, 32)))
        decode[0].client.subscribe(res.id)
        allocs = prefill.begin("tp-kill", res)
        prefill.push_layer("tp-kill", allocs, prefill.ranks[0], 0, res.block_size)
        prefill.push_layer("tp-kill", allocs, prefill.ranks[1], 0, res.block_size)
        prefill.ranks[1].client.close()  # the worker process of rank 1 is gone
        event = wait_state(prefill.ranks[0].client, res.id)
        assert event.state == "FAILED" and "engine connection closed" in event.reason, event
        failed = await etcd.wait_state(res.id, State.FAILED)
        assert "closed" in failed.reason
        assert wait_state(decode[0].client, res.id).state in ("FAILED", "CANCELLED")
        # (staging is freed once the last write already posted stops reading it, which may
        # be a moment after the FAILED: the code frees it then, not at the failure)
        admin = pre.client()
        await until(lambda: admin.admin("stats")["staging_allocations"] == 0, what="staging freed")
        report = await settle(stack.etcd.endpoint, quiet=True)
        assert report.engines["D1"].free == set(range(64))


async def test_a_rank_outside_the_engines_tp_is_refused_at_hello(stack):
    pre = stack.sidecar("prefill", "P1", layout_text(2, 32), 64)
    pre.ready()
    client = pre.client()
    try:
        with pytest.raises(ChannelError, match="rank 2: sidecar P1 serves an engine of tp_size=2"):
            client.hello(name="test-rank", rank=2)
    finally:
        client.close()

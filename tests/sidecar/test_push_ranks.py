"""Tensor-parallel pushes through the pusher and the landing table, on the in-process
fake transport with real bytes: every prefill rank begins, stages its head shares and
pushes its layers on its own, in any order; one LANDED notice follows every rank's
writes; each decode rank's landing blocks, read back through the head plan, hold exactly
that rank's heads of the model's KV; the blocks are CONSUMED once every decode rank has
copied its share."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from kvpush.channel import reblock
from kvpush.channel.head_plan import plan_heads
from kvpush.contract.engine import EngineRecord
from kvpush.contract.layout import KvLayout
from kvpush.contract.states import LandingState, PushState
from kvpush.contract.target import PushTarget
from kvpush.contract.v1 import types_pb2
from kvpush.sidecar import notify
from kvpush.sidecar.landing import LandingTable
from kvpush.sidecar.peers import PeerRegistry
from kvpush.sidecar.pools import LandingPool, StagingPool
from kvpush.sidecar.progress import ProgressDriver
from kvpush.sidecar.push import PushConfig, PushEngine, PushError
from kvpush.sidecar.transport.fake import FakeFabric

TOKENS, BLOCKS = 45, (5, 6, 2)  # 45 tokens: 2 blocks of 16 and a partial one; a run broken


def layout(heads: int, tp: int, block: int = 16) -> KvLayout:
    return KvLayout(num_layers=3, block_size=block, num_kv_heads=heads, head_dim=4, dtype="float16", tp_size=tp)


class RankedPair:
    """A prefill engine of TP ``p_tp`` (a staging pool per rank) pushing into a decode
    engine of TP ``d_tp`` (a landing pool per rank) over one fake fabric."""

    def __init__(self, heads: int, p_tp: int, d_tp: int, p_block: int = 32):
        self.src, self.dst = layout(heads, p_tp, p_block), layout(heads, d_tp)
        self.fabric = FakeFabric()
        self.staging = [StagingPool.create_shm(f"ranks-test.staging.r{r}", self.src, 64) for r in range(p_tp)]
        self.landing = [LandingPool.create_shm(f"ranks-test.landing.r{r}", self.dst, 16) for r in range(d_tp)]
        self.tp, self.td = self.fabric.transport("P.1"), self.fabric.transport("D.1")
        for pool in self.staging:
            self.tp.register(pool.memory)
        for pool in self.landing:
            self.td.register(pool.memory)
        self.pdriver, self.ddriver = ProgressDriver(self.tp), ProgressDriver(self.td)
        self.table = LandingTable(self.landing, "inc-d", self.ddriver)
        self.ddriver.on_notif = self.table.handle_notif
        self.peers = PeerRegistry(self.tp)
        self.peers.add(EngineRecord(
            engine_id="D", role=types_pb2.DECODE, layout=self.dst, incarnation="inc-d", nixl_agent="D.1",
            nixl_metadata=self.td.metadata(), num_blocks=16, pool_base_address=self.landing[0].base_address,
            pool_size_bytes=self.landing[0].size_bytes,
            rank_pools=tuple((p.base_address, 0) for p in self.landing) if d_tp > 1 else ()))
        self.outcomes = []
        self.pusher = PushEngine(self.tp, self.pdriver, self.staging, self.src, self.peers, PushConfig(hold_s=0),
                                 self.outcomes.append)
        rng = np.random.default_rng(heads * 100 + p_tp * 10 + d_tp)
        width = self.src.head_dim * self.src.itemsize
        self.kv = [rng.integers(0, 256, (2, TOKENS, heads, width), dtype=np.uint8) for _ in range(self.src.num_layers)]
        self.target = PushTarget("res-1", "D", "inc-d", BLOCKS, 16, TOKENS, tp_size=d_tp)

    def rank_tokens(self, rank: int, layer: int) -> np.ndarray:
        """What prefill rank ``rank``'s cache holds of a layer: its heads, as vLLM splits them."""
        return self.kv[layer][:, :, list(self.src.rank_heads(rank))]

    def run(self, order: random.Random) -> dict:
        """Every rank begins, stages and pushes every layer, interleaved in a random order."""
        allocs = {}
        for rank in order.sample(range(self.src.tp_size), self.src.tp_size):
            allocs[rank] = self.pusher.begin("req-1", self.target, owner=f"conn-{rank}", rank=rank)
        steps = [(layer, rank) for layer in range(self.src.num_layers) for rank in range(self.src.tp_size)]
        order.shuffle(steps)
        done = {rank: 0 for rank in allocs}  # each rank's layers go in order, ranks interleave
        for _, rank in steps:
            layer = done[rank]
            done[rank] += 1
            for alloc in allocs[rank]:
                geom = reblock.share_geometry(self.src, alloc, 16, TOKENS)
                tokens = reblock.share_heads(self.rank_tokens(rank, layer), alloc)
                reblock.stage_tokens(self.staging[rank].memory.host_view(), alloc, geom, layer, tokens, 0, TOKENS)
            self.pusher.push("req-1", layer, rank=rank)
        for rank in allocs:
            self.pusher.end("req-1", rank=rank)
        return allocs

    def settle(self) -> None:
        for _ in range(20):
            for write in self.fabric.pending:
                self.fabric.complete(write)
            self.pdriver.poll_once()
            self.ddriver.poll_once()

    def landed(self, rank: int, layer: int) -> np.ndarray:
        """Decode rank ``rank``'s heads of ``layer`` as ``(parts, tokens, heads, width)``."""
        plan = plan_heads(self.src, self.dst)
        blocks = self.landing[rank].blocks_view(layer)[list(BLOCKS)]
        canon = plan.unshare(rank, np.ascontiguousarray(blocks).reshape(-1), TOKENS)
        return canon.transpose(1, 0, 2, 3, 4).reshape(2, -1, *canon.shape[3:])[:, :TOKENS]

    def close(self) -> None:
        for pool in self.staging + self.landing:
            pool.close()


PAIRS = [(4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 4, 2), (4, 1, 4), (8, 4, 8), (2, 4, 1), (2, 1, 4), (6, 3, 2)]


@pytest.mark.parametrize("heads, p_tp, d_tp", PAIRS)
def test_every_rank_pushes_its_heads_into_the_decode_ranks_that_hold_them(heads, p_tp, d_tp):
    pair = RankedPair(heads, p_tp, d_tp)
    try:
        allocs = pair.run(random.Random(heads + p_tp + d_tp))
        plan = plan_heads(pair.src, pair.dst)
        assert sum(len(a) for a in allocs.values()) == len(plan.shares)
        # Replicated heads are sent by one holder: the others stage nothing.
        assert all(bool(allocs[r]) == bool(plan.from_rank(r)) for r in range(p_tp))
        landed = [w for w in pair.fabric.pending if w.notif]
        assert not landed, "the LANDED notice waits for every rank's writes"
        pair.settle()
        assert pair.table.query("res-1").state == LandingState.LANDED
        event = pair.table.query("res-1")
        assert event.src_tp == p_tp
        for d in range(d_tp):
            for layer in range(pair.src.num_layers):
                want = pair.kv[layer][:, :, list(pair.dst.rank_heads(d))]
                np.testing.assert_array_equal(pair.landed(d, layer), want, err_msg=f"decode rank {d} layer {layer}")
        assert [o.state for o in pair.outcomes] == [PushState.PUSHED]
        assert all(pool.live_allocations == 0 for pool in pair.staging)
        # Consumed once every decode rank copied its share out (or at once when the engine's
        # scheduler, rank None, gives it back: it will not be loaded).
        if p_tp == 1:
            assert pair.table.consume("res-1", None)
        for d in range(d_tp if p_tp > 1 else 0):
            assert pair.table.query("res-1").state == LandingState.LANDED
            assert pair.table.consume("res-1", d)
        assert pair.table.query("res-1").state == LandingState.CONSUMED
    finally:
        pair.close()


def test_one_transfer_per_rank_and_layer_and_the_final_once_every_rank_is_done():
    pair = RankedPair(4, 2, 2)
    try:
        pair.run(random.Random(3))
        writes = pair.fabric.pending
        # Two ranks x three layers, each written at once: LANDED waits for all of them.
        assert len(writes) == 6 and not any(w.notif for w in writes)
        pair.settle()
        # ... carried by a seventh, tiny write (the last piece's last bytes again).
        assert pair.pusher.counters["transfers"] == 7
        # Equal TP, as without TP: per rank and layer one run of whole blocks (5-6) and the
        # K and V of the partial last block (2); and the notice's one.
        assert pair.pusher.counters["descriptors"] == 6 * 3 + 1
    finally:
        pair.close()


def test_a_rank_that_ends_early_fails_the_request_and_frees_every_ranks_staging():
    pair = RankedPair(4, 2, 1)
    try:
        a0 = pair.pusher.begin("req-1", pair.target, owner="conn-0", rank=0)
        pair.pusher.begin("req-1", pair.target, owner="conn-1", rank=1)
        with pytest.raises(PushError, match="already being pushed"):
            pair.pusher.begin("req-1", pair.target, owner="conn-0", rank=0)
        geom = reblock.share_geometry(pair.src, a0[0], 16, TOKENS)
        reblock.stage_tokens(pair.staging[0].memory.host_view(), a0[0], geom, 0, pair.rank_tokens(0, 0), 0, TOKENS)
        pair.pusher.push("req-1", 0, rank=0)
        pair.pusher.end("req-1", rank=1)  # rank 1 says it is done with nothing pushed
        pair.settle()
        assert [o.state for o in pair.outcomes] == [PushState.FAILED]
        assert "(rank 1)" in pair.outcomes[0].reason
        assert all(pool.live_allocations == 0 for pool in pair.staging)
        assert pair.table.query("res-1").state == LandingState.FAILED  # told by ABORT
    finally:
        pair.close()


def test_a_ranks_connection_closing_fails_the_request():
    pair = RankedPair(4, 2, 2)
    try:
        pair.pusher.begin("req-1", pair.target, owner="conn-0", rank=0)
        pair.pusher.begin("req-1", pair.target, owner="conn-1", rank=1)
        pair.pusher.drop_owner("conn-1")
        pair.settle()
        assert [o.state for o in pair.outcomes] == [PushState.FAILED]
        assert all(pool.live_allocations == 0 for pool in pair.staging)
    finally:
        pair.close()


def test_a_decode_engine_of_another_tp_than_the_reservation_says_is_refused():
    pair = RankedPair(4, 2, 2)
    try:
        wrong = dataclasses.replace(pair.target, tp_size=1)
        with pytest.raises(PushError, match="says engine D has tp 1, its record 2"):
            pair.pusher.begin("req-1", wrong, owner="conn-0", rank=0)
        pair.settle()
        assert [o.state for o in pair.outcomes] == [PushState.FAILED]  # refused before any staging
        assert all(pool.live_allocations == 0 for pool in pair.staging)
        with pytest.raises(PushError, match="tp_size=3 cannot split num_kv_heads=4"):
            pair.pusher.begin("req-2", dataclasses.replace(pair.target, tp_size=3), rank=0)
    finally:
        pair.close()


def test_a_landed_notice_from_a_prefill_tp_that_cannot_hold_the_heads_fails():
    pair = RankedPair(4, 1, 1)
    try:
        bad = notify.PushNotice(notify.LANDED, "res-9", "inc-d", (1,), 16, 10, src_tp=3)
        pair.table.handle_notif("P.1", notify.encode(bad))
        event = pair.table.query("res-9")
        assert event.state == LandingState.FAILED and "tp 3 cannot hold our 4 KV heads" in event.reason
    finally:
        pair.close()

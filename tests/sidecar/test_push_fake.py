"""The push and landing logic against the in-process fake transport: the writes complete
in whatever order the test says, and a write can fail, with real bytes moved."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvpush.channel import reblock
from kvpush.channel.geometry import DestGeometry
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
from kvpush.sidecar.push import TAIL_BYTES, PushConfig, PushEngine
from kvpush.sidecar.transport.fake import FakeFabric

LAYOUT = KvLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
BLOCKS, TOKENS = (3, 7, 8), 40


MOVED = PushTarget("res-2", "D2", "inc-d2", (9, 1, 4), LAYOUT.block_size, TOKENS)  # D's reservation, moved to D2


class Pair:
    """A prefill pusher and a decode landing table joined by a fake fabric (and a second
    decode engine, for relocations)."""

    def __init__(self, hold_s: float = 0.0):
        self.fabric = FakeFabric()
        self.staging = StagingPool.create_shm("fake-test.staging", LAYOUT, 16)
        self.landing_pool = LandingPool.create_shm("fake-test.landing", LAYOUT, 16)
        self.tp, self.td = self.fabric.transport("P.1"), self.fabric.transport("D.1")
        self.tp.register(self.staging.memory)
        self.td.register(self.landing_pool.memory)
        self.pdriver, self.ddriver = ProgressDriver(self.tp), ProgressDriver(self.td)
        self.landing = LandingTable([self.landing_pool], "inc-d", self.ddriver)
        self.ddriver.on_notif = self.landing.handle_notif
        peers = PeerRegistry(self.tp)
        peers.add(EngineRecord(engine_id="D", role=types_pb2.DECODE, layout=LAYOUT, incarnation="inc-d",
                               nixl_agent="D.1", nixl_metadata=self.td.metadata(), num_blocks=16,
                               pool_base_address=self.landing_pool.base_address,
                               pool_size_bytes=self.landing_pool.size_bytes))
        self.outcomes = []
        self.holdable = hold_s > 0
        self.pusher = PushEngine(self.tp, self.pdriver, [self.staging], LAYOUT, peers, PushConfig(hold_s=hold_s),
                                 self.outcomes.append)
        # A second decode engine, where a relocation sends the KV when the first one fails.
        self.landing_pool2 = LandingPool.create_shm("fake-test.landing2", LAYOUT, 16)
        self.td2 = self.fabric.transport("D2.1")
        self.td2.register(self.landing_pool2.memory)
        self.ddriver2 = ProgressDriver(self.td2)
        self.landing2 = LandingTable([self.landing_pool2], "inc-d2", self.ddriver2)
        self.ddriver2.on_notif = self.landing2.handle_notif
        peers.add(EngineRecord(engine_id="D2", role=types_pb2.DECODE, layout=LAYOUT, incarnation="inc-d2",
                               nixl_agent="D2.1", nixl_metadata=self.td2.metadata(), num_blocks=16,
                               pool_base_address=self.landing_pool2.base_address,
                               pool_size_bytes=self.landing_pool2.size_bytes))
        self.geom = DestGeometry.for_layout(LAYOUT, LAYOUT.block_size, TOKENS)
        rng = np.random.default_rng(7)
        width = LAYOUT.head_dim * LAYOUT.itemsize
        self.tokens = [rng.integers(0, 256, (LAYOUT.kv_parts, TOKENS, LAYOUT.num_kv_heads, width), dtype=np.uint8)
                       for _ in range(LAYOUT.num_layers)]

    def begin_and_push_all(self):
        (alloc,) = self.pusher.begin("req-1", PushTarget("res-1", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS),
                                  holdable=self.holdable)
        for layer, tokens in enumerate(self.tokens):
            reblock.stage_tokens(self.staging.memory.host_view(), alloc, self.geom, layer, tokens, 0, TOKENS)
            self.pusher.push("req-1", layer)
        return alloc

    def poll(self):
        self.pdriver.poll_once()
        self.ddriver.poll_once()
        self.ddriver2.poll_once()

    def landed_bytes_match(self, pool=None, blocks=BLOCKS) -> bool:
        pool = pool or self.landing_pool
        return all(np.array_equal(reblock.gather_tokens(pool.blocks_view(layer), blocks, 0, TOKENS),
                                  self.tokens[layer]) for layer in range(LAYOUT.num_layers))

    def state(self) -> LandingState:
        return self.landing.query("res-1").state

    def close(self):
        self.staging.close()
        self.landing_pool.close()
        self.landing_pool2.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_the_landed_notice_never_overtakes_an_earlier_write(pair):
    pair.begin_and_push_all()
    pair.poll()  # BEGIN hint: the decode side polls hot
    assert pair.state() == LandingState.PUSHING
    earlier = pair.fabric.pending
    # Every layer is staged and written at once; LANDED is held while any write is in
    # flight, then carried by a rewrite of the last piece's last bytes.
    assert len(earlier) == LAYOUT.num_layers and not any(w.notif for w in earlier)
    assert pair.pusher.state("req-1") == PushState.FINALIZING
    for write in reversed(earlier):  # the most adversarial order: the latest write first
        assert not pair.fabric.pending[-1].notif  # nothing carries LANDED while a write is pending
        pair.fabric.complete(write)
        pair.poll()
        assert pair.state() == LandingState.PUSHING
    final = pair.fabric.pending
    assert len(final) == 1 and final[0].notif and notify.decode(final[0].notif).kind == notify.LANDED
    assert pair.landed_bytes_match()  # every byte is there before the notice can be
    pair.fabric.complete(final[0])
    pair.poll()
    assert pair.state() == LandingState.LANDED and pair.landed_bytes_match()
    assert [o.state for o in pair.outcomes] == [PushState.PUSHED]
    kv = LAYOUT.num_layers * TOKENS * LAYOUT.block_layer_bytes // LAYOUT.block_size
    assert pair.outcomes[0].bytes_pushed == kv + TAIL_BYTES  # (the notice's rewrite: the same bytes again)
    assert pair.staging.live_allocations == 0


def test_a_failed_write_fails_the_push_and_the_landing_and_frees_staging_only_when_no_write_reads_it(pair):
    pair.begin_and_push_all()
    first, second, third, fourth = pair.fabric.pending
    pair.fabric.complete(first)
    pair.fabric.complete(fourth)
    pair.fabric.fail(second)
    pair.poll()
    assert [o.state for o in pair.outcomes] == [PushState.FAILED]
    assert "failed" in pair.outcomes[0].reason
    # The decode side heard ABORT: the engine waiting for it recomputes at once.
    assert pair.state() == LandingState.FAILED and "aborted" in pair.landing.query("res-1").reason
    # The third write still reads staging: the allocation is kept until it is released.
    assert pair.staging.live_allocations == 1
    pair.fabric.complete(third)
    pair.poll()
    assert pair.staging.live_allocations == 0
    assert not any(w.notif for w in pair.fabric.writes)  # LANDED was never sent
    assert pair.state() == LandingState.FAILED  # and a late write changes nothing


def test_a_reservation_past_its_deadline_is_never_pushed_into(pair):
    """Its blocks may be free, or another request's once their quarantine is over."""
    late = PushTarget("res-1", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS,
                      deadline_unix_ms=int(time.time() * 1000) - 1)
    with pytest.raises(Exception, match="past its deadline"):
        pair.pusher.begin("req-1", late)
    assert [o.state for o in pair.outcomes] == [PushState.FAILED] and "deadline" in pair.outcomes[0].reason
    assert pair.staging.live_allocations == 0 and not pair.fabric.writes


def test_a_peer_that_left_the_fabric_fails_the_push_and_is_not_tried_again(pair):
    del pair.fabric.transports["D.1"]
    (alloc,) = pair.pusher.begin("req-1", PushTarget("res-1", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS))
    reblock.stage_tokens(pair.staging.memory.host_view(), alloc, pair.geom, 0, pair.tokens[0], 0, TOKENS)
    pair.pusher.push("req-1", 0)
    assert [o.state for o in pair.outcomes] == [PushState.FAILED]
    assert pair.staging.live_allocations == 0
    with pytest.raises(Exception, match="gone"):
        pair.pusher.begin("req-2", PushTarget("res-2", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS))


def complete_all(pair, receiver: str = "") -> None:
    for _ in range(LAYOUT.num_layers + 1):  # the final write is posted once the others are done
        for w in pair.fabric.pending:
            if not receiver or w.receiver == receiver:
                pair.fabric.complete(w)
        pair.poll()


def test_staging_is_held_after_the_push_until_the_kv_is_consumed():
    pair = Pair(hold_s=5.0)
    try:
        pair.begin_and_push_all()
        complete_all(pair)
        assert [o.state for o in pair.outcomes] == [PushState.PUSHED]
        assert pair.staging.live_allocations == 1 and len(pair.pusher.held) == 1 and pair.pusher.active == 0
        assert pair.pusher.live_reservations() == ["res-1"]  # checked after a watch break, like a push
        assert pair.pusher.release_held("res-1")
        assert pair.staging.live_allocations == 0 and len(pair.pusher.held) == 0
        assert pair.pusher.relocate("res-1", MOVED).startswith("no staged KV")
    finally:
        pair.close()


def test_a_push_whose_decode_engine_died_after_it_landed_is_pushed_again_from_staging():
    pair = Pair(hold_s=5.0)
    try:
        pair.begin_and_push_all()
        complete_all(pair)
        assert pair.state() == LandingState.LANDED
        # D died before loading it: the control plane moved the reservation to D2.
        assert pair.pusher.relocate("res-1", MOVED) == ""
        assert {w.receiver for w in pair.fabric.pending} == {"D2.1"}
        complete_all(pair)
        assert pair.landing2.query("res-2").state == LandingState.LANDED
        assert pair.landed_bytes_match(pair.landing_pool2, MOVED.block_ids)
        assert [(o.reservation_id, o.state) for o in pair.outcomes] == [("res-1", PushState.PUSHED),
                                                                       ("res-2", PushState.PUSHED)]
        assert pair.pusher.counters["relocated"] == 1
        assert pair.pusher.release_held("res-2") and pair.staging.live_allocations == 0
    finally:
        pair.close()


def test_a_push_whose_decode_engine_dies_mid_push_keeps_staging_and_finishes_on_the_new_engine():
    pair = Pair(hold_s=5.0)
    try:
        (alloc,) = pair.pusher.begin("req-1", PushTarget("res-1", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS),
                                  holdable=True)

        def stage(layer):
            reblock.stage_tokens(pair.staging.memory.host_view(), alloc, pair.geom, layer, pair.tokens[layer], 0,
                                 TOKENS)
            pair.pusher.push("req-1", layer)
        stage(0)
        stage(1)
        first, second = pair.fabric.pending
        pair.fabric.complete(first)
        pair.fabric.fail(second)  # D is gone
        pair.poll()
        assert [o.state for o in pair.outcomes] == [PushState.FAILED]
        # The engine goes on staging layers as it computes them; nothing is written.
        stage(2)
        assert not pair.fabric.pending
        assert pair.pusher.relocate("res-1", MOVED) == ""  # moved while prefill still runs
        stage(3)
        pair.pusher.end("req-1")
        complete_all(pair, "D2.1")
        assert pair.landing2.query("res-2").state == LandingState.LANDED
        assert pair.landed_bytes_match(pair.landing_pool2, MOVED.block_ids)
        assert [o.state for o in pair.outcomes] == [PushState.FAILED, PushState.PUSHED]
    finally:
        pair.close()


def test_held_staging_is_freed_for_new_requests_refused_when_it_does_not_fit_and_cancelled_with_its_reservation():
    pair = Pair(hold_s=5.0)
    try:
        pair.begin_and_push_all()
        complete_all(pair)
        assert len(pair.pusher.held) == 1
        # A target of another size is not the staged request.
        wrong = PushTarget("res-9", "D2", "inc-d2", (1, 2, 4, 5), LAYOUT.block_size, TOKENS + 16)
        assert "does not match" in pair.pusher.relocate("res-1", wrong)
        # New requests take all of staging: the held one makes room rather than refusing them.
        for i in range(pair.staging.num_units // len(BLOCKS)):
            pair.pusher.begin(f"new-{i}", PushTarget(f"n-{i}", "D2", "inc-d2", BLOCKS, LAYOUT.block_size, TOKENS))
        assert len(pair.pusher.held) == 0 and pair.pusher.counters["hold_evicted"] == 1
        assert pair.pusher.relocate("res-1", MOVED).startswith("no staged KV")
    finally:
        pair.close()
    pair = Pair(hold_s=5.0)
    try:
        pair.begin_and_push_all()
        complete_all(pair)
        assert not pair.pusher.cancel_reservation("res-1", "reservation FAILED: engine gone", hold=True)
        assert len(pair.pusher.held) == 1  # FAILED: a relocation may come
        assert pair.pusher.cancel_reservation("res-1", "reservation RELEASED")
        assert len(pair.pusher.held) == 0 and pair.staging.live_allocations == 0
    finally:
        pair.close()


async def test_held_staging_is_freed_when_its_time_is_over():
    pair = Pair(hold_s=0.05)
    try:
        pair.begin_and_push_all()
        complete_all(pair)
        assert len(pair.pusher.held) == 1
        await asyncio.sleep(0.2)
        assert len(pair.pusher.held) == 0 and pair.staging.live_allocations == 0
        assert pair.pusher.counters["hold_expired"] == 1
    finally:
        pair.close()


async def test_a_whole_sidecar_pair_runs_on_an_injected_transport(tmp_path):
    from kvpush.contract.states import DECODE, PREFILL
    from kvpush.sidecar.base import SidecarConfig
    from kvpush.sidecar.sidecar import make_sidecar
    from kvpush.sidecar.transport.fake import FakeTransport

    fabric = FakeFabric(auto_complete=True)  # every write lands as it is posted

    def transport(config):
        return fabric.transport(config.agent_name)

    events = []
    decode = make_sidecar(SidecarConfig("dec-f", DECODE, LAYOUT, 16, str(tmp_path / "d.sock")),
                          on_landing_event=events.append, transport_factory=transport)
    prefill = make_sidecar(SidecarConfig("pre-f", PREFILL, LAYOUT, 16, str(tmp_path / "p.sock")),
                           transport_factory=transport)
    await decode.start()
    await prefill.start()
    try:
        assert isinstance(prefill.transport, FakeTransport) and isinstance(decode.transport, FakeTransport)
        prefill.add_peer(decode.engine_record())
        target = PushTarget("res-f", "dec-f", decode.config.incarnation, (2, 3), LAYOUT.block_size, TOKENS - 20)
        (alloc,) = prefill.pusher.begin("req-f", target)
        geom = DestGeometry.for_layout(LAYOUT, LAYOUT.block_size, target.num_tokens)
        width = LAYOUT.head_dim * LAYOUT.itemsize
        data = np.random.default_rng(3).integers(0, 256, (LAYOUT.num_layers, LAYOUT.kv_parts, target.num_tokens,
                                                          LAYOUT.num_kv_heads, width), dtype=np.uint8)
        for layer in range(LAYOUT.num_layers):
            reblock.stage_tokens(prefill.pool.memory.host_view(), alloc, geom, layer, data[layer], 0, target.num_tokens)
            prefill.pusher.push("req-f", layer)
        for _ in range(200):  # the decode sidecar's own progress driver hears LANDED
            if decode.landing.query("res-f").state == LandingState.LANDED:
                break
            await asyncio.sleep(0.01)
        assert decode.landing.query("res-f").state == LandingState.LANDED
        for layer in range(LAYOUT.num_layers):
            got = reblock.gather_tokens(decode.pool.blocks_view(layer), [2, 3], 0, target.num_tokens)
            assert np.array_equal(got, data[layer])
        await asyncio.sleep(0.05)
        assert [e.state for e in events] == [LandingState.LANDED]
    finally:
        await prefill.stop()
        await decode.stop()

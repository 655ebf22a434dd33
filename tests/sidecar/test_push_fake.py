"""The push and landing logic against the in-process fake transport: the writes complete
in whatever order the test says, and a write can fail, with real bytes moved."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engine import reblock
from engine.geometry import DestGeometry
from kvpush.contract.engine import EngineRecord
from kvpush.contract.layout import KvLayout
from kvpush.contract.states import LandingState, PushState
from kvpush.contract.target import PushTarget
from kvpush.contract.v1 import types_pb2
from sidecar import notify
from sidecar.landing import LandingTable
from sidecar.peers import PeerRegistry
from sidecar.pools import LandingPool, StagingPool
from sidecar.progress import ProgressDriver
from sidecar.push import PushConfig, PushEngine
from sidecar.transport.fake import FakeFabric

LAYOUT = KvLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=8, dtype="float32")
BLOCKS, TOKENS = (3, 7, 8), 40


class Pair:
    """A prefill pusher and a decode landing table joined by a fake fabric."""

    def __init__(self):
        self.fabric = FakeFabric()
        self.staging = StagingPool.create_shm("fake-test.staging", LAYOUT, 16)
        self.landing_pool = LandingPool.create_shm("fake-test.landing", LAYOUT, 16)
        self.tp, self.td = self.fabric.transport("P.1"), self.fabric.transport("D.1")
        self.tp.register(self.staging.memory)
        self.td.register(self.landing_pool.memory)
        self.pdriver, self.ddriver = ProgressDriver(self.tp), ProgressDriver(self.td)
        self.landing = LandingTable(self.landing_pool, "inc-d", self.ddriver)
        self.ddriver.on_notif = self.landing.handle_notif
        peers = PeerRegistry(self.tp)
        peers.add(EngineRecord(engine_id="D", role=types_pb2.DECODE, layout=LAYOUT, incarnation="inc-d",
                               nixl_agent="D.1", nixl_metadata=self.td.metadata(), num_blocks=16,
                               pool_base_address=self.landing_pool.base_address,
                               pool_size_bytes=self.landing_pool.size_bytes))
        self.outcomes = []
        self.pusher = PushEngine(self.tp, self.pdriver, self.staging, LAYOUT, peers, PushConfig(),
                                 self.outcomes.append)
        self.geom = DestGeometry.for_layout(LAYOUT, LAYOUT.block_size, TOKENS)
        rng = np.random.default_rng(7)
        width = LAYOUT.head_dim * LAYOUT.itemsize
        self.tokens = [rng.integers(0, 256, (LAYOUT.kv_parts, TOKENS, LAYOUT.num_kv_heads, width), dtype=np.uint8)
                       for _ in range(LAYOUT.num_layers)]

    def begin_and_push_all(self):
        alloc = self.pusher.begin("req-1", PushTarget("res-1", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS))
        for layer, tokens in enumerate(self.tokens):
            reblock.stage_tokens(self.staging.memory.host_view(), alloc, self.geom, layer, tokens, 0, TOKENS)
            self.pusher.push("req-1", layer)
        return alloc

    def poll(self):
        self.pdriver.poll_once()
        self.ddriver.poll_once()

    def landed_bytes_match(self) -> bool:
        return all(np.array_equal(reblock.gather_tokens(self.landing_pool.blocks_view(layer), BLOCKS, 0, TOKENS),
                                  self.tokens[layer]) for layer in range(LAYOUT.num_layers))

    def state(self) -> LandingState:
        return self.landing.query("res-1").state

    def close(self):
        self.staging.close()
        self.landing_pool.close()


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
    # Every layer is staged and pushed, but the final write (the one that carries LANDED)
    # is held while earlier writes are in flight.
    assert len(earlier) == LAYOUT.num_layers - 1 and not any(w.notif for w in earlier)
    assert pair.pusher.state("req-1") == PushState.FINALIZING
    for write in reversed(earlier):  # the most adversarial order: the latest write first
        pair.fabric.complete(write)
        pair.poll()
        assert pair.state() == LandingState.PUSHING
    final = pair.fabric.pending
    assert len(final) == 1 and final[0].notif and notify.decode(final[0].notif).kind == notify.LANDED
    assert not pair.landed_bytes_match()  # the last layer is not there yet
    pair.fabric.complete(final[0])
    pair.poll()
    assert pair.state() == LandingState.LANDED and pair.landed_bytes_match()
    assert [o.state for o in pair.outcomes] == [PushState.PUSHED]
    assert pair.outcomes[0].bytes_pushed == LAYOUT.num_layers * TOKENS * LAYOUT.block_layer_bytes // LAYOUT.block_size
    assert pair.staging.live_allocations == 0


def test_a_failed_write_fails_the_push_and_the_landing_and_frees_staging_only_when_no_write_reads_it(pair):
    pair.begin_and_push_all()
    first, second, third = pair.fabric.pending
    pair.fabric.complete(first)
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


def test_a_peer_that_left_the_fabric_fails_the_push_and_is_not_tried_again(pair):
    del pair.fabric.transports["D.1"]
    alloc = pair.pusher.begin("req-1", PushTarget("res-1", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS))
    reblock.stage_tokens(pair.staging.memory.host_view(), alloc, pair.geom, 0, pair.tokens[0], 0, TOKENS)
    pair.pusher.push("req-1", 0)
    assert [o.state for o in pair.outcomes] == [PushState.FAILED]
    assert pair.staging.live_allocations == 0
    with pytest.raises(Exception, match="gone"):
        pair.pusher.begin("req-2", PushTarget("res-2", "D", "inc-d", BLOCKS, LAYOUT.block_size, TOKENS))


async def test_a_whole_sidecar_pair_runs_on_an_injected_transport(tmp_path):
    from kvpush.contract.states import DECODE, PREFILL
    from sidecar.base import SidecarConfig
    from sidecar.sidecar import make_sidecar
    from sidecar.transport.fake import FakeTransport

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
        alloc = prefill.pusher.begin("req-f", target)
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

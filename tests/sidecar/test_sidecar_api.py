"""The Python API a sidecar main uses, in one process and one event loop:
two sidecars, peers added from ``Engine`` protos, reservations from
``Reservation`` protos, outcomes and landing events through the callbacks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time

import numpy as np
import pytest

from kvpush.contract.layout import KvLayout
from kvpush.contract.v1 import types_pb2
from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from kvpush.channel import reblock
from kvpush.channel.geometry import DestGeometry
from kvpush.contract.states import LandingState, PushState
from kvpush.contract.engine import EngineRecord
from kvpush.contract.target import PushTarget
from kvpush.sidecar.push import PushError
from kvpush.sidecar.base import SidecarBase, SidecarConfig
from kvpush.sidecar.sidecar import make_sidecar
from kvpush.contract.states import DECODE, PREFILL

pytestmark = pytest.mark.timeout(30)

LAYOUT = KvLayout(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype="float16")


class Recorder:
    def __init__(self):
        self.items = []
        self.changed = asyncio.Event()

    def __call__(self, item):
        self.items.append(item)
        self.changed.set()

    async def wait_for(self, predicate, timeout_s=5.0):
        async def loop():
            while True:
                for item in self.items:
                    if predicate(item):
                        return item
                self.changed.clear()
                await self.changed.wait()
        return await asyncio.wait_for(loop(), timeout_s)


def engine_proto(sidecar: SidecarBase) -> types_pb2.Engine:
    engine = dataclasses.replace(sidecar.engine_record(), model="m").to_proto()
    return types_pb2.Engine.FromString(engine.SerializeToString())  # as if through the registry


def reservation(rid: str, engine: types_pb2.Engine, block_ids, num_tokens) -> types_pb2.Reservation:
    return types_pb2.Reservation(id=rid, engine_id=engine.engine_id, engine_incarnation=engine.incarnation,
                                 nixl_agent=engine.nixl_agent, block_ids=block_ids,
                                 block_size=engine.kv_layout.block_size, num_tokens=num_tokens)


def stage_all(prefill: SidecarBase, alloc, target: PushTarget, data: np.ndarray) -> None:
    geom = DestGeometry.for_layout(LAYOUT, target.block_size, target.num_tokens)
    for layer in range(LAYOUT.num_layers):
        reblock.stage_tokens(prefill.pool.memory.host_view(), alloc, geom, layer, data[layer], 0, target.num_tokens)


@pytest.fixture
async def pair(tmp_path):
    outcomes, events = Recorder(), Recorder()
    decode = make_sidecar(SidecarConfig("dec-a", DECODE, LAYOUT, 32, str(tmp_path / "d.sock")), on_landing_event=events)
    prefill = make_sidecar(SidecarConfig("pre-a", PREFILL, LAYOUT, 64, str(tmp_path / "p.sock")),
                      on_push_outcome=outcomes)
    await decode.start()
    await prefill.start()
    try:
        yield prefill, decode, outcomes, events
    finally:
        await prefill.stop()
        await decode.stop()


def random_kv(num_tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYOUT.num_layers, 2, num_tokens, 2, 16), dtype=np.uint8)


async def test_push_through_the_python_api_with_proto_records(pair):
    prefill, decode, outcomes, events = pair
    engine = engine_proto(decode)
    prefill.add_peer(EngineRecord.from_proto(engine))
    target = PushTarget.from_proto(reservation("res-1", engine, [3, 4, 9], 40))
    data = random_kv(40)
    (alloc,) = prefill.pusher.begin("req-1", target)
    stage_all(prefill, alloc, target, data)
    for layer in range(LAYOUT.num_layers):
        prefill.pusher.push("req-1", layer)
    landed = await events.wait_for(lambda e: e.reservation_id == "res-1")
    assert landed.state == LandingState.LANDED and landed.block_ids == (3, 4, 9) and landed.num_tokens == 40
    outcome = await outcomes.wait_for(lambda o: o.reservation_id == "res-1")
    # One write per layer, and a tiny one carrying LANDED when earlier writes were still in
    # flight as the last layer's went out (pushed in a tight loop here: they usually are).
    assert outcome.state == PushState.PUSHED and outcome.transfers in (LAYOUT.num_layers, LAYOUT.num_layers + 1)
    for layer in range(LAYOUT.num_layers):
        got = reblock.gather_tokens(decode.pool.blocks_view(layer), [3, 4, 9], 0, 40)
        assert np.array_equal(got, data[layer])
    assert decode.landing.consume("res-1") and decode.landing.query("res-1").state == LandingState.CONSUMED


async def test_peer_resolved_on_demand_and_replaced_on_new_incarnation(pair, tmp_path):
    prefill, decode, outcomes, events = pair
    asked = []
    current = [engine_proto(decode)]  # what the registry knows of engine dec-a

    async def resolver(engine_id, incarnation):
        asked.append((engine_id, incarnation))
        await asyncio.sleep(0.01)  # a control-plane round trip
        return EngineRecord.from_proto(current[0])

    prefill.peers.resolver = resolver
    engine = engine_proto(decode)
    for n in range(2):  # the second request finds the peer cached: no second lookup, no second load
        target = PushTarget.from_proto(reservation(f"res-{n}", engine, [n * 2, n * 2 + 1], 20))
        (alloc,) = prefill.pusher.begin(f"req-{n}", target)
        stage_all(prefill, alloc, target, random_kv(20, n))
        for layer in range(LAYOUT.num_layers):
            prefill.pusher.push(f"req-{n}", layer)  # queued while resolving, in order
        assert (await outcomes.wait_for(lambda o: o.reservation_id == f"res-{n}")).state == PushState.PUSHED
    assert asked == [("dec-a", engine.incarnation)] and prefill.peers.loads == 1

    # The decode engine restarts: same id, new incarnation, new memory.
    reborn = make_sidecar(SidecarConfig("dec-a", DECODE, LAYOUT, 32, str(tmp_path / "d2.sock")))
    await reborn.start()
    try:
        current[0] = new = engine_proto(reborn)
        # The first reservation naming the new life: looked up once, replaces the old peer.
        target = PushTarget.from_proto(reservation("res-new", new, [7, 8], 20))
        (alloc,) = prefill.pusher.begin("req-new", target)
        stage_all(prefill, alloc, target, random_kv(20, 7))
        for layer in range(LAYOUT.num_layers):
            prefill.pusher.push("req-new", layer)
        assert (await outcomes.wait_for(lambda o: o.reservation_id == "res-new")).state == PushState.PUSHED
        assert asked[-1] == ("dec-a", new.incarnation) and prefill.peers.loads == 2
        got = reblock.gather_tokens(reborn.pool.blocks_view(0), [7, 8], 0, 20)
        assert np.array_equal(got, random_kv(20, 7)[0])
        # A reservation of the old life: looked up, found stale, failed; nothing written.
        stale = PushTarget.from_proto(reservation("res-stale", engine, [0], 5))
        prefill.pusher.begin("req-stale", stale)
        prefill.pusher.push("req-stale", 0)
        failed = await outcomes.wait_for(lambda o: o.reservation_id == "res-stale")
        assert failed.state == PushState.FAILED and "not the current one" in failed.reason
        assert prefill.peers.loads == 2 and prefill.pool.live_allocations == 0
        # Without a resolver the same refusal is immediate.
        prefill.peers.resolver = None
        with pytest.raises(PushError, match="not the current one"):
            prefill.pusher.begin("req-stale2", PushTarget.from_proto(reservation("res-stale2", engine, [0], 5)))
    finally:
        await reborn.stop()


async def test_landed_needs_every_write_and_ignores_other_incarnations(pair):
    prefill, decode, outcomes, events = pair
    engine = engine_proto(decode)
    prefill.add_peer(EngineRecord.from_proto(engine))
    target = PushTarget.from_proto(reservation("res-p", engine, [0, 1], 32))
    (alloc,) = prefill.pusher.begin("req-p", target)
    stage_all(prefill, alloc, target, random_kv(32))
    for layer in range(LAYOUT.num_layers - 1):
        prefill.pusher.push("req-p", layer)
    await asyncio.sleep(0.2)
    assert decode.landing.query("res-p").state == LandingState.PUSHING  # begun, not landed
    assert not events.items
    # A LANDED notice for another incarnation of this engine is ignored.
    from kvpush.sidecar import notify
    decode.landing.handle_notif("x", notify.encode(notify.PushNotice(notify.LANDED, "res-p", "old", (0, 1), 16, 32)))
    assert decode.landing.query("res-p").state == LandingState.PUSHING
    prefill.pusher.push("req-p", LAYOUT.num_layers - 1)
    assert (await events.wait_for(lambda e: e.reservation_id == "res-p")).state == LandingState.LANDED
    # Cancelled locally (deadline) before the push: a late LANDED does not resurrect it.
    decode.landing.cancel("res-late", "deadline")
    target = PushTarget.from_proto(reservation("res-late", engine, [5], 10))
    (alloc,) = prefill.pusher.begin("req-late", target)
    stage_all(prefill, alloc, target, random_kv(10))
    for layer in range(LAYOUT.num_layers):
        prefill.pusher.push("req-late", layer)
    await outcomes.wait_for(lambda o: o.reservation_id == "res-late")
    assert decode.landing.query("res-late").state == LandingState.CANCELLED


@pytest.mark.timeout(30)
def test_stalled_decode_fails_within_the_transfer_timeout_never_lands(sidecars):
    layout = "layers=4,block=16,heads=2,dim=16,dtype=float16"
    dec = sidecars.launch("decode", "D1", layout, 64)
    pre = sidecars.launch("prefill", "P1", layout, 256, "--transfer-timeout", "1.0")
    dec.ready(), pre.ready()
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        prefill.client.admin("add_peer", record=dec.record)
        ids = prefill.cache_blocks_for(64)
        decode.client.subscribe("res-s")
        os.kill(dec.pid, signal.SIGSTOP)  # alive but not progressing: writes cannot complete
        try:
            alloc = prefill.begin("s", "res-s", dec.record, [4, 5, 6, 7], 64)
            prefill.push_all("s", alloc, 16, 64, ids)
            event = wait_state(prefill.client, "res-s", 5)
            assert event.state == "FAILED" and "not done after" in event.reason
            # The staging is freed once the transport lets go of the cancelled write (it
            # may still be reading it when FAILED is sent; on a slow machine, a poll later),
            # with the peer still stopped.
            deadline = time.monotonic() + 5
            while prefill.client.admin("stats")["staging_allocations"] != 0:
                assert time.monotonic() < deadline, prefill.client.admin("stats")
                time.sleep(0.05)
        finally:
            os.kill(dec.pid, signal.SIGCONT)
        assert wait_state(decode.client, "res-s", 5).state == "FAILED"  # the ABORT notice, never LANDED
        alloc = prefill.begin("s2", "res-s2", dec.record, [8, 9], 32)  # and the pair still works
        prefill.push_all("s2", alloc, 16, 32, ids)
        assert wait_state(prefill.client, "res-s2", 5).state == "PUSHED"
    finally:
        prefill.close(), decode.close()


def test_handover_keeps_asks_and_grants_bounded():
    """The prefill sidecar's handover: a grant waits for its ask and an ask for its grant;
    asks no grant answers (refused Reserves) and unasked grants are bounded."""
    from kvpush.sidecar.handover import Handover

    class Conn:
        def __init__(self):
            self.sent = []

        def send(self, data):
            self.sent.append(data)
    h, a, b = Handover(limit=4, ask_ttl_s=60.0), Conn(), Conn()
    h.offer("early", {"reservation_id": "r1"}, int(time.time() * 1000) + 30_000)
    assert h.ask("early", a) == {"reservation_id": "r1"} and not a.sent
    assert h.ask("late", b) is None
    h.offer("late", {"reservation_id": "r2"}, int(time.time() * 1000) + 30_000)
    assert len(b.sent) == 1 and b"r2" in b.sent[0]
    for i in range(10):                           # asks never answered: at most `limit` kept
        h.ask(f"refused-{i}", a)
    assert h.stats()["handover_waiting"] <= 4
    for i in range(10):                           # grants never asked for: at most `limit` kept
        h.offer(f"orphan-{i}", {}, int(time.time() * 1000) + 30_000)
    assert h.stats()["handover_known"] <= 4
    h.forget(a)                                   # its channel closed
    assert h.stats()["handover_waiting"] == 0
    expired = Handover(ask_ttl_s=0.0)
    expired.offer("gone", {}, int(time.time() * 1000) - 1)   # past its deadline: not handed out
    assert expired.ask("gone", a) is None


def test_checksums_are_refused_for_a_tensor_parallel_engine(tmp_path):
    # Debug checksums are computed over one head share's staging: not over a TP engine's.
    from kvpush.sidecar.outbound import PushConfig
    tp2 = dataclasses.replace(LAYOUT, num_kv_heads=4, tp_size=2)
    with pytest.raises(ValueError, match="--checksums covers engines without tensor parallelism only"):
        SidecarConfig("pre-tp", PREFILL, tp2, 32, str(tmp_path / "p.sock"), push=PushConfig(checksums=True))

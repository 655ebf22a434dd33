"""Decode failover at the router: the reservation's decode engine is unreachable when the
continuation goes out, so the router moves the reservation (Scheduler.Relocate) and sends
the continuation, with the moved reservation, to the other decode engine; the prefill
engine is asked once. (Stand-in engines, a real control plane; the sidecars' half, the
push again from staging, is tested with real sidecars and real vLLM engines.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from aiohttp.test_utils import TestServer

from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import registry_pb2, scheduler_pb2, types_pb2
from kvpush.router import metrics
from kvpush.router.app import DISPATCHER, build_app
from kvpush.router.config import DecodeEngine, RouterConfig
from tests.controlplane.helpers import settle
from kvpush.router.tokens import WhitespaceCounter
from tests.router.fakes import FakeEngine, WordTokenizer


def relocations(outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvpush_router_relocations_total", {"outcome": outcome}) or 0.0


async def test_an_unreachable_decode_engine_is_replaced_by_moving_the_reservation(stack, engine_client):
    s = stack
    prefill_sim = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, model="tiny", role=types_pb2.PREFILL)
    other_sim = SimulatedEngine(engine_client, "decode-1", num_blocks=8, model="tiny")
    await prefill_sim.register()
    await other_sim.register()
    other = FakeEngine("D1")
    other.mode = "token_ids"
    other_server = TestServer(other.app(), handler_cancellation=True)
    await other_server.start_server()
    named_server = TestServer(s["decode"].app(), handler_cancellation=True)  # decode-0, to be killed
    await named_server.start_server()
    urls = {"decode-0": str(named_server.make_url("")).rstrip("/"),
            "decode-1": str(other_server.make_url("")).rstrip("/")}
    servers = {"decode-0": named_server, "decode-1": other_server}
    fakes = {"decode-0": s["decode"], "decode-1": other}
    s["decode"].mode = "token_ids"

    # The prefill sidecar's part: hear the reservations naming the prefill engine.
    heard: dict[str, types_pb2.Reservation] = {}
    watch = engine_client.registry.WatchEngineReservations(
        registry_pb2.WatchEngineReservationsRequest(engine_id="prefill-0"), metadata=engine_client.metadata)

    async def follow():
        async for event in watch:
            if event.reservation.id:
                heard.setdefault(event.reservation.request_id, event.reservation)
    following = asyncio.ensure_future(follow())

    async def handover(request_id: str) -> str:
        while request_id not in heard:
            await asyncio.sleep(0.01)
        return heard[request_id].id
    s["prefill"].mode = "token_ids"
    s["prefill"].handover = handover

    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       prefill_ids=("prefill-0",),
                       decode=tuple(DecodeEngine(eid, url) for eid, url in urls.items()), max_model_len=1000)
    app = build_app(cfg, WordTokenizer())
    router = TestServer(app, handler_cancellation=True)
    await router.start_server()
    moved_before = relocations("moved")
    try:
        s["prefill"].stall.clear()  # the prefill engine computes ...
        ask = asyncio.ensure_future(s["session"].post(str(router.make_url("")).rstrip("/") + "/v1/completions",
                                                      json={"model": "tiny", "prompt": "a b", "max_tokens": 3}))
        while not heard:
            await asyncio.sleep(0.01)
        first = next(iter(heard.values()))
        assert first.prefill_engine_id == "prefill-0"
        await servers[first.engine_id].close()  # ... and the reservation's decode engine dies
        s["prefill"].stall.set()
        resp = await asyncio.wait_for(ask, 20)
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        assert answer["choices"][0]["text"] == " w7 w10 w11"  # the first token, then the other's two
        survivor = "decode-0" if first.engine_id == "decode-1" else "decode-1"
        continuation = fakes[survivor].bodies[-1]
        kv = continuation["kv_transfer_params"]["kvpush"]
        assert kv["engine_id"] == survivor and kv["reservation_id"] != first.id
        assert continuation["prompt"] == [1, 2, 3, 7]
        assert len(s["prefill"].bodies) == 1  # one prefill
        moved = await s["tenant"].scheduler.GetReservation(
            scheduler_pb2.GetReservationRequest(reservation_id=kv["reservation_id"]), metadata=s["tenant"].metadata)
        assert moved.moved_from == first.id and moved.state == types_pb2.RESERVED
        old = await s["tenant"].scheduler.GetReservation(
            scheduler_pb2.GetReservationRequest(reservation_id=first.id), metadata=s["tenant"].metadata)
        assert old.state == types_pb2.FAILED and old.moved_to == moved.id
        assert relocations("moved") == moved_before + 1
        # The request was counted on the engine answering it, and is counted nowhere once answered.
        assert set(app[DISPATCHER].outstanding.values()) <= {0}, app[DISPATCHER].outstanding
        # The new decode engine's sidecar would report it consumed once loaded.
        await engine_client.registry.ReportState(registry_pb2.ReportStateRequest(
            reservation_id=moved.id, state=types_pb2.CONSUMED, landed=True), metadata=engine_client.metadata)
        await settle(s["etcd"].endpoint, quiet=True)
    finally:
        s["prefill"].stall.set()
        following.cancel()
        await router.close()
        for server in servers.values():
            await server.close()
        await prefill_sim.stop()
        await other_sim.stop()


async def test_on_the_push_path_an_unreachable_decode_engine_is_replaced_by_moving_the_reservation(
        stack, engine_client):
    """The push path (decode asked at once, beside the prefill): the reservation named no
    prefill engine when it was made, so the router names the one it sent the prefill to."""
    s = stack
    prefill_sim = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, model="tiny", role=types_pb2.PREFILL)
    dead_sim = SimulatedEngine(engine_client, "decode-1", num_blocks=8, model="tiny")
    await prefill_sim.register()
    await dead_sim.register()  # as free as decode-0: the tie goes to the larger id, decode-1
    dead = TestServer(FakeEngine("D1").app())
    await dead.start_server()
    dead_url = str(dead.make_url("")).rstrip("/")
    await dead.close()  # its vLLM died: nothing listens there
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       prefill_ids=("prefill-0",),
                       decode=(DecodeEngine("decode-0", s["decode_url"]), DecodeEngine("decode-1", dead_url)),
                       max_model_len=1000)
    app = build_app(cfg, WhitespaceCounter())  # no fast detokenizer: every request takes the push path
    router = TestServer(app, handler_cancellation=True)
    await router.start_server()
    moved_before = relocations("moved")
    try:
        resp = await s["session"].post(str(router.make_url("")).rstrip("/") + "/v1/completions",
                                       json={"model": "tiny", "prompt": "a b", "max_tokens": 3})
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["engine"] == "D"  # decode-0 answered
        assert relocations("moved") == moved_before + 1
        assert len(s["prefill"].bodies) == 1  # one prefill
        first = s["prefill"].bodies[0]["kv_transfer_params"]["kvpush"]["reservation_id"]
        kv = s["decode"].bodies[-1]["kv_transfer_params"]["kvpush"]
        assert kv["engine_id"] == "decode-0" and kv["reservation_id"] != first
        moved = await s["tenant"].scheduler.GetReservation(
            scheduler_pb2.GetReservationRequest(reservation_id=kv["reservation_id"]), metadata=s["tenant"].metadata)
        assert moved.moved_from == first and moved.prefill_engine_id == "prefill-0"
        old = await s["tenant"].scheduler.GetReservation(
            scheduler_pb2.GetReservationRequest(reservation_id=first), metadata=s["tenant"].metadata)
        assert old.state == types_pb2.FAILED and old.moved_to == moved.id
        assert set(app[DISPATCHER].outstanding.values()) <= {0}, app[DISPATCHER].outstanding
        await engine_client.registry.ReportState(registry_pb2.ReportStateRequest(
            reservation_id=moved.id, state=types_pb2.CONSUMED, landed=True), metadata=engine_client.metadata)
        await settle(s["etcd"].endpoint, quiet=True)
    finally:
        await router.close()
        await prefill_sim.stop()
        await dead_sim.stop()


@pytest.mark.parametrize("stream, how", [(True, "break"), (False, "break"), (True, "error"), (True, "silent")])
async def test_decode_dying_part_way_is_resumed_elsewhere_with_the_text_whole(stack, engine_client, stream, how):
    """Decode's stream breaks after three tokens, while its events were being passed on
    (``relay.Passthrough``), or sends an error event right behind them (one read: the
    events before it are still the client's), or sends nothing more for --upstream-timeout
    (hung): another decode engine goes on from the tokens received, and the client's
    answer is the one an unbroken stream gives, no token lost or repeated."""
    s = stack
    other_sim = SimulatedEngine(engine_client, "decode-1", num_blocks=8, model="tiny")
    await other_sim.register()
    other = FakeEngine("D1")
    other_server = TestServer(other.app(), handler_cancellation=True)
    await other_server.start_server()
    for fake in (s["prefill"], s["decode"], other):
        fake.mode = "token_ids"
        fake.chunk_delay = 0.01 if how == "break" else 0.0   # events one by one, as an engine streams them
    setattr(s["decode"], f"{how}_after", 3)
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       max_model_len=1000, decode=(DecodeEngine("decode-0", s["decode_url"]),
                                                   DecodeEngine("decode-1", str(other_server.make_url("")).rstrip("/"))),
                       upstream_timeout_s=0.5)
    router = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
    await router.start_server()
    try:
        for _ in range(2):  # (whichever decode engine the Reserve picks first)
            async with s["session"].post(str(router.make_url("/v1/completions")), json={
                    "model": "tiny", "prompt": "a b c", "max_tokens": 8, "stream": stream,
                    "return_token_ids": True}) as r:
                assert r.status == 200
                if stream:
                    events = [json.loads(e[6:]) for e in (await r.read()).decode().split("\n\n")
                              if e.startswith("data: {")]
                    text = "".join(c["text"] for e in events for c in e["choices"])
                    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
                else:
                    choice = (await r.json())["choices"][0]
                    text, ids = choice["text"], choice["token_ids"]
            assert ids == [7] + list(range(10, 17)), ids
            assert text == "".join(f" w{t}" for t in ids)
        assert any(len(b.get("prompt") or []) > 4 for b in other.bodies + s["decode"].bodies)  # a resume happened
    finally:
        await router.close()
        await other_server.close()
        await other_sim.stop()

"""A router with no --prefill/--decode finds its engines in the registry: one that
registers after the router started is served at once, one marked unavailable or dead
is dropped, all without a restart; with no engine it answers 503, not a hang."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.test_utils import TestServer

from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import registry_pb2, types_pb2
from kvpush.router.app import build_app
from kvpush.router.config import DecodeEngine, RouterConfig
from tests.controlplane.helpers import make_tenant, settle
from tests.router.fakes import FakeEngine, WordTokenizer


async def _serve(engine: FakeEngine) -> tuple[TestServer, str]:
    server = TestServer(engine.app(), handler_cancellation=True)
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def _health_until(session, url: str, pred, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with session.get(url + "/health") as r:
            health = dict(await r.json(), http=r.status)
        if pred(health):
            return health
        assert asyncio.get_running_loop().time() < deadline, health
        await asyncio.sleep(0.05)


async def test_engines_come_and_go_without_a_restart(cp, admin, engine_client, etcd):
    prefill, decode, spare = FakeEngine("P"), FakeEngine("D"), FakeEngine("D2")
    for e in (prefill, decode, spare):
        e.mode = "token_ids"
    (p_srv, p_url), (d_srv, d_url), (s_srv, s_url) = [await _serve(e) for e in (prefill, decode, spare)]
    tenant = await make_tenant(admin, cp.address, "router")
    token = tenant.metadata[0][1].split()[1]
    cfg = RouterConfig(controlplane=cp.address, token=token, model="tiny", prefill_urls=(), decode=(),
                       max_model_len=1000)
    router = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
    await router.start_server()
    url = str(router.make_url("")).rstrip("/")
    session = aiohttp.ClientSession()
    sims = []
    ask = {"model": "tiny", "prompt": "a b", "max_tokens": 3}
    try:
        health = await _health_until(session, url, lambda h: h["status"] == "no engines")
        assert health["http"] == 503 and health["source"] == "registry"
        async with session.post(url + "/v1/completions", json=ask) as r:
            assert r.status == 503 and "no engine" in (await r.json())["error"]["message"]

        # Engines register after the router started: served at once.
        p_sim = SimulatedEngine(engine_client, "prefill-0", 64, model="tiny", role=types_pb2.PREFILL,
                                serving_url=p_url)
        d_sim = SimulatedEngine(engine_client, "decode-0", 64, model="tiny", serving_url=d_url)
        sims += [p_sim, d_sim]
        for sim in (p_sim, d_sim):
            await sim.register()
        health = await _health_until(session, url, lambda h: h["decode"] and h["prefill"])
        assert health["decode"] == {"decode-0": d_url} and health["prefill"] == {p_url: "prefill-0"}
        async with session.post(url + "/v1/completions", json=ask) as r:
            assert r.status == 200, await r.text()
        assert decode.bodies and decode.bodies[-1]["prompt"] == [1, 2, 3, 7]  # decode continued prefill's token

        # Its sidecar says the engine went away: dropped; the prefill engine serves alone.
        await engine_client.registry.SetEngineAvailability(registry_pb2.SetEngineAvailabilityRequest(
            engine_id="decode-0", incarnation=d_sim.incarnation, unavailable="engine's connections closed"),
            metadata=engine_client.metadata, timeout=5)
        await _health_until(session, url, lambda h: not h["decode"])
        before = len(decode.bodies)
        async with session.post(url + "/v1/completions", json=dict(ask, stream=True)) as r:
            text = await r.text()
            assert r.status == 200 and text.endswith("[DONE]\n\n") and '"error"' not in text, text
        assert len(decode.bodies) == before

        # It dies; another decode engine registers: served, the dead one never again.
        await d_sim.crash()
        s_sim = SimulatedEngine(engine_client, "decode-1", 64, model="tiny", serving_url=s_url)
        sims.append(s_sim)
        await s_sim.register()
        await _health_until(session, url, lambda h: h["decode"] == {"decode-1": s_url}, timeout=20)
        async with session.post(url + "/v1/completions", json=ask) as r:
            assert r.status == 200, await r.text()
        assert spare.bodies and len(decode.bodies) == before
        await settle(etcd.endpoint, quiet=True)
    finally:
        await session.close()
        await router.close()
        for sim in sims:
            await sim.stop()
        for srv in (p_srv, d_srv, s_srv):
            await srv.close()
        await tenant.close()



async def test_a_decode_engine_dropped_while_prefill_runs_is_replaced(stack):
    """The reservation names a decode engine; while the prefill engine computes, the
    router drops that engine (its sidecar reported it gone). The continuation goes to the
    engine left (the prefill engine), without KV params, the reservation is released and
    the client gets 200."""
    from kvpush.router.app import DISPATCHER
    from kvpush.router.engines import Engines

    s = stack
    s["prefill"].mode = "token_ids"
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       decode=(DecodeEngine("decode-0", s["decode_url"]),), max_model_len=1000)
    app = build_app(cfg, WordTokenizer())
    router = TestServer(app, handler_cancellation=True)
    await router.start_server()
    try:
        s["prefill"].stall.clear()  # the prefill engine holds its answer
        before = len(s["prefill"].bodies)
        ask = asyncio.ensure_future(s["session"].post(str(router.make_url("")).rstrip("/") + "/v1/completions",
                                                      json={"model": "tiny", "prompt": "a b", "max_tokens": 3}))
        while len(s["prefill"].bodies) == before:
            await asyncio.sleep(0.01)
        directory = next(iter(app[DISPATCHER].engines.directories.values()))  # (its one registry's)
        directory.engines = Engines(prefill=directory.engines.prefill, decode=())  # decode-0 dropped
        s["prefill"].stall.set()
        resp = await asyncio.wait_for(ask, 20)
        assert resp.status == 200, await resp.text()
        resp.release()
        continuation = s["prefill"].bodies[-1]
        assert "kv_transfer_params" not in continuation and continuation["prompt"] == [1, 2, 3, 7]
        res_id = s["prefill"].bodies[before]["kv_transfer_params"]["kvpush"]["reservation_id"]
        assert s["decode"].bodies == [] or all("kv_transfer_params" not in b for b in s["decode"].bodies)
        report = await settle(s["etcd"].endpoint, quiet=True)
        assert res_id not in {r.id for r in report.live}
    finally:
        s["prefill"].stall.set()
        await router.close()

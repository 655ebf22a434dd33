"""A real ``kvpush sidecar`` watching its engine's connections: unavailable until the
engine first connects (``--wait-for-engine``), unavailable again when the engine's last
connection closes (its live reservation ends FAILED, no Reserve lands on it), available
when it comes back; its serving URL is published; tools' connections do not count; a
prompt the engine recomputed is counted by reason."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpush.app.etcd_server import free_port
from kvpush.contract.states import State
from kvpush.sidecar.engine_presence import GONE, NOT_YET
from tests.controlplane.helpers import expect_code
from tests.sidecar.service_helpers import Etcd, Scheduler
from tests.sidecar.test_service_metrics import scrape

pytestmark = pytest.mark.timeout(90)

LAYOUT = "layers=2,block=16,heads=2,dim=16,dtype=float16"


async def test_the_engine_going_away_and_coming_back(stack):
    port = free_port()
    dec = stack.sidecar("decode", "D1", LAYOUT, 32, "m", "--wait-for-engine", "--engine-grace", "0.3",
                        "--serving-url", "http://127.0.0.1:8200/", "--metrics-port", str(port))
    dec.ready()
    sched, etcd = await Scheduler(stack.cp.address).setup(), Etcd(stack.etcd.endpoint)
    engine = tool = None
    try:
        rec = await etcd.engine("D1")
        assert (rec.unavailable, rec.serving_url) == (NOT_YET, "http://127.0.0.1:8200")
        await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, sched.reserve("early", 16))

        tool = dec.client()
        tool.hello(name="a tool")  # not the engine: changes nothing
        engine = dec.client()
        engine.hello(name="vllm-worker", pid=1, engine=True)
        await etcd.wait_engine("D1", True, predicate=lambda e: e.unavailable == "")
        res = await sched.reserve("r-1", 32)
        assert res.engine_id == "D1"
        # The per-request silent-failure signal: a prompt decode computed itself, by reason.
        engine.recomputed_nowait(res.id, "timeout")
        engine.ping()  # frames are handled in order: the note is counted once the ping is answered
        assert scrape(port)[("kvpush_sidecar_recomputes_total", (("reason", "timeout"),))] == 1

        engine.close()  # the engine died: its connections close
        engine = None
        rec = await etcd.wait_engine("D1", True, predicate=lambda e: e.unavailable == GONE)
        ended = await etcd.wait_state(res.id, State.FAILED, timeout_s=10)
        assert "unavailable" in ended.reason
        await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, sched.reserve("while-gone", 16))
        m = scrape(port)
        assert m[("kvpush_sidecar_engine_available", ())] == 0
        assert m[("kvpush_sidecar_engine_departures_total", ())] == 1

        engine = dec.client()  # restarted
        engine.hello(name="vllm-scheduler", pid=2, engine=True)
        await etcd.wait_engine("D1", True, predicate=lambda e: e.unavailable == "")
        assert (await sched.reserve("r-2", 16)).engine_id == "D1"
        assert scrape(port)[("kvpush_sidecar_engine_available", ())] == 1
        # A connector reconnecting inside the grace period is not a death.
        engine.close()
        engine = dec.client()
        engine.hello(name="vllm-scheduler", pid=2, engine=True)
        await asyncio.sleep(0.8)
        assert (await etcd.engine("D1")).unavailable == ""
        assert scrape(port)[("kvpush_sidecar_engine_departures_total", ())] == 1
    finally:
        for client in (engine, tool):
            if client is not None:
                client.close()
        await sched.close()
        await etcd.close()


async def test_an_openai_server_that_stops_answering_makes_the_engine_unavailable(stack):
    """vLLM's API server is a process of its own: one that fails or dies while the engine's
    connections stay open is noticed by ``--probe-serving`` (three failed /health probes in
    a row), and the engine is available again once it answers."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    health = {"status": 200}

    async def answer(request):
        return web.Response(status=health["status"])
    app = web.Application()
    app.router.add_get("/health", answer)
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    dec = stack.sidecar("decode", "D1", LAYOUT, 32, "m", "--serving-url", url, "--probe-serving", "0.1")
    dec.ready()
    etcd = Etcd(stack.etcd.endpoint)
    try:
        await etcd.wait_engine("D1", True, predicate=lambda e: e.unavailable == "")
        health["status"] = 503  # up, and failing
        rec = await etcd.wait_engine("D1", True, predicate=lambda e: "not answering" in e.unavailable)
        assert f"{url}/health" in rec.unavailable and "answered 503" in rec.unavailable
        health["status"] = 200
        await etcd.wait_engine("D1", True, predicate=lambda e: e.unavailable == "")
        await server.close()  # gone: nothing listens there
        rec = await etcd.wait_engine("D1", True, predicate=lambda e: "not answering" in e.unavailable)
        assert dec.client().admin("service")["serving_probes"] >= 6
    finally:
        await etcd.close()
        await server.close()

"""A control plane that hangs (a real replica process, SIGSTOPped, as when it or its etcd
stalls): the request that meets it first waits out its Reserve timeout and is served
without push; the requests after it are served without push at once, not each after its
own timeout; once the control plane answers again, one request at a time finds it back
and push resumes."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.router import metrics
from kvpush.router.app import build_app
from kvpush.router.config import DecodeEngine, RouterConfig
from kvpush.router.tokens import WhitespaceCounter
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import make_tenant
from tests.router.fakes import FakeEngine

pytestmark = pytest.mark.timeout(90)
TIMEOUT_S = 1.0  # the router's --reserve-timeout here


def fallbacks(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvpush_router_fallbacks_total", {"reason": reason}) or 0.0


async def test_a_hung_control_plane_costs_one_reserve_timeout_not_one_per_request(etcd, cp_processes):
    (plane,) = cp_processes(1)
    admin = ControlPlaneClient(plane.address, ADMIN_TOKEN)
    engine_client = ControlPlaneClient(plane.address, ENGINE_TOKEN)
    sim = SimulatedEngine(engine_client, "decode-0", num_blocks=256, model="tiny", lease_ttl_s=30)
    await sim.register()
    tenant = await make_tenant(admin, plane.address, "router")
    prefill, decode = FakeEngine("P"), FakeEngine("D")
    servers = [TestServer(f.app(), handler_cancellation=True) for f in (prefill, decode)]
    for server in servers:
        await server.start_server()
    cfg = RouterConfig(controlplane=plane.address, token=tenant.metadata[0][1].split()[1], model="tiny",
                       prefill_urls=(str(servers[0].make_url("")).rstrip("/"),),
                       decode=(DecodeEngine("decode-0", str(servers[1].make_url("")).rstrip("/")),),
                       max_model_len=1000, reserve_timeout_s=TIMEOUT_S)
    router = TestServer(build_app(cfg, WhitespaceCounter()), handler_cancellation=True)
    await router.start_server()
    url = str(router.make_url("/v1/completions"))
    session = aiohttp.ClientSession()

    async def one() -> tuple[float, bool]:
        """(seconds to the answer, whether decode was given a reservation: pushed)"""
        started = time.monotonic()
        async with session.post(url, json={"model": "tiny", "prompt": "one two three", "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        return time.monotonic() - started, "kv_transfer_params" in decode.bodies[-1]

    try:
        assert (await one())[1]  # pushed while the control plane answers
        down = fallbacks("registry_down")
        plane.proc.send_signal(signal.SIGSTOP)
        try:
            answers = [await one() for _ in range(6)]
        finally:
            plane.proc.send_signal(signal.SIGCONT)
        assert not any(pushed for _, pushed in answers), answers
        # The first waited out the Reserve timeout; the rest did not wait for it at all.
        assert answers[0][0] >= TIMEOUT_S * 0.9, answers
        assert all(took < TIMEOUT_S / 2 for took, _ in answers[1:]), answers
        assert fallbacks("registry_down") >= down + 5
        # Back: once its spell aside is over (registries.DOWN_S), a request finds it answering.
        deadline = time.monotonic() + 15
        while not (await one())[1]:
            assert time.monotonic() < deadline, "push did not resume after the control plane came back"
            await asyncio.sleep(0.2)
    finally:
        await session.close()
        await router.close()
        for server in servers:
            await server.close()
        await sim.stop()
        for client in (tenant, admin, engine_client):
            await client.close()

"""The router tests' stack: stand-in prefill and decode engines, a real control plane
with one simulated decode engine registered, a tenant, and two routers (whitespace
tokenizer; a fast-detokenizer one for the first-token path)."""

from __future__ import annotations

import aiohttp
import pytest_asyncio
from aiohttp.test_utils import TestServer

from kvpush.app.simulated import SimulatedEngine
from kvpush.router.app import build_app
from kvpush.router.config import DecodeEngine, RouterConfig
from kvpush.router.tokens import WhitespaceCounter
from tests.controlplane.helpers import make_tenant
from tests.router.fakes import FakeEngine, WordTokenizer


@pytest_asyncio.fixture
async def stack(cp, admin, engine_client, etcd):
    prefill, decode = FakeEngine("P"), FakeEngine("D")
    servers = [TestServer(prefill.app(), handler_cancellation=True),
               TestServer(decode.app(), handler_cancellation=True)]
    for s in servers:
        await s.start_server()
    sim = SimulatedEngine(engine_client, "decode-0", num_blocks=8, model="tiny")
    await sim.register()
    tenant = await make_tenant(admin, cp.address, "router")
    token = tenant.metadata[0][1].split()[1]
    cfg = RouterConfig(controlplane=cp.address, token=token, model="tiny",
                       prefill_urls=(str(servers[0].make_url("")).rstrip("/"),),
                       decode=(DecodeEngine("decode-0", str(servers[1].make_url("")).rstrip("/")),),
                       max_model_len=1000)
    router = TestServer(build_app(cfg, WhitespaceCounter()), handler_cancellation=True)
    await router.start_server()
    ft = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
    await ft.start_server()
    session = aiohttp.ClientSession()
    yield dict(prefill=prefill, decode=decode, url=str(router.make_url("")).rstrip("/"), session=session,
               tenant=tenant, etcd=etcd, cp=cp, ft_url=str(ft.make_url("")).rstrip("/"), token=token,
               prefill_url=str(servers[0].make_url("")).rstrip("/"),
               decode_url=str(servers[1].make_url("")).rstrip("/"))
    await session.close()
    await router.close()
    await ft.close()
    for s in servers:
        await s.close()
    await tenant.close()
    await sim.stop()

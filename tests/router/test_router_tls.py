"""TLS on the router's hops: to a control plane that requires mutual TLS (the same
``--tls-*`` settings as every other client of it), and HTTPS on its own port, spoken to
by the ``openai`` client; plaintext is refused on both."""

from __future__ import annotations

import ssl

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from kvpush.app.etcd_server import free_port
from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.contract.v1 import admin_pb2
from kvpush.router.app import start
from kvpush.router.config import DecodeEngine, RouterConfig
from kvpush.router.tokens import WhitespaceCounter
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import make_tenant
from tests.pki import make_pki
from tests.router.fakes import FakeEngine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("router-pki"), ("server", "router", "engine"))


@pytest_asyncio.fixture
async def tls_plane(etcd, pki):
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            engine_token=ENGINE_TOKEN, tls_cert=pki("server.pem"),
                                            tls_key=pki("server.key"), tls_client_ca=pki("ca.pem")))
    await plane.start()
    await plane.view.ready.wait()
    plane.address = f"127.0.0.1:{plane.port}"
    yield plane
    await plane.stop(grace=0.1)


def mtls_client(plane, pki, token: str, name: str) -> ControlPlaneClient:
    return ControlPlaneClient(plane.address, token, pki("ca.pem"), pki(f"{name}.pem"), pki(f"{name}.key"))


async def test_the_router_reserves_over_mutual_tls_and_serves_https(tls_plane, pki):
    admin, engines = mtls_client(tls_plane, pki, ADMIN_TOKEN, "engine"), mtls_client(
        tls_plane, pki, ENGINE_TOKEN, "engine")
    sim = SimulatedEngine(engines, "decode-0", num_blocks=8, model="tiny")
    await sim.register()
    tenant = await make_tenant(admin, tls_plane.address, "router-tls")
    token = tenant.metadata[0][1].split()[1]
    prefill, decode = FakeEngine("P"), FakeEngine("D")
    servers = [TestServer(prefill.app()), TestServer(decode.app())]
    for s in servers:
        await s.start_server()
    url = lambda s: str(s.make_url("")).rstrip("/")  # noqa: E731
    cfg = RouterConfig(controlplane=tls_plane.address, token=token, model="tiny", prefill_urls=(url(servers[0]),),
                       decode=(DecodeEngine("decode-0", url(servers[1])),), max_model_len=1000,
                       listen_port=free_port(), tls_ca=pki("ca.pem"), tls_cert=pki("router.pem"),
                       tls_key=pki("router.key"), http_tls_cert=pki("server.pem"), http_tls_key=pki("server.key"))
    runner = await start(cfg, WhitespaceCounter())
    base = f"https://127.0.0.1:{cfg.listen_port}"
    try:
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=pki("ca.pem"))) as http:
            client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http)
            answer = await client.completions.create(model="tiny", prompt="one two three", max_tokens=3)
            assert answer.choices[0].text == " hi"
        kv = prefill.bodies[0]["kv_transfer_params"]["kvpush"]
        assert kv["engine_id"] == "decode-0" and kv["reservation_id"]  # reserved over mutual TLS
        status = await admin.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=admin.metadata, timeout=5)
        assert status.replica_id
        # Plaintext is refused on both hops: to the router's HTTPS port, and to the control plane.
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.post(f"http://127.0.0.1:{cfg.listen_port}/v1/completions",
                                 json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=5)
        insecure = ControlPlaneClient(tls_plane.address, token)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await insecure.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=insecure.metadata, timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await insecure.close()
    finally:
        await runner.cleanup()
        for s in servers:
            await s.close()
        for c in (tenant, admin):
            await c.close()
        await sim.stop()
        await engines.close()


def test_half_a_tls_setting_is_refused():
    with pytest.raises(ValueError, match="--http-tls-cert and --http-tls-key go together"):
        RouterConfig(controlplane="x:1", token="t", model="m", prefill_urls=(), decode=(), http_tls_cert="c.pem")
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        RouterConfig(controlplane="x:1", token="t", model="m", prefill_urls=(), decode=(), tls_cert="c.pem")

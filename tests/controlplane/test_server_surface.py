"""What operators touch: TLS and mutual TLS, grpc health, reflection, metrics, CLI."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpush.controlplane import metrics
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.app.etcd_server import free_port
from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import admin_pb2
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN, ROOT
from tests.controlplane.helpers import make_tenant, reserve
from tests.pki import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), ("server", "client"))


async def _status_ok(client: ControlPlaneClient) -> bool:
    resp = await client.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=client.metadata, timeout=5)
    return bool(resp.replica_id)


async def test_tls_and_mutual_tls(etcd, pki):
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            tls_cert=pki("server.pem"), tls_key=pki("server.key"),
                                            tls_client_ca=pki("ca.pem")))
    await plane.start()
    await plane.view.ready.wait()
    address = f"127.0.0.1:{plane.port}"
    try:
        good = ControlPlaneClient(address, ADMIN_TOKEN, tls_ca=pki("ca.pem"), tls_cert=pki("client.pem"),
                                  tls_key=pki("client.key"))
        assert await _status_ok(good)
        no_cert = ControlPlaneClient(address, ADMIN_TOKEN, tls_ca=pki("ca.pem"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _status_ok(no_cert)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        plaintext = ControlPlaneClient(address, ADMIN_TOKEN)
        with pytest.raises(grpc.aio.AioRpcError):
            await _status_ok(plaintext)
        for c in (good, no_cert, plaintext):
            await c.close()
        # `kvpush health`, what the Kubernetes probes run: gRPC health over mutual TLS.
        probe = [sys.executable, "-m", "kvpush.app.cli", "health", "--controlplane", address, "--tls-ca", pki("ca.pem"),
                 "--tls-cert", pki("client.pem"), "--tls-key", pki("client.key")]
        for cmd, code, says in ((probe, 0, "SERVING"), (probe[:-4], 1, "UNAVAILABLE")):
            proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode == code and says in (out + err).decode(), (out, err)
    finally:
        await plane.stop(0.1)


async def test_health_reflection_and_metrics(etcd):
    metrics_port = free_port()
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            engine_token=ENGINE_TOKEN, metrics_port=metrics_port))
    await plane.start()
    address = f"127.0.0.1:{plane.port}"
    try:
        channel = grpc.aio.insecure_channel(address)
        health = health_pb2_grpc.HealthStub(channel)
        for _ in range(50):
            resp = await health.Check(health_pb2.HealthCheckRequest(service="kvpush.v1.Scheduler"))
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.1)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

        refl = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
        services = set()
        async for answer in refl.ServerReflectionInfo(ask()):
            services |= {s.name for s in answer.list_services_response.service}
        assert {"kvpush.v1.Scheduler", "kvpush.v1.Registry", "kvpush.v1.Admin"} <= services
        await channel.close()

        admin = ControlPlaneClient(address, ADMIN_TOKEN)
        engine_client = ControlPlaneClient(address, ENGINE_TOKEN)
        engine = SimulatedEngine(engine_client, "decode-m", num_blocks=32)
        await engine.register()
        tenant = await make_tenant(admin, address, "acme")
        await reserve(tenant, "a", 40)
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
        assert 'kvpush_reserve_total{code="OK"}' in text
        assert "kvpush_reserve_latency_seconds_bucket" in text
        assert "kvpush_etcd_txn_latency_seconds_count" in text
        assert 'kvpush_reservations{state="RESERVED"} 1.0' in text
        assert 'kvpush_engine_free_blocks{engine="decode-m"} 29.0' in text
        metrics.watch_gc()  # serve() does this; the in-process replica here was started without it
        metrics.watch_gc()  # idempotent: one observation per collection, not two

        def full_collections() -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            found = re.search(r'kvpush_gc_pause_seconds_count\{generation="2"\} (\S+)', text)
            return float(found.group(1)) if found else 0.0
        before = full_collections()
        gc.collect()
        assert full_collections() == before + 1
        await engine.stop()
        for c in (admin, engine_client, tenant):
            await c.close()
    finally:
        await plane.stop(0.1)


async def test_cli_status_and_tenant(cp, engine_client, admin):
    engine = SimulatedEngine(engine_client, "decode-cli", num_blocks=16)
    await engine.register()
    env = {**os.environ, "KVPUSH_ADMIN_TOKEN": ADMIN_TOKEN, "KVPUSH_CONTROLPLANE": cp.address}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "kvpush.app.cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
    out = await asyncio.to_thread(run, "tenant", "create", "cli-tenant", "--quota-blocks", "7")
    assert out.returncode == 0, out.stderr
    created = json.loads(out.stdout)
    assert created["name"] == "cli-tenant" and created["token"].startswith("kvp_")
    tenant = ControlPlaneClient(cp.address, created["token"])
    await reserve(tenant, "x", 20)
    out = await asyncio.to_thread(run, "status")
    assert out.returncode == 0, out.stderr
    assert "decode-cli" in out.stdout and "RESERVED" in out.stdout
    out = await asyncio.to_thread(run, "status", "--json")
    status = json.loads(out.stdout)
    assert status["engines"][0]["free_blocks"] == 14
    out = await asyncio.to_thread(run, "tenant", "create", "cli-tenant")
    assert out.returncode != 0 and "ALREADY_EXISTS" in out.stderr
    await tenant.close()
    await engine.stop()

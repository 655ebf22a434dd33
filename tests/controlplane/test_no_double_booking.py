"""Two control-plane replicas (separate processes), hundreds of concurrent Reserves
for more blocks than exist: exactly the capacity is granted, the rest are
RESOURCE_EXHAUSTED, and etcd shows no block booked twice. Also with both replicas
believing they own every engine (the same replica id: kvpush/controlplane/ownership.py),
as two replicas briefly do while one has not yet seen the other join or leave."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.app.simulated import SimulatedEngine
from kvpush.controlplane.invariants import check
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import make_tenant, release, reserve, settle

ENGINES = {"decode-a": 40, "decode-b": 24, "decode-c": 16}   # 80 blocks in all
ASKS = 400                                                   # each wants 1 or 2 blocks


@pytest.mark.parametrize("ids", [[], ["--replica-id", "twin"]], ids=["engines-shared-out", "both-own-every-engine"])
async def test_two_replicas_never_double_book(etcd, cp_processes, ids):
    replicas = cp_processes(2, extra=["--max-batch", "50", *ids])
    admin = ControlPlaneClient(replicas[0].address, ADMIN_TOKEN)
    engine_client = ControlPlaneClient(replicas[1].address, ENGINE_TOKEN)
    engines = [SimulatedEngine(engine_client, eid, n, lease_ttl_s=30) for eid, n in ENGINES.items()]
    for engine in engines:
        await engine.register()
    tenant_a = await make_tenant(admin, replicas[0].address, "acme")
    token = tenant_a.metadata[0][1].split()[1]
    clients = [tenant_a, ControlPlaneClient(replicas[1].address, token)]
    await asyncio.sleep(0.5)  # both replicas' views have the engines and tenant

    async def one(i: int):
        tokens = 16 if i % 3 else 32    # 1 or 2 blocks of 16 tokens
        try:
            res = await reserve(clients[i % 2], f"req-{i}", tokens)
            return ("ok", res)
        except grpc.aio.AioRpcError as exc:
            return (exc.code().name, exc.details())

    results = await asyncio.gather(*(one(i) for i in range(ASKS)))
    codes = collections.Counter(code for code, _ in results)
    granted = [res for code, res in results if code == "ok"]
    assert set(codes) <= {"ok", "RESOURCE_EXHAUSTED"}, codes
    blocks_granted = sum(len(r.block_ids) for r in granted)
    total = sum(ENGINES.values())
    seen = collections.Counter((r.engine_id, b) for r in granted for b in r.block_ids)
    twice = {k for k, n in seen.items() if n > 1}
    if twice or blocks_granted > total:  # (seen once in CI, 82 of 80: say all there is to say)
        report = await check(etcd.endpoint)
        holders = [(r.id, r.request_id, r.engine_id, list(r.block_ids))
                   for r in granted if any((r.engine_id, b) in twice for b in r.block_ids)]
        logs = "\n".join(f"--- replica {i}\n{p.tail()}" for i, p in enumerate(replicas))
        pytest.fail(f"{blocks_granted} blocks granted of {total}, {codes}; held twice: {sorted(twice)} by "
                    f"{holders}; etcd: {report.summary()}\n{logs}")
    # Every block handed out exactly once; a 2-block ask may be refused while
    # single blocks remain on some engine, so allow at most one per engine.
    assert total - len(ENGINES) <= blocks_granted, (blocks_granted, codes)
    report = await settle(etcd.endpoint)
    assert sum(len(e.reserved) for e in report.engines.values()) == blocks_granted
    assert len(report.live) == len(granted)

    # Release everything through both replicas; the registry ends empty.
    await asyncio.gather(*(release(clients[i % 2], r.id) for i, r in enumerate(granted)))
    report = await settle(etcd.endpoint, quiet=True)
    assert all(len(e.free) == ENGINES[e.engine_id] for e in report.engines.values())
    for engine in engines:
        await engine.stop()
    for client in clients + [admin, engine_client]:
        await client.close()


async def test_quota_holds_across_replicas(etcd, cp_processes):
    replicas = cp_processes(2)
    admin = ControlPlaneClient(replicas[0].address, ADMIN_TOKEN)
    engine_client = ControlPlaneClient(replicas[1].address, ENGINE_TOKEN)
    engine = SimulatedEngine(engine_client, "decode-big", 500, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, replicas[0].address, "capped", quota_blocks=30)
    token = tenant.metadata[0][1].split()[1]
    clients = [tenant, ControlPlaneClient(replicas[1].address, token)]
    await asyncio.sleep(0.5)
    results = await asyncio.gather(*(reserve(clients[i % 2], f"q{i}", 16) for i in range(200)),
                                   return_exceptions=True)
    granted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(granted) == 30 and len(refused) == 170
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in r.details() for r in refused)
    report = await settle(etcd.endpoint)
    assert report.tenant_usage["capped"] == 30
    await engine.stop()
    for client in clients + [admin, engine_client]:
        await client.close()


async def test_replica_killed_under_load(etcd, cp_processes):
    """SIGKILL one replica while both take Reserves: callers of the dead one get
    errors, the survivor keeps serving, and etcd stays consistent."""
    replicas = cp_processes(2)
    admin = ControlPlaneClient(replicas[0].address, ADMIN_TOKEN)
    engine_client = ControlPlaneClient(replicas[0].address, ENGINE_TOKEN)
    engine = SimulatedEngine(engine_client, "decode-k", 2000, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, replicas[0].address, "acme")
    token = tenant.metadata[0][1].split()[1]
    victim = ControlPlaneClient(replicas[1].address, token)
    await asyncio.sleep(0.5)

    async def hammer(client, prefix, n, stop_on_error=False):
        out = []
        for i in range(n):
            try:
                out.append(await reserve(client, f"{prefix}{i}", 1))
            except grpc.aio.AioRpcError as exc:
                out.append(exc.code())
                if stop_on_error:
                    break
        return out
    load = [asyncio.create_task(hammer(victim, f"v{j}-", 1000, stop_on_error=True)) for j in range(4)]
    await asyncio.sleep(0.3)
    replicas[1].proc.kill()
    survivors = await hammer(tenant, "s", 50)
    results = [r for task in load for r in await task]
    assert all(not isinstance(r, grpc.StatusCode) for r in survivors), survivors
    assert any(isinstance(r, grpc.StatusCode) for r in results)  # the victim's callers saw it die
    report = await settle(etcd.endpoint)
    granted = [r for r in survivors + results if not isinstance(r, grpc.StatusCode)]
    # Every reservation a caller was told about is in etcd; etcd may hold more
    # (written just before the kill, answer lost): they expire with their deadline.
    assert {r.id for r in granted} <= {r.id for r in report.live}
    await engine.stop()
    for client in (tenant, victim, admin, engine_client):
        await client.close()

"""A quota tenant served through two replicas, each holding a share of its quota
(kvpush/controlplane/quota_shares.py), over a real etcd: Reserves committed within a
share leave the usage fence alone; the quota is never overrun and, near it, what the other
replica's share holds unused is taken back rather than a Reserve refused; a quota changed
takes every share away; shares no longer needed are given back; a replica stopping takes
its share with it."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import REGISTRY

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import admin_pb2
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient
from kvpush.controlplane.invariants import check
from tests.controlplane.helpers import release, reserve, settle
from tests.controlplane.test_follow import eventually
from tests.controlplane.test_forwarding import tenant_of_a
from tests.controlplane.test_partitioned import engine_owned_by, two_replicas


def in_share() -> float:
    return REGISTRY.get_sample_value("kvpush_reserve_in_share_total") or 0.0


async def shares_in_etcd(endpoint: str, tenant: str) -> dict[str, int]:
    client = EtcdClient(endpoint)
    try:
        kvs, _ = await client.get_prefix(keys.shares(tenant))
    finally:
        await client.close()
    return {keys.split_request(kv.key)[1][len(keys.SHARE_MARK):]: int(kv.value) for kv in kvs}


async def burst(clients, prefix: str, count: int):
    results = await asyncio.gather(*(reserve(clients[i % 2], f"{prefix}{i}", 16) for i in range(count)),
                                   return_exceptions=True)
    granted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
               and "quota" in r.details() for r in refused), refused
    return granted, refused


async def capped(planes, addr, clients, engines, quota: int) -> list[ControlPlaneClient]:
    """Tenant acme with ``quota`` blocks, an engine on each replica, and its clients on a and b."""
    tenant_a = await tenant_of_a(planes, addr, clients, engines, [engine_owned_by("a"), engine_owned_by("b")])
    admin = clients[0]
    await admin.admin.UpdateTenant(admin_pb2.UpdateTenantRequest(name="acme", quota_blocks=quota),
                                   metadata=admin.metadata)
    tenant_b = ControlPlaneClient(addr[1], tenant_a.metadata[0][1].split()[1])
    clients.append(tenant_b)
    await eventually(lambda: all(p.view.tenant("acme").quota_blocks == quota for p in planes))
    return [tenant_a, tenant_b]


async def test_shares_serve_a_quota_tenant_through_two_replicas_and_never_overrun_it(etcd):
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        a, b = planes
        through = await capped(planes, addr, clients, engines, 40)
        tenant_a, admin = through[0], clients[0]

        # Waves of Reserves through both: after the first, each replica holds a share and
        # commits within it, without the usage fence.
        before = in_share()
        granted = []
        for wave in range(4):
            got, refused = await burst(through, f"w{wave}-", 6)
            assert not refused
            granted += got
        assert in_share() > before
        held = await shares_in_etcd(etcd.endpoint, "acme")
        assert set(held) == {"a", "b"} and sum(held.values()) <= 40

        # Far more than the quota at once: exactly what it has left is granted; the other
        # replica's unused share is taken back rather than a Reserve refused.
        got, refused = await burst(through, "over-", 60)
        assert len(granted) + len(got) == 40 and len(refused) == 60 - len(got)
        report = await settle(etcd.endpoint)
        assert report.tenant_usage["acme"] == 40

        # A quota changed takes every share away; the new quota holds.
        await admin.admin.UpdateTenant(admin_pb2.UpdateTenantRequest(name="acme", quota_blocks=30),
                                       metadata=admin.metadata)
        assert await shares_in_etcd(etcd.endpoint, "acme") == {}
        await eventually(lambda: all(p.view.tenant("acme").quota_blocks == 30 for p in planes))
        everything = granted + got
        for res in everything[:15]:
            await release(tenant_a, res.id)
        await eventually(lambda: all(p.view.requests.used.get("acme") == 25 for p in planes))
        got, refused = await burst(through, "after-", 10)
        assert len(got) == 5
        report = await settle(etcd.endpoint)
        assert report.tenant_usage["acme"] == 30

        # Nothing reserved for a while: the shares are given back (what their entries hold stays).
        for res in everything[15:] + got:
            await release(tenant_a, res.id)
        await eventually(lambda: not a.view.requests.shares.get("acme") and not b.view.requests.shares.get("acme"),
                         timeout=15)
        assert await shares_in_etcd(etcd.endpoint, "acme") == {}


async def test_a_replica_stopping_takes_its_share_with_it(etcd):
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        a, b = planes
        tenant_a, tenant_b = await capped(planes, addr, clients, engines, 20)
        kept = []
        for wave in range(3):
            got, _ = await burst([tenant_b, tenant_b], f"b{wave}-", 4)
            kept += got
        assert "b" in await shares_in_etcd(etcd.endpoint, "acme")
        await b.stop()
        planes.remove(b)
        assert "b" not in await shares_in_etcd(etcd.endpoint, "acme")
        # b's reservations still count, as plain usage: a grants exactly the rest.
        await eventually(lambda: "b" not in a.view.requests.shares.get("acme", {}))
        got, refused = await burst([tenant_a, tenant_a], "a-", 20)
        assert len(got) == 20 - len(kept)
        report = await settle(etcd.endpoint)
        assert report.tenant_usage["acme"] == 20


async def test_the_quota_holds_while_both_replicas_reserve_release_and_take_shares_back(etcd):
    """Rounds of bursts through both replicas, each bigger than the quota, with part released
    between them: shares grow, are used, and are taken back in every order the two replicas'
    batches fall in; etcd never holds more than the quota, read after every burst."""
    quota = 24
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        tenant_a, tenant_b = await capped(planes, addr, clients, engines, quota)
        live, before = [], in_share()
        for round_ in range(8):
            got, _ = await burst([tenant_a, tenant_b], f"r{round_}-", 16 if round_ % 2 else 40)
            live += got
            report = await check(etcd.endpoint, quiet=True)
            assert report.tenant_usage.get("acme", 0) == len(live) <= quota
            for res in live[::3]:
                await release(tenant_b if round_ % 2 else tenant_a, res.id)
            live = [res for i, res in enumerate(live) if i % 3]
        assert in_share() > before
        report = await settle(etcd.endpoint)
        assert report.tenant_usage.get("acme", 0) == len(live)

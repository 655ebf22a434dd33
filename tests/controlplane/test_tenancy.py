"""Tenants: tokens, isolation (NOT_FOUND, never PERMISSION_DENIED), quotas, pools."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import admin_pb2, scheduler_pb2, types_pb2
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve, settle


async def test_isolation_between_tenants(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    alice = await make_tenant(admin, cp.address, "alice")
    bob = await make_tenant(admin, cp.address, "bob")
    res = await reserve(alice, "same-id", 16)
    # bob's identical request id is his own namespace: a different reservation.
    bobs = await reserve(bob, "same-id", 16)
    assert bobs.id != res.id
    get = scheduler_pb2.GetReservationRequest(reservation_id=res.id)
    assert (await alice.scheduler.GetReservation(get, metadata=alice.metadata)).id == res.id
    await expect_code(grpc.StatusCode.NOT_FOUND, bob.scheduler.GetReservation(get, metadata=bob.metadata))
    await expect_code(grpc.StatusCode.NOT_FOUND, release(bob, res.id))
    # bob's watch never shows alice's reservations.
    watch = bob.scheduler.WatchReservations(scheduler_pb2.WatchReservationsRequest(include_snapshot=True),
                                            metadata=bob.metadata)
    snapshot = []
    while True:
        event = await asyncio.wait_for(watch.read(), 5)
        if event.kind == scheduler_pb2.ReservationEvent.SNAPSHOT_END:
            break
        snapshot.append(event.reservation.id)
    assert snapshot == [bobs.id]
    await release(alice, res.id)   # must not reach bob: his next event is his own release
    await release(bob, bobs.id)
    event = await asyncio.wait_for(watch.read(), 5)
    assert event.reservation.id == bobs.id and event.reservation.tenant == "bob"
    watch.cancel()
    await settle(etcd.endpoint, quiet=True)
    for c in (alice, bob):
        await c.close()
    await engine.stop()


async def test_bad_tokens_are_unauthenticated(cp, admin, engine_client):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=8)
    await engine.register()
    nobody = ControlPlaneClient(cp.address, "kvp_not-a-real-token-at-all")
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, reserve(nobody, "x", 16))
    bare = ControlPlaneClient(cp.address, "")
    bare.metadata = ()
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, reserve(bare, "x", 16))
    # A tenant token is not an admin or engine token.
    alice = await make_tenant(admin, cp.address, "alice")
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, alice.admin.ListTenants(
        admin_pb2.ListTenantsRequest(), metadata=alice.metadata))
    # Rotating the token revokes the old one at once.
    rotated = await admin.admin.RotateTenantToken(admin_pb2.RotateTenantTokenRequest(name="alice"),
                                                  metadata=admin.metadata)
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, reserve(alice, "x", 16))
    fresh = ControlPlaneClient(cp.address, rotated.token)
    assert (await reserve(fresh, "x", 16)).tenant == "alice"
    for c in (nobody, bare, alice, fresh):
        await c.close()
    await engine.stop()


async def test_quota_is_enforced_and_freed(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    small = await make_tenant(admin, cp.address, "small", quota_blocks=5)
    first = await reserve(small, "a", 48)   # 3 blocks
    details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, reserve(small, "b", 48))
    assert "quota" in details
    second = await reserve(small, "c", 32)  # 2 more: exactly the quota
    await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, reserve(small, "d", 1))
    await release(small, first.id)
    await reserve(small, "e", 48)
    report = await settle(etcd.endpoint)
    assert report.tenant_usage["small"] == 5
    # Concurrent asks cannot overrun the quota either.
    await release(small, second.id)
    results = await asyncio.gather(*(reserve(small, f"p{i}", 16) for i in range(10)), return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in results) == 2
    report = await settle(etcd.endpoint)
    assert report.tenant_usage["small"] == 5
    listed = await admin.admin.ListTenants(admin_pb2.ListTenantsRequest(), metadata=admin.metadata)
    assert {t.name: t.reserved_blocks for t in listed.tenants}["small"] == 5
    await small.close()
    await engine.stop()


async def test_allowed_pools(cp, admin, engine_client):
    gold = SimulatedEngine(engine_client, "decode-gold", num_blocks=8, pool="gold")
    std = SimulatedEngine(engine_client, "decode-std", num_blocks=8, pool="standard")
    await gold.register()
    await std.register()
    t = await make_tenant(admin, cp.address, "std-only", pools=["standard"])
    engines = await t.scheduler.ListEngines(scheduler_pb2.ListEnginesRequest(), metadata=t.metadata)
    assert [e.engine_id for e in engines.engines] == ["decode-std"]
    got = [await reserve(t, f"r{i}", 16) for i in range(8)]
    assert {r.engine_id for r in got} == {"decode-std"}
    await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, reserve(t, "more", 16))
    await admin.admin.UpdateTenant(admin_pb2.UpdateTenantRequest(name="std-only", allowed_pools=[]),
                                   metadata=admin.metadata)
    await asyncio.sleep(0.1)
    assert (await reserve(t, "more", 16)).engine_id == "decode-gold"
    await t.close()
    await gold.stop()
    await std.stop()


async def test_tenant_admin_lifecycle(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=8)
    await engine.register()
    t = await make_tenant(admin, cp.address, "temp")
    await expect_code(grpc.StatusCode.ALREADY_EXISTS, make_tenant(admin, cp.address, "temp"))
    await reserve(t, "a", 16)
    await reserve(t, "b", 16)
    resp = await admin.admin.DeleteTenant(admin_pb2.DeleteTenantRequest(name="temp"), metadata=admin.metadata)
    assert resp.reservations_released == 2
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, reserve(t, "c", 16))
    await expect_code(grpc.StatusCode.NOT_FOUND, admin.admin.DeleteTenant(
        admin_pb2.DeleteTenantRequest(name="temp"), metadata=admin.metadata))
    await settle(etcd.endpoint, quiet=True)
    await t.close()
    await engine.stop()


async def test_a_tenant_at_its_quota_does_not_hold_back_another(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    small = await make_tenant(admin, cp.address, "small", quota_blocks=4)
    big = await make_tenant(admin, cp.address, "big")
    held = [await reserve(small, f"s{i}", 32) for i in range(2)]  # 4 blocks: at the quota
    # Both tenants' asks arrive together (one group commit): the one at its quota is
    # refused, naming the quota, and the other's are all granted in the same batches.
    asks = [reserve(small, f"more{i}", 16) for i in range(6)] + [reserve(big, f"b{i}", 16) for i in range(12)]
    results = await asyncio.gather(*asks, return_exceptions=True)
    refused, granted = results[:6], results[6:]
    assert all(isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
               and "quota" in r.details() for r in refused), refused
    assert all(not isinstance(r, Exception) and r.tenant == "big" for r in granted), granted
    report = await settle(etcd.endpoint)
    assert report.tenant_usage["small"] == 4 and report.tenant_usage["big"] == 12
    for res in held:
        await release(small, res.id)
    for res in granted:
        await release(big, res.id)
    await settle(etcd.endpoint, quiet=True)
    await small.close()
    await big.close()
    await engine.stop()


async def test_tenant_watchers_are_told_when_an_engine_dies(cp, admin, engine_client, etcd):
    doomed = SimulatedEngine(engine_client, "decode-0", num_blocks=64, lease_ttl_s=2)
    other = SimulatedEngine(engine_client, "decode-1", num_blocks=64)
    await doomed.register()
    await other.register()
    alice = await make_tenant(admin, cp.address, "alice")
    on_doomed = [await reserve(alice, f"a{i}", 16, preferred_engine_id="decode-0") for i in range(2)]
    elsewhere = await reserve(alice, "b", 16, preferred_engine_id="decode-1")
    assert {r.engine_id for r in on_doomed} == {"decode-0"} and elsewhere.engine_id == "decode-1"
    watch = alice.scheduler.WatchReservations(scheduler_pb2.WatchReservationsRequest(), metadata=alice.metadata)
    await asyncio.sleep(0.2)  # the watch is subscribed
    await doomed.crash()  # its lease runs out: the control plane ends its reservations
    told = {}
    while len(told) < len(on_doomed):
        event = await asyncio.wait_for(watch.read(), 20)
        told[event.reservation.id] = event.reservation
    assert set(told) == {r.id for r in on_doomed}
    assert all(r.state == types_pb2.FAILED and "decode" in r.reason for r in told.values()), told
    got = await alice.scheduler.GetReservation(scheduler_pb2.GetReservationRequest(reservation_id=elsewhere.id),
                                               metadata=alice.metadata)
    assert got.state == types_pb2.RESERVED  # the other engine's is untouched
    watch.cancel()
    await release(alice, elsewhere.id)
    await settle(etcd.endpoint, quiet=True)
    await alice.close()
    await other.stop()

"""Two replicas that each follow only their own slots (kvpush/controlplane/following.py),
over a real etcd: neither holds the other's reservations, and every call still works
through either one. A Reserve whose replica has no room of its own reaches the other's
engines, a Reserve asked again through the other replica gets its first answer, a decode
sidecar's stream on the non-owner hears its engine, a release and a tenant's deletion
through the non-owner end what they should, and etcd's invariants hold."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import admin_pb2, registry_pb2, scheduler_pb2, types_pb2
from kvpush.controlplane import keys
from kvpush.controlplane.ownership import assign
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve, settle, stop_all
from tests.controlplane.test_follow import eventually

OWNERS = assign(["a", "b"])


@contextlib.asynccontextmanager
async def two_replicas(etcd, **config):
    """Replicas a and b in this process (``config``: ControlPlaneConfig's fields), started and
    ready: (planes, their addresses, and the lists of clients and engines a test adds to, all
    stopped at the end)."""
    planes = [ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                              engine_token=ENGINE_TOKEN, replica_id=rid, sweep_interval_s=0.5,
                                              **config))
              for rid in ("a", "b")]
    clients: list[ControlPlaneClient] = []
    engines: list[SimulatedEngine] = []
    try:
        for plane in planes:
            await plane.start()
            await plane.view.ready.wait()
        yield planes, [f"127.0.0.1:{p.port}" for p in planes], clients, engines
    finally:
        await stop_all(engines, clients, planes)


def engine_owned_by(replica: str, skip: int = 0) -> str:
    found = [f"decode-{i}" for i in range(200) if OWNERS[keys.slot_of(f"decode-{i}")] == replica]
    return found[skip]


async def test_two_replicas_follow_their_own_slots_and_serve_everything(etcd):
    # Not forwarding (test_forwarding.py does): a commits the other's engines' Reserves itself.
    async with two_replicas(etcd, forward=False) as (planes, addr, clients, engines):
        a, b = planes
        await eventually(lambda: all(p.view.following is not None and len(p.view.following) < keys.SLOTS
                                     for p in planes))
        assert a.view.following.isdisjoint(b.view.following)
        assert len(a.view.following | b.view.following) == keys.SLOTS

        admin = ControlPlaneClient(addr[0], ADMIN_TOKEN)
        engine_client = ControlPlaneClient(addr[0], ENGINE_TOKEN)
        clients += [admin, engine_client]
        # One engine, owned by b: a has no room of its own.
        only = engine_owned_by("b")
        engine = SimulatedEngine(engine_client, only, num_blocks=64)
        engines.append(engine)
        await engine.register()
        tenant_a = await make_tenant(admin, addr[0], "acme")
        token = tenant_a.metadata[0][1].split()[1]
        tenant_b = ControlPlaneClient(addr[1], token)
        clients += [tenant_a, tenant_b]
        await eventually(lambda: b.view.tenant("acme") is not None and only in b.view.pool_fences)

        # Through b (the owner): a's view never hears of it.
        mine = await reserve(tenant_b, "req-b", 16)
        await asyncio.sleep(0.3)
        assert mine.id in b.view.reservations and mine.id not in a.view.reservations

        # Through a: it takes b's slot on for a while and reserves there.
        first = await reserve(tenant_a, "req-1", 16)
        assert first.engine_id == only and first.id in a.view.reservations
        # Asked again, through either replica (neither follows the request index): the same
        # reservation, not a second one.
        assert not a.view.requests and not b.view.requests
        assert (await reserve(tenant_b, "req-1", 16)).id == first.id
        assert (await reserve(tenant_a, "req-1", 16)).id == first.id
        got = await reserve(tenant_b, "req-2", 16)
        assert (await reserve(tenant_a, "req-2", 16)).id == got.id

        # A decode sidecar's stream on the replica that does not own its engine hears it.
        watch = engine_client.registry.WatchEngineReservations(
            registry_pb2.WatchEngineReservationsRequest(engine_id=only, include_snapshot=True),
            metadata=engine_client.metadata)
        seen: list = []
        while (event := await watch.read()).kind != scheduler_pb2.ReservationEvent.SNAPSHOT_END:
            seen.append(event.reservation.id)
        assert set(seen) == {mine.id, first.id, got.id}
        # Released through a (which follows the slot now) and through b: both reach the stream.
        await release(tenant_a, mine.id)
        event = await asyncio.wait_for(watch.read(), 5)
        assert event.reservation.id == mine.id and event.reservation.state == types_pb2.RELEASED
        watch.cancel()

        # A prefill sidecar's stream, on a replica owning neither the prefill engine nor the
        # decode engine: told from the copies under the prefill engine's slot, which is all
        # that replica takes on for it.
        prefill_id = engine_owned_by("a", skip=1)
        prefill = SimulatedEngine(engine_client, prefill_id, num_blocks=64, role=types_pb2.PREFILL)
        engines.append(prefill)
        await prefill.register()
        other = ControlPlaneClient(addr[1], ENGINE_TOKEN)
        clients.append(other)
        before = set(b.view.following)
        p_watch = other.registry.WatchEngineReservations(
            registry_pb2.WatchEngineReservationsRequest(engine_id=prefill_id, include_snapshot=True),
            metadata=other.metadata)
        assert (await asyncio.wait_for(p_watch.read(), 5)).kind == scheduler_pb2.ReservationEvent.SNAPSHOT_END
        assert b.view.following == before | {keys.slot_of(prefill_id)}
        named = await reserve(tenant_a, "req-named", 16, prefill_engine_id=prefill_id)
        event = await asyncio.wait_for(p_watch.read(), 5)
        assert event.reservation.id == named.id and event.reservation.state == types_pb2.RESERVED
        await release(tenant_a, named.id)
        event = await asyncio.wait_for(p_watch.read(), 5)
        assert event.reservation.id == named.id and event.reservation.state == types_pb2.RELEASED
        p_watch.cancel()

        status = await admin.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=admin.metadata)
        assert status.live_replicas == 2

        # Deleting the tenant through a ends its reservations on every slot.
        deleted = await admin.admin.DeleteTenant(admin_pb2.DeleteTenantRequest(name="acme"), metadata=admin.metadata)
        assert deleted.reservations_released == 2
        report = await settle(etcd.endpoint, quiet=True)
        assert not [r for r in report.live if r.tenant == "acme"]
        await expect_code(grpc.StatusCode.UNAUTHENTICATED, reserve(tenant_b, "req-after", 16))


async def test_a_quota_counted_by_partitioned_replicas_is_never_overrun(etcd):
    """A tenant with a quota no longer makes every replica follow every slot: a replica its
    Reserves come to follows that tenant's part of the request index (its usage) besides
    its own slots. Reserves through both replicas at once, on engines each owns, never take
    more than the quota (the usage fence orders them); what is released is counted back on
    both, and the count is what etcd holds."""
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        a, b = planes
        admin = ControlPlaneClient(addr[0], ADMIN_TOKEN)
        engine_client = ControlPlaneClient(addr[0], ENGINE_TOKEN)
        clients += [admin, engine_client]
        for owner in ("a", "b"):
            engines.append(SimulatedEngine(engine_client, engine_owned_by(owner), num_blocks=64))
            await engines[-1].register()
        capped = await make_tenant(admin, addr[0], "capped", quota_blocks=10)
        token = capped.metadata[0][1].split()[1]
        through = [capped, ControlPlaneClient(addr[1], token)]
        clients += through

        def slots(plane) -> set:
            return {p for p in plane.view.following or () if isinstance(p, int)}
        await eventually(lambda: all(p.view.tenant("capped") is not None and p.view.following is not None
                                     and len(slots(p)) < keys.SLOTS for p in planes))
        assert slots(a).isdisjoint(slots(b)) and not any("capped" in p.view.following for p in planes)

        # 24 asks of one block each through both replicas at once: exactly 10 granted.
        results = await asyncio.gather(*(reserve(through[i % 2], f"q{i}", 16) for i in range(24)),
                                       return_exceptions=True)
        granted = [r for r in results if not isinstance(r, Exception)]
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(granted) == 10, [getattr(r, "details", lambda: r)() for r in refused]
        assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in r.details() for r in refused)
        assert {r.engine_id for r in granted} <= {e.engine_id for e in engines}
        await eventually(lambda: all(p.view.requests.used.get("capped") == 10 for p in planes))
        assert all("capped" in p.view.following and len(slots(p)) < keys.SLOTS for p in planes)

        # Released through a: b counts the blocks back and grants that many more, no more.
        for res in granted[:3]:
            await release(capped, res.id)
        await eventually(lambda: b.view.requests.used.get("capped") == 7)
        for i in range(3):
            await reserve(through[1], f"more{i}", 16)
        await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, reserve(through[1], "over", 16))
        listed = await admin.admin.ListTenants(admin_pb2.ListTenantsRequest(), metadata=admin.metadata)
        assert {t.name: t.reserved_blocks for t in listed.tenants}["capped"] == 10
        report = await settle(etcd.endpoint)
        assert report.tenant_usage["capped"] == 10


async def test_list_engines_tells_the_others_engines_from_their_owners_summary_without_following_them(etcd):
    """ListEngines through a replica owning one engine and not the other: its own exact, the
    other's free blocks as its owner last told (free_summary.py), and the replica keeps to
    its own slots; asked for exact counts, it follows every slot and gives them all."""
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        a, b = planes
        await eventually(lambda: all(p.view.following is not None and len(p.view.following) < keys.SLOTS
                                     for p in planes))
        admin = ControlPlaneClient(addr[0], ADMIN_TOKEN)
        engine_client = ControlPlaneClient(addr[0], ENGINE_TOKEN)
        clients += [admin, engine_client]
        mine, theirs = engine_owned_by("a"), engine_owned_by("b")
        for engine_id in (mine, theirs):
            engines.append(SimulatedEngine(engine_client, engine_id, num_blocks=64))
            await engines[-1].register()
        tenant_a = await make_tenant(admin, addr[0], "acme")
        tenant_b = ControlPlaneClient(addr[1], tenant_a.metadata[0][1].split()[1])
        clients += [tenant_a, tenant_b]
        await eventually(lambda: b.view.tenant("acme") is not None and theirs in b.view.pool_fences)
        held = [await reserve(tenant_b, f"req-{i}", 40) for i in range(2)]  # through b, on its own engine
        assert {r.engine_id for r in held} == {theirs}
        exact_free = b.view.free_blocks(theirs)
        assert exact_free < 64

        following = set(a.view.following)

        async def listed(exact: bool = False) -> dict:
            answer = await tenant_a.scheduler.ListEngines(scheduler_pb2.ListEnginesRequest(exact=exact),
                                                          metadata=tenant_a.metadata, timeout=10)
            return {e.engine_id: e for e in answer.engines}
        deadline = asyncio.get_running_loop().time() + 5
        while (got := await listed())[theirs].free_blocks != exact_free:  # (told every 0.5 s)
            assert asyncio.get_running_loop().time() < deadline, got[theirs]
            await asyncio.sleep(0.1)
        assert got[theirs].reserved_blocks == 64 - exact_free and got[theirs].live_reservations == 0
        assert got[mine].free_blocks == 64 and got[mine].num_blocks == 64
        await asyncio.sleep(0.3)
        assert a.view.following == following  # nothing more followed for it

        got = await listed(exact=True)
        assert got[theirs].free_blocks == exact_free and got[theirs].live_reservations == 2
        # Every slot (None: all), while it answered and for a while after.
        assert a.view.following is None or len(a.view.following) == keys.SLOTS

"""Three control-plane replicas (processes) over a real 3-member etcd share the engines out
between them (kvpush/controlplane/ownership.py) and each reserves on its own; one killed
under Reserve load gives its engines up to the other two within its lease's TTL, the
callers it had go on through the survivors by themselves (one multi-address channel),
and etcd shows no reservation lost or made twice and no block booked twice."""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest

from kvpush.app.etcd_server import EtcdCluster
from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import admin_pb2
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient
from kvpush.controlplane.ownership import LEASE_TTL_S, SLOTS, assign, slot_of
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.controlplane.follow import follow
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN, ControlPlaneProcess
from tests.controlplane.helpers import expect_code, make_tenant, reserve, settle, stop_all

pytestmark = pytest.mark.timeout(240)

ENGINES = 24


@pytest.fixture
def cluster():
    c = EtcdCluster(3).start()
    yield c
    c.stop()


async def shares(clients: list[ControlPlaneClient]) -> list[admin_pb2.StatusResponse]:
    return [await c.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=c.metadata, timeout=10) for c in clients]


async def until_shared(clients: list[ControlPlaneClient], replicas: int, timeout_s: float) -> float:
    """Seconds until every replica sees ``replicas`` live and their slots add up to all."""
    t0 = time.monotonic()
    while True:
        got = await shares(clients)
        if all(s.live_replicas == replicas and s.owned_slots > 0 for s in got) and \
                sum(s.owned_slots for s in got) == SLOTS:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < timeout_s, [(s.replica_id, s.live_replicas, s.owned_slots) for s in got]
        await asyncio.sleep(0.1)


async def test_three_replicas_share_the_engines_and_a_killed_one_gives_them_up(cluster):
    procs = [ControlPlaneProcess(cluster.endpoints) for _ in range(3)]
    clients: list[ControlPlaneClient] = []
    try:
        for p in procs:
            p.wait_ready()
        admins = [ControlPlaneClient(p.address, ADMIN_TOKEN) for p in procs]
        clients += admins
        await until_shared(admins, 3, 15)
        ids = [s.replica_id for s in await shares(admins)]
        owners = assign(ids)

        engine_client = ControlPlaneClient(procs[0].address, ENGINE_TOKEN)
        clients.append(engine_client)
        # Roomy engines: a replica keeps to its own while they are within 5% of the emptiest,
        # and the few a replica may own must stay within that for the whole run.
        engines = [SimulatedEngine(engine_client, f"decode-{i:02d}", 40_000, lease_ttl_s=30) for i in range(ENGINES)]
        for engine in engines:
            await engine.register()
        owned = {ids[i]: {e.engine_id for e in engines if owners[slot_of(e.engine_id)] == ids[i]} for i in range(3)}
        assert all(owned.values()), owned
        tenant = await make_tenant(admins[0], procs[0].address, "acme")
        token = tenant.metadata[0][1].split()[1]
        clients.append(tenant)
        await asyncio.sleep(0.5)  # every view has the engines and the tenant
        # Callers of the replica about to die reach it first on a channel that lists every replica.
        others = ",".join(p.address for p in procs[:2])
        failover = ControlPlaneClient(f"ipv4:{procs[2].address},{others}", token)
        direct = [ControlPlaneClient(p.address, token) for p in procs[:2]]
        clients += [failover, *direct]

        answered: dict[str, tuple[object, float, int]] = {}  # request id -> (reservation, when, worker's replica)
        unavailable = 0
        stop = asyncio.Event()

        async def load(name: str, client: ControlPlaneClient, replica: int) -> None:
            nonlocal unavailable
            i = 0
            while not stop.is_set():
                rid = f"{name}-{i}"
                while True:  # asked again with the same request id until answered: Reserve is idempotent
                    try:
                        res = await reserve(client, rid, 16, deadline_ms=120_000)
                        break
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
                        unavailable += 1
                        await asyncio.sleep(0.05)
                answered[rid] = (res, time.monotonic(), replica)
                i += 1

        tasks = [asyncio.create_task(load(f"v{w}", failover, 2)) for w in range(2)]
        tasks += [asyncio.create_task(load(f"d{r}", direct[r], r)) for r in range(2)]
        await asyncio.sleep(2)
        killed = time.monotonic()
        procs[2].proc.kill()
        took = await until_shared(admins[:2], 2, LEASE_TTL_S + 5)
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.gather(*tasks)

        report = await settle(cluster.endpoints)  # every invariant: no block in two live reservations
        live = {r.request_id: r for r in report.live}
        assert set(answered) <= set(live)  # none lost (more may be live: answered by the dead one, never heard)
        for rid, (res, _, _) in answered.items():
            assert live[rid].id == res.id and live[rid].blocks == list(res.block_ids)
        assert len({r.id for r in report.live}) == len(report.live)
        after = [rid for rid, (_, when, replica) in answered.items() if replica == 2 and when > killed + took]
        assert after, "the dead replica's callers were not served by the others"
        # Before the kill, each replica reserved on the engines it owns.
        for r in range(2):
            mine = [res.engine_id for res, when, replica in answered.values() if replica == r and when < killed]
            assert mine and set(mine) <= owned[ids[r]], (ids[r], set(mine) - owned[ids[r]])
        print(f"\n{len(answered)} reservations; the killed replica's slots taken over in {took:.1f} s "
              f"(lease TTL {LEASE_TTL_S} s); {unavailable} UNAVAILABLE answers retried")
        for engine in engines:
            await engine.stop()
    finally:
        for client in clients:
            await client.close()
        for p in procs:
            p.stop()


async def test_a_replica_stopped_cleanly_hands_its_engines_over_at_once(etcd, cp_processes):
    procs = cp_processes(2)
    admins = [ControlPlaneClient(p.address, ADMIN_TOKEN) for p in procs]
    reader = EtcdClient(etcd.endpoint)
    try:
        await until_shared(admins, 2, 15)
        assert len((await reader.get_prefix(keys.REPLICAS))[0]) == 2
        procs[1].stop()  # SIGTERM: it revokes its lease on the way out
        # Its key is gone as it exits, not when its lease would have run out.
        assert len((await reader.get_prefix(keys.REPLICAS))[0]) == 1
        took = await until_shared(admins[:1], 1, 3)
        assert took < LEASE_TTL_S
    finally:
        await reader.close()
        for a in admins:
            await a.close()


async def test_a_replica_owning_few_engines_does_not_pile_its_requests_on_them(etcd, cp_processes):
    """Three engines, two replicas: one owns two, the other one. Each takes half the
    Reserves; preferring its own engines without a limit, the second would put its whole
    half on its one engine. Within the slack, the engines stay level."""
    engine_ids = ["decode-x", "decode-y", "decode-z"]
    ids = next((a, b) for a, b in ((f"cp-{i}", f"cp-{i + 1}") for i in range(0, 200, 2))
               if sorted(collections.Counter(assign([a, b])[slot_of(e)] for e in engine_ids).values()) == [1, 2])
    procs = cp_processes(1, ["--replica-id", ids[0]]) + cp_processes(1, ["--replica-id", ids[1]])
    admins = [ControlPlaneClient(p.address, ADMIN_TOKEN) for p in procs]
    engine_client = ControlPlaneClient(procs[0].address, ENGINE_TOKEN)
    engines = [SimulatedEngine(engine_client, e, 100, lease_ttl_s=30) for e in engine_ids]
    try:
        await until_shared(admins, 2, 15)
        for engine in engines:
            await engine.register()
        tenant = await make_tenant(admins[0], procs[0].address, "acme")
        token = tenant.metadata[0][1].split()[1]
        clients = [tenant, ControlPlaneClient(procs[1].address, token)]
        await asyncio.sleep(0.5)
        placed, order = collections.Counter(), []
        for i in range(60):  # held, one block each
            engine_id = (await reserve(clients[i % 2], f"r{i}", 16, deadline_ms=60_000)).engine_id
            placed[engine_id] += 1
            order.append(f"{ids[i % 2]}>{engine_id}")
        # 30 on one, 15 on two without the slack ((which replica asked)>(where it went), in order, if not)
        assert max(placed.values()) - min(placed.values()) <= 8, (placed, " ".join(order))
        for client in clients:
            await client.close()
    finally:
        for engine in engines:
            await engine.stop()
        for client in admins + [engine_client]:
            await client.close()


async def test_a_quota_set_through_a_lagging_replica_still_holds(etcd):
    """Reserves for a tenant without a quota leave its usage fence alone. A quota set through
    a replica whose view has not yet seen another replica's reservations for that tenant (on
    another engine: the other fences pass too) must not be checked against that short count:
    setting it bumps the fence, so the lagging replica's Reserve waits until it has caught up."""
    planes = []
    for _ in range(2):
        plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                                engine_token=ENGINE_TOKEN))
        await plane.start()
        await plane.view.ready.wait()
        planes.append(plane)
    lagging, other = planes
    addresses = [f"127.0.0.1:{p.port}" for p in planes]
    admin = ControlPlaneClient(addresses[0], ADMIN_TOKEN)
    engine_client = ControlPlaneClient(addresses[0], ENGINE_TOKEN)
    engines = [SimulatedEngine(engine_client, e, 100, lease_ttl_s=30) for e in ("decode-p", "decode-q")]
    clients = [admin, engine_client]
    try:
        for engine in engines:
            await engine.register()
        tenant = await make_tenant(admin, addresses[0], "acme")
        token = tenant.metadata[0][1].split()[1]
        via_other = ControlPlaneClient(addresses[1], token)
        clients += [tenant, via_other]
        await asyncio.sleep(0.3)
        lagging._follow.cancel()  # its view stops here
        await asyncio.gather(lagging._follow, return_exceptions=True)
        for i in range(4):
            await reserve(via_other, f"held-{i}", 16, preferred_engine_id="decode-p")
        await admin.admin.UpdateTenant(admin_pb2.UpdateTenantRequest(name="acme", quota_blocks=4),
                                       metadata=admin.metadata, timeout=10)
        ask = asyncio.create_task(reserve(tenant, "one-more", 16, preferred_engine_id="decode-q"))
        await asyncio.sleep(0.5)
        assert not ask.done(), "granted on a count that missed the other replica's reservations"
        lagging._follow = asyncio.create_task(follow(lagging.view, lagging.etcd, lagging._stop))
        details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, ask)
        assert "quota" in details
        report = await settle(etcd.endpoint)
        assert report.tenant_usage["acme"] == 4
    finally:
        await stop_all(engines, clients, planes)

"""A Reserve that should go to another replica's engine is forwarded to that engine's owner,
which commits it (kvpush/controlplane/elsewhere.py, forwarding.py): two replicas over a real
etcd, the unary call and the stream, asked again, KV-aware preference for the other's
engine, a conflicting request id, and an owner that cannot be reached (the Reserve is then
committed by the replica asked, after following the slot), and forwarding between replicas
that require client certificates."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import REGISTRY

from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.reserve_stream import StreamReserver
from kvpush.contract.v1 import admin_pb2, scheduler_pb2
from kvpush.controlplane import keys
from kvpush.controlplane.records import ReplicaRecord
from kvpush.controlplane.server import ControlPlaneConfig, peer_tls
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import expect_code, reserve, settle
from tests.controlplane.test_follow import eventually
from tests.controlplane.test_partitioned import engine_owned_by, two_replicas
from tests.pki import make_pki


def forwarded(code: str = "OK") -> float:
    return REGISTRY.get_sample_value("kvpush_reserve_forwarded_total", {"code": code}) or 0.0


def widened() -> float:
    return REGISTRY.get_sample_value("kvpush_reserve_widened_total") or 0.0


async def tenant_of_a(planes, addr, clients, engines, engine_ids, **tls) -> ControlPlaneClient:
    """``engine_ids`` registered (64 blocks each) and tenant acme's client on replica a, once
    a knows the engines from b's free summary (put every 0.5 s) and b knows the tenant."""
    a, b = planes
    admin = ControlPlaneClient(addr[0], ADMIN_TOKEN, **tls)
    engine_client = ControlPlaneClient(addr[0], ENGINE_TOKEN, **tls)
    clients += [admin, engine_client]
    for engine_id in engine_ids:
        engines.append(SimulatedEngine(engine_client, engine_id, num_blocks=64))
        await engines[-1].register()
    made = await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name="acme"), metadata=admin.metadata)
    tenant = ControlPlaneClient(addr[0], made.token, **tls)
    clients.append(tenant)
    await eventually(lambda: b.view.tenant("acme") is not None and a.view.following is not None and all(
        a.view.followed(keys.slot_of(e)) or a.view.free_told.merged().get(e) == 64 for e in engine_ids))
    return tenant


async def test_the_owner_commits_what_another_replica_is_asked_for(etcd):
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        a, b = planes
        theirs, mine = engine_owned_by("b"), engine_owned_by("a")
        tenant_a = await tenant_of_a(planes, addr, clients, engines, [theirs, mine])
        slot = keys.slot_of(theirs)
        assert slot not in a.view.following

        # KV-aware routing's preference for b's engine, asked of a: b commits it.
        before = forwarded()
        first = await reserve(tenant_a, "req-1", 16, preferred_engine_id=theirs)
        assert first.engine_id == theirs and forwarded() == before + 1
        await eventually(lambda: first.id in b.view.reservations)
        assert first.id not in a.view.reservations and slot not in a.view.following

        # Asked again through a: forwarded again, and b answers the same reservation.
        assert (await reserve(tenant_a, "req-1", 16, preferred_engine_id=theirs)).id == first.id
        # The same request id with other parameters: b's ALREADY_EXISTS, passed on as it is.
        details = await expect_code(grpc.StatusCode.ALREADY_EXISTS,
                                    reserve(tenant_a, "req-1", 32, preferred_engine_id=theirs))
        assert first.id in details

        # a's own engine full: a Reserve over the stream goes to b's, through b.
        await reserve(tenant_a, "fill", 64 * 16, preferred_engine_id=mine)
        stream = StreamReserver(tenant_a)
        try:
            before = forwarded()
            got = await asyncio.gather(*(stream.reserve(scheduler_pb2.ReserveRequest(
                request_id=f"s{i}", num_tokens=16, model="sim-model"), timeout=10) for i in range(5)))
        finally:
            await stream.close()
        assert {r.engine_id for r in got} == {theirs} and forwarded() == before + 5
        await eventually(lambda: all(r.id in b.view.reservations for r in got))
        assert slot not in a.view.following
        report = await settle(etcd.endpoint, until=lambda r: len(r.live) == 7)
        assert len(report.engines[theirs].free) == 64 - 6


async def test_an_owner_that_cannot_be_reached_costs_a_detour_not_the_request(etcd):
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        a, b = planes
        theirs = engine_owned_by("b")
        other = next(engine_owned_by("b", skip=i) for i in range(1, 50)
                     if keys.slot_of(engine_owned_by("b", skip=i)) != keys.slot_of(theirs))
        tenant_a = await tenant_of_a(planes, addr, clients, engines, [theirs, other])
        # a's view says b is where nothing listens (a replica restarted elsewhere, a bad
        # --advertise): the forward fails at once and a commits the Reserve itself.
        a.view.replicas["b"] = ReplicaRecord("b", "127.0.0.1:1", 0)
        before_unavailable, before_widened = forwarded("UNAVAILABLE"), widened()
        got = await reserve(tenant_a, "req-1", 16, preferred_engine_id=theirs)
        assert got.engine_id == theirs and got.id in a.view.reservations
        assert forwarded("UNAVAILABLE") == before_unavailable + 1 and widened() == before_widened + 1
        assert keys.slot_of(theirs) in a.view.following
        # For a while b is not asked again (it would cost every such Reserve a wait on an
        # owner that may be gone until its lease runs out): one for b's other engine, in a
        # slot a does not follow, is committed by a at once.
        assert keys.slot_of(other) not in a.view.following
        aside, unavailable = forwarded("SET_ASIDE"), forwarded("UNAVAILABLE")
        again = await reserve(tenant_a, "req-2", 16, preferred_engine_id=other)
        assert again.engine_id == other and again.id in a.view.reservations
        assert forwarded("SET_ASIDE") == aside + 1 and forwarded("UNAVAILABLE") == unavailable
        await settle(etcd.endpoint, until=lambda r: len(r.live) == 2)


async def test_forwarding_between_replicas_that_require_client_certificates(etcd, tmp_path):
    pki = make_pki(tmp_path, ("server", "client"))
    tls = dict(tls_cert=pki("server.pem"), tls_key=pki("server.key"), tls_client_ca=pki("ca.pem"))
    # Without a CA for its peers a TLS replica does not forward (it would not know whom to trust).
    assert peer_tls(ControlPlaneConfig(**tls)) == (False, None)
    # The peers' certificates name localhost and 127.0.0.1; the name is overridden as it would
    # be for a certificate naming the service rather than each pod's address.
    async with two_replicas(etcd, peer_tls_ca=pki("ca.pem"), peer_tls_server_name="localhost", **tls) as (
            planes, addr, clients, engines):
        a, b = planes
        theirs = engine_owned_by("b")
        tenant_a = await tenant_of_a(planes, addr, clients, engines, [theirs], tls_ca=pki("ca.pem"),
                                     tls_cert=pki("client.pem"), tls_key=pki("client.key"))
        before = forwarded()
        got = await reserve(tenant_a, "req-1", 16)
        assert got.engine_id == theirs and forwarded() == before + 1
        await eventually(lambda: got.id in b.view.reservations)
        assert got.id not in a.view.reservations

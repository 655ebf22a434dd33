"""What sidecars rely on: the engine-scoped watch, and a prefill engine's death
ending the reservations it was pushing into."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import registry_pb2, scheduler_pb2, types_pb2
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve, settle

CHANGED = scheduler_pb2.ReservationEvent.CHANGED


async def report(client, res_id, state, engine_id=""):
    return await client.registry.ReportState(registry_pb2.ReportStateRequest(
        reservation_id=res_id, state=state, engine_id=engine_id), metadata=client.metadata, timeout=5)


async def read_until(stream, pred, timeout=10.0):
    while True:
        event = await asyncio.wait_for(stream.read(), timeout)
        if event.kind == CHANGED and pred(event.reservation):
            return event.reservation


async def test_pushing_needs_a_registered_prefill_engine(cp, admin, engine_client):
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=16)
    await decode.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    res = await reserve(tenant, "r", 16)
    details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, report(engine_client, res.id, types_pb2.PUSHING))
    assert "engine_id" in details
    await expect_code(grpc.StatusCode.NOT_FOUND, report(engine_client, res.id, types_pb2.PUSHING, "ghost"))
    await tenant.close()
    await decode.stop()


async def test_engine_watches_and_prefill_death(cp, admin, engine_client, etcd):
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    prefill = SimulatedEngine(engine_client, "prefill-0", num_blocks=32, role=types_pb2.PREFILL)
    await decode.register()
    await prefill.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    old = await reserve(tenant, "before-watch", 16)

    def watch(engine_id):
        return engine_client.registry.WatchEngineReservations(
            registry_pb2.WatchEngineReservationsRequest(engine_id=engine_id, include_snapshot=True),
            metadata=engine_client.metadata)
    d_watch, p_watch = watch("decode-0"), watch("prefill-0")
    snap = await asyncio.wait_for(d_watch.read(), 5)
    assert snap.kind == scheduler_pb2.ReservationEvent.SNAPSHOT and snap.reservation.id == old.id
    assert (await asyncio.wait_for(d_watch.read(), 5)).kind == scheduler_pb2.ReservationEvent.SNAPSHOT_END
    assert (await asyncio.wait_for(p_watch.read(), 5)).kind == scheduler_pb2.ReservationEvent.SNAPSHOT_END

    res = await reserve(tenant, "r", 64)
    seen = await read_until(d_watch, lambda r: r.id == res.id)
    assert seen.state == types_pb2.RESERVED
    got = await report(engine_client, res.id, types_pb2.PUSHING, "prefill-0")
    assert got.prefill_engine_id == "prefill-0"
    assert (await read_until(p_watch, lambda r: r.id == res.id)).state == types_pb2.PUSHING

    # The prefill engine dies mid-push: the reservation it was filling ends FAILED,
    # the decode side hears of it, and the blocks come back.
    await prefill.crash()
    ended = await read_until(d_watch, lambda r: r.id == res.id and r.state == types_pb2.FAILED)
    assert "prefill" in ended.reason and ended.ended_unix_ms > 0
    report_ = await settle(etcd.endpoint, until=lambda r: [x.id for x in r.live] == [old.id])
    assert len(report_.engines["decode-0"].free) == 31
    await release(tenant, old.id)
    for stream in (d_watch, p_watch):
        stream.cancel()
    await tenant.close()
    await decode.stop()


async def test_unconsumed_blocks_are_quarantined(etcd):
    """A late write from a prefill that has not yet heard of the end must not land
    in someone else's KV: blocks of a reservation that ended unconsumed stay out
    of use for the quarantine; consumed ones come back at once."""
    from kvpush.client.control_plane import ControlPlaneClient
    from kvpush.controlplane.invariants import check
    from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
    from tests.conftest import ADMIN_TOKEN
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            quarantine_ms=1500))
    await plane.start()
    await plane.view.ready.wait()
    address = f"127.0.0.1:{plane.port}"
    admin = ControlPlaneClient(address, ADMIN_TOKEN)
    try:
        decode = SimulatedEngine(admin, "decode-0", num_blocks=2)
        await decode.register()
        tenant = await make_tenant(admin, address, "acme", quota_blocks=2)
        a = await reserve(tenant, "a", 16)
        b = await reserve(tenant, "b", 16)
        await release(tenant, a.id)                          # aborted: quarantined
        await report(admin, b.id, types_pb2.LANDED)
        await report(admin, b.id, types_pb2.CONSUMED)        # consumed: free at once
        c = await reserve(tenant, "c", 16)
        assert list(c.block_ids) == list(b.block_ids)
        # Quota is back (a's end returned it) but a's block is still quarantined.
        details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, reserve(tenant, "d", 16))
        assert "room" in details
        # A replica that starts now learns the quarantine from the tombstone in etcd.
        late = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                               quarantine_ms=1500))
        await late.start()
        await late.view.ready.wait()
        assert late.view.free_blocks("decode-0") == 0
        await late.stop(0.1)
        await asyncio.sleep(1.6)
        d = await reserve(tenant, "d", 16)
        assert list(d.block_ids) == list(a.block_ids)
        report_ = await check(etcd.endpoint, quarantine_ms=1500)
        assert report_.ok, report_.summary()
        # The checker does catch a reuse inside the quarantine.
        strict = await check(etcd.endpoint, quarantine_ms=60_000)
        assert any("quarantine" in v for v in strict.violations)
        await tenant.close()
        await decode.stop()
    finally:
        await admin.close()
        await plane.stop(0.1)


async def test_reserve_naming_the_prefill_engine_reaches_its_watch_at_once(cp, admin, engine_client):
    """The router may send the prefill request before its Reserve answers: a reservation
    that names the prefill engine is on that engine's watch the moment it is granted."""
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    prefill = SimulatedEngine(engine_client, "prefill-0", num_blocks=32, role=types_pb2.PREFILL)
    await decode.register()
    await prefill.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    p_watch = engine_client.registry.WatchEngineReservations(
        registry_pb2.WatchEngineReservationsRequest(engine_id="prefill-0", include_snapshot=True),
        metadata=engine_client.metadata)
    assert (await asyncio.wait_for(p_watch.read(), 5)).kind == scheduler_pb2.ReservationEvent.SNAPSHOT_END
    res = await reserve(tenant, "rt-handover", 40, prefill_engine_id="prefill-0")
    assert res.prefill_engine_id == "prefill-0" and res.prefill_engine_incarnation
    seen = await read_until(p_watch, lambda r: r.id == res.id)
    assert seen.state == types_pb2.RESERVED and seen.request_id == "rt-handover"
    assert list(seen.block_ids) == list(res.block_ids) and seen.engine_id == "decode-0"
    # Not a prefill engine, or none at all: refused, naming the field; nothing is reserved.
    for bad in ("decode-0", "ghost", "bad id!"):
        details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                                    reserve(tenant, f"rt-{len(bad)}", 8, prefill_engine_id=bad))
        assert "prefill_engine_id" in details
    await release(tenant, res.id)
    p_watch.cancel()
    await tenant.close()
    await decode.stop()
    await prefill.stop()

"""Two replicas whose quarantines of the same ended reservation end at different times
(their clocks differ; a record deleted by its lease is timed by each replica's own
clock). The one whose quarantine ends first may grant the blocks again; the other,
applying that grant over blocks it still holds in quarantine, must not free them when
its own quarantine ends: they are the new reservation's."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import registry_pb2, types_pb2
from kvpush.controlplane.invariants import check
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from tests.conftest import ADMIN_TOKEN
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve
from tests.polling import until


async def test_a_grant_over_blocks_another_replica_still_quarantines_survives_that_quarantine(etcd):
    def replica(quarantine_ms: int) -> ControlPlane:
        # (the same replica id: both own the engine, so each commits its own Reserves)
        return ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                               replica_id="twin", quarantine_ms=quarantine_ms))
    quick, slow = replica(300), replica(2500)
    clients = []
    try:
        for plane in (quick, slow):
            await plane.start()
            await plane.view.ready.wait()
        admin = ControlPlaneClient(f"127.0.0.1:{quick.port}", ADMIN_TOKEN)
        clients.append(admin)
        decode = SimulatedEngine(admin, "decode-0", num_blocks=1)
        await decode.register()
        tenant = await make_tenant(admin, f"127.0.0.1:{quick.port}", "acme")
        token = tenant.metadata[0][1].split()[1]
        via_slow = ControlPlaneClient(f"127.0.0.1:{slow.port}", token)
        clients += [tenant, via_slow]
        first = await reserve(tenant, "first", 16)
        await release(tenant, first.id)            # ended unconsumed: quarantined on both
        await asyncio.sleep(0.5)                   # past the quick replica's quarantine only
        second = await reserve(tenant, "second", 16)
        assert list(second.block_ids) == list(first.block_ids)
        await until(lambda: second.id in slow.view.reservations, 2, "the slow replica applied the grant")
        assert slow.view.free_blocks("decode-0") == 0
        await asyncio.sleep(2.5)                   # past the slow replica's quarantine too
        assert slow.view.free_blocks("decode-0") == 0, "the slow replica freed a block the second reservation holds"
        details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, reserve(via_slow, "third", 16))
        assert "room" in details
        for state in (types_pb2.LANDED, types_pb2.CONSUMED):   # consumed: free at once, on both
            await admin.registry.ReportState(registry_pb2.ReportStateRequest(reservation_id=second.id, state=state),
                                             metadata=admin.metadata, timeout=5)
        await until(lambda: slow.view.free_blocks("decode-0") == 1, 2, "the consumed block free on the slow replica")
        report = await check(etcd.endpoint, quarantine_ms=300)
        assert report.ok, report.summary()
        await decode.stop()
    finally:
        for client in clients:
            await client.close()
        for plane in (quick, slow):
            await plane.stop(0.1)

"""Deadlines, engine death, and etcd outages: every reservation ends, every block
comes back, watchers are told; checked by reading etcd directly."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc

from kvpush.client.reserve_stream import StreamReserver
from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import registry_pb2, scheduler_pb2, types_pb2
from tests.conftest import ENGINE_TOKEN, ROOT
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve, settle


async def next_event(stream, kind=scheduler_pb2.ReservationEvent.CHANGED, timeout=10.0):
    while True:
        event = await asyncio.wait_for(stream.read(), timeout)
        if event.kind == kind:
            return event


async def test_deadline_expiry_frees_blocks_and_tells_watchers(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    watch = tenant.scheduler.WatchReservations(scheduler_pb2.WatchReservationsRequest(include_snapshot=True),
                                               metadata=tenant.metadata)
    await next_event(watch, scheduler_pb2.ReservationEvent.SNAPSHOT_END)
    started = time.monotonic()
    res = await reserve(tenant, "short", 100, deadline_ms=1000)
    created = await next_event(watch)
    assert created.reservation.id == res.id and created.reservation.state == types_pb2.RESERVED
    expired = await next_event(watch, timeout=15)
    assert expired.reservation.id == res.id and expired.reservation.state == types_pb2.EXPIRED
    assert time.monotonic() - started < 8  # etcd's lease granularity, not ours
    report = await settle(etcd.endpoint, quiet=True)
    assert len(report.engines["decode-0"].free) == 32
    # The ended record stays readable for a while, and cannot be released.
    await asyncio.sleep(0.3)
    got = await tenant.scheduler.GetReservation(scheduler_pb2.GetReservationRequest(reservation_id=res.id),
                                                metadata=tenant.metadata)
    assert got.state == types_pb2.EXPIRED
    await expect_code(grpc.StatusCode.NOT_FOUND, release(tenant, res.id))
    watch.cancel()
    await tenant.close()
    await engine.stop()


async def test_engine_heartbeat_stream_end_fails_its_reservations(cp, admin, engine_client, etcd):
    keep = SimulatedEngine(engine_client, "decode-keep", num_blocks=16)
    dying = SimulatedEngine(engine_client, "decode-dying", num_blocks=16)
    await keep.register()
    await dying.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    held = [await reserve(tenant, f"d{i}", 16, preferred_engine_id="decode-dying") for i in range(3)]
    other = await reserve(tenant, "k", 16, preferred_engine_id="decode-keep")
    assert {r.engine_id for r in held} == {"decode-dying"}
    await dying.crash()
    report = await settle(etcd.endpoint, until=lambda r: "decode-dying" not in r.engines and len(r.live) == 1)
    for res in held:
        got = await cp.lifecycle.find(res.id)
        assert got.state.name == "FAILED", got
    assert [r.id for r in report.live] == [other.id]
    await release(tenant, other.id)
    await settle(etcd.endpoint, quiet=True)
    await tenant.close()
    await keep.stop()


async def test_a_heartbeat_etcd_fails_ends_its_stream_but_not_the_engine(cp, admin, engine_client, etcd):
    """etcd failed the keep-alive (a leader election): the stream ends UNAVAILABLE, and the
    engine, whose lease is still good, keeps its registration and its reservations (the
    engine's next stream, or its lease's TTL, decides). A leader change once deregistered
    every engine whose heartbeat came at that moment."""
    from kvpush.controlplane.etcd import EtcdUnavailable
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=16, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    res = await reserve(tenant, "r1", 16)

    async def election(lease_id: int) -> int:
        raise EtcdUnavailable("etcdserver: leader changed")
    cp.etcd.refresh_lease = election
    try:
        ping = registry_pb2.HeartbeatPing(engine_id="decode-0", lease_id=engine.lease_id)
        call = engine_client.registry.Heartbeat(iter([ping]), metadata=engine_client.metadata, timeout=10)
        code = await expect_code(grpc.StatusCode.UNAVAILABLE, call.read())
        assert "leader changed" in code
    finally:
        del cp.etcd.refresh_lease
    await asyncio.sleep(1.0)  # a revoke, had one been sent, has landed
    report = await settle(etcd.endpoint, until=lambda r: "decode-0" in r.engines and len(r.live) == 1)
    assert [r.id for r in report.live] == [res.id]
    await release(tenant, res.id)
    await settle(etcd.endpoint, quiet=True)
    await tenant.close()
    await engine.stop()


ENGINE_SCRIPT = """
import asyncio, sys
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.app.simulated import SimulatedEngine
async def main():
    client = ControlPlaneClient(sys.argv[1], sys.argv[2])
    engine = SimulatedEngine(client, "decode-proc", num_blocks=16, lease_ttl_s=3)
    await engine.register()
    print("registered", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_killed_engine_process_reservations_end_failed(cp, admin, etcd):
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, cp.address, ENGINE_TOKEN], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.strip() == b"registered"
        tenant = await make_tenant(admin, cp.address, "acme")
        await asyncio.sleep(0.2)
        res = await reserve(tenant, "x", 64)
        assert res.engine_id == "decode-proc"
        os.kill(proc.pid, signal.SIGKILL)
        # Nothing tells the control plane but the cut stream (or, failing that, the 3 s lease).
        await settle(etcd.endpoint, until=lambda r: not r.live and "decode-proc" not in r.engines)
        assert (await cp.lifecycle.find(res.id)).state.name == "FAILED"
        await tenant.close()
    finally:
        proc.kill()
        proc.wait()


async def test_restarted_engine_new_incarnation_fails_old_reservations(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=16)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    old = await reserve(tenant, "a", 64)
    reborn = SimulatedEngine(engine_client, "decode-0", num_blocks=16)  # new incarnation
    await reborn.register()
    report = await settle(etcd.endpoint, until=lambda r: not r.live)
    assert (await cp.lifecycle.find(old.id)).state.name == "FAILED"
    assert len(report.engines["decode-0"].free) == 16
    fresh = await reserve(tenant, "b", 64)
    assert fresh.engine_incarnation == reborn.incarnation
    await release(tenant, fresh.id)
    await engine.crash()  # the old stream ending must not take the new registration down
    await asyncio.sleep(0.5)
    assert (await settle(etcd.endpoint, quiet=True)).engines.keys() == {"decode-0"}
    await tenant.close()
    await reborn.stop()


async def test_etcd_outage_gives_unavailable_then_recovers(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    await reserve(tenant, "before", 16)
    etcd.proc.send_signal(signal.SIGSTOP)  # etcd hangs: worse than a clean crash
    try:
        details = await expect_code(grpc.StatusCode.UNAVAILABLE, reserve(tenant, "during", 16))
        assert "etcd" in details
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 20
    while True:
        try:
            res = await reserve(tenant, "after", 16)
            break
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() < deadline, "control plane did not recover"
            await asyncio.sleep(0.2)
    assert res.state == types_pb2.RESERVED
    # A write that timed out may still have committed once etcd woke up. Retrying
    # with the same request_id is safe: it returns that reservation, or makes one.
    during = await reserve(tenant, "during", 16)
    again = await reserve(tenant, "during", 16)
    assert during.id == again.id
    report = await settle(etcd.endpoint)
    assert sorted(r.request_id for r in report.live) == ["after", "before", "during"]
    await tenant.close()
    await engine.stop()


async def test_etcd_outage_answers_every_ask_of_a_batch(cp, admin, engine_client, etcd):
    """Asks a batch put off to its next transaction (a request id asked twice at once, one
    past what a transaction holds) are answered UNAVAILABLE with the rest when etcd fails,
    not left to their callers' deadlines."""
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    await reserve(tenant, "before", 16)
    etcd.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        got = await asyncio.gather(*(expect_code(grpc.StatusCode.UNAVAILABLE, reserve(tenant, f"twice-{i // 2}", 16))
                                     for i in range(30)), return_exceptions=True)
        assert all(isinstance(g, str) and "etcd" in g for g in got), got
        assert time.monotonic() - started < 8   # (the callers' own timeout is 10 s)
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    await tenant.close()
    await engine.stop()


async def test_deregister_engine(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=16)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    await reserve(tenant, "a", 16)
    resp = await engine_client.registry.DeregisterEngine(
        registry_pb2.DeregisterEngineRequest(engine_id="decode-0", incarnation=engine.incarnation),
        metadata=engine_client.metadata)
    assert resp.reservations_failed == 1
    await settle(etcd.endpoint, quiet=True, until=lambda r: not r.engines)
    await expect_code(grpc.StatusCode.NOT_FOUND, engine_client.registry.GetEngine(
        registry_pb2.GetEngineRequest(engine_id="decode-0"), metadata=engine_client.metadata))
    await tenant.close()
    await engine.crash()


async def test_expired_engine_lease_is_refused_on_heartbeat(cp, engine_client):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=16)
    resp = await engine.register()
    await engine.crash()  # stream cut: the control plane revokes the lease
    await asyncio.sleep(0.3)

    async def pings():
        yield registry_pb2.HeartbeatPing(engine_id="decode-0", lease_id=resp.lease_id)

    async def beat():
        async for _ in engine_client.registry.Heartbeat(pings(), metadata=engine_client.metadata):
            pass
    await expect_code(grpc.StatusCode.NOT_FOUND, beat())


async def test_engine_with_many_reservations_dies(cp, admin, engine_client, etcd):
    """Ending a dead engine's reservations is batched: 600 end within seconds."""
    engine = SimulatedEngine(engine_client, "decode-busy", num_blocks=1000)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    reserver = StreamReserver(tenant)
    granted = await asyncio.gather(*(reserver.reserve(scheduler_pb2.ReserveRequest(
        request_id=f"m{i}", num_tokens=16, model="sim-model"), timeout=30) for i in range(600)))
    assert len({r.id for r in granted}) == 600
    await reserver.close()
    started = time.monotonic()
    await engine.crash()
    report = await settle(etcd.endpoint, until=lambda r: not r.live, timeout=30)
    assert len(report.terminal) >= 600
    assert all(r.state.name == "FAILED" for r in report.terminal)
    assert time.monotonic() - started < 10
    await tenant.close()


async def test_revoking_a_lease_that_is_already_gone_is_not_an_error(cp):
    """A new incarnation's RegisterEngine revokes the old lease, which the old
    heartbeat stream's end may have revoked a moment before (it raced and answered
    INTERNAL once): the second revoke must be a no-op."""
    lease = await cp.etcd.grant_lease(5)
    await cp.etcd.revoke_lease(lease)
    await cp.etcd.revoke_lease(lease)

"""StreamReserver, the pipelining client of ReserveStream, against a real etcd and
control plane: coalescing, refusals, callers that stop waiting, a restarted server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.reserve_stream import ReserveRefused, StreamReserver
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.app.etcd_server import free_port
from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import scheduler_pb2
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import make_tenant, settle


def ask(request_id: str, num_tokens: int = 16, **kw) -> scheduler_pb2.ReserveRequest:
    return scheduler_pb2.ReserveRequest(request_id=request_id, num_tokens=num_tokens, model="sim-model", **kw)


async def test_concurrent_reserves_share_one_stream_and_messages(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=1000)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    reserver = StreamReserver(tenant)
    granted = await asyncio.gather(*(reserver.reserve(ask(f"c{i}"), timeout=10) for i in range(300)))
    assert len({r.id for r in granted}) == 300
    assert {r.request_id for r in granted} == {f"c{i}" for i in range(300)}
    assert reserver.streams_opened == 1
    # Idempotent like the unary call: the same request id answers the same reservation.
    again = await reserver.reserve(ask("c7"), timeout=10)
    assert again.id == next(r.id for r in granted if r.request_id == "c7")
    report = await settle(etcd.endpoint, until=lambda r: len(r.live) == 300)
    assert len(report.engines["decode-0"].free) == 1000 - 300
    await reserver.close()
    await tenant.close()
    await engine.stop()


async def test_refusals_carry_the_unary_status_codes(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=4)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    reserver = StreamReserver(tenant)
    with pytest.raises(ReserveRefused) as bad:
        await reserver.reserve(ask("", 16), timeout=10)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in bad.value.details
    with pytest.raises(ReserveRefused) as model:
        await reserver.reserve(scheduler_pb2.ReserveRequest(request_id="m", num_tokens=16, model="nope"), timeout=10)
    assert model.value.code == grpc.StatusCode.INVALID_ARGUMENT and "model" in model.value.details
    await reserver.reserve(ask("fits", 64), timeout=10)
    with pytest.raises(ReserveRefused) as full:
        await reserver.reserve(ask("no-room", 16), timeout=10)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(ReserveRefused) as dup:
        await reserver.reserve(ask("fits", 48), timeout=10)
    assert dup.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert reserver.streams_opened == 1  # a refused ask does not end the stream
    await reserver.close()

    stranger = StreamReserver(ControlPlaneClient(cp.address, "not-a-token-0123456789"))
    with pytest.raises(ReserveRefused) as unauth:
        await stranger.reserve(ask("x"), timeout=10)
    assert unauth.value.code == grpc.StatusCode.UNAUTHENTICATED
    await stranger.close()
    assert (await settle(etcd.endpoint)).ok
    await tenant.close()
    await engine.stop()


async def test_a_caller_that_stops_waiting_leaks_no_blocks(cp, admin, engine_client, etcd):
    """Asks that time out or are cancelled after they were sent are granted anyway
    by the server; the client releases each grant, so every block comes back."""
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=200)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    reserver = StreamReserver(tenant)
    await reserver.reserve(ask("warm"), timeout=10)
    timed_out = 0
    for i in range(20):
        try:
            await reserver.reserve(ask(f"t{i}"), timeout=1e-4)
        except ReserveRefused as exc:
            assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
            timed_out += 1
    cancelled = [asyncio.create_task(reserver.reserve(ask(f"k{i}"), timeout=10)) for i in range(20)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    for task in cancelled:
        task.cancel()
    await asyncio.gather(*cancelled, return_exceptions=True)
    assert timed_out > 0
    # Only "warm" stays reserved once the abandoned grants have been released.
    report = await settle(etcd.endpoint, until=lambda r: len(r.live) == 1, timeout=20)
    assert [r.request_id for r in report.live] == ["warm"]
    assert reserver.abandoned_released > 0  # some were granted after their caller left
    await reserver.close()
    await tenant.close()
    await engine.stop()


async def test_a_caller_cancelled_as_its_grant_arrives_leaks_no_blocks(cp, admin, engine_client, etcd):
    """The grant is delivered and the caller is cancelled before it resumes to take it
    (a client that disconnects at that moment): the grant is released, not held to its
    deadline."""
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=200)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    reserver = StreamReserver(tenant)
    await reserver.reserve(ask("warm"), timeout=10)
    callers: list[asyncio.Task] = []
    deliver = reserver._deliver

    def deliver_then_cancel(answer) -> None:
        deliver(answer)  # the caller's future now holds the grant ...
        for task in callers:
            task.cancel()  # ... and the caller is cancelled before it runs again
    reserver._deliver = deliver_then_cancel
    callers.extend(asyncio.create_task(reserver.reserve(ask(f"late{i}"), timeout=10)) for i in range(5))
    outcomes = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    report = await settle(etcd.endpoint, until=lambda r: len(r.live) == 1, timeout=20)
    assert [r.request_id for r in report.live] == ["warm"]
    assert reserver.abandoned_released == 5
    await reserver.close()
    await tenant.close()
    await engine.stop()


async def test_a_restarted_control_plane_fails_what_is_in_flight_then_serves_again(etcd):
    """A broken stream never hangs a caller: asks fail UNAVAILABLE, and the next ask
    opens a new stream to the replica that came back on the same address."""
    port = free_port()
    config = ControlPlaneConfig(listen=f"127.0.0.1:{port}", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                engine_token=ENGINE_TOKEN, sweep_interval_s=0.5)
    address = f"127.0.0.1:{port}"

    async def start() -> ControlPlane:
        plane = ControlPlane(config)
        await plane.start()
        await plane.view.ready.wait()
        return plane

    plane = await start()
    admin = ControlPlaneClient(address, ADMIN_TOKEN)
    engine_client = ControlPlaneClient(address, ENGINE_TOKEN)
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=500, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, address, "acme")
    reserver = StreamReserver(tenant)
    await reserver.reserve(ask("before"), timeout=10)

    burst = [asyncio.create_task(reserver.reserve(ask(f"b{i}"), timeout=10)) for i in range(100)]
    await asyncio.sleep(0)
    await plane.stop(grace=0)
    results = await asyncio.gather(*burst, return_exceptions=True)
    for res in results:
        if isinstance(res, BaseException):
            assert isinstance(res, ReserveRefused) and res.code == grpc.StatusCode.UNAVAILABLE, res
    with pytest.raises(ReserveRefused) as down:
        await reserver.reserve(ask("while-down"), timeout=10)
    assert down.value.code == grpc.StatusCode.UNAVAILABLE

    plane = await start()
    # The engine's record outlives the replica (its lease is in etcd). The channel
    # may still be backing off from the refused connections: the caller retries.
    for _ in range(50):
        try:
            got = await reserver.reserve(ask("after"), timeout=10)
            break
        except ReserveRefused as exc:
            assert exc.code == grpc.StatusCode.UNAVAILABLE
            await asyncio.sleep(0.2)
    assert got.request_id == "after"
    assert reserver.streams_opened >= 2
    await reserver.close()
    for client in (tenant, admin, engine_client):
        await client.close()
    await engine.stop()
    await plane.stop(grace=0.1)

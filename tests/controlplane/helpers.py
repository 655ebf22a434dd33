"""Small helpers for control-plane tests."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.controlplane.invariants import check
from kvpush.contract.v1 import admin_pb2, scheduler_pb2, types_pb2


async def make_tenant(admin: ControlPlaneClient, address: str, name: str, quota_blocks: int = 0,
                      pools: list[str] | None = None) -> ControlPlaneClient:
    tenant = await admin.admin.CreateTenant(
        admin_pb2.CreateTenantRequest(name=name, quota_blocks=quota_blocks, allowed_pools=pools or []),
        metadata=admin.metadata, timeout=10)
    return ControlPlaneClient(address, tenant.token)


async def reserve(client: ControlPlaneClient, request_id: str, num_tokens: int, model: str = "sim-model",
                  **kw) -> scheduler_pb2.Reservation:
    return await client.scheduler.Reserve(
        scheduler_pb2.ReserveRequest(request_id=request_id, num_tokens=num_tokens, model=model, **kw),
        metadata=client.metadata, timeout=10)


async def release(client: ControlPlaneClient, res_id: str, consumed: bool = False):
    return await client.scheduler.Release(scheduler_pb2.ReleaseRequest(reservation_id=res_id, consumed=consumed),
                                          metadata=client.metadata, timeout=10)


async def stays_reserved(client: ControlPlaneClient, res_id: str, checks: int = 5, every_s: float = 0.1) -> None:
    """``res_id`` is RESERVED at each of ``checks`` looks, ``every_s`` apart: nothing ended it
    (where only its decode engine, a stand-in that never consumes, was to)."""
    for _ in range(checks):
        res = await client.scheduler.GetReservation(scheduler_pb2.GetReservationRequest(reservation_id=res_id),
                                                    metadata=client.metadata, timeout=10)
        assert res.state == types_pb2.RESERVED, (types_pb2.ReservationState.Name(res.state), res.reason)
        await asyncio.sleep(every_s)


async def expect_code(code: grpc.StatusCode, coro) -> str:
    """Await ``coro``; it must fail with ``code``. Returns the status details."""
    try:
        await coro
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == code, f"expected {code.name}, got {exc.code().name}: {exc.details()}"
        return exc.details()
    raise AssertionError(f"expected {code.name}, the call succeeded")


async def settle(endpoint: str, quiet: bool = False, timeout: float = 15.0, until=None):
    """Wait until etcd satisfies every invariant (orphans reaped) and ``until(report)``
    holds, if given; return the report."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        report = await check(endpoint, quiet=quiet)
        done = report.ok and (until is None or until(report))
        if done or asyncio.get_running_loop().time() > deadline:
            assert report.ok, report.summary()
            assert until is None or until(report), f"condition not reached: {report.summary()}"
            return report
        await asyncio.sleep(0.2)


async def stop_all(engines, clients, planes) -> None:
    """A test's teardown: its simulated engines, then its clients, then its in-process replicas."""
    for engine in engines:
        await engine.stop()
    for client in clients:
        await client.close()
    for plane in planes:
        await plane.stop(grace=0.1)

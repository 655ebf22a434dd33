"""How routers find engines: WatchEngines follows registrations, availability changes
and removals; an unavailable engine takes no Reserve and its live reservations end."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import registry_pb2, scheduler_pb2, types_pb2
from tests.controlplane.helpers import expect_code, make_tenant, reserve, settle

Event = scheduler_pb2.EngineEvent


async def next_event(stream, kind=None, timeout=10.0):
    while True:
        event = await asyncio.wait_for(stream.read(), timeout)
        if kind is None or event.kind == kind:
            return event


async def set_available(client, engine: SimulatedEngine, unavailable: str):
    return await client.registry.SetEngineAvailability(registry_pb2.SetEngineAvailabilityRequest(
        engine_id=engine.engine_id, incarnation=engine.incarnation, unavailable=unavailable),
        metadata=client.metadata, timeout=5)


async def test_watch_engines_follows_registration_availability_and_death(cp, admin, engine_client, etcd):
    tenant = await make_tenant(admin, cp.address, "acme", pools=["default"])
    watch = tenant.scheduler.WatchEngines(scheduler_pb2.WatchEnginesRequest(model="sim-model"),
                                          metadata=tenant.metadata)
    assert (await next_event(watch)).kind == Event.SNAPSHOT_END  # nothing registered yet
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=64, serving_url="http://127.0.0.1:8200")
    hidden = SimulatedEngine(engine_client, "decode-other", num_blocks=64, pool="other",
                             serving_url="http://127.0.0.1:8300")
    await hidden.register()  # a pool the tenant may not use: never shown to it
    await decode.register()
    seen = (await next_event(watch, Event.CHANGED)).engine
    assert (seen.engine_id, seen.serving_url, seen.unavailable) == ("decode-0", "http://127.0.0.1:8200", "")
    assert seen.nixl_metadata == b"" and seen.role == types_pb2.DECODE

    # Unavailable: the live reservation ends FAILED at once, no new one is granted.
    live = await reserve(tenant, "before", 32)
    answer = await set_available(engine_client, decode, "engine's connections closed")
    assert answer.reservations_failed == 1 and answer.engine.unavailable
    seen = (await next_event(watch, Event.CHANGED)).engine
    assert seen.engine_id == "decode-0" and seen.unavailable == "engine's connections closed"
    got = await tenant.scheduler.GetReservation(scheduler_pb2.GetReservationRequest(reservation_id=live.id),
                                                metadata=tenant.metadata, timeout=5)
    assert got.state == types_pb2.FAILED and "unavailable" in got.reason
    details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, reserve(tenant, "while-away", 16))
    assert "no decode engine" in details

    # Back: reservations again; then its death is a REMOVED.
    await set_available(engine_client, decode, "")
    assert (await next_event(watch, Event.CHANGED)).engine.unavailable == ""
    again = await reserve(tenant, "after", 16)
    assert again.engine_id == "decode-0"
    await decode.crash()
    gone = await next_event(watch, Event.REMOVED, timeout=20)
    assert (gone.engine.engine_id, gone.engine.incarnation) == ("decode-0", decode.incarnation)
    watch.cancel()

    # A watch begun now has only what is there.
    late = tenant.scheduler.WatchEngines(scheduler_pb2.WatchEnginesRequest(), metadata=tenant.metadata)
    assert (await next_event(late)).kind == Event.SNAPSHOT_END
    late.cancel()
    await settle(etcd.endpoint, quiet=True)
    await hidden.stop()
    await tenant.close()


async def test_availability_and_serving_url_refuse_bad_input(cp, admin, engine_client):
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=16)
    await decode.register()
    refused = SimulatedEngine(engine_client, "decode-1", num_blocks=16, serving_url="ftp://nowhere")
    details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, refused.register())
    assert "engine.serving_url" in details
    req = registry_pb2.SetEngineAvailabilityRequest
    call = engine_client.registry.SetEngineAvailability
    md = engine_client.metadata
    assert "not its current one" in await expect_code(grpc.StatusCode.FAILED_PRECONDITION, call(
        req(engine_id="decode-0", incarnation="an-old-life", unavailable="x"), metadata=md, timeout=5))
    await expect_code(grpc.StatusCode.NOT_FOUND, call(req(engine_id="ghost", incarnation="i"), metadata=md, timeout=5))
    assert "unavailable" in await expect_code(grpc.StatusCode.INVALID_ARGUMENT, call(
        req(engine_id="decode-0", incarnation=decode.incarnation, unavailable="a\nb"), metadata=md, timeout=5))
    tenant = await make_tenant(admin, cp.address, "acme")
    # Tenants cannot mark engines (the Registry API takes engine tokens only).
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, tenant.registry.SetEngineAvailability(
        req(engine_id="decode-0", incarnation=decode.incarnation, unavailable="x"), metadata=tenant.metadata,
        timeout=5))
    await tenant.close()
    await decode.stop()

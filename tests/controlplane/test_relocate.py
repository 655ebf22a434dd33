"""Scheduler.Relocate, the control plane's half of decode failover: the reservation ends
FAILED and its successor, on another decode engine of the same block size and bound to
the same request and prefill engine, is created in the same transaction."""

from __future__ import annotations

import grpc

from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.layout import KvLayout
from kvpush.contract.v1 import registry_pb2, scheduler_pb2, types_pb2
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve, settle


async def relocate(client, res_id: str, reason: str = "decode engine unreachable"):
    return await client.scheduler.Relocate(scheduler_pb2.RelocateRequest(reservation_id=res_id, reason=reason),
                                           metadata=client.metadata, timeout=10)


async def get(client, res_id: str):
    return await client.scheduler.GetReservation(scheduler_pb2.GetReservationRequest(reservation_id=res_id),
                                                 metadata=client.metadata, timeout=10)


async def engines(engine_client, *ids, num_blocks=64, layout=None):
    made = [SimulatedEngine(engine_client, eid, num_blocks=num_blocks, layout=layout) for eid in ids]
    for e in made:
        await e.register()
    return made


async def test_relocate_moves_a_live_reservation_in_one_transaction(cp, admin, engine_client, etcd):
    tenant = await make_tenant(admin, cp.address, "acme", quota_blocks=6)
    d0, = await engines(engine_client, "decode-0")
    prefill = SimulatedEngine(engine_client, "prefill-0", num_blocks=64, role=types_pb2.PREFILL)
    await prefill.register()
    old = await reserve(tenant, "req-1", 80, prefill_engine_id="prefill-0")  # 5 blocks of a quota of 6
    assert old.engine_id == "decode-0"
    # Alone, there is nowhere to go: the old one stays as it was.
    details = await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, relocate(tenant, old.id))
    assert "no other decode engine" in details
    assert (await get(tenant, old.id)).state == types_pb2.RESERVED

    d1, = await engines(engine_client, "decode-1")
    # The quota counts the old reservation's blocks as given back in the same transaction.
    new = await relocate(tenant, old.id, "decode-0 refused the connection")
    assert (new.engine_id, new.moved_from, new.request_id) == ("decode-1", old.id, "req-1")
    assert (new.prefill_engine_id, new.prefill_engine_incarnation) == ("prefill-0", prefill.incarnation)
    assert new.num_tokens == 80 and new.state == types_pb2.RESERVED
    assert abs(new.deadline_unix_ms - old.deadline_unix_ms) <= 1000  # the request's deadline, not a new one
    ended = await get(tenant, old.id)
    assert ended.state == types_pb2.FAILED and ended.moved_to == new.id
    assert "decode-0 refused the connection" in ended.reason

    # Asked again (a retry): the same successor, not a third reservation.
    assert (await relocate(tenant, old.id)).id == new.id
    # A Reserve of the same request id is the successor's now (idempotent, same params).
    assert (await reserve(tenant, "req-1", 80, prefill_engine_id="prefill-0")).id == new.id
    # The successor moves on in turn, back to the first engine.
    third = await relocate(tenant, new.id)
    assert third.engine_id == "decode-0" and third.moved_from == new.id
    await engine_client.registry.ReportState(registry_pb2.ReportStateRequest(
        reservation_id=third.id, state=types_pb2.CONSUMED, landed=True), metadata=engine_client.metadata, timeout=5)
    # Consumed: its KV was loaded; nothing is left to move.
    details = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, relocate(tenant, third.id))
    assert "CONSUMED" in details
    await settle(etcd.endpoint, quiet=True)
    for e in (d0, d1, prefill):
        await e.stop()
    await tenant.close()


async def test_relocate_an_engine_death_and_what_cannot_move(cp, admin, engine_client, etcd):
    tenant = await make_tenant(admin, cp.address, "acme")
    other = await make_tenant(admin, cp.address, "other")
    d0, d1 = await engines(engine_client, "decode-0", "decode-1")
    wide, = await engines(engine_client, "decode-wide", layout=KvLayout(num_layers=4, block_size=32, num_kv_heads=2,
                                                                         head_dim=64))
    prefill = SimulatedEngine(engine_client, "prefill-0", num_blocks=64, role=types_pb2.PREFILL)
    await prefill.register()
    old = await reserve(tenant, "req-1", 40, prefill_engine_id="prefill-0", preferred_engine_id="decode-0")
    assert old.engine_id == "decode-0"
    # Its engine is marked unavailable: the control plane ended the reservation FAILED
    # first; it still moves (FAILED and not moved yet), to the engine of its block size.
    await engine_client.registry.SetEngineAvailability(registry_pb2.SetEngineAvailabilityRequest(
        engine_id="decode-0", incarnation=d0.incarnation, unavailable="engine gone"),
        metadata=engine_client.metadata, timeout=5)
    assert (await get(tenant, old.id)).state == types_pb2.FAILED
    new = await relocate(tenant, old.id)
    assert new.engine_id == "decode-1" and new.block_size == old.block_size
    assert (await get(tenant, old.id)).moved_to == new.id

    # Another tenant's reservation does not exist for this one.
    await expect_code(grpc.StatusCode.NOT_FOUND, relocate(other, new.id))
    await expect_code(grpc.StatusCode.NOT_FOUND, relocate(tenant, "r-" + "0" * 24))
    details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, relocate(tenant, ""))
    assert "reservation_id" in details
    # Released: nothing to move. No prefill engine named: no staged KV anywhere.
    await release(tenant, new.id)
    assert "RELEASED" in await expect_code(grpc.StatusCode.FAILED_PRECONDITION, relocate(tenant, new.id))
    # (Moved once to a successor that has ended: not moved again.)
    assert "has ended" in await expect_code(grpc.StatusCode.FAILED_PRECONDITION, relocate(tenant, old.id))
    plain = await reserve(tenant, "req-2", 16, preferred_engine_id="decode-1")
    assert "no prefill engine" in await expect_code(grpc.StatusCode.FAILED_PRECONDITION, relocate(tenant, plain.id))
    # The prefill engine restarted: its staging went with it.
    held = await reserve(tenant, "req-3", 16, prefill_engine_id="prefill-0", preferred_engine_id="decode-1")
    await prefill.crash()
    restarted = SimulatedEngine(engine_client, "prefill-0", num_blocks=64, role=types_pb2.PREFILL)
    await restarted.register()
    details = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, relocate(tenant, held.id))
    assert "restarted" in details or "gone" in details
    # (The prefill life it was named for ended: so did the reservation, FAILED.)
    assert (await get(tenant, held.id)).state == types_pb2.FAILED
    await release(tenant, plain.id)
    await settle(etcd.endpoint, quiet=True)
    for e in (d0, d1, wide, restarted):
        await e.stop()
    await tenant.close()
    await other.close()


async def test_a_move_planned_on_a_stale_read_reads_again_instead_of_failing(cp, admin, engine_client, etcd):
    """The engine's death ends the reservation FAILED between Relocate's read and its
    transaction (the race a killed decode sidecar makes): the move reads it again and goes
    through, instead of retrying a compare that can never hold ("too much contention")."""
    from kvpush.controlplane.reserve_plan import ReserveAsk
    from kvpush.contract.states import State

    tenant = await make_tenant(admin, cp.address, "acme")
    d0, d1 = await engines(engine_client, "decode-0", "decode-1")
    prefill = SimulatedEngine(engine_client, "prefill-0", num_blocks=64, role=types_pb2.PREFILL)
    await prefill.register()
    old = await reserve(tenant, "req-1", 40, prefill_engine_id="prefill-0", preferred_engine_id="decode-0")
    stale, revision = cp.view.reservation_at(old.id)  # what Relocate read ...
    await cp.lifecycle.transition(old.id, State.FAILED, "engine died")  # ... before the engine's death wrote
    record = cp.view.tenant("acme")
    moved = await cp.reserver.reserve(ReserveAsk(
        tenant=record, request_id="req-1", num_tokens=40, model="sim-model", deadline_ms=20_000,
        prefill_engine_id="prefill-0", prefill_incarnation=prefill.incarnation, moving=stale,
        moving_revision=revision, move_reason="decode engine died"))
    assert moved.engine_id == "decode-1" and moved.moved_from == old.id
    ended = await get(tenant, old.id)
    assert ended.state == types_pb2.FAILED and ended.moved_to == moved.id and "engine died" in ended.reason
    await release(tenant, moved.id)
    await settle(etcd.endpoint, quiet=True)
    for e in (d0, d1, prefill):
        await e.stop()
    await tenant.close()

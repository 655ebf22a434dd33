"""The reservation lifecycle: every legal transition applied in etcd, every
illegal one refused, stale reports ignored."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from kvpush.controlplane import errors
from kvpush.controlplane.lifecycle_states import LEGAL, IllegalTransition, Move, decide
from kvpush.contract.states import LIVE, TERMINAL, State
from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import registry_pb2
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve, settle

ALL = list(State)


def test_table_is_complete_and_terminal_states_are_final():
    assert set(LEGAL) == set(State)
    assert LIVE | TERMINAL == set(State) and not LIVE & TERMINAL
    for state in TERMINAL:
        assert LEGAL[state] == frozenset()
    for state in LIVE:
        assert {State.RELEASED, State.EXPIRED, State.FAILED} <= LEGAL[state]


@pytest.mark.parametrize("current,target", list(itertools.product(ALL, ALL)))
def test_decide_every_pair(current, target):
    if target in LEGAL[current]:
        assert decide(current, target) is Move.APPLY
    elif current.live and target.live and (current == target or
                                           [State.RESERVED, State.PUSHING, State.LANDED].index(target)
                                           < [State.RESERVED, State.PUSHING, State.LANDED].index(current)):
        assert decide(current, target) is Move.STALE
    else:
        with pytest.raises(IllegalTransition):
            decide(current, target)


# Paths from RESERVED through the legal moves, each applied for real in etcd.
PATHS = [
    [State.PUSHING, State.LANDED, State.CONSUMED],
    [State.LANDED, State.CONSUMED],
    [State.RELEASED], [State.FAILED], [State.EXPIRED],
    [State.PUSHING, State.RELEASED], [State.PUSHING, State.FAILED], [State.PUSHING, State.EXPIRED],
    [State.PUSHING, State.LANDED, State.RELEASED], [State.LANDED, State.FAILED], [State.LANDED, State.EXPIRED],
]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "->".join(s.name for s in p))
async def test_legal_paths_in_etcd(cp, admin, engine_client, etcd, path):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    res = await reserve(tenant, "r", 64)
    for target in path:
        rec = await cp.lifecycle.transition(res.id, target, "test")
        assert rec.state == target
        stored = await cp.lifecycle.find(res.id)
        assert stored.state == target
    # Whatever the last state, one more terminal move is refused.
    with pytest.raises(errors.StateConflict):
        await cp.lifecycle.transition(res.id, State.FAILED, "again")
    report = await settle(etcd.endpoint, quiet=True)
    assert len(report.engines["decode-0"].free) == 32
    await tenant.close()
    await engine.stop()


async def test_reports_over_the_api(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    res = await reserve(tenant, "r", 16)

    async def report(state, client=engine_client):
        return await client.registry.ReportState(
            registry_pb2.ReportStateRequest(reservation_id=res.id, state=state, engine_id="decode-0"),
            metadata=client.metadata, timeout=5)

    assert (await report(State.LANDED)).state == State.LANDED
    # The prefill side's PUSHING arrives late: stale, not an error, nothing changes.
    assert (await report(State.PUSHING)).state == State.LANDED
    # Tenants cannot report states: that is the sidecars' API.
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, report(State.CONSUMED, client=tenant))
    # RESERVED/RELEASED/EXPIRED are not reportable.
    for bad in (State.RESERVED, State.RELEASED, State.EXPIRED):
        await expect_code(grpc.StatusCode.INVALID_ARGUMENT, report(bad))
    assert (await report(State.CONSUMED)).state == State.CONSUMED
    await expect_code(grpc.StatusCode.FAILED_PRECONDITION, report(State.LANDED))
    # Releasing an ended reservation: NOT_FOUND.
    await expect_code(grpc.StatusCode.NOT_FOUND, release(tenant, res.id))
    await settle(etcd.endpoint, quiet=True)
    await tenant.close()
    await engine.stop()


async def test_consume_before_landed_is_refused(cp, admin, engine_client):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    res = await reserve(tenant, "r", 16)
    details = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, release(tenant, res.id, consumed=True))
    assert "RESERVED" in details and "CONSUMED" in details
    await tenant.close()
    await engine.stop()


async def test_landed_folded_into_consumed_over_the_api(cp, admin, engine_client, etcd):
    """A decode sidecar that consumes within moments of the landing sends one CONSUMED
    with ``landed``: from RESERVED or PUSHING it moves through LANDED in one write.
    Without ``landed`` the jump is refused; ``landed`` on any other state is bad input."""
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")

    async def report(res_id, state, landed=False, engine_id=""):
        return await engine_client.registry.ReportState(
            registry_pb2.ReportStateRequest(reservation_id=res_id, state=state, landed=landed,
                                            engine_id=engine_id),
            metadata=engine_client.metadata, timeout=5)

    first, second = await reserve(tenant, "r1", 16), await reserve(tenant, "r2", 16)
    details = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, report(first.id, State.CONSUMED))
    assert "RESERVED" in details and "CONSUMED" in details
    assert (await report(first.id, State.CONSUMED, landed=True)).state == State.CONSUMED
    assert (await report(second.id, State.PUSHING, engine_id="decode-0")).state == State.PUSHING
    assert (await report(second.id, State.CONSUMED, landed=True)).state == State.CONSUMED
    third = await reserve(tenant, "r3", 16)
    for bad in (State.LANDED, State.FAILED, State.PUSHING):
        details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                                    report(third.id, bad, landed=True, engine_id="decode-0"))
        assert "landed" in details
    assert (await cp.lifecycle.find(third.id)).state == State.RESERVED
    # An ended reservation stays ended: landed does not revive it.
    await release(tenant, third.id)
    await expect_code(grpc.StatusCode.FAILED_PRECONDITION, report(third.id, State.CONSUMED, landed=True))
    report_ = await settle(etcd.endpoint, quiet=True)
    assert len(report_.engines["decode-0"].free) == 32
    await tenant.close()
    await engine.stop()


async def test_a_restarted_prefill_engine_fails_only_what_its_earlier_life_was_pushing(cp, admin, engine_client,
                                                                                         etcd):
    """PUSHING reports carry the prefill engine's incarnation: when it restarts, the
    reservations its old life was pushing into end FAILED, the ones its new life has
    begun meanwhile go on; a report in the name of an old life is refused."""
    from kvpush.contract.v1 import types_pb2
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    await decode.register()
    old = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, role=types_pb2.PREFILL)
    await old.register()
    tenant = await make_tenant(admin, cp.address, "acme")

    async def pushing(res_id, incarnation):
        return await engine_client.registry.ReportState(
            registry_pb2.ReportStateRequest(reservation_id=res_id, state=State.PUSHING, engine_id="prefill-0",
                                            incarnation=incarnation),
            metadata=engine_client.metadata, timeout=5)

    a, b, c = [await reserve(tenant, n, 16) for n in ("a", "b", "c")]
    assert (await pushing(a.id, old.incarnation)).prefill_engine_incarnation == old.incarnation
    await old.crash()
    new = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, role=types_pb2.PREFILL)
    await new.register()  # the restart: the control plane fails the old life's pushes
    await pushing(b.id, new.incarnation)  # the new life may begin before that is done
    await cp.lifecycle.fail_engine("prefill-0", "restarted", keep_incarnation=new.incarnation)
    await cp.reaper.sweep()
    assert (await cp.lifecycle.find(a.id)).state == State.FAILED
    assert (await cp.lifecycle.find(b.id)).state == State.PUSHING
    details = await expect_code(grpc.StatusCode.FAILED_PRECONDITION, pushing(c.id, old.incarnation))
    assert "incarnation" in details
    assert (await cp.lifecycle.find(c.id)).state == State.RESERVED
    for res in (b, c):
        await release(tenant, res.id)
    await settle(etcd.endpoint, quiet=True)
    await tenant.close()
    await new.stop(), await decode.stop()


async def test_a_prefill_engine_that_dies_before_its_push_began_fails_what_it_was_named_for(cp, admin, engine_client,
                                                                                           etcd):
    """A reservation names its prefill engine's life at Reserve. That life dying ends it
    FAILED at once, PUSHING reported or not (a short push dies before its report), so the
    decode engine waiting for it recomputes now instead of at the deadline; what a new life
    was named for goes on, and a landed one is the decode engine's already."""
    import time

    from kvpush.contract.v1 import types_pb2
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=32)
    await decode.register()
    old = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, role=types_pb2.PREFILL)
    await old.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    named, landed = [await reserve(tenant, n, 16, prefill_engine_id="prefill-0") for n in ("named", "landed")]
    unnamed = await reserve(tenant, "unnamed", 16)
    assert named.prefill_engine_incarnation == old.incarnation
    await engine_client.registry.ReportState(
        registry_pb2.ReportStateRequest(reservation_id=landed.id, state=State.LANDED, engine_id="decode-0",
                                        incarnation=decode.incarnation),
        metadata=engine_client.metadata, timeout=5)
    t0 = time.monotonic()
    await old.crash()
    while (await cp.lifecycle.find(named.id)).state != State.FAILED:
        assert time.monotonic() - t0 < 2.0, "the named reservation outlived its prefill engine"
        await asyncio.sleep(0.01)
    assert "prefill" in (await cp.lifecycle.find(named.id)).reason
    assert (await cp.lifecycle.find(landed.id)).state == State.LANDED
    assert (await cp.lifecycle.find(unnamed.id)).state == State.RESERVED
    new = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, role=types_pb2.PREFILL)
    await new.register()
    fresh = await reserve(tenant, "fresh", 16, prefill_engine_id="prefill-0")
    await cp.reaper.sweep()
    assert (await cp.lifecycle.find(fresh.id)).state == State.RESERVED
    for res in (landed, unnamed, fresh):
        await release(tenant, res.id)
    await settle(etcd.endpoint, quiet=True)
    await tenant.close()
    await new.stop(), await decode.stop()

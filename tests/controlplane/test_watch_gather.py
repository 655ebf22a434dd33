"""A tenant's reservation watch on a replica that follows only its own slots
(kvpush/controlplane/watch_gather.py): gathered from every replica, each answering for the
engines it owns. Over a real etcd with two replicas: the snapshot and the changes of both
replicas' engines, nothing of another tenant, no slot taken on for it, and the stream ended
(UNAVAILABLE) when a third replica joins. The merge's order on its own, with made-up sources."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import scheduler_pb2, types_pb2
from kvpush.controlplane import errors, keys
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.controlplane.watch_gather import gather
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import release, reserve
from tests.controlplane.test_follow import eventually
from tests.controlplane.test_forwarding import tenant_of_a
from tests.controlplane.test_partitioned import engine_owned_by, two_replicas

Event = scheduler_pb2.ReservationEvent


async def read_snapshot(watch) -> set[str]:
    seen = set()
    while (event := await asyncio.wait_for(watch.read(), 5)).kind != Event.SNAPSHOT_END:
        assert event.kind == Event.SNAPSHOT
        seen.add(event.reservation.id)
    return seen


async def test_a_tenants_watch_is_gathered_from_every_replica(etcd):
    async with two_replicas(etcd) as (planes, addr, clients, engines):
        a, b = planes
        theirs, mine = engine_owned_by("b"), engine_owned_by("a")
        tenant_a = await tenant_of_a(planes, addr, clients, engines, [theirs, mine])
        followed = set(a.view.following)
        on_mine = await reserve(tenant_a, "r-mine", 16, preferred_engine_id=mine)
        on_theirs = await reserve(tenant_a, "r-theirs", 16, preferred_engine_id=theirs)
        watch = tenant_a.scheduler.WatchReservations(scheduler_pb2.WatchReservationsRequest(include_snapshot=True),
                                                     metadata=tenant_a.metadata)
        assert await read_snapshot(watch) == {on_mine.id, on_theirs.id}
        # A change on b's engine, made through b, reaches the watch on a.
        token = tenant_a.metadata[0][1].split()[1]
        tenant_b = ControlPlaneClient(addr[1], token)
        clients.append(tenant_b)
        later = await reserve(tenant_b, "r-later", 16)
        event = await asyncio.wait_for(watch.read(), 5)
        assert event.kind == Event.CHANGED and event.reservation.id == later.id
        await release(tenant_b, on_theirs.id)
        event = await asyncio.wait_for(watch.read(), 5)
        assert event.reservation.id == on_theirs.id and event.reservation.state == types_pb2.RELEASED
        # a took no slot on for it (before, it followed all 256).
        assert set(a.view.following) == followed and keys.slot_of(theirs) not in a.view.following
        # Ownership moves: the watch ends, and says to watch again.
        c = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            engine_token=ENGINE_TOKEN, replica_id="c"))
        planes.append(c)
        await c.start()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while True:
                await asyncio.wait_for(watch.read(), 10)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and "include_snapshot" in ended.value.details()
        # Watched again: everything still live, from the three of them.
        await eventually(lambda: len(a.view.replicas) == 3 and all(p.view.ready.is_set() for p in planes))
        watch = tenant_a.scheduler.WatchReservations(scheduler_pb2.WatchReservationsRequest(include_snapshot=True),
                                                     metadata=tenant_a.metadata)
        assert await read_snapshot(watch) == {on_mine.id, later.id}
        watch.cancel()


async def source(*events, error: Exception | None = None, pause: float = 0.0):
    for event in events:
        await asyncio.sleep(pause)
        yield event
    if error is not None:
        raise error
    await asyncio.Event().wait()  # a watch stays open


def res(rid: str, kind=Event.CHANGED, revision: int = 0):
    return Event(kind=kind, reservation=types_pb2.Reservation(id=rid), revision=revision)


async def test_changes_wait_behind_the_one_snapshot_end_of_all_sources():
    fast = source(res("a1", Event.SNAPSHOT), Event(kind=Event.SNAPSHOT_END, revision=7), res("a2"))
    slow = source(res("b1", Event.SNAPSHOT), Event(kind=Event.SNAPSHOT_END, revision=5), res("b2"), pause=0.05)
    merged = gather([fast, slow], True, lambda: False)
    got = [await anext(merged) for _ in range(5)]
    kinds = [(e.kind, e.reservation.id) for e in got]
    assert set(kinds[:2]) == {(Event.SNAPSHOT, "a1"), (Event.SNAPSHOT, "b1")}
    assert kinds[2] == (Event.SNAPSHOT_END, "") and got[2].revision == 5
    assert kinds[3:] == [(Event.CHANGED, "a2"), (Event.CHANGED, "b2")]
    await merged.aclose()


async def test_a_failing_source_or_moved_ownership_ends_the_stream():
    failing = gather([source(res("x")), source(error=errors.unavailable("peer gone"))], False, lambda: False)
    with pytest.raises(errors.ApiError) as gone:
        async for _ in failing:
            pass
    assert gone.value.code == grpc.StatusCode.UNAVAILABLE
    moved = gather([source()], False, lambda: True)
    with pytest.raises(errors.ApiError) as changed:
        await anext(moved)
    assert changed.value.code == grpc.StatusCode.UNAVAILABLE and "include_snapshot" in changed.value.message

"""A view that follows some slots (kvpush/controlplane/follow.py), against a real etcd and a
real control plane writing reservations on engines in several slots: it holds the shared
state and exactly its slots' reservations, takes a slot on and gives one up while it runs,
and still learns the registry's revision through etcd's progress answers."""

from __future__ import annotations

import asyncio

from kvpush.app.simulated import SimulatedEngine
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient, RangeWatch, op_put, prefix_end
from kvpush.controlplane.follow import Interest, follow
from kvpush.controlplane.view import ReservationChange, View
from tests.controlplane.helpers import make_tenant, reserve


def engines_in_distinct_slots(count: int) -> list[str]:
    names, slots = [], set()
    for i in range(1000):
        name = f"decode-{i}"
        if keys.slot_of(name) not in slots:
            slots.add(keys.slot_of(name))
            names.append(name)
        if len(names) == count:
            return names
    raise AssertionError("not enough slots")


async def eventually(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_range_watch_carries_several_ranges_cancels_one_and_answers_progress(etcd):
    client = EtcdClient(etcd.endpoint)
    watch = RangeWatch(client)
    got: list[tuple[int, bytes]] = []
    progress: list[int] = []

    async def read():
        async for watch_id, rev, events in watch.responses():
            if watch_id == RangeWatch.PROGRESS:
                progress.append(rev)
            got.extend((watch_id, ev.kv.key) for ev in events)

    try:
        rev = await client.put(b"/other/x", b"0")
        a = watch.add(b"/a/", prefix_end(b"/a/"), rev + 1)
        b = watch.add(b"/b/", prefix_end(b"/b/"), rev + 1)
        reader = asyncio.create_task(read())
        await client.txn([], [op_put(b"/a/1", b"1"), op_put(b"/b/1", b"1"), op_put(b"/c/1", b"1")])
        await eventually(lambda: len(got) == 2)
        assert sorted(got) == [(a, b"/a/1"), (b, b"/b/1")]
        watch.cancel(a)
        await asyncio.sleep(0.2)
        last = await client.txn([], [op_put(b"/a/2", b"2"), op_put(b"/b/2", b"2")])
        await eventually(lambda: len(got) == 3)
        assert got[-1] == (b, b"/b/2")
        watch.request_progress()
        await eventually(lambda: bool(progress))
        assert progress[-1] >= last.revision
        await asyncio.sleep(0.2)
        assert len(got) == 3  # nothing from the cancelled watcher
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    finally:
        await client.close()


async def test_a_view_follows_its_slots_takes_one_on_and_gives_one_up(cp, admin, engine_client, etcd):
    names = engines_in_distinct_slots(3)
    slot = {name: keys.slot_of(name) for name in names}
    engines = [SimulatedEngine(engine_client, name, num_blocks=256) for name in names]
    for engine in engines:
        await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")

    wanted = {slot[names[0]]}
    interest = Interest(lambda: frozenset(wanted))
    view, stop = View(), asyncio.Event()
    changes: list[ReservationChange] = []
    view.subscribe(lambda c: changes.append(c) if isinstance(c, ReservationChange) else None)
    etcd_client = EtcdClient(etcd.endpoint)
    follower = asyncio.create_task(follow(view, etcd_client, stop, interest))
    try:
        await view.ready.wait()
        # The shared state is all there: every engine and the tenant.
        await eventually(lambda: set(view.engines) == set(names) and view.tenant("acme") is not None)
        by_engine: dict[str, list[str]] = {name: [] for name in names}
        for i in range(12):
            res = await reserve(tenant, f"req-{i}", 16, preferred_engine_id=names[i % 3])
            assert keys.reservation_slot(res.id) == slot[res.engine_id]
            by_engine[res.engine_id].append(res.id)
        await eventually(lambda: set(view.reservations) == set(by_engine[names[0]]))
        assert set(view.pool_fences) == {names[0]}  # only its slot's engines can be chosen here
        assert view.free_blocks(names[0]) == 256 - 4 and view.free_blocks(names[1]) == 256

        # Its revision still moves, though its watchers hear nothing of the other slots.
        res = await reserve(tenant, "req-other", 16, preferred_engine_id=names[1])
        by_engine[names[1]].append(res.id)
        current = (await etcd_client.get_prefix(keys.TENANTS))[1]
        assert await view.wait_for_revision(current, timeout=5.0)

        # Take the second engine's slot on: its reservations appear, later ones follow.
        wanted.add(slot[names[1]])
        interest.poke()
        await eventually(lambda: set(view.reservations) == set(by_engine[names[0]] + by_engine[names[1]]))
        res = await reserve(tenant, "req-late", 16, preferred_engine_id=names[1])
        by_engine[names[1]].append(res.id)
        await eventually(lambda: res.id in view.reservations)
        assert view.free_blocks(names[1]) == 256 - 6

        # Give the first one up: its reservations leave without being announced as ended.
        announced = len(changes)
        wanted.discard(slot[names[0]])
        interest.poke()
        await eventually(lambda: set(view.reservations) == set(by_engine[names[1]]))
        assert names[0] not in view.pool_fences and view.free_blocks(names[0]) == 256
        assert all(c.new is not None for c in changes[announced:])
        res = await reserve(tenant, "req-gone", 16, preferred_engine_id=names[0])
        by_engine[names[0]].append(res.id)
        await asyncio.sleep(0.3)
        assert res.id not in view.reservations

        # Back to every slot: one watch over everything, every live reservation.
        interest.wanted = lambda: None
        interest.poke()
        await eventually(lambda: view.following is None
                         and set(view.reservations) == {r for ids in by_engine.values() for r in ids})
    finally:
        stop.set()
        await asyncio.wait_for(follower, 5)
        await etcd_client.close()
        await tenant.close()
        for engine in engines:
            await engine.stop()


def test_a_tenants_index_taken_on_counts_what_this_replica_wrote_before():
    """A write this replica made into a tenant's index it did not follow (its own Reserve,
    applied to its view at once) must not leave the key's revision behind: taking the index
    on later reads that key at the same revision, and skipping it as seen would leave the
    tenant's usage short, and a quota overrun (found as a 31st block on a 30-block quota)."""
    from kvpush.controlplane.etcd import KV
    from kvpush.controlplane.records import RequestEntry
    view = View()
    view.load([], 1, frozenset({3}))
    key, value = keys.request("capped", "q1"), RequestEntry("r-03" + "0" * 22, 2).encode()
    view.apply(KV(key, value, 5, 5, 0), False, 5)       # its own write, the index not followed
    view.apply(KV(keys.usage("capped"), b"", 5, 1, 0), False, 5)
    assert not view.requests and "capped" not in view.requests.fences
    view.take_tenant("capped", [KV(key, value, 5, 5, 0), KV(keys.usage("capped"), b"", 5, 1, 0)])
    assert view.requests.used == {"capped": 2} and view.requests.fences == {"capped": 5}
    assert view.requests.reservation_id("capped", "q1") == "r-03" + "0" * 22
    view.drop_tenant("capped")
    assert not view.requests and not view.requests.used and not view.requests.fences

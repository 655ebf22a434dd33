"""Keeps a replica's View in step with etcd: a snapshot, then a watch; again after a gap.

What it follows is the registry's shared state and a set of parts (keys.py), which may
change while it runs (``Interest``): slots (the replica's own and those its clients need)
and tenants' parts of the request index (those whose quota it counts). Following every
slot takes one watch over the whole keyspace. Following some takes one watch stream with
a watcher per part (and three for the shared state): a part taken on is read at a
revision and watched from the next, a part given up is cancelled and its keys leave the
view, and the other slots' requests never reach this replica.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from kvpush import log
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import (EtcdClient, EtcdUnavailable, RangeWatch, WatchCompacted, prefix_end,
                                      watch_event)
from kvpush.controlplane.pool_fences import WatchGap
from kvpush.controlplane.view import View

_log = log.get("view")

APPLY_SLICE = 256       # watch events applied per loop turn
PROGRESS_EVERY_S = 1.0  # with several watchers, how often the view's revision is brought up to date


class Interest:
    """The parts a view should follow (slots, ints; tenants' request indexes, strs): ``None``
    for everything. ``wanted`` is read again whenever ``changed`` is set."""

    def __init__(self, wanted: Callable[[], frozenset[int | str] | None] = lambda: None) -> None:
        self.wanted = wanted
        self.changed = asyncio.Event()

    def poke(self) -> None:
        self.changed.set()


def _range(part: int | str) -> tuple[bytes, bytes]:
    """A slot's keys, or a tenant's part of the request index."""
    prefix = keys.slot_prefix(part) if isinstance(part, int) else keys.tenant_requests(part)
    return prefix, prefix_end(prefix)


def _order(part: int | str) -> tuple[int, str]:
    return (0, f"{part:03d}") if isinstance(part, int) else (1, part)


async def _read(etcd: EtcdClient, ranges, revision: int = 0):
    kvs: list = []
    for start, end in ranges:
        part, revision = await etcd.get_range(start, end, revision)
        kvs += part
    return kvs, revision


async def _apply(view: View, events) -> None:
    for first in range(0, len(events), APPLY_SLICE):
        if first:
            # A lease running out deletes thousands of keys in one revision: let Reserves
            # in between (their decisions are fenced in etcd, and a view part way through
            # a revision only under-counts frees).
            await asyncio.sleep(0)
        for raw in events[first:first + APPLY_SLICE]:
            ev = watch_event(raw)
            view.apply(ev.kv, ev.deleted, ev.kv.mod_revision)


async def _session(view: View, etcd: EtcdClient, stop: asyncio.Event, interest: Interest) -> None:
    """One snapshot and the watch after it, until the stream breaks, a watcher is
    compacted away, or the interest switches between all slots and some."""
    interest.changed.clear()
    wanted = interest.wanted()
    shared = list(keys.SHARED_RANGES) if wanted is not None else [(keys.ROOT, prefix_end(keys.ROOT))]
    parts = sorted(wanted or (), key=_order)
    kvs, revision = await _read(etcd, shared + [_range(p) for p in parts])
    view.load(kvs, revision, None if wanted is None else frozenset(parts))
    view.ready.set()
    watch = RangeWatch(etcd)
    for start, end in shared:
        watch.add(start, end, revision + 1)
    by_part = {part: watch.add(*_range(part), revision + 1) for part in parts}
    tasks = [asyncio.create_task(_consume(view, watch, several=wanted is not None), name="view-watch"),
             asyncio.create_task(_retarget(view, etcd, watch, by_part, interest, wanted is None),
                                 name="view-retarget"),
             asyncio.create_task(stop.wait(), name="view-stop")]
    if wanted is not None:
        view.request_progress = watch.request_progress
        tasks.append(asyncio.create_task(_tick(watch), name="view-progress"))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a broken stream or a failed read ends the session with its error
    finally:
        view.request_progress = lambda: None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _consume(view: View, watch: RangeWatch, several: bool) -> None:
    async for watch_id, rev, events in watch.responses():
        if events:
            await _apply(view, events)
        # One watcher: each answer says everything up to its revision has been sent. Several:
        # only etcd's progress answer covers them all.
        if not several or watch_id == RangeWatch.PROGRESS:
            view.advance(rev)


async def _tick(watch: RangeWatch) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        watch.request_progress()


async def _retarget(view: View, etcd: EtcdClient, watch: RangeWatch, by_part: dict[int | str, int],
                    interest: Interest, all_slots: bool) -> None:
    """Takes on and gives up parts as the interest changes; returns (ending the session,
    which starts another) when it switches to or from everything."""
    while True:
        await interest.changed.wait()
        interest.changed.clear()
        wanted = interest.wanted()
        if (wanted is None) != all_slots:
            interest.changed.set()  # the next session reads it
            return
        if wanted is None:
            continue
        for part in set(by_part) - wanted:
            watch.cancel(by_part.pop(part))
            if isinstance(part, int):
                view.drop_slot(part)
            else:
                view.drop_tenant(part)
        for part in sorted(wanted - set(by_part), key=_order):
            kvs, revision = await _read(etcd, [_range(part)])
            by_part[part] = watch.add(*_range(part), revision + 1)
            if isinstance(part, int):
                view.take_slot(part, kvs)
            else:
                view.take_tenant(part, kvs)
        if set(by_part) != wanted:
            interest.changed.set()  # it moved again while we read


async def follow(view: View, etcd: EtcdClient, stop: asyncio.Event, interest: Interest | None = None) -> None:
    """Keep ``view`` in step with etcd until ``stop``: load, then watch; reload on gaps."""
    interest = interest or Interest()
    backoff = 0.1
    while not stop.is_set():
        try:
            await _session(view, etcd, stop, interest)
            backoff = 0.1
            if stop.is_set():
                return
            continue  # (it ended to switch between all slots and some)
        except (EtcdUnavailable, WatchCompacted, WatchGap) as exc:
            _log.warning("view resync", reason=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not kill the replica's view for good
            _log.exception("view follow failed")
        try:
            await asyncio.wait_for(stop.wait(), backoff)
        except asyncio.TimeoutError:
            pass
        backoff = min(backoff * 2, 2.0)

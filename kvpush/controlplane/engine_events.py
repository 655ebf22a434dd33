"""Engines as the Scheduler and Registry APIs serve them: one record with the view's
counts (``engine_proto``), and the stream of registrations, changes and removals
that routers follow to find engines (``engine_events``)."""

from __future__ import annotations

from typing import AsyncIterator, Callable

from kvpush.controlplane import keys
from kvpush.controlplane.view import EngineChange, View
from kvpush.controlplane.watch_queue import WatchQueue
from kvpush.contract.engine import EngineRecord
from kvpush.contract.v1 import scheduler_pb2, types_pb2

Event = scheduler_pb2.EngineEvent


def engine_proto(view: View, rec: EngineRecord) -> types_pb2.Engine:
    msg = rec.to_proto()
    if not view.followed(keys.slot_of(rec.engine_id)):
        return msg  # its reservations are not in this view: no counts rather than wrong ones
    live = view.live_reservations(engine_id=rec.engine_id)
    msg.free_blocks = view.free_blocks(rec.engine_id)
    msg.reserved_blocks = rec.num_blocks - msg.free_blocks
    msg.live_reservations = len(live)
    return msg


def engine_summary_proto(view: View, rec: EngineRecord) -> types_pb2.Engine:
    """``engine_proto`` where this view follows the engine; else its free blocks as its
    owner last told the others (free_summary.py), when it has."""
    if view.followed(keys.slot_of(rec.engine_id)):
        return engine_proto(view, rec)
    msg = rec.to_proto()
    free = view.free_told.merged().get(rec.engine_id)
    if free is not None:
        msg.free_blocks = free
        msg.reserved_blocks = max(rec.num_blocks - free, 0)
    return msg


def _listed(view: View, rec: EngineRecord) -> types_pb2.Engine:
    msg = engine_proto(view, rec)
    msg.ClearField("nixl_metadata")  # up to 1 MiB an engine, and no router needs it
    return msg


async def engine_events(view: View, concerns: Callable[[EngineRecord], bool]) -> AsyncIterator[Event]:
    """The engines ``concerns(record)`` selects: every one now (SNAPSHOT ... SNAPSHOT_END),
    then each registration, change and removal as the view applies it. An engine that
    stops being selected (its pool changed) is REMOVED. A watcher that falls
    WATCH_QUEUE events behind is cut off (RESOURCE_EXHAUSTED) and reconnects."""
    queue = WatchQueue("watch again")

    def on_change(change: object) -> None:
        if not isinstance(change, EngineChange):
            return
        was = change.old is not None and concerns(change.old)
        now = change.new is not None and concerns(change.new)
        if not (was or now):
            return
        queue.put((change.new if now else change.old, now, change.revision))

    unsubscribe = view.subscribe(on_change)
    try:
        for entry in sorted(view.engines.values(), key=lambda e: e.record.engine_id):
            if concerns(entry.record):
                yield Event(kind=Event.SNAPSHOT, engine=_listed(view, entry.record), revision=view.revision)
        yield Event(kind=Event.SNAPSHOT_END, revision=view.revision)
        while True:
            rec, present, revision = await queue.get()
            if present:
                yield Event(kind=Event.CHANGED, engine=_listed(view, rec), revision=revision)
            else:
                gone = types_pb2.Engine(engine_id=rec.engine_id, role=rec.role, incarnation=rec.incarnation,
                                        model=rec.model, serving_url=rec.serving_url)
                yield Event(kind=Event.REMOVED, engine=gone, revision=revision)
    finally:
        unsubscribe()

"""A tenant's reservation watch served without following every slot.

A tenant's reservations are on every engine, so in every slot, and a replica follows only
its own slots (following.py). It serves the watch by gathering: the events of the engines
it owns from its own view, and those of every other live replica's engines from that replica
(``WatchReservations`` with ``owned_only``, the caller's token, over the peer clients
forwarding.py keeps), merged into one stream. With a snapshot asked for, one SNAPSHOT_END
follows every source's snapshot, and changes that came before it wait behind it.

Ownership moving (a replica joined or left) ends the stream with UNAVAILABLE: while the
slots move, a slot could briefly have no replica answering for it, and a watcher that
reconnects with a snapshot has the state again, as after falling behind. A source that
fails ends it the same way.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.controlplane import errors
from kvpush.controlplane.watch_queue import WatchQueue
from kvpush.contract.v1 import scheduler_pb2

RECHECK_S = 0.5   # how often a quiet stream looks whether ownership moved
AGAIN = "watch again, with include_snapshot"
Event = scheduler_pb2.ReservationEvent


async def peer_events(client: ControlPlaneClient, address: str,
                      include_snapshot: bool) -> AsyncIterator[scheduler_pb2.ReservationEvent]:
    """What the replica at ``address`` owns of the caller's reservations."""
    call = client.scheduler.WatchReservations(
        scheduler_pb2.WatchReservationsRequest(include_snapshot=include_snapshot, owned_only=True),
        metadata=client.metadata)
    try:
        async for event in call:
            yield event
    except grpc.aio.AioRpcError as exc:
        raise errors.unavailable(f"the replica at {address} stopped answering its part of this watch "
                                 f"({exc.code().name}); {AGAIN}") from None
    finally:
        call.cancel()
    raise errors.unavailable(f"the replica at {address} ended its part of this watch; {AGAIN}")


async def gather(sources: list[AsyncIterator[scheduler_pb2.ReservationEvent]], include_snapshot: bool,
                 moved: Callable[[], bool]) -> AsyncIterator[scheduler_pb2.ReservationEvent]:
    """The events of ``sources``, merged; ends (UNAVAILABLE) when ``moved()`` says ownership
    moved or a source fails, and (RESOURCE_EXHAUSTED) when the watcher falls behind."""
    queue = WatchQueue(AGAIN)

    async def pump(i: int, source) -> None:
        try:
            async for event in source:
                queue.put((i, event))
        except asyncio.CancelledError:
            raise
        except errors.ApiError as exc:
            queue.put((i, exc))
        except Exception as exc:  # never a silent end: the watcher reconnects
            queue.put((i, errors.unavailable(f"{exc}; {AGAIN}")))
    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    waiting = set(range(len(sources))) if include_snapshot else set()
    held: list = []
    low = 0
    try:
        while True:
            try:
                i, item = await asyncio.wait_for(queue.get(), RECHECK_S)
            except asyncio.TimeoutError:
                item = None
            if moved():
                raise errors.unavailable(f"the registry's replicas changed, and with them who answers for "
                                         f"which engines; {AGAIN}")
            if item is None:
                continue
            if isinstance(item, Exception):
                raise item
            if item.kind == Event.SNAPSHOT_END and i in waiting:
                waiting.discard(i)
                low = min(low, item.revision) if low else item.revision
                if not waiting:
                    yield Event(kind=Event.SNAPSHOT_END, revision=low)
                    for event in held:
                        yield event
                    held.clear()
            elif waiting and item.kind == Event.CHANGED:
                held.append(item)
                if len(held) > queue.limit:
                    raise errors.exhausted(f"watcher fell too far behind; {AGAIN}")
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

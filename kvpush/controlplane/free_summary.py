"""What each replica tells the others of its own engines' room: their free blocks.

A replica follows only its own slots (following.py), so its view has exact counts for its
own engines and none for the others'. Each replica puts the free blocks of the engines it
owns under ``keys.FREE/<replica id>`` (on its membership lease), and every view keeps what
the others put. A Reserve compares its own engines against that summary: when another
replica's engine has clearly more room (``ownership.OWN_SLACK`` of its blocks), it goes to
that engine's owner (elsewhere.py). The summary only steers; the fences still decide.

How stale it may be is counted in blocks, not only in time: a summary that lags by more
than the slack steers Reserves onto engines that are already fuller than the others (a
replica owning few engines piles its requests on them until the next summary). So a
summary is put as soon as an engine came or went or one engine's free blocks moved
``MOVED`` of its size (half the slack) from what was told, at most every ``SOONER_S``;
smaller changes are put every ``EVERY_S`` (each put costs every other replica a decode
and a new candidates' list: see bench/scaling_replicas.py). Waking is driven by the
view's ``free_moved``, never by polling.
"""

from __future__ import annotations

import asyncio

from kvpush import log
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient
from kvpush.controlplane.ownership import OWN_SLACK, Membership, Ownership
from kvpush.controlplane.records import encode_free
from kvpush.controlplane.view import View

_log = log.get("free_summary")

EVERY_S = 0.5          # any change is told within this
SOONER_S = 0.1         # no two summaries closer than this (a replica's puts stay <= 10/s)
MOVED = OWN_SLACK / 2  # of an engine's blocks: a change this large is told within SOONER_S


def _own_free(view: View, ownership: Ownership) -> dict[str, int]:
    return {eid: view.free_blocks(eid) for eid, entry in view.engines.items()
            if entry.record.is_decode and ownership.owns(eid) and view.followed(keys.slot_of(eid))}


def _moved_far(view: View, free: dict[str, int], told: dict[str, int]) -> bool:
    """Whether an engine appeared, went, or moved MOVED of its blocks since ``told``."""
    if free.keys() != told.keys():
        return True
    for eid, blocks in free.items():
        if abs(blocks - told[eid]) >= max(1, int(MOVED * view.engines[eid].record.num_blocks)):
            return True
    return False


async def publish(etcd: EtcdClient, view: View, ownership: Ownership, membership: Membership,
                  stop: asyncio.Event) -> None:
    """Put this replica's own engines' free blocks as they change (module docstring), until
    ``stop``."""
    loop = asyncio.get_running_loop()
    told: dict[str, int] | None = None  # None: not put (or a put failed): the next turn puts
    put_at = 0.0
    while not stop.is_set():
        view.free_moved.clear()  # (before reading: a change while we put wakes the next turn)
        pending = False
        try:
            if membership.lease and len(ownership.members) > 1 and view.ready.is_set():
                free = _own_free(view, ownership)
                if told is None or free != told:
                    if told is None or loop.time() - put_at >= EVERY_S or _moved_far(view, free, told):
                        await etcd.put(keys.free(ownership.replica_id), encode_free(free), membership.lease)
                        told, put_at = free, loop.time()
                    else:
                        pending = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # etcd unavailable, the lease just ran out: the next turn
            _log.debug("free summary not put", reason=str(exc) or type(exc).__name__)
            told = None
        try:
            await asyncio.wait_for(stop.wait(), SOONER_S)
            return
        except asyncio.TimeoutError:
            pass
        # The next change, or (a smaller change waiting) the end of EVERY_S since the last put.
        wait = max(EVERY_S - (loop.time() - put_at), 0.0) if pending else EVERY_S
        try:
            await asyncio.wait_for(view.free_moved.wait(), wait)
        except asyncio.TimeoutError:
            pass

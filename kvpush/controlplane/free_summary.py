"""What each replica tells the others of its own engines' room: their free blocks.

A replica follows only its own slots (following.py), so its view has exact counts for its
own engines and none for the others'. Each replica puts the free blocks of the engines it
owns under ``keys.FREE/<replica id>`` (on its membership lease) every ``EVERY_S`` when
they changed, and every view keeps what the others put. A Reserve compares its own
engines against that summary: when another replica's engine has clearly more room, it
takes that engine's slot on (following.py) and chooses again. The summary is at most
``EVERY_S`` old, so it only steers; the fences still decide.
"""

from __future__ import annotations

import asyncio

from kvpush import log
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient
from kvpush.controlplane.ownership import Membership, Ownership
from kvpush.controlplane.records import encode_free
from kvpush.controlplane.view import View

_log = log.get("free_summary")

EVERY_S = 0.5


async def publish(etcd: EtcdClient, view: View, ownership: Ownership, membership: Membership,
                  stop: asyncio.Event) -> None:
    """Put this replica's own engines' free blocks whenever they changed, until ``stop``."""
    last = b""
    key = keys.free(ownership.replica_id)
    while not stop.is_set():
        try:
            if membership.lease and len(ownership.members) > 1 and view.ready.is_set():
                free = {eid: view.free_blocks(eid) for eid, entry in view.engines.items()
                        if entry.record.is_decode and ownership.owns(eid) and view.followed(keys.slot_of(eid))}
                value = encode_free(free)
                if value != last:
                    await etcd.put(key, value, membership.lease)
                    last = value
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # etcd unavailable, the lease just ran out: the next turn
            _log.debug("free summary not put", reason=str(exc) or type(exc).__name__)
            last = b""
        try:
            await asyncio.wait_for(stop.wait(), EVERY_S)
        except asyncio.TimeoutError:
            pass

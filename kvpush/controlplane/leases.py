"""Shared etcd leases: one per second of deadline, one per tombstone period.

A lease per reservation would cost an extra etcd round trip per Reserve; sharing
one lease among all reservations that expire in the same second keeps Reserve at
one transaction per batch. Deadlines are therefore rounded up to the second
(and etcd never expires a lease sooner than about 2 s after it is granted).
"""

from __future__ import annotations

import asyncio
import math
import time

from kvpush.controlplane.etcd import EtcdClient

# One tombstone lease per second of endings. Every record under a lease is deleted in
# one etcd revision when it runs out, and every replica's watch gets all of them at
# once: with 10 s buckets, 40,000 tombstones expired together and stalled Reserves
# for 300 ms (measured); per second, a burst is a second's worth of endings.
TOMBSTONE_PERIOD_S = 1
# ... and at most this many records per lease: etcd deletes a lease's keys in one
# raft entry, and every transaction waits behind it (10,000 keys: 60-90 ms).
TOMBSTONE_LEASE_KEYS = 500


class LeaseBuckets:
    def __init__(self, etcd: EtcdClient, tombstone_ttl_s: int = 120) -> None:
        self._etcd = etcd
        self._tombstone_ttl = tombstone_ttl_s
        self._buckets: dict[tuple, asyncio.Future] = {}  # (kind, bucket): deadline second, or (second, part)
        self._prefetching: set[asyncio.Task] = set()
        self._tomb_period, self._tomb_filled = 0, 0

    async def _lease(self, kind: str, bucket, ttl: int) -> int:
        key = (kind, bucket)
        fut = self._buckets.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._buckets[key] = fut
            try:
                fut.set_result(await self._etcd.grant_lease(max(ttl, 1)))
            except BaseException as exc:
                del self._buckets[key]
                fut.set_exception(exc)
                fut.exception()  # mark retrieved; the caller gets it below
                raise
            self._prune()
        return await asyncio.shield(fut)

    async def for_deadline(self, deadline_ms: int) -> int:
        """A lease that expires at the first whole second at or after ``deadline_ms``."""
        bucket = math.ceil(deadline_ms / 1000)
        now = int(time.time())
        # The next seconds' buckets are granted ahead, in the background: otherwise
        # the first Reserve of every second pays a LeaseGrant round trip (with an
        # fsync) before its own transaction, on the request's TTFT.
        for ahead in (1, 2):
            self._grant_ahead("deadline", bucket + ahead, bucket + ahead - now)
        return await self._lease("deadline", bucket, bucket - now)

    def _grant_ahead(self, kind: str, bucket, ttl: int) -> None:
        if (kind, bucket) not in self._buckets:
            task = asyncio.get_running_loop().create_task(self._lease(kind, bucket, ttl))
            self._prefetching.add(task)
            task.add_done_callback(self._prefetched)

    def _prefetched(self, task: asyncio.Task) -> None:
        self._prefetching.discard(task)
        if not task.cancelled():
            task.exception()  # a failed grant ahead is retried by the Reserve that needs it

    async def tombstone(self, records: int = 1) -> int:
        """A lease for ``records`` records of ended reservations, kept about
        ``tombstone_ttl_s``; each lease carries at most TOMBSTONE_LEASE_KEYS."""
        period = int(time.time()) // TOMBSTONE_PERIOD_S
        if period != self._tomb_period:
            self._tomb_period, self._tomb_filled = period, 0
        part = self._tomb_filled // TOMBSTONE_LEASE_KEYS
        self._tomb_filled += records
        self._grant_ahead("tombstone", (period + 1, 0), self._tombstone_ttl + TOMBSTONE_PERIOD_S)
        if self._tomb_filled > (part + 0.5) * TOMBSTONE_LEASE_KEYS:
            self._grant_ahead("tombstone", (period, part + 1), self._tombstone_ttl)
        return await self._lease("tombstone", (period, part), self._tombstone_ttl)

    def forget(self) -> None:
        """Drop cached leases (etcd said one was not found, e.g. after a restore)."""
        self._buckets.clear()

    def _prune(self) -> None:
        now = int(time.time())
        for kind, bucket in list(self._buckets):
            if (kind == "deadline" and bucket < now) or \
                    (kind == "tombstone" and bucket[0] < now // TOMBSTONE_PERIOD_S - 1):
                del self._buckets[(kind, bucket)]

"""Shared deadline leases (fast, with a fake etcd): one grant per second of
deadline, and the next seconds' buckets granted ahead so a Reserve does not pay
a LeaseGrant round trip before its own transaction."""

from __future__ import annotations

import asyncio
import time

from kvpush.controlplane.leases import LeaseBuckets


class FakeEtcd:
    def __init__(self):
        self.grants = []

    async def grant_lease(self, ttl: int) -> int:
        await asyncio.sleep(0.01)  # a round trip
        self.grants.append(ttl)
        return len(self.grants)


async def test_one_grant_per_second_and_the_next_seconds_ahead():
    etcd = FakeEtcd()
    leases = LeaseBuckets(etcd)
    now_ms = int(time.time() * 1000)
    deadline = (now_ms // 1000 + 30) * 1000  # a whole second: bucket = 30 s from now
    first = await asyncio.gather(*(leases.for_deadline(deadline - i) for i in range(5)))
    assert len(set(first)) == 1  # five Reserves of one second share one lease
    await asyncio.sleep(0.05)  # the buckets ahead are granted meanwhile
    assert len(etcd.grants) == 3
    nxt = await leases.for_deadline(deadline + 1000)
    assert len(etcd.grants) == 3, "the next second's lease was not granted ahead"
    assert nxt not in first
    await asyncio.sleep(0.05)
    assert len(etcd.grants) == 4  # and one more ahead (deadline + 3 s)


async def test_tombstone_leases_hold_a_bounded_number_of_records(monkeypatch):
    """etcd deletes a lease's keys in one raft entry that every transaction waits
    behind, so a second of endings is spread over leases of TOMBSTONE_LEASE_KEYS."""
    from kvpush.controlplane import leases as leases_mod
    etcd = FakeEtcd()
    leases = LeaseBuckets(etcd)
    second = 1_000_000
    monkeypatch.setattr(leases_mod.time, "time", lambda: float(second))
    got = [await leases.tombstone(100) for _ in range(12)]  # 1,200 records in one second
    cap = leases_mod.TOMBSTONE_LEASE_KEYS
    by_lease: dict[int, int] = {}
    for lease in got:
        by_lease[lease] = by_lease.get(lease, 0) + 100
    assert len(by_lease) == -(-1200 // cap) and max(by_lease.values()) <= cap
    second += 1  # a new second starts a new lease
    assert await leases.tombstone(1) not in by_lease

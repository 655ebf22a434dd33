"""Shared deadline leases (fast, with a fake etcd): one grant per second of
deadline, and the next seconds' buckets granted ahead so a Reserve does not pay
a LeaseGrant round trip before its own transaction."""

from __future__ import annotations

import asyncio
import time

from controlplane.leases import LeaseBuckets


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

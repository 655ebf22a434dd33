"""When a replica tells the others its engines' free blocks (free_summary.py): at once when
an engine came or moved half the slack, else within EVERY_S; never two puts closer than
SOONER_S; woken by the view, not by polling. Stand-ins for etcd and the view (the summary
steering Reserves with real replicas and etcd: test_ownership_cluster.py, test_partitioned.py)."""

from __future__ import annotations

import asyncio
import types

import pytest

from kvpush.controlplane import free_summary
from kvpush.controlplane.records import decode_free


class _Etcd:
    def __init__(self) -> None:
        self.puts: list[tuple[float, dict[str, int]]] = []

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.puts.append((asyncio.get_running_loop().time(), decode_free(value)))


class _View:
    def __init__(self, engines: dict[str, int]) -> None:
        self.free = dict(engines)
        self.engines = {eid: types.SimpleNamespace(record=types.SimpleNamespace(is_decode=True, num_blocks=n))
                        for eid, n in engines.items()}
        self.ready = asyncio.Event()
        self.ready.set()
        self.free_moved = asyncio.Event()

    def free_blocks(self, eid: str) -> int:
        return self.free[eid]

    def followed(self, slot: int) -> bool:
        return True

    def take(self, eid: str, blocks: int) -> None:
        self.free[eid] -= blocks
        self.free_moved.set()


class _Ownership:
    replica_id = "cp-a"
    members = {"cp-a": None, "cp-b": None}

    def owns(self, eid: str) -> bool:
        return True


@pytest.fixture
async def telling():
    etcd, view, stop = _Etcd(), _View({"e1": 1000, "e2": 1000}), asyncio.Event()
    task = asyncio.create_task(free_summary.publish(etcd, view, _Ownership(), types.SimpleNamespace(lease=7), stop))
    await asyncio.sleep(0.05)
    yield etcd, view
    stop.set()
    await asyncio.wait_for(task, 1)


async def _until(cond, timeout: float) -> None:
    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.005)
    await asyncio.wait_for(wait(), timeout)


async def test_a_move_of_half_the_slack_is_told_at_once(telling):
    etcd, view = telling
    assert [p for _, p in etcd.puts] == [{"e1": 1000, "e2": 1000}]  # the first, at once
    far = int(free_summary.MOVED * 1000)
    await asyncio.sleep(free_summary.SOONER_S)
    view.take("e1", far)
    sent = asyncio.get_running_loop().time()
    await _until(lambda: len(etcd.puts) == 2, 2)
    assert etcd.puts[-1][1] == {"e1": 1000 - far, "e2": 1000}
    # (within SOONER_S of the move on an idle machine; well before EVERY_S on a loaded one)
    assert etcd.puts[-1][0] - sent < free_summary.EVERY_S / 2


async def test_smaller_moves_wait_for_every_s_and_puts_are_spaced(telling):
    etcd, view = telling
    for _ in range(5):  # each well under MOVED; together still under
        view.take("e2", 1)
        await asyncio.sleep(0.02)
    await _until(lambda: len(etcd.puts) == 2, 2)
    assert etcd.puts[-1][1] == {"e1": 1000, "e2": 995}
    assert etcd.puts[1][0] - etcd.puts[0][0] >= free_summary.EVERY_S - 0.01  # waited for EVERY_S
    # A burst of far moves: told as it goes, but never two puts within SOONER_S.
    far = int(free_summary.MOVED * 1000)
    for _ in range(20):
        view.take("e1", far)
        await asyncio.sleep(0.01)
    await _until(lambda: etcd.puts[-1][1]["e1"] == 1000 - 20 * far, 2)
    gaps = [b[0] - a[0] for a, b in zip(etcd.puts, etcd.puts[1:])]
    assert min(gaps) >= free_summary.SOONER_S - 0.005, gaps
    assert len(etcd.puts) >= 4  # told several times during the burst, not once at its end


async def test_nothing_changing_puts_nothing(telling):
    etcd, view = telling
    await asyncio.sleep(2 * free_summary.EVERY_S)
    assert len(etcd.puts) == 1

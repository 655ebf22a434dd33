"""What the Reserve benchmarks share (bench/reserve.py and its --lifecycle and --failover
modes): a control-plane replica as a process, the ways to call Reserve, the load shapes
(closed loop, spaced, paced open loop) and the registry's wipe between measurements.
Apart from reserve.py so that its modes import this, not the script that imports them."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time

import grpc
import psutil
from aetcd import rpc

from bench.common import ROOT, wait_idle
from kvpush.app.etcd_server import EmbeddedEtcd, free_port
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.reserve_stream import ReserveRefused, StreamReserver
from kvpush.contract.states import State
from kvpush.contract.v1 import admin_pb2, scheduler_pb2
from kvpush.controlplane.etcd import EtcdClient, op_delete_prefix

ADMIN = "bench-admin-token-0123456789"
BLOCKS_PER_ENGINE = 60_000
ENGINES = 4
_ids = itertools.count()


class Plane:
    def __init__(self, etcd: str, group_commit: bool, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        ready = tempfile.mktemp(prefix="kvpush-bench-ready-")
        cmd = [sys.executable, "-m", "kvpush.app.cli", "controlplane", "--listen", self.address, "--etcd", etcd,
               "--admin-token", ADMIN, "--max-batch", "500", "--default-deadline-ms", "600000",
               "--ready-file", ready, "--log-level", "warning", *extra]
        if not group_commit:
            cmd.append("--no-group-commit")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("control plane did not start")
            time.sleep(0.05)
        os.unlink(ready)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


REFUSED = (grpc.aio.AioRpcError, ReserveRefused)


def unary_call(client: ControlPlaneClient):
    """Reserve as one unary gRPC call per reservation."""
    async def call(req: scheduler_pb2.ReserveRequest) -> None:
        await client.scheduler.Reserve(req, metadata=client.metadata, timeout=10)
    return call


def stream_call(reserver: StreamReserver):
    """Reserve through the pipelining client: asks ready together share a stream message."""
    async def call(req: scheduler_pb2.ReserveRequest) -> None:
        await reserver.reserve(req, timeout=10)
    return call


async def timed_reserve(call, model: str, latencies: list) -> bool:
    """One Reserve of one block; its latency appended on success, False on an error."""
    req = scheduler_pb2.ReserveRequest(request_id=f"b{next(_ids)}", num_tokens=16, model=model)
    t0 = time.perf_counter()
    try:
        await call(req)
    except REFUSED:
        return False
    latencies.append(time.perf_counter() - t0)
    return True


async def closed_loop(call, concurrency: int, seconds: float, model: str):
    """``concurrency`` callers, each reserving back to back (a router with that many
    requests arriving at once)."""
    latencies, errors = [], 0
    stop_at = time.perf_counter() + seconds

    async def worker():
        nonlocal errors
        while time.perf_counter() < stop_at:
            errors += not await timed_reserve(call, model, latencies)
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, errors, time.perf_counter() - started


IDLE_GAP_S = 0.25  # a lightly loaded router: one request every quarter second


async def spaced(call, count: int, model: str):
    """One Reserve at a time with the machine idle in between: what a lone request pays
    (every process on the path is woken from idle)."""
    latencies, errors = [], 0
    started = time.perf_counter()
    for _ in range(count):
        await asyncio.sleep(IDLE_GAP_S)
        errors += not await timed_reserve(call, model, latencies)
    return latencies, errors, time.perf_counter() - started


async def paced(rate: float, total: int):
    """Yield (i, scheduled time) for ``total`` sends at ``rate``/s, sleeping until each
    is due (sends that are late go at once: an open loop never slows down)."""
    start = time.perf_counter()
    for i in range(total):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        yield i, scheduled


async def open_loop(call, rate: float, seconds: float, model: str):
    """Send at ``rate``/s whatever is outstanding; latency counts from each request's
    scheduled time, so a stall is not hidden by the sender slowing down."""
    latencies, errors, tasks = [], 0, set()

    async def one(scheduled: float):
        nonlocal errors
        req = scheduler_pb2.ReserveRequest(request_id=f"o{next(_ids)}", num_tokens=16, model=model)
        try:
            await call(req)
            latencies.append(time.perf_counter() - scheduled)
        except REFUSED:
            errors += 1
    start = time.perf_counter()
    async for _, scheduled in paced(rate, int(rate * seconds)):
        task = asyncio.create_task(one(scheduled))
        tasks.add(task)  # only the outstanding ones: a growing heap makes the generator's own GC pauses longer
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return latencies, errors, time.perf_counter() - start


async def live_count(admin: ControlPlaneClient) -> int:
    status = await admin.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=admin.metadata, timeout=30)
    return sum(n for state, n in status.reservations_by_state.items() if State[state].live)


async def wipe_registry(etcd: EmbeddedEtcd) -> float:
    """Delete the whole registry, compact and defragment, and wait until etcd is idle
    again (the seconds waited): the next measurement starts from a fresh etcd."""
    wiper = EtcdClient(etcd.endpoint)
    result = await wiper.txn([], [op_delete_prefix(b"/kvpush/v1/")])
    await wiper.close()
    await compact_and_defragment(etcd.endpoint, result.revision)
    return await asyncio.to_thread(wait_idle, psutil.Process(etcd.proc.pid))


async def compact_and_defragment(endpoint: str, revision: int) -> None:
    """Leave etcd as a fresh one would be, so the next mode does not pay for this one."""
    channel = grpc.aio.insecure_channel(endpoint)
    await rpc.KVStub(channel).Compact(rpc.CompactionRequest(revision=revision, physical=True), timeout=60)
    await rpc.MaintenanceStub(channel).Defragment(rpc.DefragmentRequest(), timeout=60)
    await channel.close()



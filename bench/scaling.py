"""How the control plane grows: Reserve latency, CPU and memory against the number of
registered engines and of live reservations; the cost of each sidecar's watch stream;
etcd's keyspace per engine and per reservation.

    .venv/bin/python bench/scaling.py          # ~5 minutes; writes docs/BENCHMARKS.md (section "scaling")
    .venv/bin/python bench/scaling.py --quick  # a smoke run (no report)

Simulated decode engines (kvpush/app/simulated.py: they register and heartbeat as sidecars do,
lease TTL 10 s, one beat every 3.3 s each, and move no bytes), one control-plane replica
(group commit), one etcd with fsync, all on this 2-core machine. At each point the
registry is filled to the live count (one block each, long deadlines), then an open
loop of Reserve + Release pairs at a fixed rate keeps it there while Reserve latency and
each process's CPU are measured. The watch rows open one WatchEngineReservations stream
per engine, as every decode sidecar does, and repeat the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import sys
import time

import grpc
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aetcd import rpc  # noqa: E402

from kvpush.app.etcd_server import EmbeddedEtcd  # noqa: E402
from kvpush.app.simulated import SimulatedEngine  # noqa: E402
from kvpush.app.table import markdown, render  # noqa: E402
from bench.common import CpuMeter, pct, update_section, wait_idle  # noqa: E402
from bench.reserve_plane import ADMIN, Plane, compact_and_defragment, paced, wipe_registry  # noqa: E402
from kvpush.client.control_plane import ControlPlaneClient  # noqa: E402
from kvpush.client.reserve_stream import ReserveRefused, StreamReserver  # noqa: E402
from kvpush.controlplane import keys  # noqa: E402
from kvpush.controlplane.etcd import EtcdClient  # noqa: E402
from kvpush.controlplane.invariants import check  # noqa: E402
from kvpush.aio import tune_gc  # noqa: E402
from kvpush.contract.v1 import admin_pb2, registry_pb2, scheduler_pb2  # noqa: E402

MODEL = "scale"
_ids = itertools.count()


async def db_size(endpoint: str) -> int:
    channel = grpc.aio.insecure_channel(endpoint)
    status = await rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=30)
    await channel.close()
    return status.dbSizeInUse or status.dbSize


async def keyspace(etcd: EtcdClient) -> dict[str, tuple[int, int]]:
    """prefix name -> (keys, bytes of keys and values)."""
    engines, _ = await etcd.get_prefix(keys.ENGINES)
    requests, _ = await etcd.get_prefix(keys.REQUESTS)
    slotted, _ = await etcd.get_prefix(keys.SLOTTED)
    groups = {"engines": engines, "requests": requests,
              "reservations": [kv for kv in slotted if keys.split_slotted(kv.key)[0] == keys.RESERVATIONS]}
    return {name: (len(kvs), sum(len(kv.key) + len(kv.value) for kv in kvs)) for name, kvs in groups.items()}


async def fill(reserver: StreamReserver, count: int, concurrency: int = 256) -> float:
    """``count`` live reservations of one block each; returns the fill rate."""
    left = iter(range(count))
    t0 = time.perf_counter()

    async def worker():
        for _ in left:
            await reserver.reserve(scheduler_pb2.ReserveRequest(request_id=f"f{next(_ids)}", num_tokens=16,
                                                                model=MODEL, deadline_ms=1_800_000), timeout=30)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - t0)


async def steady(reserver: StreamReserver, tenant: ControlPlaneClient, rate: float, seconds: float):
    """Reserve + Release pairs at ``rate``/s (the live count stays put); Reserve latency
    from each pair's scheduled time."""
    latencies, errors, tasks = [], 0, set()

    async def one(scheduled: float):
        nonlocal errors
        try:
            res = await reserver.reserve(scheduler_pb2.ReserveRequest(
                request_id=f"s{next(_ids)}", num_tokens=16, model=MODEL, deadline_ms=60_000), timeout=10)
            latencies.append(time.perf_counter() - scheduled)
            await tenant.scheduler.Release(scheduler_pb2.ReleaseRequest(reservation_id=res.id),
                                           metadata=tenant.metadata, timeout=10)
        except (grpc.aio.AioRpcError, ReserveRefused):
            errors += 1
    async for _, scheduled in paced(rate, int(rate * seconds)):
        task = asyncio.create_task(one(scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return latencies, errors


async def watch_all(client: ControlPlaneClient, engines: list[SimulatedEngine]) -> tuple[list, list]:
    """One WatchEngineReservations stream per engine, read as a sidecar reads it."""
    counts = [0] * len(engines)
    calls = []

    async def read(i: int, call) -> None:
        try:
            async for _ in call:
                counts[i] += 1
        except grpc.aio.AioRpcError:
            pass
    tasks = []
    for i, engine in enumerate(engines):
        call = client.registry.WatchEngineReservations(registry_pb2.WatchEngineReservationsRequest(
            engine_id=engine.engine_id), metadata=client.metadata)
        calls.append(call)
        tasks.append(asyncio.create_task(read(i, call)))
    await asyncio.sleep(1.0)
    return calls, tasks


async def point(etcd: EmbeddedEtcd, engines_n: int, live: int, rate: float, seconds: float,
                watchers: bool = False, passive: bool = False) -> dict:
    plane = Plane(etcd.endpoint, group_commit=True)
    # A second replica serving nothing and following everything (--follow all, as one serving a
    # tenant's reservation watch does): what following the whole registry costs a replica.
    follower = Plane(etcd.endpoint, group_commit=True, extra=("--follow", "all")) if passive else None
    cp_proc, etcd_proc = psutil.Process(plane.proc.pid), psutil.Process(etcd.proc.pid)
    procs = {"controlplane": cp_proc, "etcd": etcd_proc, "client": psutil.Process()}
    if follower is not None:
        procs["follower"] = psutil.Process(follower.proc.pid)
    meter = CpuMeter(procs)
    try:
        admin = ControlPlaneClient(plane.address, ADMIN)
        made = await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name="scale"), metadata=admin.metadata)
        tenant = ControlPlaneClient(plane.address, made.token)
        reserver = StreamReserver(tenant)
        # Room for the live count and for every pair of the run outstanding at once.
        blocks = math.ceil(1.2 * live / engines_n) + math.ceil(rate * seconds / engines_n) + 64
        rss0 = cp_proc.memory_info().rss
        db0 = await db_size(etcd.endpoint)
        engines = [SimulatedEngine(admin, f"d{i:04d}", blocks, model=MODEL, lease_ttl_s=10)
                   for i in range(engines_n)]
        t0 = time.perf_counter()
        for chunk in range(0, engines_n, 50):
            await asyncio.gather(*(e.register() for e in engines[chunk:chunk + 50]))
        register_s = time.perf_counter() - t0
        fill_rate = await fill(reserver, live)
        calls, readers = await watch_all(admin, engines) if watchers else ([], [])
        tune_gc()
        await asyncio.to_thread(wait_idle, cp_proc, 0.3, 1.0, 30.0)
        # Idle: what the engines themselves cost (heartbeats, and the watch streams).
        meter.start()
        await asyncio.sleep(3.0)
        idle = meter.stop()
        meter.start()
        t0 = time.perf_counter()
        lat, errors = await steady(reserver, tenant, rate, seconds)
        wall = time.perf_counter() - t0
        busy = meter.stop()
        rss = cp_proc.memory_info().rss
        wiper = EtcdClient(etcd.endpoint)
        space = await keyspace(wiper)
        revision = (await wiper.get_prefix(keys.ENGINES))[1]
        await compact_and_defragment(etcd.endpoint, revision)
        db = await db_size(etcd.endpoint)
        for call in calls:
            call.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for engine in engines:
            await engine.crash()
        report = await check(etcd.endpoint, allow_orphans=True)
        await wiper.close()
        await reserver.close()
        await tenant.close()
        await admin.close()
    finally:
        plane.stop()
        if follower is not None:
            follower.stop()
    await wipe_registry(etcd)
    row = dict(engines=engines_n, live=live, watchers=engines_n if watchers else 0, passive=passive,
               register_s=register_s,
               fill_rate=fill_rate, ok=len(lat), errors=errors, rate=len(lat) / wall,
               p50=pct(lat, 50) * 1e3, p99=pct(lat, 99) * 1e3,
               idle={k: v / 3.0 for k, v in idle.items()}, busy={k: v / wall for k, v in busy.items()},
               rss_mb=rss / 2**20, rss_growth_mb=(rss - rss0) / 2**20, db_mb=db / 2**20,
               db_growth_mb=(db - db0) / 2**20, space=space, invariants=report.ok)
    print(f"  {engines_n:5d} engines {live:7d} live {row['watchers']:5d} watch streams: Reserve p50 "
          f"{row['p50']:.2f} ms p99 {row['p99']:.2f} ms at {row['rate']:.0f}/s (errors {errors}); cp CPU idle "
          f"{row['idle']['controlplane']:.2f} busy {row['busy']['controlplane']:.2f}; cp RSS {row['rss_mb']:.0f} MB; "
          f"etcd db {row['db_mb']:.1f} MB; fill {fill_rate:.0f}/s; register {register_s:.1f} s; "
          f"invariants {'OK' if report.ok else 'VIOLATED'}", flush=True)
    return row


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    # Below one replica's saturation on this machine (Release is one unbatched transaction
    # each), so the rows show what scale costs, not queueing.
    parser.add_argument("--rate", type=float, default=300.0, help="Reserve + Release pairs per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--replicas", action="store_true",
                        help="CPU per request on each replica with 1, 2 and 4 replicas, following everything and their own slots (bench/scaling_replicas.py)")
    args = parser.parse_args()
    if args.replicas:
        from bench.scaling_replicas import replicas
        points = [("owned", 1, 100.0, ""), ("owned", 2, 100.0, "shares")] if args.quick else \
            [(mode, n, 100.0, quota) for mode, quota in (("all", ""), ("owned", ""), ("owned", "shares"),
                                                        ("owned", "fenced"))
             for n in (1, 2, 4)] + [("owned", 1, rate, "") for rate in (300.0, 600.0, 1200.0)]
        await replicas(points, seconds=2.0 if args.quick else 6.0, write=not args.quick)
        return
    grid = [(10, 1_000), (100, 1_000), (1_000, 1_000), (10, 100_000), (100, 100_000), (1_000, 100_000)]
    if args.quick:
        grid, args.seconds = [(10, 200), (100, 2_000)], 1.0
    etcd = EmbeddedEtcd(max_txn_ops=4096).start()
    rows = []
    try:
        print(f"etcd {etcd.endpoint}; Reserve + Release at {args.rate:.0f}/s for {args.seconds:g} s per point",
              flush=True)
        for engines_n, live in grid:
            rows.append(await point(etcd, engines_n, live, args.rate, args.seconds))
        top = max(n for n, _ in grid)
        low = min(live for _, live in grid)
        rows.append(await point(etcd, top, low, args.rate, args.seconds, watchers=True))
        rows.append(await point(etcd, top, low, args.rate, args.seconds, passive=True))
    finally:
        etcd.stop()
    headers = ["engines", "live reservations", "watch streams", "2nd replica", "Reserve p50 ms", "p99 ms", "pairs/s", "errors",
               "cp CPU idle", "cp CPU busy", "etcd CPU busy", "client CPU busy", "cp RSS MB", "etcd db MB"]
    table = [[r["engines"], f"{r['live']:,}", r["watchers"],
              f"{r['busy']['follower']:.2f} busy" if r["passive"] else "-", f"{r['p50']:.2f}", f"{r['p99']:.2f}",
              f"{r['rate']:.0f}", r["errors"], f"{r['idle']['controlplane']:.3f}", f"{r['busy']['controlplane']:.2f}",
              f"{r['busy']['etcd']:.2f}", f"{r['busy']['client']:.2f}", f"{r['rss_mb']:.0f}", f"{r['db_mb']:.1f}"]
             for r in rows]
    print(render(headers, table))
    if args.quick:
        return

    def at(engines_n: int, live: int, watchers: int = 0, passive: bool = False) -> dict:
        return next(r for r in rows if (r["engines"], r["live"], r["watchers"], r["passive"]) ==
                    (engines_n, live, watchers, passive))
    big, small = at(1_000, 100_000), at(1_000, 1_000)
    per_res_bytes = (big["space"]["reservations"][1] + big["space"]["requests"][1]) / big["space"]["reservations"][0]
    per_engine_bytes = big["space"]["engines"][1] / big["space"]["engines"][0]
    per_res_db = (big["db_mb"] - small["db_mb"]) * 2**20 / (big["live"] - small["live"])
    per_res_rss = (big["rss_mb"] - small["rss_mb"]) * 2**20 / (big["live"] - small["live"])
    per_engine_idle = (at(1_000, 1_000)["idle"]["controlplane"] - at(10, 1_000)["idle"]["controlplane"]) / 990
    pair_cpu = {r["engines"]: r["busy"]["controlplane"] / r["rate"] for r in rows if r["live"] == 1_000 and
                not r["watchers"] and not r["passive"]}
    follow = at(top, low, passive=True)
    follow_cpu = (follow["busy"]["follower"] - follow["idle"]["follower"]) / follow["rate"]
    # The serving replica's own cost of a pair, less what it spends at rest (heartbeats).
    pair_net = {r["engines"]: (r["busy"]["controlplane"] - r["idle"]["controlplane"]) / r["rate"] for r in rows
                if r["live"] == 1_000 and not r["watchers"] and not r["passive"]}
    etcd_pair = sum(r["busy"]["etcd"] / r["rate"] for r in rows) / len(rows)
    watched = at(top, low, top)
    unwatched = (small["busy"]["controlplane"] + follow["busy"]["controlplane"]) / 2  # two runs without streams
    fanout = (watched["busy"]["controlplane"] - unwatched) / watched["rate"] / top
    text = f"""## Scaling: engines, live reservations, watch streams

Command: `.venv/bin/python bench/scaling.py` (one run; simulated decode engines that register and heartbeat
as sidecars do, lease TTL 10 s; one control-plane replica with group commit; one etcd with fsync; the load
generator; all on the same 2 cores). At each point the registry holds the live count (one block each), then
Reserve + Release pairs run open loop at {args.rate:.0f}/s for {args.seconds:g} s: Reserve latency from each
pair's scheduled time. CPU columns are cores (CPU seconds per wall second): "idle" is the 3 s before the load
(heartbeats, watch streams), "busy" during it. The last row opens one `WatchEngineReservations` stream per
engine, as every decode sidecar holds. Memory is the replica's RSS; etcd's size is after a compaction and
defragmentation (history removed). `docs/SCALING.md` turns these into a fleet's sizing.

{markdown(headers, table)}

- etcd keyspace: **{per_engine_bytes:.0f} bytes per engine record** (with its simulated 51-byte NIXL
  metadata; a real UCX agent's is a few KiB), **{per_res_bytes:.0f} bytes per live reservation** (its record
  and its request index key); etcd's database grows {per_res_db:.0f} bytes per reservation after compaction.
- The replica's memory: {per_res_rss:.0f} bytes per live reservation (RSS at 100k minus 1k live, 1,000 engines).
- Engines at rest: {per_engine_idle * 1e3:.3f} ms of control-plane CPU per second per engine (heartbeats).
- A Reserve + Release pair costs {", ".join(f"{v * 1e3:.2f} ms" for v in pair_cpu.values())} of control-plane
  CPU at {", ".join(str(k) for k in pair_cpu)} engines ({", ".join(f"{v * 1e3:.2f}" for v in pair_net.values())} ms
  less the replica's CPU at rest), and {etcd_pair * 1e3:.2f} ms of etcd's (all rows' mean).
- A second replica that serves nothing and follows everything (`--follow all`, as a replica serving a
  tenant's reservation watch does) spends {follow_cpu * 1e3:.3f} ms of CPU per pair (less its CPU at rest): its
  view applies every change. A replica following its own slots (the default) pays about nothing for the
  others' requests ("Scaling out").
- Watch fan-out: {top} open streams add {fanout * 1e6:.2f} us of control-plane CPU per pair per stream
  ({watched['busy']['controlplane']:.2f} cores against {unwatched:.2f}, the mean of the two runs without them;
  the rows move by about 0.05 cores run to run).
- Invariants checked in etcd after every point: {'all hold' if all(r['invariants'] for r in rows) else 'VIOLATED'}.
"""
    update_section("scaling", text)
    print("wrote docs/BENCHMARKS.md (scaling)")


if __name__ == "__main__":
    from kvpush import aio
    aio.run(main())

"""Full lifecycles per second: Reserve (the router's stream client) then the decode
sidecar's CONSUMED report (``ReportState`` with ``landed``: one write for LANDED and
CONSUMED), beside Reserve alone, with the lifecycle ends group-committed and without
(``--no-group-commit``: one transaction per reservation and per transition). Run by
``bench/reserve.py --lifecycle``; writes the section "lifecycle" of docs/BENCHMARKS.md."""

from __future__ import annotations

import asyncio
import itertools
import time

import psutil

from kvpush.app.etcd_server import EmbeddedEtcd
from kvpush.app.simulated import SimulatedEngine
from kvpush.app.table import markdown, render
from bench.common import CpuMeter, pct, update_section, wait_idle
from bench.reserve_plane import ADMIN, BLOCKS_PER_ENGINE, ENGINES, REFUSED, Plane, paced, wipe_registry
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.report_stream import StreamReporter
from kvpush.client.reserve_stream import StreamReserver
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient, op_delete_prefix
from kvpush.controlplane.invariants import check
from kvpush.aio import tune_gc
from kvpush.contract.v1 import admin_pb2, registry_pb2, scheduler_pb2, types_pb2

_ids = itertools.count()


class Ops:
    def __init__(self, reserver: StreamReserver, engine: ControlPlaneClient, model: str,
                 reporter: StreamReporter | None = None) -> None:
        """``reporter``: CONSUMED over the sidecars' ReportStates stream; None: one unary call each."""
        self.reserver, self.engine, self.model, self.reporter = reserver, engine, model, reporter
        self.reserve_lat: list[float] = []
        self.end_lat: list[float] = []
        self.errors = 0

    async def reserve(self, scheduled: float | None = None):
        req = scheduler_pb2.ReserveRequest(request_id=f"l{next(_ids)}", num_tokens=16, model=self.model)
        t0 = scheduled if scheduled is not None else time.perf_counter()
        res = await self.reserver.reserve(req, timeout=10)
        self.reserve_lat.append(time.perf_counter() - t0)
        return res

    async def lifecycle(self, scheduled: float | None = None) -> None:
        try:
            res = await self.reserve(scheduled)
            t1 = time.perf_counter()
            report = registry_pb2.ReportStateRequest(reservation_id=res.id, state=types_pb2.CONSUMED, landed=True)
            if self.reporter is not None:
                await self.reporter.report(report, timeout=10)
            else:
                await self.engine.registry.ReportState(report, metadata=self.engine.metadata, timeout=10)
            self.end_lat.append(time.perf_counter() - t1)
        except REFUSED:
            self.errors += 1

    async def reserve_only(self, scheduled: float | None = None) -> None:
        try:
            await self.reserve(scheduled)
        except REFUSED:
            self.errors += 1


async def closed(op, concurrency: int, seconds: float) -> float:
    stop_at = time.perf_counter() + seconds

    async def worker():
        while time.perf_counter() < stop_at:
            await op()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def opened(op, rate: float, seconds: float) -> float:
    tasks = set()
    t0 = time.perf_counter()
    async for _, scheduled in paced(rate, int(rate * seconds)):
        task = asyncio.create_task(op(scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return time.perf_counter() - t0


async def run_mode(etcd: EmbeddedEtcd, group_commit: bool, seconds: float, rate: float) -> list[dict]:
    plane = Plane(etcd.endpoint, group_commit)
    mode = "ends group-committed" if group_commit else "1 txn / transition"
    rows = []
    try:
        admin = ControlPlaneClient(plane.address, ADMIN)
        model = f"life-{'gc' if group_commit else 'single'}"
        made = await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name=model), metadata=admin.metadata)
        tenant = ControlPlaneClient(plane.address, made.token)
        reserver = StreamReserver(tenant)
        reporter = StreamReporter(admin)
        engines = [SimulatedEngine(admin, f"{model}-d{i}", BLOCKS_PER_ENGINE, model=model, lease_ttl_s=60)
                   for i in range(ENGINES)]
        for engine in engines:
            await engine.register()
        meter = CpuMeter({"controlplane": psutil.Process(plane.proc.pid), "etcd": psutil.Process(etcd.proc.pid),
                          "client": psutil.Process()})
        quiet = [psutil.Process(plane.proc.pid), psutil.Process(etcd.proc.pid)]
        wiper = EtcdClient(etcd.endpoint)

        async def measure(what: str, load: str, run, unary: bool = False) -> None:
            await asyncio.gather(*(asyncio.to_thread(wait_idle, p, 0.1, 0.5) for p in quiet))
            ops = Ops(reserver, admin, model, None if unary else reporter)
            await closed(ops.lifecycle, 8, 0.3)  # warm up
            ops = Ops(reserver, admin, model, None if unary else reporter)
            tune_gc()
            meter.start()
            wall = await run(ops)
            cpu = meter.stop()
            done = len(ops.end_lat) if what.startswith("lifecycle") else len(ops.reserve_lat)
            rows.append(dict(mode=mode, what=what, load=load, rate=done / wall, errors=ops.errors,
                             r50=pct(ops.reserve_lat, 50) * 1e3, r99=pct(ops.reserve_lat, 99) * 1e3,
                             e50=pct(ops.end_lat, 50) * 1e3 if ops.end_lat else float("nan"),
                             e99=pct(ops.end_lat, 99) * 1e3 if ops.end_lat else float("nan"),
                             cpu={k: v / wall for k, v in cpu.items()}))
            r = rows[-1]
            print(f"  {mode:22s} {what:12s} {load:22s} {r['rate']:6.0f}/s  Reserve p50 {r['r50']:.2f} p99 "
                  f"{r['r99']:.2f} ms  CONSUMED p50 {r['e50']:.2f} p99 {r['e99']:.2f} ms  errors {r['errors']}",
                  flush=True)

        await measure("reserve only", "closed, 64 concurrent", lambda ops: closed(ops.reserve_only, 64, seconds))
        await measure("lifecycle, unary CONSUMED", "closed, 64 concurrent",
                      lambda ops: closed(ops.lifecycle, 64, seconds), unary=True)
        for conc in (16, 64, 256):
            await measure("lifecycle", f"closed, {conc} concurrent", lambda ops, c=conc: closed(ops.lifecycle, c, seconds))
        for i in range(2):
            await measure("lifecycle", f"open, {rate:.0f}/s ({i + 1} of 2)",
                          lambda ops: opened(ops.lifecycle, rate, seconds * 1.5))
        for engine in engines:
            await engine.crash()
        for prefix in keys.in_every_slot(keys.RESERVATIONS):
            await wiper.txn([], [op_delete_prefix(prefix)])
        await wiper.close()
        await reporter.close()
        await reserver.close()
        await tenant.close()
        await admin.close()
    finally:
        plane.stop()
    await wipe_registry(etcd)
    return rows


async def lifecycle(seconds: float = 4.0, rate: float = 2000.0, write: bool = True) -> None:
    etcd = EmbeddedEtcd(max_txn_ops=4096).start()
    try:
        print(f"etcd {etcd.endpoint}; {ENGINES} simulated decode engines; full lifecycles vs Reserve alone",
              flush=True)
        rows = await run_mode(etcd, True, seconds, rate) + await run_mode(etcd, False, seconds, rate)
        report = await check(etcd.endpoint, allow_orphans=True)
    finally:
        etcd.stop()
    headers = ["mode", "what", "load", "per s", "Reserve p50 ms", "p99 ms", "CONSUMED p50 ms", "p99 ms", "errors",
               "CPU cp", "CPU etcd", "CPU client", "cp us / op"]
    table = [[r["mode"], r["what"], r["load"], f"{r['rate']:.0f}", f"{r['r50']:.2f}", f"{r['r99']:.2f}",
              "-" if r["what"] == "reserve only" else f"{r['e50']:.2f}", "-" if r["what"] == "reserve only" else
              f"{r['e99']:.2f}", r["errors"], f"{r['cpu']['controlplane']:.2f}", f"{r['cpu']['etcd']:.2f}",
              f"{r['cpu']['client']:.2f}", f"{1e6 * r['cpu']['controlplane'] / r['rate']:.0f}" if r["rate"] else "-"]
             for r in rows]
    print(render(headers, table))
    if not write:
        return

    def best(mode: str, what: str) -> float:
        return max(r["rate"] for r in rows if r["mode"] == mode and r["what"] == what)
    gc, single = "ends group-committed", "1 txn / transition"
    opens = [r for r in rows if r["mode"] == gc and r["load"].startswith("open")]
    text = f"""## Full lifecycles: Reserve + the decode's CONSUMED

Command: `.venv/bin/python bench/reserve.py --lifecycle` (one run, same etcd with fsync, same 2 cores;
{ENGINES} simulated decode engines of {BLOCKS_PER_ENGINE} blocks). A lifecycle is a Reserve through the
router's stream client, then the decode sidecar's CONSUMED report (with `landed`: LANDED and CONSUMED in one
write) over the sidecars' `ReportStates` stream (`kvpush/client/report_stream.py`), each timed on its own; the
"unary CONSUMED" row sends it as one `ReportState` call each, as sidecars did before. "ends group-committed" writes concurrent transitions in one
etcd transaction (one nested compare-and-swap each, `kvpush/controlplane/group_commit.py`); "1 txn / transition" is
the same replica with `--no-group-commit`. CPU columns are cores used by the control plane, etcd and the load generator; "cp us / op"
is the control plane's CPU per lifecycle (per Reserve in the "reserve only" row).

{markdown(headers, table)}

- Best: **{best(gc, 'lifecycle'):.0f} lifecycles/s** with the ends group-committed, {best(single, 'lifecycle'):.0f}/s
  with one transaction each, {best(gc, 'lifecycle, unary CONSUMED'):.0f}/s with the report as one unary call;
  Reserve alone in the same runs: {best(gc, 'reserve only'):.0f}/s and {best(single, 'reserve only'):.0f}/s.
- Open loop at {rate:.0f} lifecycles/s, ends group-committed: Reserve p99 {' / '.join(f"{r['r99']:.2f}" for r in opens)} ms,
  CONSUMED p99 {' / '.join(f"{r['e99']:.2f}" for r in opens)} ms.
- Invariants checked in etcd after the run: {'all hold' if report.ok else 'VIOLATED'}.
"""
    update_section("lifecycle", text)
    print("wrote docs/BENCHMARKS.md (lifecycle)")

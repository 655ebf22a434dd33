"""What a Reserve costs when the replica it reaches owns none of the engines it can go to:
forwarded to the owner (kvpush/controlplane/forwarding.py, the default) against committed by
the replica reached after taking the engines' slots on (``--no-forward``), beside the same
load sent straight to the owner. Two replica processes over one etcd, 100 simulated decode
engines all owned by replica b, full lifecycles (Reserve over the router's stream client to
the replica the row names, CONSUMED over the sidecars' report stream to b, which follows the
engines as a decode sidecar's replica does) open loop.

    python -m bench.forwarding [--rate 200] [--seconds 6] [--runs 2] [--quick]

Writes the section "forwarding" of docs/BENCHMARKS.md (not with --quick)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import psutil

from bench.common import CpuMeter, pct, update_section, wait_idle
from bench.reserve_plane import ADMIN, Plane, wipe_registry
from bench.scaling_replicas import Front, _tenant_everywhere, lifecycles_open_loop
from kvpush.aio import tune_gc
from kvpush.app.etcd_server import EmbeddedEtcd
from kvpush.app.simulated import SimulatedEngine
from kvpush.app.table import markdown, render
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import admin_pb2
from kvpush.controlplane import keys
from kvpush.controlplane.invariants import check
from kvpush.controlplane.ownership import assign

MODEL = "fleet"
ENGINES = 100
# (label, the share of Reserves sent to a (the rest to b), the replicas' extra flags)
ROWS = (("all to the owner (b)", 0.0, ()),
        ("all to a, forwarded to b", 1.0, ()),
        ("all to a, --no-forward (a takes b's slots on)", 1.0, ("--no-forward",)),
        ("1 in 10 to a, forwarded to b", 0.1, ()),
        ("1 in 10 to a, --no-forward", 0.1, ("--no-forward",)))


def b_engines() -> list[str]:
    owners = assign(["a", "b"])
    return [e for e in (f"d{i:04d}" for i in range(10 * ENGINES)) if owners[keys.slot_of(e)] == "b"][:ENGINES]


async def point(etcd: EmbeddedEtcd, to_a: float, extra: tuple[str, ...], rate: float, seconds: float) -> dict:
    planes = {rid: Plane(etcd.endpoint, group_commit=True, extra=("--replica-id", rid, *extra)) for rid in "ab"}
    names = {f"replica {rid}": psutil.Process(p.proc.pid) for rid, p in planes.items()}
    names["etcd"] = psutil.Process(etcd.proc.pid)
    meter = CpuMeter(names)
    try:
        admin = ControlPlaneClient(planes["a"].address, ADMIN)
        made = await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name="fleet"), metadata=admin.metadata)
        await _tenant_everywhere(list(planes.values()), made.token)
        fronts = {rid: Front(p, made.token) for rid, p in planes.items()}
        blocks = int(rate * seconds * 2 / ENGINES) + 64
        engines = [SimulatedEngine(fronts["ab"[i % 2]].admin, eid, blocks, model=MODEL, lease_ttl_s=10)
                   for i, eid in enumerate(b_engines())]
        await asyncio.gather(*(e.register() for e in engines))
        # Reserves to the replicas in the row's shares; CONSUMED always to b, which follows the
        # engines (its own), as a decode sidecar reports to the replica its stream is on.
        own_reporter, fronts["a"].reporter = fronts["a"].reporter, fronts["b"].reporter
        every = round(1 / to_a) if to_a else 0  # every n-th Reserve goes to a
        sent = [fronts["a" if every and i % every == 0 else "b"] for i in range(int(rate * seconds))]
        await asyncio.sleep(1.0)  # b's free summary reaches a
        for front in fronts.values():  # warm every stream
            await asyncio.gather(*(front.lifecycle(time.perf_counter()) for _ in range(32)))
            front.reserve_lat.clear()
        tune_gc()
        await asyncio.gather(*(asyncio.to_thread(wait_idle, p, 0.3, 1.0, 30.0) for p in names.values()))
        meter.start()
        await asyncio.sleep(3.0)
        idle = {k: v / 3.0 for k, v in meter.stop().items()}
        wall, busy = await lifecycles_open_loop(meter, rate, sent)
        for engine in engines:
            await engine.crash()
        report = await check(etcd.endpoint, allow_orphans=True)
        lat = {rid: f.reserve_lat for rid, f in fronts.items()}
        errors = sum(f.errors for f in fronts.values())
        served = sum(map(len, lat.values()))
        fronts["a"].reporter = own_reporter
        for f in fronts.values():
            await f.close()
        await admin.close()
    finally:
        for plane in planes.values():
            plane.stop()
    await wipe_registry(etcd)
    per_request = {k: (busy[k] - idle[k]) * wall / max(served, 1) * 1e3 for k in names}
    ms = {rid: (pct(x, 50) * 1e3, pct(x, 99) * 1e3) if x else None for rid, x in lat.items()}
    return dict(rate=served / wall, errors=errors, lat=ms, per_request=per_request, invariants=report.ok)


def _lat(row: dict, rid: str) -> str:
    return "-" if row["lat"][rid] is None else "{:.2f} / {:.2f}".format(*row["lat"][rid])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="lifecycles per second")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    runs, seconds = (1, 2.0) if args.quick else (args.runs, args.seconds)
    rows = []
    with EmbeddedEtcd() as etcd:
        for run in range(runs):
            for label, to_a, extra in ROWS:
                row = await point(etcd, to_a, extra, args.rate, seconds)
                row.update(label=label, run=run + 1)
                rows.append(row)
                print(f"  run {run + 1}, {label}: {row['rate']:.0f}/s, errors {row['errors']}, Reserve p50/p99 "
                      f"through a {_lat(row, 'a')}, through b {_lat(row, 'b')} ms, CPU per request: "
                      + ", ".join(f"{k} {v:.3f}" for k, v in row["per_request"].items())
                      + f" ms; invariants {'OK' if row['invariants'] else 'VIOLATED'}", flush=True)
    headers = ["run", "Reserves sent", "lifecycles/s", "errors", "Reserve p50 / p99 through a (ms)",
               "through b (ms)", "CPU per request: replica a (ms)", "replica b (ms)", "etcd (ms)", "invariants"]
    table = [[r["run"], r["label"], f"{r['rate']:.0f}", r["errors"], _lat(r, "a"), _lat(r, "b"),
              f"{r['per_request']['replica a']:.3f}", f"{r['per_request']['replica b']:.3f}",
              f"{r['per_request']['etcd']:.3f}", "hold" if r["invariants"] else "VIOLATED"] for r in rows]
    print(render(headers, table))
    if args.quick:
        return
    text = f"""## Forwarding: a Reserve reaching a replica that owns none of its engines

`python -m bench.forwarding --rate {args.rate:.0f} --seconds {seconds:.0f} --runs {runs}` on this VM, {time.strftime('%Y-%m-%d')}
({os.cpu_count()} vCPUs, shared by both replicas, etcd and the load generator). Two replicas, {ENGINES}
simulated decode engines all owned by replica b, full lifecycles open loop at {args.rate:.0f}/s: the
Reserves to the replicas the row names, CONSUMED to b (which follows the engines, as a decode
sidecar's replica does). "Forwarded": replica a sends each Reserve on to b, which
commits it (kvpush/controlplane/forwarding.py). "--no-forward": a takes b's engines' slots on and
commits itself, fenced per engine (the behaviour before forwarding). CPU per request is each
process's CPU under load less at rest, over all the requests served.

{markdown(headers, table)}
"""
    update_section("forwarding", text)


if __name__ == "__main__":
    asyncio.run(main())

"""One etcd's own ceiling for kvpush's transactions, with no control plane in the way.

    .venv/bin/python bench/etcd_ceiling.py          # ~3 minutes; writes docs/BENCHMARKS.md (section "etcd-ceiling")
    .venv/bin/python bench/etcd_ceiling.py --quick  # a smoke run (no report)

A request costs etcd two transactions' worth of work, as in service: its share of a
group-committed Reserve (per reservation a compare on the request key and two puts under
a deadline lease; per batch the engine's and the pool fence's compares and the fence's
touch: kvpush/controlplane/reserver.py) and its share of a group-committed end (a nested
compare-and-swap that writes the CONSUMED tombstone under a tombstone lease and deletes the
request key: kvpush/controlplane/lifecycle.py). Committers stand for replicas: each has
its own engine (no conflicts) and one batch in flight, and they run in two processes so
that Python builds the transactions on both cores. Measured on one etcd with fsync and on
a 3-member cluster with fsync, all on this machine's 2 cores: requests/s, etcd's CPU per
request (every member's), and transaction latency.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMeter, pct, update_section  # noqa: E402
from kvpush.app.etcd_server import EmbeddedEtcd, EtcdCluster  # noqa: E402
from kvpush.app.table import markdown, render  # noqa: E402
from kvpush.contract.states import State  # noqa: E402
from kvpush.controlplane import keys  # noqa: E402
from kvpush.controlplane.etcd import (EtcdClient, cmp_create, cmp_mod, op_delete, op_put, op_touch,  # noqa: E402
                                      op_txn)
from kvpush.controlplane.records import RequestEntry, ReservationRecord, now_ms, to_extents  # noqa: E402
from kvpush.controlplane.reserve_plan import new_reservation_id  # noqa: E402


def _record(engine_id: str, request_id: str) -> ReservationRecord:
    created = now_ms()
    return ReservationRecord(
        id=new_reservation_id(engine_id), tenant="fleet", request_id=request_id, engine_id=engine_id,
        incarnation="0123456789ab", nixl_agent=f"agent-{engine_id}", extents=to_extents(list(range(8))),
        block_size=16, num_tokens=128, model="fleet-model", state=State.RESERVED, deadline_ms=created + 60_000,
        created_ms=created, prefill_engine_id="prefill-0001", prefill_incarnation="ba9876543210", decode_tp=1)


async def _committer(etcd: EtcdClient, engine_id: str, batch: int, until: float, leases: tuple[int, int],
                     latencies: list[float]) -> int:
    deadline_lease, tombstone_lease = leases
    engine_rev = await etcd.put(keys.engine(engine_id), b"{}")
    pool_rev = await etcd.put(keys.pool(engine_id), b"")
    done, n = 0, 0
    while time.perf_counter() < until:
        records = []
        for _ in range(batch):
            n += 1
            records.append(_record(engine_id, f"{engine_id}-{n}"))
        compares = [cmp_create(keys.request(r.tenant, r.request_id), 0) for r in records]
        compares += [cmp_mod(keys.engine(engine_id), engine_rev), cmp_mod(keys.pool(engine_id), pool_rev)]
        ops = [op_touch(keys.pool(engine_id))]
        for r in records:
            ops.append(op_put(keys.reservation(r.id), r.encode(), deadline_lease))
            ops.append(op_put(keys.request(r.tenant, r.request_id), RequestEntry(r.id, r.num_blocks).encode(),
                              deadline_lease))
        t0 = time.perf_counter()
        result = await etcd.txn(compares, ops)
        latencies.append(time.perf_counter() - t0)
        assert result.succeeded
        pool_rev = result.revision
        nested = []
        for r in records:
            ended = r.encode().replace(b'"RESERVED"', b'"CONSUMED"')
            nested.append(op_txn([cmp_mod(keys.reservation(r.id), result.revision)],
                                 [op_put(keys.reservation(r.id), ended, tombstone_lease),
                                  op_delete(keys.request(r.tenant, r.request_id))]))
        t0 = time.perf_counter()
        await etcd.txn([], nested)
        latencies.append(time.perf_counter() - t0)
        done += batch
    return done


async def _process(endpoints: str, name: str, committers: int, batch: int, seconds: float) -> tuple[int, list]:
    etcd = EtcdClient(endpoints, timeout=10)
    leases = (await etcd.grant_lease(600), await etcd.grant_lease(600))
    latencies: list[float] = []
    until = time.perf_counter() + seconds
    counts = await asyncio.gather(*(_committer(etcd, f"{name}-{c}", batch, until, leases, latencies)
                                    for c in range(committers)))
    await etcd.close()
    return sum(counts), latencies


def _worker(endpoints: str, name: str, committers: int, batch: int, seconds: float, out) -> None:
    out.put(asyncio.run(_process(endpoints, name, committers, batch, seconds)))


def point(endpoints: str, members: list[psutil.Process], committers: int, batch: int, seconds: float,
          tag: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    per = [committers // 2 + committers % 2, committers // 2]
    procs = [ctx.Process(target=_worker, args=(endpoints, f"p{tag}-{i}", n, batch, seconds, out))
             for i, n in enumerate(per) if n]
    # etcd's CPU over the workers' whole lives (it idles while they import), over the
    # requests they completed; cores over the seconds they wrote.
    meter = CpuMeter({f"m{i}": p for i, p in enumerate(members)})
    meter.start()
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    cpu = sum(meter.stop().values())
    for p in procs:
        p.join(30)
    done = sum(r[0] for r in results)
    lat = [x for r in results for x in r[1]]
    rate = done / seconds
    return dict(committers=committers, batch=batch, rate=rate, etcd_cores=cpu / seconds,
                etcd_us=cpu / done * 1e6 if done else float("nan"),
                p50=pct(lat, 50) * 1e3, p99=pct(lat, 99) * 1e3)


def run(name: str, endpoints: str, members: list[psutil.Process], grid, seconds: float) -> list[dict]:
    rows = []
    for i, (committers, batch) in enumerate(grid):
        row = dict(point(endpoints, members, committers, batch, seconds, i), etcd=name)
        rows.append(row)
        print(f"  {name:28s} {committers:3d} committers x {batch:3d} per batch: {row['rate']:7.0f} requests/s, "
              f"etcd {row['etcd_cores']:.2f} cores ({row['etcd_us']:.0f} us/request), txn p50 {row['p50']:.1f} "
              f"p99 {row['p99']:.1f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    grid = [(2, 1), (2, 16), (4, 16), (4, 64), (8, 64), (16, 64)]
    if args.quick:
        grid, args.seconds = [(2, 16)], 1.0
    rows = []
    single = EmbeddedEtcd(max_txn_ops=4096).start()
    try:
        rows += run("1 member, fsync", single.endpoint, [psutil.Process(single.proc.pid)], grid, args.seconds)
    finally:
        single.stop()
    if not args.quick:
        cluster = EtcdCluster(3, unsafe_no_fsync=False).start()
        try:
            rows += run("3 members, fsync", cluster.endpoints, [psutil.Process(m.proc.pid) for m in cluster.members],
                        grid, args.seconds)
        finally:
            cluster.stop()
    headers = ["etcd", "committers (1 batch in flight each)", "requests per batch", "requests/s", "etcd cores",
               "etcd CPU per request (us)", "txn p50 ms", "txn p99 ms"]
    table = [[r["etcd"], r["committers"], r["batch"], f"{r['rate']:.0f}", f"{r['etcd_cores']:.2f}",
              f"{r['etcd_us']:.0f}", f"{r['p50']:.1f}", f"{r['p99']:.1f}"] for r in rows]
    print(render(headers, table))
    if args.quick:
        return
    best = {name: max((r for r in rows if r["etcd"] == name), key=lambda r: r["rate"])
            for name in ("1 member, fsync", "3 members, fsync")}
    text = f"""## etcd's own ceiling for kvpush's transactions

Command: `.venv/bin/python bench/etcd_ceiling.py` (one run; no control plane: two Python processes write
what the replicas write, {args.seconds:g} s a point). A request is its share of a group-committed Reserve
(a compare on its request key, its record and request key put under a deadline lease; the engine's and
pool fence's compares and the fence's touch once per batch) and of a group-committed end (the nested
compare-and-swap writing its CONSUMED tombstone and deleting its request key). Each committer stands for a
replica: its own engine, one batch in flight. "etcd cores" adds every member's CPU; all members, the two
writer processes and nothing else share this machine's 2 cores.

{markdown(headers, table)}

- Most carried: {best['1 member, fsync']['rate']:.0f} requests/s on one member
  ({best['1 member, fsync']['etcd_us']:.0f} us of etcd CPU per request), {best['3 members, fsync']['rate']:.0f}
  requests/s on three ({best['3 members, fsync']['etcd_us']:.0f} us per request, all three members' CPU added).
- docs/SCALING.md turns these into how many requests one etcd cluster carries.
"""
    update_section("etcd-ceiling", text)
    print("wrote docs/BENCHMARKS.md (etcd-ceiling)")


if __name__ == "__main__":
    main()

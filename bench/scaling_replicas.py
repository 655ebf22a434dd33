"""What each control-plane replica pays per request as replicas are added: 1, 2 and 4
replicas over one etcd, 1,000 simulated decode engines, full lifecycles (Reserve over the
router's stream client, CONSUMED over the sidecars' report stream) at the same rate on every
serving replica (so the registry carries N times one replica's load, as a registry scaled out
would), plus one replica that serves nothing (what following the registry costs a replica
that has no part in a request). Run by ``bench/scaling.py --replicas``; writes the section
"scaling-replicas" of docs/BENCHMARKS.md.

Each replica's CPU is measured at rest (heartbeats) and under the open-loop load; "per
request" is its CPU under load less at rest, divided by the requests it served. Every point
runs twice, the replicas at ``--follow all`` (the baseline: each applies every change of
every other, so it pays the follow once per request of the whole registry and its cost per
request served grows with the number of replicas) and at ``--follow owned`` (each follows
its own slots: kvpush/controlplane/following.py). A third set of points gives the tenant a
quota (one that never binds): every Reserve is then counted against the tenant's usage, which
each replica follows in the tenant's part of the request index, and fenced on its usage key,
which the serving replicas' batches share."""

from __future__ import annotations

import asyncio
import itertools
import time

import grpc
import psutil

from bench.common import CpuMeter, pct, update_section, wait_idle
from bench.reserve_plane import ADMIN, REFUSED, Plane, paced, wipe_registry
from kvpush.aio import tune_gc
from kvpush.app.etcd_server import EmbeddedEtcd
from kvpush.app.simulated import SimulatedEngine
from kvpush.app.table import markdown, render
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.report_stream import StreamReporter
from kvpush.client.reserve_stream import StreamReserver
from kvpush.contract.v1 import admin_pb2, registry_pb2, scheduler_pb2, types_pb2
from kvpush.controlplane.invariants import check

MODEL = "fleet"
ENGINES = 1_000
_ids = itertools.count()


class Front:
    """One serving replica as the load generator sees it: its stream clients and what it served."""

    def __init__(self, plane: Plane, token: str) -> None:
        self.plane = plane
        self.admin = ControlPlaneClient(plane.address, ADMIN)
        self.tenant = ControlPlaneClient(plane.address, token)
        self.reserver = StreamReserver(self.tenant)
        self.reporter = StreamReporter(self.admin)
        self.reserve_lat: list[float] = []
        self.errors = 0

    async def lifecycle(self, scheduled: float) -> None:
        try:
            res = await self.reserver.reserve(scheduler_pb2.ReserveRequest(
                request_id=f"q{next(_ids)}", num_tokens=16, model=MODEL), timeout=10)
            self.reserve_lat.append(time.perf_counter() - scheduled)
            await self.reporter.report(registry_pb2.ReportStateRequest(
                reservation_id=res.id, state=types_pb2.CONSUMED, landed=True), timeout=10)
        except REFUSED:
            self.errors += 1

    async def close(self) -> None:
        for closer in (self.reporter, self.reserver, self.tenant, self.admin):
            await closer.close()


async def _tenant_everywhere(fronts_planes: list[Plane], token: str) -> None:
    """Wait until every replica's view has the tenant (it was created through the first): a
    lookup of an id that does not exist answers NOT_FOUND once the token is known. (Not
    ListEngines, which answers from the free summary on a replica whose view lacks them.)"""
    for plane in fronts_planes:
        client = ControlPlaneClient(plane.address, token)
        for _ in range(200):
            try:
                await client.scheduler.GetReservation(scheduler_pb2.GetReservationRequest(
                    reservation_id="r-" + "0" * 24), metadata=client.metadata, timeout=5)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    break
                await asyncio.sleep(0.05)
        await client.close()


async def lifecycles_open_loop(meter: CpuMeter, rate: float, sent: list[Front]) -> tuple[float, dict]:
    """One lifecycle through each of ``sent`` (a Front per request) at ``rate``/s, open loop:
    (wall seconds, each process's CPU in cores meanwhile)."""
    tasks = set()
    meter.start()
    t0 = time.perf_counter()
    async for i, scheduled in paced(rate, len(sent)):
        task = asyncio.create_task(sent[i].lifecycle(scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    return wall, {k: v / wall for k, v in meter.stop().items()}


QUOTA = 1 << 30   # blocks: counted and fenced, never reached


QUOTA_MODES = {"": "", "shares": ", quota", "fenced": ", quota, --no-quota-shares"}


async def point(etcd: EmbeddedEtcd, follow: str, replicas: int, per_replica: float, seconds: float,
                quota: str = "") -> dict:
    """``quota``: "" (the tenant has none), "shares" (it has one; the replicas hold shares of it,
    the default) or "fenced" (it has one, and every Reserve is fenced: --no-quota-shares)."""
    rate = per_replica * replicas
    extra = ("--follow", follow) + (("--no-quota-shares",) if quota == "fenced" else ())
    planes = [Plane(etcd.endpoint, group_commit=True, extra=extra) for _ in range(replicas)]
    passive = Plane(etcd.endpoint, group_commit=True, extra=extra)
    names = {f"r{i}": psutil.Process(p.proc.pid) for i, p in enumerate(planes)}
    names["passive"] = psutil.Process(passive.proc.pid)
    names["etcd"] = psutil.Process(etcd.proc.pid)
    names["client"] = psutil.Process()
    meter = CpuMeter(names)
    try:
        admin = ControlPlaneClient(planes[0].address, ADMIN)
        made = await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name="fleet", quota_blocks=QUOTA if quota
                                                                            else 0), metadata=admin.metadata)
        await _tenant_everywhere(planes, made.token)
        fronts = [Front(p, made.token) for p in planes]
        blocks = int(rate * seconds * 2 / ENGINES) + 64
        # Heartbeats spread over the serving replicas, as sidecars behind a Service would be.
        engines = [SimulatedEngine(fronts[i % replicas].admin, f"d{i:04d}", blocks, model=MODEL, lease_ttl_s=10)
                   for i in range(ENGINES)]
        for chunk in range(0, ENGINES, 50):
            await asyncio.gather(*(e.register() for e in engines[chunk:chunk + 50]))
        for front in fronts:  # warm every stream
            await asyncio.gather(*(front.lifecycle(time.perf_counter()) for _ in range(32)))
            front.reserve_lat.clear()
        tune_gc()
        quiet = [names[n] for n in names if n not in ("client",)]
        await asyncio.gather(*(asyncio.to_thread(wait_idle, p, 0.3, 1.0, 30.0) for p in quiet))
        meter.start()
        await asyncio.sleep(3.0)
        idle = {k: v / 3.0 for k, v in meter.stop().items()}
        wall, busy = await lifecycles_open_loop(meter, rate, [fronts[i % replicas]
                                                              for i in range(int(rate * seconds))])
        for engine in engines:
            await engine.crash()
        report = await check(etcd.endpoint, allow_orphans=True)
        served = [len(f.reserve_lat) for f in fronts]
        lat = [x for f in fronts for x in f.reserve_lat]
        errors = sum(f.errors for f in fronts)
        for front in fronts:
            await front.close()
        await admin.close()
    finally:
        for plane in planes + [passive]:
            plane.stop()
    await wipe_registry(etcd)
    total = sum(served)
    per_request = [(busy[f"r{i}"] - idle[f"r{i}"]) * wall / served[i] for i in range(replicas)]
    row = dict(follow=follow + QUOTA_MODES[quota], replicas=replicas, offered=rate, rate=total / wall, errors=errors, p50=pct(lat, 50) * 1e3, p99=pct(lat, 99) * 1e3,
               per_request_ms=[x * 1e3 for x in per_request],
               follow_ms=(busy["passive"] - idle["passive"]) * wall / total * 1e3,
               busy=busy, idle=idle, invariants=report.ok)
    print(f"  --follow {row['follow']}, {replicas} replicas: {row['rate']:.0f} lifecycles/s, Reserve p50 {row['p50']:.2f} p99 {row['p99']:.2f} ms, "
          f"errors {errors}; CPU per request served "
          f"{', '.join(f'{x:.3f}' for x in row['per_request_ms'])} ms; the idle replica's follow "
          f"{row['follow_ms']:.3f} ms per request; etcd {busy['etcd']:.2f} cores; invariants "
          f"{'OK' if report.ok else 'VIOLATED'}", flush=True)
    return row


async def replicas(points: list[tuple[str, int, float, bool]], seconds: float, write: bool) -> None:
    """``points``: (--follow mode, serving replicas, lifecycles/s on each, the quota mode: point())."""
    etcd = EmbeddedEtcd(max_txn_ops=4096).start()
    rows = []
    try:
        print(f"etcd {etcd.endpoint}; {ENGINES} simulated decode engines; {seconds:g} s a point, "
              f"plus one replica serving nothing", flush=True)
        for follow, n, per_replica, quota in points:
            rows.append(await point(etcd, follow, n, per_replica, seconds, quota))
    finally:
        etcd.stop()
    headers = ["--follow", "serving replicas", "lifecycles/s (registry)", "errors", "Reserve p50 ms", "p99 ms",
               "CPU per request served, each replica (ms)", "follow per request, replica serving nothing (ms)",
               "etcd cores", "load generator cores"]
    table = [[r["follow"], r["replicas"], f"{r['rate']:.0f}", r["errors"], f"{r['p50']:.2f}", f"{r['p99']:.2f}",
              " / ".join(f"{x:.3f}" for x in r["per_request_ms"]), f"{r['follow_ms']:.3f}",
              f"{r['busy']['etcd']:.2f}", f"{r['busy']['client']:.2f}"] for r in rows]
    print(render(headers, table))
    if not write:
        return

    def mean(r: dict) -> float:
        return sum(r["per_request_ms"]) / len(r["per_request_ms"])

    def same_rate(follow: str) -> list[dict]:
        base = [r for r in rows if r["follow"] == follow]
        per = min(r["offered"] / r["replicas"] for r in base)  # the rate every serving replica is offered
        return [r for r in base if r["offered"] / r["replicas"] == per]

    def carried(r: dict) -> str:
        short = r["rate"] < 0.9 * r["offered"]
        return f" (carrying {r['rate']:.0f} of {r['offered']:.0f}/s offered)" if short else ""

    lines = []
    for follow in ("all", "owned", *(f"owned{label}" for label in list(QUOTA_MODES.values())[1:])):
        grow = same_rate(follow)
        if len(grow) > 1:
            first = mean(grow[0])
            lines.append(f"- `--follow {follow}`: a serving replica's CPU per request served, at "
                         f"{grow[0]['rate'] / grow[0]['replicas']:.0f}/s on each, is "
                         + ", ".join(f"{mean(r):.2f} ms with {r['replicas']}{carried(r)}" for r in grow)
                         + f" serving replicas ({', '.join(f'{mean(r) / first:.2f}' for r in grow)} of one's); the "
                         "replica serving nothing pays "
                         + ", ".join(f"{r['follow_ms']:.3f} ms" for r in grow) + " per request of the registry.")
    text = f"""## Scaling out: what each replica pays per request, and what following costs

Command: `.venv/bin/python bench/scaling.py --replicas` (one run; one etcd with fsync; {ENGINES} simulated
decode engines, their heartbeats spread over the serving replicas; full lifecycles, a Reserve over the
router's stream client and the decode's CONSUMED over the sidecars' report stream, open loop for
{seconds:g} s a point, request i sent to serving replica i mod N; one more replica serves nothing). Each point
runs with every replica at `--follow all` (each follows the whole registry, as before ownership) and at
`--follow owned` (each follows its own slots and what its clients need: the default). The rows with one
serving replica raise the registry's rate; the others keep the same rate on each serving replica, so N
replicas carry N times one's load. "CPU per request served" is each serving replica's CPU under load less
its CPU at rest, over the requests it served; the follow column is the idle replica's CPU under load less
at rest, over all the registry's requests (it owns a share of the engines too, and the serving replicas
reserve on their own). Every process shares this machine's 2 cores.

{markdown(headers, table)}

{chr(10).join(lines)}
- With a quota, each of the tenant's Reserves is counted against the tenant's usage, which a replica follows
  in the tenant's part of the request index while the tenant's Reserves come to it (the replica serving
  nothing follows none of it). With `--no-quota-shares` every batch is fenced on the tenant's one usage key:
  the serving replicas' batches for that tenant take turns, and one that lost a turn plans again (how every
  quota was served before shares). By default each serving replica holds a share of the quota
  (kvpush/controlplane/quota_shares.py) and commits within it without the fence; only a batch that
  outgrows its share is fenced.
- Invariants checked in etcd after every point: {'all hold' if all(r['invariants'] for r in rows) else 'VIOLATED'}.
"""
    update_section("scaling-replicas", text)
    print("wrote docs/BENCHMARKS.md (scaling-replicas)")

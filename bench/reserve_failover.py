"""Reserve while etcd's leader dies: ``bench/reserve.py --failover`` (about a minute).

A control-plane process on a real 3-member etcd cluster (``kvpush.app.etcd_server.EtcdCluster``,
fsync on), simulated decode engines, Reserve through the stream client in an open loop;
the leader SIGKILLed mid-run and started again on its data. Reports latency and errors
per phase, the stall, the CPU of each process, and the invariants checked in etcd.
"""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import psutil

from kvpush.app.etcd_server import EtcdCluster, binary_version
from kvpush.app.simulated import SimulatedEngine
from kvpush.app.table import markdown, render
from bench.common import CpuMeter, pct, update_section
from bench.reserve_plane import ADMIN, BLOCKS_PER_ENGINE, ENGINES, Plane, _ids, closed_loop, paced, stream_call
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.reserve_stream import ReserveRefused, StreamReserver
from kvpush.controlplane.invariants import check
from kvpush.contract.v1 import admin_pb2, scheduler_pb2


class MemberCpu:
    """CPU seconds of one etcd member over a run in which it is killed and started again."""

    def __init__(self, member) -> None:
        self.member, self.used, self._proc, self._t0 = member, 0.0, None, 0.0

    def start(self) -> None:
        self._proc = psutil.Process(self.member.proc.pid)
        self._t0 = CpuMeter._cpu(self._proc, False)

    def stop(self) -> None:
        if self._proc is not None:
            self.used += CpuMeter._cpu(self._proc, False) - self._t0
            self._proc = None


async def failover(rate: float, seconds: float, kill_at: float, back_at: float) -> None:
    """Open-loop Reserve through the stream client against a control plane on a real
    3-member etcd; the leader SIGKILLed at ``kill_at`` s and started again at ``back_at``.
    No request is retried: every error is counted where it happened."""
    cluster = EtcdCluster(3, unsafe_no_fsync=False).start()
    plane = Plane(cluster.endpoints, group_commit=True)
    samples: list[tuple[float, float, str]] = []  # (scheduled s from start, latency s, "" or error code)
    reasons: collections.Counter = collections.Counter()
    try:
        admin = ControlPlaneClient(plane.address, ADMIN)
        tenant = await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name="failover"),
                                                metadata=admin.metadata)
        client = ControlPlaneClient(plane.address, tenant.token)
        reserver = StreamReserver(client)
        engines = [SimulatedEngine(admin, f"failover-d{i}", BLOCKS_PER_ENGINE, model="failover", lease_ttl_s=60)
                   for i in range(ENGINES)]
        for engine in engines:
            await engine.register()
        await closed_loop(stream_call(reserver), 8, 0.5, "failover")  # warm up
        members = [MemberCpu(m) for m in cluster.members]
        meter = CpuMeter({"controlplane": psutil.Process(plane.proc.pid), "client": psutil.Process()})
        for m in members:
            m.start()
        meter.start()
        start = time.perf_counter()

        async def one(scheduled: float) -> None:
            req = scheduler_pb2.ReserveRequest(request_id=f"f{next(_ids)}", num_tokens=16, model="failover",
                                               deadline_ms=600_000)
            try:
                await reserver.reserve(req, timeout=10)
                samples.append((scheduled - start, time.perf_counter() - scheduled, ""))
            except grpc.aio.AioRpcError as exc:
                samples.append((scheduled - start, time.perf_counter() - scheduled, exc.code().name))
                reasons[exc.details()[:90]] += 1
            except ReserveRefused as exc:
                samples.append((scheduled - start, time.perf_counter() - scheduled, exc.code.name))
                reasons[exc.details[:90]] += 1

        async def faults() -> tuple[int, float, float]:
            await asyncio.sleep(kill_at)
            leader = await asyncio.to_thread(cluster.leader)
            members[leader].stop()
            cluster.members[leader].kill()
            killed = time.perf_counter() - start
            await asyncio.sleep(max(0.0, back_at - kill_at))
            await asyncio.to_thread(cluster.restart, leader)
            members[leader].start()
            return leader, killed, time.perf_counter() - start

        tasks, fault = set(), asyncio.create_task(faults())
        async for _, scheduled in paced(rate, int(rate * seconds)):
            task = asyncio.create_task(one(scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
        leader, killed, back = await fault
        wall = time.perf_counter() - start
        cpu = meter.stop()
        for m in members:
            m.stop()
        await reserver.close()
        await client.close()
        report = await check(cluster.endpoints, allow_orphans=True)
        live = len(report.live)
        # Each member on its own: a member that lost acknowledged writes (etcd 3.5.0-3.5.2,
        # docs/OPERATIONS.md) would still pass a check read through another.
        held = [len((await check(m.endpoint, allow_orphans=True)).live) for m in cluster.members]
        release = binary_version(cluster.members[0].binary)
        for engine in engines:
            await engine.stop()
        await admin.close()
    finally:
        plane.stop()
        cluster.stop()
    ok = [s for s in samples if not s[2]]
    errors = [s for s in samples if s[2]]
    codes = sorted({s[2] for s in errors})
    phases = [("before the kill", 0.0, killed), ("leader dead", killed, back), ("after its restart", back, 1e9)]
    headers = ["phase", "sent", "ok", "errors", "p50 ms", "p99 ms", "max ms"]
    rows = []
    for name, lo, hi in phases:
        sent = [s for s in samples if lo <= s[0] < hi]
        lat = [s[1] for s in sent if not s[2]]
        rows.append([f"{name} ({lo:.1f}-{min(hi, wall):.1f} s)", len(sent), len(lat), len(sent) - len(lat),
                     f"{pct(lat, 50) * 1e3:.2f}", f"{pct(lat, 99) * 1e3:.1f}", f"{max(lat, default=0) * 1e3:.0f}"])
    window = (f"{errors[0][0]:.2f}-{errors[-1][0] + errors[-1][1]:.2f} s" if errors else "none")
    slow = [s for s in ok if s[1] > 0.1 and s[0] >= killed]
    stall = (max(s[0] + s[1] for s in slow) - killed) if slow else 0.0
    print(render(headers, rows))
    for reason, n in reasons.most_common():
        print(f"  {n} x {reason}")
    text = f"""## Reserve while etcd's leader dies (3-member cluster)

Command: `.venv/bin/python bench/reserve.py --failover`. Setup, on this machine's 2 cores:

- a real 3-member etcd cluster on loopback (`kvpush.app.etcd_server.EtcdCluster`, etcd {release}, fsync on);
- one control-plane process given all three endpoints (`--etcd a,b,c`, `--etcd-timeout 2`);
- {ENGINES} simulated decode engines;
- Reserve through the stream client in an open loop at {rate:.0f}/s for {seconds:g} s, no retries.

Member {leader}, the leader, was SIGKILLed at {killed:.1f} s and started again on its data at {back:.1f} s.

{markdown(headers, rows)}

- **Errors**: {len(errors)} of {len(samples)} ({', '.join(codes) or 'none'}), between {window}
  (scheduled time to answer): {'; '.join(f'{n} x "{r}"' for r, n in reasons.most_common()) or 'none'}.
  Only asks whose transaction etcd left in doubt are answered UNAVAILABLE: sent to the leader as it
  died, or timed out. A retry of the same request id is idempotent. A write etcd certainly did not
  apply (no connection to the member, no leader) is retried on the next member within the call's
  timeout.
- **The stall**: Reserves that were in flight when the leader died were answered, or failed, within
  {stall:.2f} s of the kill. The bound is the etcd call timeout: a proposal the dead leader held gets no
  answer. An election itself takes about a second.
- **CPU** (seconds per wall second, cores): control plane {cpu['controlplane'] / wall:.2f}, load generator
  {cpu['client'] / wall:.2f}, etcd members {' / '.join(f'{m.used / wall:.2f}' for m in members)} (the killed
  one counted while it ran).
- **Invariants** checked in etcd after the run: {'all hold' if report.ok else 'VIOLATED: ' + report.summary()}
  ({live} live reservations; none double-booked); each member read on its own holds
  {' / '.join(map(str, held))}{'' if len(set(held)) == 1 and held[0] == live else ' (MEMBERS DISAGREE)'}.
"""
    update_section("reserve-failover", text)
    print("wrote docs/BENCHMARKS.md (reserve-failover)")

"""`kvpush demo`: bring the system up on loopback, exercise it, print a summary,
shut everything down.

What runs today: the embedded etcd, a control-plane replica, and two SIMULATED
decode engines (registered and heartbeating like sidecars, but owning no memory
and moving no bytes: the real sidecars and vLLM engines come with the worker and
connector work). Requests reserve landing blocks ahead of "prefill", go through
the lifecycle the sidecars will drive (PUSHING, LANDED, CONSUMED), one is
aborted and one is left to expire, and the registry is checked against its
invariants at the end.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time

from controlplane.client import ControlPlaneClient
from controlplane.invariants import check
from kvpush.etcd_server import EmbeddedEtcd, free_port
from kvpush.simulated import SimulatedEngine
from kvpush.table import render
from kvpush.v1 import admin_pb2, registry_pb2, scheduler_pb2, types_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def start_controlplane(etcd: str, logs: str, admin: str, engine: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    ready = os.path.join(logs, "controlplane.ready")
    if os.path.exists(ready):
        os.unlink(ready)
    log = open(os.path.join(logs, "controlplane.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.cli", "controlplane", "--listen", f"127.0.0.1:{port}",
                             "--etcd", etcd, "--admin-token", admin, "--engine-token", engine,
                             "--max-batch", "500", "--ready-file", ready], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"control plane failed to start; see {logs}/controlplane.log")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port}"


async def run(address: str, admin_token: str, engine_token: str, requests: int, etcd_endpoint: str) -> int:
    admin = ControlPlaneClient(address, admin_token)
    engines_client = ControlPlaneClient(address, engine_token)
    engines = [SimulatedEngine(engines_client, f"sim-decode-{i}", num_blocks=256, model="demo-model")
               for i in range(2)]
    for engine in engines:
        await engine.register()
        say(f"registered SIMULATED decode engine {engine.engine_id} (256 blocks of 16 tokens; no real memory)")
    tenant = await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name="demo", quota_blocks=400),
                                            metadata=admin.metadata)
    client = ControlPlaneClient(address, tenant.token)
    say("created tenant 'demo' (quota 400 blocks)")

    rows = []
    for i in range(requests):
        tokens = [100, 512, 2048, 37, 1000, 4000, 16, 777][i % 8]
        t0 = time.perf_counter()
        res = await client.scheduler.Reserve(scheduler_pb2.ReserveRequest(
            request_id=f"demo-{i}", num_tokens=tokens, model="demo-model",
            deadline_ms=1000 if i == requests - 1 else 30_000), metadata=client.metadata)
        reserve_ms = (time.perf_counter() - t0) * 1e3
        rows.append([res.request_id, tokens, res.engine_id, len(res.block_ids),
                     f"{res.block_ids[0]}..{res.block_ids[-1]}", f"{reserve_ms:.2f}", res.id])

    async def report(res_id: str, state: int) -> types_pb2.Reservation:
        return await engines_client.registry.ReportState(registry_pb2.ReportStateRequest(
            reservation_id=res_id, state=state), metadata=engines_client.metadata)

    final = {}
    for i, row in enumerate(rows):
        res_id = row[-1]
        if i == requests - 1:
            continue  # left to expire
        if i == requests - 2:
            got = await client.scheduler.Release(scheduler_pb2.ReleaseRequest(
                reservation_id=res_id, reason="client disconnected"), metadata=client.metadata)
        else:
            await report(res_id, types_pb2.PUSHING)
            await report(res_id, types_pb2.LANDED)
            got = await report(res_id, types_pb2.CONSUMED)
        final[res_id] = types_pb2.ReservationState.Name(got.state)
    say("waiting for the last reservation's 1 s deadline to pass ...")
    expired_id = rows[-1][-1]
    for _ in range(100):
        got = await client.scheduler.GetReservation(scheduler_pb2.GetReservationRequest(reservation_id=expired_id),
                                                    metadata=client.metadata)
        if got.state == types_pb2.EXPIRED:
            break
        await asyncio.sleep(0.1)
    final[expired_id] = types_pb2.ReservationState.Name(got.state)

    print()
    print(render(["request", "tokens", "decode engine", "blocks", "block ids", "Reserve ms", "final state"],
                 [r[:-1] + [final[r[-1]]] for r in rows]))
    report_ = await check(etcd_endpoint, quiet=True)
    print()
    say(f"registry invariants (read from etcd directly): {'all hold' if report_.ok else report_.summary()}")
    for engine_id, blocks in sorted(report_.engines.items()):
        say(f"  {engine_id}: {len(blocks.free)}/{blocks.num_blocks} blocks free, {len(blocks.reserved)} reserved")
    for engine in engines:
        await engine.stop()
    for c in (client, admin, engines_client):
        await c.close()
    return 0 if report_.ok and set(final.values()) == {"CONSUMED", "RELEASED", "EXPIRED"} else 1


def main(args) -> int:
    logs = os.path.abspath(args.keep_logs)
    os.makedirs(logs, exist_ok=True)
    admin_token, engine_token = "kvp_admin_" + secrets.token_hex(16), "kvp_engine_" + secrets.token_hex(16)
    say("starting embedded etcd ...")
    etcd = EmbeddedEtcd(log_path=os.path.join(logs, "etcd.log")).start()
    cp = None
    try:
        say(f"etcd up at {etcd.endpoint}; starting the control plane ...")
        cp, address = start_controlplane(etcd.endpoint, logs, admin_token, engine_token)
        say(f"control plane serving on {address}")
        return asyncio.run(run(address, admin_token, engine_token, args.requests, etcd.endpoint))
    finally:
        if cp is not None:
            cp.terminate()
            cp.wait(15)
        etcd.stop()
        say(f"everything stopped; logs in {logs}")

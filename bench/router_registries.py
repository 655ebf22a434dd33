"""A router over one registry and over two (issue #32, "beyond one etcd"): what routing
between registries costs a request, and what a registry without room costs.

    .venv/bin/python bench/router_registries.py --report   # ~4 minutes on 2 cores; writes
                                                           # the "Router over several
                                                           # registries" section of
                                                           # docs/BENCHMARKS.md

Two registries, each its own etcd and control-plane process. A stand-in engine process
(``bench/stand_in.py``'s) registers a simulated prefill and decode engine in each, with
its own URL as theirs, and hands each awaited prefill request its reservation as a prefill
sidecar would (it follows the prefill engine's reservations by watch). A router finds the
engines in the registries; an open loop of short streamed requests (a 64-token prompt, 8
tokens: the first-token path, every request reserved and its handover awaited) at a
fixed rate. Modes, each with its own router and stand-in, in turn, in a rotating order:

  one          --controlplane A: one registry, the router as most deployments run it
  two          --controlplane A --controlplane B, both with room
  two, A full  the same, A's decode engine holding 4 blocks: full from its first
               reservation to that reservation's deadline (3 s; nothing here reports
               CONSUMED), so A refuses for room, the request is reserved in B within the
               same Reserve timeout, and A is asked last for 0.5 s before it is tried again

Per mode: the clients' TTFT p50 / p99, the router's CPU per request, the control planes'
and etcds' (each mode's requests over them), the router's own count of Reserves per
registry and outcome and of fallbacks. On 2 cores two registries cannot show more
throughput than one (the two etcds and control planes share what one had): this measures
what the routing costs, not what the split buys (docs/SCALING.md does that arithmetic).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
import urllib.request

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMeter, pct, update_section  # noqa: E402
from bench.stand_in import prompt_ids, stand_in_app, stream  # noqa: E402
from kvpush.app import engines  # noqa: E402
from kvpush.app.etcd_server import EmbeddedEtcd, free_port  # noqa: E402
from kvpush.app.procs import ManagedProcess, file_exists, python  # noqa: E402
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model  # noqa: E402

T0 = time.monotonic()
ADMIN, ENGINE = "kvp_admin_" + "b" * 32, "kvp_engine_" + "b" * 32
TENANT = "kvp_tenant_bench_" + "c" * 24   # the same tenant token in both registries: --token once
TOKENS = 8
DEADLINE_MS = 3000
FULL_BLOCKS = 4
MODES = ("one", "two", "two, A full")


def say(msg: str) -> None:
    print(f"[router-registries {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Registry:
    """An etcd and a control-plane process, with the bench's tenant."""

    def __init__(self, name: str, logs: str, run: str) -> None:
        self.name = name
        self.etcd = EmbeddedEtcd(log_path=os.path.join(logs, f"etcd-{name}.log")).start()
        port = free_port()
        ready = os.path.join(run, f"cp-{name}.ready")
        self.proc = ManagedProcess(f"controlplane-{name}", [
            python(), "-m", "kvpush.app.cli", "controlplane", "--listen", f"127.0.0.1:{port}", "--etcd",
            self.etcd.endpoint, "--admin-token", ADMIN, "--engine-token", ENGINE, "--max-batch", "500",
            "--ready-file", ready], os.path.join(logs, f"controlplane-{name}.log"), cwd=engines.ROOT)
        self.proc.wait_until(file_exists(ready), 60, "serving", say)
        self.address = f"127.0.0.1:{port}"
        asyncio.run(self._tenant())

    async def _tenant(self) -> None:
        from kvpush.client.control_plane import ControlPlaneClient
        from kvpush.contract.v1 import admin_pb2
        async with ControlPlaneClient(self.address, ADMIN) as admin:
            await admin.admin.CreateTenant(admin_pb2.CreateTenantRequest(name="bench", token=TENANT),
                                           metadata=admin.metadata, timeout=10)

    def stop(self) -> None:
        self.proc.stop()
        self.etcd.stop()


def stand_in(port: int, model: str, registries: list[str], blocks: list[int], tag: str) -> None:
    """The stand-in engine process: a prefill and a decode engine of each registry, all
    served here, every awaited prefill request handed its reservation."""
    from aiohttp import web
    from kvpush.app.simulated import SimulatedEngine
    from kvpush.client.control_plane import ControlPlaneClient
    from kvpush.contract.v1 import registry_pb2, types_pb2

    heard: dict[str, str] = {}
    waiting: dict[str, asyncio.Future] = {}
    url = f"http://127.0.0.1:{port}"
    parts: list = []

    async def handover(request_id: str, wait_s: float) -> str:
        if request_id not in heard:
            fut = waiting.setdefault(request_id, asyncio.get_running_loop().create_future())
            try:
                await asyncio.wait_for(asyncio.shield(fut), wait_s)
            except asyncio.TimeoutError:
                return ""   # none came: computed without a push, as the connector does
            finally:
                waiting.pop(request_id, None)
        return heard.pop(request_id)

    async def follow(client, engine_id: str) -> None:
        call = client.registry.WatchEngineReservations(
            registry_pb2.WatchEngineReservationsRequest(engine_id=engine_id), metadata=client.metadata)
        async for event in call:
            r = event.reservation
            if r.id and r.request_id not in heard:
                heard[r.request_id] = r.id
                fut = waiting.get(r.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(None)

    async def start(app) -> None:
        for i, (address, n) in enumerate(zip(registries, blocks)):
            name = "ab"[i]
            client = ControlPlaneClient(address, ENGINE)
            # (Each engine its own URL: an engine is its URL to a router.)
            prefill = SimulatedEngine(client, f"prefill-{name}-{tag}", 1000, model="tiny", role=types_pb2.PREFILL,
                                      serving_url=f"{url}/prefill-{name}")
            decode = SimulatedEngine(client, f"decode-{name}-{tag}", n, model="tiny",
                                     serving_url=f"{url}/decode-{name}")
            for sim in (prefill, decode):
                await sim.register()
            parts.append((client, (prefill, decode), asyncio.ensure_future(follow(client, prefill.engine_id))))

    async def stop(app) -> None:
        for client, sims, following in parts:
            following.cancel()
            for sim in sims:
                await sim.stop()
            await client.close()

    app = stand_in_app(model, handover=handover)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


async def open_loop(url: str, rate: float, seconds: float, tag: str) -> list[dict]:
    """A request every 1/``rate`` s for ``seconds``, each streaming ``TOKENS`` tokens."""
    body = {"model": "tiny", "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    n = int(rate * seconds)
    start = time.perf_counter()

    async def one(i: int, s: aiohttp.ClientSession) -> dict:
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        try:
            return await stream(s, url, dict(body, prompt=prompt_ids(hash((tag, i)) % 100_000)))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return {"error": repr(exc)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        return await asyncio.gather(*(one(i, s) for i in range(n)))


async def router_counts(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r'^kvpush_router_(registry_reserves_total|fallbacks_total|'
                                          r'reserve_seconds_sum|reserve_seconds_count)(?:\{([^}]*)\})? (\S+)$',
                                          text, re.M):
        out[f"{name}{{{labels}}}"] = float(value)
    return out


def one_mode(mode: str, regs: list[Registry], model: str, logs: str, run: str, rate: float, seconds: float,
             rep: int) -> dict:
    tag = f"{'abc'[MODES.index(mode)]}{rep}"
    port = free_port()
    used = regs[:1] if mode == "one" else regs
    blocks = [FULL_BLOCKS if mode == "two, A full" and i == 0 else 200_000 for i in range(len(used))]
    standin = ManagedProcess(f"stand-in-{tag}", [
        python(), os.path.abspath(__file__), "--stand-in", str(port), "--model", model, "--registries",
        ",".join(r.address for r in used), "--blocks", ",".join(map(str, blocks)), "--tag", tag],
        os.path.join(logs, f"stand-in-{tag}.log"), cwd=engines.ROOT)
    rport = free_port()
    ready = os.path.join(run, f"router-{tag}.ready")
    router = ManagedProcess(f"router-{tag}", [
        python(), "-m", "kvpush.app.cli", "router", *(a for r in used for a in ("--controlplane", r.address)),
        "--token", TENANT, "--model", "tiny", "--model-dir", model, "--port", str(rport), "--ready-file", ready,
        "--deadline-ms", str(DEADLINE_MS)], os.path.join(logs, f"router-{tag}.log"), cwd=engines.ROOT)
    try:
        router.wait_until(file_exists(ready), 60, "serving", say)
        url = f"http://127.0.0.1:{rport}"
        want = 2 * len(used)
        deadline = time.monotonic() + 30
        while True:   # the router has found every engine of its registries
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    health = json.loads(r.read())
                if len(health["decode"]) + len(health["prefill"]) >= want:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"{mode}: the router did not find the engines"
            time.sleep(0.2)
        asyncio.run(open_loop(url, rate, 2.0, f"warm-{tag}"))
        time.sleep(DEADLINE_MS / 1e3 + 0.5)   # the warm-up's reservations ended: A starts empty
        before = asyncio.run(router_counts(url))
        procs = {"router": psutil.Process(router.pid), "stand-in": psutil.Process(standin.pid),
                 "clients": psutil.Process()}
        for r in regs:
            procs[f"control plane {r.name}"] = psutil.Process(r.proc.pid)
            procs[f"etcd {r.name}"] = psutil.Process(r.etcd.proc.pid)
        meter = CpuMeter(procs)
        meter.start()
        t = time.monotonic()
        got = asyncio.run(open_loop(url, rate, seconds, tag))
        wall = time.monotonic() - t
        cpu = meter.stop()
        after = asyncio.run(router_counts(url))
    finally:
        router.stop()
        standin.stop()
    counts = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}
    ok = [g for g in got if not g.get("error") and g.get("tokens") == TOKENS]
    ttft = [g["ttft"] * 1e3 for g in ok]
    n = len(got)
    reserves = counts.get("reserve_seconds_count{}", 0.0)
    out = {"mode": mode, "rep": rep, "requests": n, "ok": len(ok), "wall_s": wall,
           "errors": sorted({str(g.get("error") or f"{g.get('tokens')} tokens") for g in got if g not in ok})[:5],
           "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
           "ttft_max_ms": max(ttft, default=float("nan")),
           "reserve_mean_ms": 1e3 * counts.get("reserve_seconds_sum{}", 0.0) / reserves if reserves else float("nan"),
           "cpu_s": cpu, "router_ms_per_request": 1e3 * cpu["router"] / max(n, 1),
           "registries_ms_per_request": 1e3 * sum(v for k, v in cpu.items()
                                                  if k.startswith(("control plane", "etcd"))) / max(n, 1),
           "counts": counts}
    say(f"{mode} (rep {rep}): {len(ok)}/{n} ok, TTFT p50 {out['ttft_p50_ms']:.2f} p99 {out['ttft_p99_ms']:.2f} ms, "
        f"router {out['router_ms_per_request']:.3f} ms/request, registries "
        f"{out['registries_ms_per_request']:.3f} ms/request, counts {counts}")
    return out


def report(rows: list[dict], rate: float, seconds: float, regs: list[Registry]) -> str:
    names = {r.address: r.name for r in regs}

    def reserves(row: dict) -> str:
        parts = []
        for key, v in sorted(row["counts"].items()):
            if key.startswith("registry_reserves_total"):
                label = dict(re.findall(r'(\w+)="([^"]*)"', key))
                parts.append(f"{names.get(label['registry'], label['registry'])} {label['outcome']} {v:.0f}")
        return ", ".join(parts) or "- (one registry: not counted by registry)"

    def fallbacks(row: dict) -> str:
        out = []
        for key, v in sorted(row["counts"].items()):
            if key.startswith("fallbacks_total"):
                reason = dict(re.findall(r'(\w+)="([^"]*)"', key)).get("reason", "?")
                out.append(f"{reason} {v:.0f}")
        return ", ".join(out) or "0"

    lines = [f"`.venv/bin/python bench/router_registries.py --report` (`bench/router_registries.py` says what "
             f"each mode is). An open loop of {rate:.0f} requests/s for {seconds:.0f} s per run (a 64-token prompt, "
             f"{TOKENS} streamed tokens, the first-token path with its handover), each mode's own router and "
             f"stand-in engine process, the modes in a rotating order; CPU of each process over the run divided "
             f"by the requests sent. {time.strftime('%Y-%m-%d')}.", "",
             "| mode | run | answered | TTFT p50 ms | TTFT p99 ms | TTFT max ms | router's Reserve, mean ms "
             "| router ms/request "
             "| control planes + etcds ms/request | Reserves by registry and outcome | fallbacks |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for row in sorted(rows, key=lambda r: (MODES.index(r["mode"]), r["rep"])):
        lines.append(f"| {row['mode']} | {row['rep'] + 1} | {row['ok']}/{row['requests']} | {row['ttft_p50_ms']:.2f} "
                     f"| {row['ttft_p99_ms']:.2f} | {row['ttft_max_ms']:.2f} | {row['reserve_mean_ms']:.2f} "
                     f"| {row['router_ms_per_request']:.3f} "
                     f"| {row['registries_ms_per_request']:.3f} | {reserves(row)} | {fallbacks(row)} |")
    errors = sorted({e for row in rows for e in row["errors"]})
    if errors:
        lines += ["", "Not answered in full: " + "; ".join(errors)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--seconds", type=float, default=15.0, help="per run")
    ap.add_argument("--reps", type=int, default=2, help="runs of each mode")
    ap.add_argument("--report", action="store_true", help="write docs/BENCHMARKS.md's section")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--stand-in", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--registries", help=argparse.SUPPRESS)
    ap.add_argument("--blocks", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stand_in:
        stand_in(args.stand_in, args.model, args.registries.split(","), [int(b) for b in args.blocks.split(",")],
                 args.tag)
        return
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    logs = tempfile.mkdtemp(prefix="router-registries-")
    run = tempfile.mkdtemp(prefix="router-registries-run-")
    say(f"logs in {logs}")
    regs: list[Registry] = []
    rows = []
    try:
        for name in ("A", "B"):
            regs.append(Registry(name, logs, run))
        for rep in range(args.reps):
            for k in range(len(MODES)):
                mode = MODES[(k + rep) % len(MODES)]
                rows.append(one_mode(mode, regs, model, logs, run, args.rate, args.seconds, rep))
    finally:
        for r in regs:
            r.stop()
    text = report(rows, args.rate, args.seconds, regs)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if args.report:
        update_section("router-registries", text)


if __name__ == "__main__":
    main()

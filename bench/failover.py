"""Decode failover: what a decode engine's death costs a request, with the reservation
moved and the KV pushed again from the prefill engine's staging (kvpush), against the
baseline every other P/D system has (another decode engine computes the prompt), beside
the limit (the same request with nothing killed).

One real stack: etcd, a control plane, sidecars, one prefill and two decode vLLM engines
with our connector (prefix caching off, so every prompt is computed or loaded whole), and
two routers, one with --no-relocate. Each trial sends one long streamed prompt; once the
prefill engine has pushed its first chunk, the prefill engine is frozen (SIGSTOP: the tiny
model would finish before the kill otherwise), the decode engine its reservation names is
killed with -9 (its vLLM; its sidecar stays, as when only the engine's container dies), and
the prefill engine is thawed. The router learns of the death when its continuation cannot
reach that engine, right after the first token; so the client's gap between its first
token (from prefill) and its second (the first from the new decode engine) is the cost of
the failover. The killed engine is started again between trials.

    .venv/bin/python bench/failover.py              # ~10 minutes; writes docs/BENCHMARKS.md
    .venv/bin/python bench/failover.py --trials 1 --no-report
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import CpuMeter, pct, update_section  # noqa: E402
from bench.loadgen import make_prompts, stream_request  # noqa: E402
from kvpush.app.stack import Stack, StackSpec  # noqa: E402
from kvpush.app.tiny_model import ensure_model  # noqa: E402

NO_CACHE = "--no-enable-prefix-caching"
MAX_TOKENS = 8


def say(msg: str) -> None:
    print(f"[failover] {msg}", flush=True)


def counters(stack: Stack, engine: str) -> dict:
    return stack.stats().get(engine, {}).get("counters", {})


def first_reservation(stack: Stack, found: dict, ready: threading.Event) -> None:
    """Follow the tenant's reservations; record the first new one granted."""
    from kvpush.client.control_plane import ControlPlaneClient
    from kvpush.contract.v1 import scheduler_pb2

    async def follow():
        async with ControlPlaneClient(stack.controlplane, stack.tenant_token) as cp:
            call = cp.scheduler.WatchReservations(scheduler_pb2.WatchReservationsRequest(), metadata=cp.metadata)
            ready.set()
            async for event in call:
                if event.reservation.id and not event.reservation.moved_from:
                    found["reservation"] = event.reservation
                    call.cancel()
                    return
    try:
        asyncio.run(follow())
    except Exception:  # the cancelled call
        pass


def engine_available(stack: Stack, engine_id: str) -> bool:
    from tests.sidecar.service_helpers import Etcd

    async def read():
        etcd = Etcd(stack.etcd.endpoint)
        try:
            rec = await etcd.engine(engine_id)
            return rec is not None and not rec.unavailable
        finally:
            await etcd.close()
    return asyncio.run(read())


def trial(stack: Stack, url: str, prompt: str) -> dict:
    found: dict = {}
    ready = threading.Event()
    watcher = threading.Thread(target=first_reservation, args=(stack, found, ready), daemon=True)
    watcher.start()
    ready.wait(10)
    pushed_before = counters(stack, "prefill-0").get("layers_pushed", 0)
    out: dict = {}
    client = threading.Thread(target=lambda: out.update(stream_request(url, prompt, MAX_TOKENS, 300)))
    client.start()
    deadline = time.monotonic() + 60
    while "reservation" not in found or counters(stack, "prefill-0").get("layers_pushed", 0) == pushed_before:
        if time.monotonic() > deadline:
            raise RuntimeError("no reservation granted, or its push never began")
        time.sleep(0.002)
    res = found["reservation"]
    prefill = os.getpgid(stack.process("vllm-prefill").proc.pid)
    os.killpg(prefill, signal.SIGSTOP)
    mid_push = counters(stack, "prefill-0").get("requests_pushed", 0)
    name = "decode" if res.engine_id == "decode-0" else res.engine_id
    victim = next(p for p in reversed(stack.procs) if p.name in (f"vllm-{name}", f"vllm-{name}-restarted")
                  and p.proc.poll() is None)
    victim.kill_group()
    os.killpg(prefill, signal.SIGCONT)
    client.join(300)
    watcher.join(5)
    out.update(named=res.engine_id, num_tokens=res.num_tokens, mid_push=mid_push)
    return out


def live(stack: Stack, name: str) -> psutil.Process:
    """The running process of ``name`` (or of its latest restart)."""
    proc = next(p for p in reversed(stack.procs) if p.name in (name, f"{name}-restarted") and p.alive())
    return psutil.Process(proc.pid)


def run_mode(stack: Stack, url: str, prompts: list[str], want: dict, killing: bool) -> dict:
    rows = []
    for prompt in prompts:
        before = {e: dict(counters(stack, e)) for e in ("prefill-0", "decode-0", "decode-1")}
        # CPU of this request alone (restarts between trials are not counted); the decode
        # engine killed in a trial is left out, the other is the one that finishes it.
        meter = CpuMeter({"router": live(stack, "router"), "control plane": live(stack, "controlplane"),
                          "vllm prefill+": live(stack, "vllm-prefill"), "prefill sidecar": live(stack, "sidecar-prefill"),
                          "vllm decode-0+": live(stack, "vllm-decode"), "vllm decode-1+": live(stack, "vllm-decode-1")})
        meter.start()
        if killing:
            r = trial(stack, url, prompt)
        else:
            r = stream_request(url, prompt, MAX_TOKENS, 300)
        cpu = meter.stop()
        named = r.get("named") or ("decode-1" if cpu["vllm decode-1"] > cpu["vllm decode-0"] else "decode-0")
        survivor = "decode-1" if named == "decode-0" and killing else "decode-0" if killing else named
        r["cpu"] = {"router": cpu["router"], "control plane": cpu["control plane"], "vllm prefill": cpu["vllm prefill"],
                    "prefill sidecar": cpu["prefill sidecar"], "vllm decode (the one answering)": cpu[f"vllm {survivor}"]}
        time.sleep(0.3)  # the counters file is written at the end of an engine step
        after = {e: dict(counters(stack, e)) for e in ("prefill-0", "decode-0", "decode-1")}
        r["begun"] = after["prefill-0"].get("requests_begun", 0) - before["prefill-0"].get("requests_begun", 0)
        r["landed"] = sum(after[e].get("loads_landed", 0) - before[e].get("loads_landed", 0)
                          for e in ("decode-0", "decode-1"))
        r["correct"] = r.get("text") == want.get(prompt)
        rows.append(r)
        say(f"  gap {1000 * (r['t2_s'] - r['ttft_s']):.0f} ms, ttft {1000 * r['ttft_s']:.0f} ms, "
            f"correct={r['correct']}, pushes begun {r['begun']}, loads by push {r['landed']}")
        if killing:
            named = r["named"]
            stack.restart_engine("decode", named)
            deadline = time.monotonic() + 60
            while not engine_available(stack, named):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{named} did not come back")
                time.sleep(0.2)
    return {"rows": rows, "cpu": {k: sum(r["cpu"][k] for r in rows) / len(rows) for k in rows[0]["cpu"]}}


NAMES = {"none": "limit: nothing killed", "relocate": "kvpush: reservation moved, KV pushed again",
         "recompute": "baseline: another engine computes the prompt (--no-relocate)"}


def gaps(rows: list[dict]) -> list[float]:
    return [1000 * (r["t2_s"] - r["ttft_s"]) for r in rows]


def report(results: dict, trials: int) -> str:
    lines = [
        "## Decode failover: a decode engine killed mid-push (issue #13)",
        "",
        f"`bench/failover.py`: one prefill and two decode vLLM engines (tiny model, prefix caching off, "
        f"prefill in chunks of 64 tokens), {trials} trials per row, one streamed prompt each, {MAX_TOKENS} output "
        "tokens, greedy. In each failover trial the decode engine the reservation names is killed with -9 (its "
        "vLLM; its sidecar lives) once the prefill engine has pushed its first chunk: the prefill engine is frozen "
        "meanwhile, so the kill lands mid-push, which also puts the freeze into those rows' TTFT. The router finds "
        "out when its continuation cannot reach the engine. **The gap** is the client's time from its first token "
        "(the prefill engine's) to its second (the first from the decode engine that finishes the request): what "
        "the failover costs the request. The limit is the same request with nothing killed; the baseline is what "
        "every other P/D system does (another decode engine computes the prompt).",
        "",
        "| prompt | row | correct | prefills | loads by push | gap p50 (ms) | gap max (ms) | gap / limit | "
        "gap / baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tokens, by_mode in results.items():
        limit = pct(gaps(by_mode["none"]["rows"]), 50)
        base = pct(gaps(by_mode["recompute"]["rows"]), 50)
        for mode in ("none", "relocate", "recompute"):
            rows = by_mode[mode]["rows"]
            g = gaps(rows)
            lines.append(f"| {tokens} | {NAMES[mode]} | {sum(r['correct'] for r in rows)}/{len(rows)} | "
                         f"{sum(r['begun'] for r in rows)} | {sum(r['landed'] for r in rows)} | {pct(g, 50):.0f} | "
                         f"{max(g):.0f} | {pct(g, 50) / limit:.2f}x | {pct(g, 50) / base:.2f}x |")
    lines += ["", "CPU seconds per request (the engine killed is left out; the restarts between trials are not "
              "counted):", ""]
    first = next(iter(results.values()))["none"]["cpu"]
    lines += ["| prompt | row | " + " | ".join(first) + " |", "|---|---|" + "---|" * len(first)]
    for tokens, by_mode in results.items():
        for mode in ("none", "relocate", "recompute"):
            lines.append(f"| {tokens} | {mode} | " + " | ".join(f"{v:.3f}" for v in by_mode[mode]["cpu"].values())
                         + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[400, 1500])
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    model = os.path.abspath(ensure_model(os.path.join(ROOT, ".kvpush", "models", "tiny-llama")))
    logs = tempfile.mkdtemp(prefix="kvpush-failover-")
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, decode_engines=2, quarantine_ms=2_000,
                            prefill_args=("--max-num-batched-tokens", "64", NO_CACHE), decode_args=(NO_CACHE,)),
                  progress=say)
    try:
        stack.start()
        recompute_url = stack.add_router("router-recompute", extra=("--no-relocate",))
        results: dict = {}
        for tokens in args.tokens:
            prompts = make_prompts(model, tokens, 3 * args.trials, f"failover-{tokens}")
            want = {}
            for p in prompts:  # the answers with nothing killed (P/D equals one engine: test_router_e2e)
                want[p] = stream_request(stack.router_url, p, MAX_TOKENS, 300)["text"]
            results[tokens] = {}
            for i, (mode, url, killing) in enumerate((("none", stack.router_url, False),
                                                      ("relocate", stack.router_url, True),
                                                      ("recompute", recompute_url, True))):
                say(f"{tokens} tokens, {mode}: {args.trials} trials")
                results[tokens][mode] = run_mode(stack, url, prompts[i * args.trials:(i + 1) * args.trials], want,
                                                 killing)
        text = report(results, args.trials)
        print(text)
        if not args.no_report:
            update_section("failover", text)
    finally:
        stack.stop()


if __name__ == "__main__":
    main()

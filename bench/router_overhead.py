"""What the router adds to a request's TTFT, by part: its HTTP hop (the same request
through the router and straight to the engine), and the decode-alone Reserve round trip.
The floor a decode-alone turn can reach through the router is the engine's own TTFT
plus these two.

    .venv/bin/python bench/router_overhead.py --report   # ~6 minutes on 2 cores; writes the
                                                         # "Router overhead" section of
                                                         # docs/BENCHMARKS.md

One stack, real parts: etcd, a control plane, a prefill and two decode vLLM engines with
prefix caching and KV events (their sidecars follow them), and one KV-aware router that
serves every turn whose decode engine holds all but a short rest by decode alone.

  hop          : a 1,000-token prompt and its 128-token answer on the prefill engine, then a
                 turn adding 64 tokens with max_tokens=1, alternately straight to that
                 engine and through the router (which proxies it there: the same engine
                 work, the router's hop the only difference);
  decode alone : the same conversation on decode-0 (straight to it), then the next turn
                 alternately straight to decode-0 and through the router (its Reserve
                 answers decode_alone on decode-0: hop plus Reserve);
  Reserve      : decode-alone Reserves one at a time over the router's kind of stream
                 (``kvpush.client.reserve_stream.StreamReserver``) from this process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpush.app import engines  # noqa: E402
from kvpush.app.stack import Stack, StackSpec  # noqa: E402
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model  # noqa: E402
from bench.common import CpuMeter, pct, update_section  # noqa: E402
from bench.multiturn import ANSWER_TOKENS, ask, ids  # noqa: E402

T0 = time.monotonic()
NEW = 64  # the turn's new tokens: decode alone computes them (and the answer's partial last block)


def say(msg: str) -> None:
    print(f"[router-overhead {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def pair(engine_url: str, router_url: str, reps: int, max_tokens: int, tag: str) -> dict:
    """TTFT (ms) of a conversation's next turn straight to the engine and through the
    router, alternating which goes first; turn 1 always straight to the engine."""
    out: dict[str, list[float]] = {"direct": [], "router": [], "errors": []}
    for rep in range(reps):
        for mode in (("direct", "router") if rep % 2 == 0 else ("router", "direct")):
            base = ids(1000, f"{tag}-{rep}-{mode}-{time.monotonic_ns()}")
            first = ask(engine_url, base, ANSWER_TOKENS)
            if first["error"]:
                out["errors"].append(first["error"])
                continue
            time.sleep(0.6)  # the engine's KV events, its sidecar's report, the control plane's view
            r = ask(engine_url if mode == "direct" else router_url, base + first["token_ids"] + ids(NEW, f"{tag}-n"),
                    max_tokens=max_tokens)
            if r["error"]:
                out["errors"].append(r["error"])
                continue
            out[mode].append(r["ttft_s"] * 1e3)
            time.sleep(0.3)
    return out


async def reserve_rtts(stack: Stack, n: int) -> list[float]:
    from kvpush.client.control_plane import ControlPlaneClient
    from kvpush.client.reserve_stream import StreamReserver
    from kvpush.contract.v1 import scheduler_pb2
    out = []
    async with ControlPlaneClient(stack.controlplane, stack.tenant_token) as cp:
        reserver = StreamReserver(cp)
        try:
            for i in range(n):
                req = scheduler_pb2.ReserveRequest(request_id=f"rtt-{i}-{time.monotonic_ns()}", model="tiny",
                                                   num_tokens=NEW, local_prefill_tokens=1_000_000)
                t = time.perf_counter()
                res = await reserver.reserve(req, timeout=5)
                out.append((time.perf_counter() - t) * 1e3)
                assert res.decode_alone, res  # nothing reserved: nothing to release
                await asyncio.sleep(0.01)
        finally:
            await reserver.close()
    return out


def row(name: str, r: dict) -> str:
    d, g = r["direct"], r["router"]
    return (f"| {name} | {pct(d, 50):.1f} / {pct(d, 90):.1f} | {pct(g, 50):.1f} / {pct(g, 90):.1f} | "
            f"{pct(g, 50) - pct(d, 50):+.1f} | {len(d)} + {len(g)} | {len(r['errors'])} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=15, help="turns of each kind, each way")
    p.add_argument("--report", action="store_true", help="write the section of docs/BENCHMARKS.md")
    args = p.parse_args()
    logs = tempfile.mkdtemp(prefix="kvpush-router-overhead-")
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, decode_engines=2, kv_aware=True, deadline_ms=30_000),
                  progress=say)
    try:
        stack.start()
        router = stack.add_router("router-alone", extra=("--local-prefill-tokens", "1000000"))
        meter = CpuMeter({p.name + "+": psutil.Process(p.pid) for p in stack.procs if p.alive()})
        meter.start()
        hop = pair(stack.urls["prefill-0"], router, args.reps, 1, "hop")
        say(f"hop: direct {pct(hop['direct'], 50):.1f} ms, router {pct(hop['router'], 50):.1f} ms")
        alone = pair(stack.urls["decode-0"], router, args.reps, 2, "alone")
        say(f"decode alone: direct {pct(alone['direct'], 50):.1f} ms, router {pct(alone['router'], 50):.1f} ms")
        cpu = meter.stop()
        rtt = asyncio.run(reserve_rtts(stack, 300))
        say(f"Reserve (decode alone): p50 {pct(rtt, 50):.2f} ms")
    finally:
        stack.stop()
    busiest = ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])[:6])
    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d')} by `bench/router_overhead.py` ({os.cpu_count()} cores; "
        f"{args.reps} turns each way, alternating). TTFT p50 / p90 (ms), streamed, measured by the client. "
        f"Turn 1: 1,000 tokens and a 128-token answer; the measured turn adds {NEW}.",
        "",
        "| turn | straight to the engine | through the router | router adds (p50) | turns | errors |",
        "|---|---|---|---|---|---|",
        row("hop: `max_tokens=1`, proxied to the prefill engine", hop),
        row("decode alone: Reserve answers `decode_alone`, then the hop", alone),
        "",
        f"Decode-alone Reserve round trip, one at a time from a client over the stream (300): "
        f"p50 {pct(rtt, 50):.2f} ms, p10 {pct(rtt, 10):.2f}, p90 {pct(rtt, 90):.2f}.",
        "",
        f"CPU seconds over the two TTFT phases, busiest processes (with their children): {busiest}.",
    ])
    print(text)
    if args.report:
        update_section("router-overhead", text)


if __name__ == "__main__":
    main()

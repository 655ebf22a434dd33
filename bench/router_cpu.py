"""The router's CPU per streamed token, beside the engines', and what one router worker
can stream when no engine is the limit.

    .venv/bin/python bench/router_cpu.py --report   # ~4 minutes on 2 cores; writes the
                                                    # "Router CPU" section of docs/BENCHMARKS.md

engines   one stack, real parts (etcd, a control plane, a prefill and a decode vLLM engine
          with their sidecars, the router): 16 concurrent streamed requests of 200 tokens
          each (greedy, ignore_eos), completions and then chats (a user message of 48 words),
          through the router (the first-token path), through the
          baseline router, through a bare TCP relay in front of the decode engine (the
          limit: bench/tcp_relay.py, what any proxy on the token path pays per event), and
          straight to the decode engine; each process's CPU over each phase divided by the
          tokens the clients received. Then TTFT, sequential and interleaved:
          through the router, and the prefill engine alone (max_tokens=1, its floor).
fake      the router alone in front of a stand-in engine process (bench/stand_in.py) that
          answers the prefill request at once and writes decode's whole stream (200 events
          as vLLM writes them) in one go, and a simulated decode engine registered with the
          control plane (so every request is reserved and takes the first-token path):
          concurrent clients for a fixed time, with 1 and 2 router workers, and through the
          bare TCP relay straight to the stand-in (the limit). Tokens/s, and the router's
          CPU per token (its workers together). On 2 cores the stand-in and the clients
          share the cores with the router, so 2 workers cannot double what 1 does here.
          Then paced: the router and the baseline router, each on its first-token path and
          its push path (requests with a presence penalty), and the relay, in front of
          a stand-in that streams one event every 5 ms, answers of 200 and of 20 tokens;
          each one's CPU per request fitted as R (per request) + E (per event) x events,
          to say where the router's CPU above the relay's goes.
paced     that paced table alone (about 4 minutes; --baseline REF for another router
          beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMeter, pct, update_section  # noqa: E402
from bench.stand_in import SimulatedDecode, drive, prompt_ids, stream  # noqa: E402
from kvpush.app import engines  # noqa: E402
from kvpush.app.etcd_server import free_port  # noqa: E402
from kvpush.app.procs import ManagedProcess, file_exists, python  # noqa: E402
from kvpush.app.stack import Stack, StackSpec  # noqa: E402
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model  # noqa: E402

T0 = time.monotonic()
BASELINE = "daaff16"  # main before issue #31: the router re-made every token's event
TOKENS = 200
CONCURRENT = 16
REPS = 3
ENDPOINTS = ("completions", "chats")  # each path measured with both, chats named so
TTFT_ROUNDS = 30  # (at 10 the p50 ratios of two runs differed by 0.1x: noise, not the router)
PACE_MS = 5.0            # the paced part: one event every 5 ms, as an engine streams
PACED_TOKENS = (200, 20)  # ... answers of two lengths, to split per request from per event
PACED_S = 8.0
PACED_ROUNDS = 2        # (one round's E moved by 5 us between runs)
LIMIT = "straight to decode through a bare TCP relay (the limit)"
PACED = "paced"
PUSHED = "the router (1 worker), push path"
FAKE_LIMIT = "bare TCP relay straight to the stand-in (the limit)"


def say(msg: str) -> None:
    print(f"[router-cpu {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


WORDS = "push each layer while the next one is still being computed and decode starts at once".split()


def chat_messages(i: int, words: int = 48) -> list[dict]:
    return [{"role": "user", "content": " ".join(WORDS[(i * 7 + k * 5) % len(WORDS)] for k in range(words))}]


async def many(url: str, count: int, tokens: int, tag: str, endpoint: str = "completions") -> list[dict]:
    body = {"model": "tiny", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}

    def prompt(i: int) -> dict:
        n = hash((tag, i)) % 1000
        return {"messages": chat_messages(n)} if endpoint == "chats" else {"prompt": prompt_ids(n)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        return await asyncio.gather(*(stream(s, url, dict(body, **prompt(i))) for i in range(count)))


def baseline_checkout(ref: str) -> str:
    """``ref``'s tree (a git worktree in /tmp), with this tree's generated gRPC stubs."""
    import glob
    import shutil
    path = os.path.join(tempfile.gettempdir(), f"kvpush-baseline-{ref}")
    if not os.path.exists(path):
        subprocess.run(["git", "-C", engines.ROOT, "worktree", "add", "--detach", path, ref], check=True,
                       stdout=subprocess.DEVNULL)
    for stub in glob.glob(os.path.join(engines.ROOT, "kvpush", "contract", "v1", "*_pb2*.py*")):
        shutil.copy(stub, os.path.join(path, "kvpush", "contract", "v1"))
    return path


def other_router(stack: Stack, name: str, checkout: str, extra: tuple[str, ...]) -> tuple[ManagedProcess, str]:
    """A router of another checkout (the baseline) in front of ``stack``'s control plane."""
    port = free_port()
    ready = os.path.join(stack.run_dir, f"{name}.ready")
    proc = ManagedProcess(name, [python(), "-m", "kvpush.app.cli", "router", "--controlplane", stack.controlplane,
                                 "--token", stack.tenant_token, "--model", "tiny", "--model-dir", stack.spec.model_dir,
                                 "--port", str(port), "--ready-file", ready, *extra],
                          os.path.join(stack.spec.log_dir, f"{name}.log"), env={"PYTHONPATH": checkout}, cwd=checkout)
    proc.wait_until(file_exists(ready), 60, "serving", say)
    return proc, f"http://127.0.0.1:{port}"


def accepting(port: int):
    """Whether 127.0.0.1:``port`` accepts a connection (for ``wait_until``)."""
    def accepts() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False
    return accepts


def bench_process(stack: Stack, name: str, script: str, *args: str) -> tuple[ManagedProcess, int]:
    """``bench/<script>`` serving on a free port (its first argument), once it accepts."""
    port = free_port()
    proc = ManagedProcess(name, [python(), os.path.join(os.path.dirname(os.path.abspath(__file__)), script),
                                 str(port), *args], os.path.join(stack.spec.log_dir, f"{name}.log"))
    proc.wait_until(accepting(port), 30, "accepting", say)
    return proc, port


def tcp_relay(stack: Stack, port: int) -> tuple[ManagedProcess, str]:
    """A bare TCP relay (``tcp_relay.py``) in front of 127.0.0.1:``port``."""
    proc, mine = bench_process(stack, "tcp-relay", "tcp_relay.py", f"127.0.0.1:{port}")
    return proc, f"http://127.0.0.1:{mine}"


def stand_in(stack: Stack, model: str, pace_ms: float,
             name: str = "stand-in") -> tuple[ManagedProcess, int, tuple[str, ...]]:
    """A stand-in engine (``stand_in.py``), and the router arguments that put it behind a
    router as its prefill engine and the simulated decode engine's URL."""
    proc, port = bench_process(stack, name, "stand_in.py", "--model", model, "--pace-ms", str(pace_ms))
    up = f"http://127.0.0.1:{port}"
    return proc, port, ("--prefill", up, "--decode", f"sim-decode={up}", "--deadline-ms", "3000")


def per_token_ms(cpu: dict[str, float], tokens: int) -> dict[str, float]:
    return {k: 1e3 * v / max(tokens, 1) for k, v in cpu.items()}


# -- engines ------------------------------------------------------------------------------------
def engines_part(model: str, logs: str, baseline: str) -> dict:
    os.makedirs(logs, exist_ok=True)
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, max_num_seqs=CONCURRENT, decode_blocks=2048,
                            engine_env=dict(engines.PD_PAIR_ENV)), progress=say)
    base_proc = relay = None
    try:
        stack.start()
        decode_url = stack.urls["decode-0"]
        prefill_url = stack.prefill_url
        base_proc, base_url = other_router(stack, "router-baseline", baseline_checkout(baseline), (
            "--prefill", f"prefill-0={prefill_url}", "--decode", f"decode-0={decode_url}"))
        relay, relay_url = tcp_relay(stack, int(decode_url.rsplit(":", 1)[1]))
        procs = {p.name: psutil.Process(p.pid) for p in stack.procs}
        procs["router-baseline"] = psutil.Process(base_proc.pid)
        procs["tcp relay"] = psutil.Process(relay.pid)
        groups = {"decode vLLM": [n for n in procs if n.startswith("vllm-decode")],
                  "prefill vLLM": [n for n in procs if n.startswith("vllm-prefill")],
                  "sidecars + control plane + etcd": [n for n in procs if n.startswith(("sidecar", "controlplane"))]}
        for url in (stack.router_url, base_url, relay_url, decode_url):
            for endpoint in ENDPOINTS:
                asyncio.run(many(url, 4, 16, "warm", endpoint))
        out = {}
        phases = (("through the router", stack.router_url, "router"),
                  (f"through the baseline router ({baseline})", base_url, "router-baseline"),
                  (LIMIT, relay_url, "tcp relay"),
                  ("straight to decode", decode_url, None))
        phases = [(name if endpoint == "completions" else f"{name}, {endpoint}", url, router, endpoint)
                  for endpoint in ENDPOINTS for name, url, router in phases]
        for rep in range(REPS):  # interleaved, so that a busier moment of the machine hits each
            for phase, url, router, endpoint in phases:
                names = dict(groups, router=[router] if router else [])
                meter = CpuMeter({f"{n}+": procs[n] for ns in names.values() for n in ns})
                meter.start()
                t = time.monotonic()
                results = asyncio.run(many(url, CONCURRENT, TOKENS, f"{phase}-{rep}", endpoint))
                wall = time.monotonic() - t
                cpu = meter.stop()
                got = out.setdefault(phase, {"tokens": 0, "wall_s": 0.0, "errors": [], "cpu_s": {},
                                             "router_ms_per_token_each": [], "endpoint": endpoint})
                tokens = sum(r.get("tokens", 0) for r in results)
                got["tokens"] += tokens
                got["wall_s"] += wall
                got["errors"] += [r["error"] for r in results if r["error"]]
                got["errors"] += [f"{r['tokens']} tokens, not {TOKENS}" for r in results
                                  if not r["error"] and r["tokens"] != TOKENS]
                for g, ns in names.items():
                    got["cpu_s"][g] = got["cpu_s"].get(g, 0.0) + sum(cpu.get(n, 0.0) for n in ns)
                if router:
                    got["router_ms_per_token_each"].append(1e3 * sum(cpu.get(n, 0.0) for n in names["router"])
                                                           / max(tokens, 1))
        for phase, got in out.items():
            got["ms_per_token"] = per_token_ms(got["cpu_s"], got["tokens"])
            say(f"{phase}: {got['tokens']} tokens in {got['wall_s']:.1f} s, errors {len(got['errors'])}, ms/token " +
                ", ".join(f"{k} {v:.3f}" for k, v in got["ms_per_token"].items()) +
                f"; router each run {[round(x, 3) for x in got['router_ms_per_token_each']]}")
        modes = {"router": (stack.router_url, 8), "baseline router": (base_url, 8), "prefill alone": (prefill_url, 1)}
        ttft: dict[str, list[float]] = {m: [] for m in modes}
        for i in range(TTFT_ROUNDS):
            order = list(modes)[i % 3:] + list(modes)[:i % 3]
            for mode in order:
                url, n = modes[mode]
                r = asyncio.run(many(url, 1, n, f"ttft-{i}-{mode}"))[0]
                if r["error"] is None:
                    ttft[mode].append(r["ttft"] * 1e3)
                time.sleep(0.2)
        out["ttft_ms"] = {k: {"p50": pct(v, 50), "p90": pct(v, 90), "n": len(v)} for k, v in ttft.items()}
        say("TTFT p50: " + ", ".join(f"{k} {v['p50']:.1f} ms" for k, v in out["ttft_ms"].items()))
        return out
    finally:
        if relay is not None:
            relay.stop()
        if base_proc is not None:
            base_proc.stop()
        stack.stop()


# -- fake upstream --------------------------------------------------------------------------------
async def router_counts(url: str) -> dict[str, float]:
    """What the router says it did: paths, fallbacks, decode events passed or made."""
    import re
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for name, labels, value in re.findall(r'^kvpush_router_(paths_total|fallbacks_total|continuation_events_total)'
                                          r'\{([^}]*)\} (\S+)$', text, re.M):
        out[f"{name}{{{labels}}}"] = out.get(f"{name}{{{labels}}}", 0.0) + float(value)
    return out


def fake_part(model: str, logs: str, seconds: float, clients: int, workers_list: list[int], baseline: str,
              pace_ms: float = 0.0, paced_only: bool = False) -> dict:
    os.makedirs(logs, exist_ok=True)
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, engines=False, deadline_ms=3000, quarantine_ms=100),
                  progress=say)
    upstream = None
    out = {}
    try:
        stack.start()
        sim = SimulatedDecode(stack.controlplane, stack.engine_token)
        upstream, port, engine_args = stand_in(stack, model, pace_ms)
        # 0: the baseline router (one process); -1: the bare TCP relay straight to the stand-in (the limit)
        for workers in [] if paced_only else [0, *workers_list, -1]:
            name = f"router-w{workers}" if workers > 0 else "router-baseline" if workers == 0 else "tcp-relay"
            if workers > 0:
                url = stack.add_router(name, discover=True, extra=(*engine_args, "--workers", str(workers)))
                proc = stack.process(name)
            elif workers == 0:
                proc, url = other_router(stack, name, baseline_checkout(baseline), engine_args)
            else:
                proc, url = tcp_relay(stack, port)
            router = psutil.Process(proc.pid)
            asyncio.run(drive(url, clients, 2.0, TOKENS))  # warm (connections, first reservations)
            meters = CpuMeter({"router+": router, "upstream": psutil.Process(upstream.pid),
                               "bench (clients)": psutil.Process(),
                               "control plane": psutil.Process(stack.process("controlplane").pid)})
            meters.start()
            t = time.monotonic()
            got = asyncio.run(drive(url, clients, seconds, TOKENS))
            wall = time.monotonic() - t
            cpu = meters.stop()
            got.update(wall_s=wall, cpu_s=cpu, tokens_per_s=got["tokens"] / wall,
                       router_ms_per_token=1e3 * cpu["router"] / max(got["tokens"], 1),
                       tokens_per_router_core_s=got["tokens"] / max(cpu["router"], 1e-9))
            if workers >= 0:
                got["router_metrics"] = asyncio.run(router_counts(url))
            out[workers if workers > 0 else f"baseline ({baseline})" if workers == 0 else FAKE_LIMIT] = got
            say(f"fake upstream, {name}: {got['tokens_per_s']:.0f} tokens/s, router "
                f"{got['router_ms_per_token'] * 1e3:.1f} us/token ({got['tokens_per_router_core_s']:.0f} tokens per "
                f"router CPU second), errors {len(got['errors'])}, cpu {cpu}")
            proc.stop()
        out[PACED] = paced_part(stack, model, clients, baseline)
        sim.stop()
        return out
    finally:
        if upstream is not None:
            upstream.stop()
        stack.stop()


def paced_part(stack: Stack, model: str, clients: int, baseline: str) -> dict:
    """The router (one worker) and the baseline router, each on its two token paths, and the
    bare TCP relay, in front of a stand-in that streams one event every PACE_MS, with
    answers of each of PACED_TOKENS tokens (one event a token), alternating: CPU per request
    = R + E x events, fitted on the two lengths. The push path (decode streams every token,
    passed through whole) is what requests with output penalties, tools, structured output
    or a seed take; the first-token path what the rest take."""
    upstream, port, engine_args = stand_in(stack, model, PACE_MS, "stand-in-paced")
    procs = [upstream]
    try:
        router_url = stack.add_router("router-paced", discover=True, extra=engine_args)
        router = stack.process("router-paced")
        procs.append(router)
        base, base_url = other_router(stack, "router-paced-baseline", baseline_checkout(baseline), engine_args)
        procs.append(base)
        relay, relay_url = tcp_relay(stack, port)
        procs.append(relay)
        plain = None  # (drive's default: 64 token ids)

        def pushed(i: int, n: int) -> dict:  # (a penalty: the push path, in the baseline's router too)
            return {"prompt": prompt_ids(i * 1000 + n), "presence_penalty": 0.5}
        who = {"router": (router_url, router.pid, plain), PUSHED: (router_url, router.pid, pushed),
               f"baseline router ({baseline}), first-token path": (base_url, base.pid, plain),
               f"baseline router ({baseline}), push path": (base_url, base.pid, pushed),
               "relay": (relay_url, relay.pid, plain)}
        per_request: dict[str, dict[int, list[float]]] = {w: {} for w in who}
        for url, _, prompt in who.values():
            asyncio.run(drive(url, clients, 2.0, PACED_TOKENS[0], prompt))  # warm
        for rnd in range(PACED_ROUNDS):
            for i, tokens in enumerate(PACED_TOKENS):
                for name in (list(who) if (rnd + i) % 2 == 0 else list(who)[::-1]):
                    url, pid, prompt = who[name]
                    meter = CpuMeter({"p+": psutil.Process(pid)})
                    meter.start()
                    got = asyncio.run(drive(url, clients, PACED_S, tokens, prompt))
                    cpu = meter.stop()["p"]
                    acc = per_request[name].setdefault(tokens, [0.0, 0, 0])  # CPU s, requests, errors
                    acc[0] += cpu
                    acc[1] += got["requests"]
                    acc[2] += len(got["errors"])
        out = {}
        long_, short = PACED_TOKENS
        for name, by in per_request.items():
            cpr = {t: c / max(r, 1) for t, (c, r, _) in by.items()}
            e = (cpr[long_] - cpr[short]) / (long_ - short)
            out[name] = {"ms_per_request_at": {t: 1e3 * v for t, v in cpr.items()}, "per_event_us": 1e6 * e,
                         "per_request_ms": 1e3 * (cpr[short] - short * e),
                         "errors": sum(x[2] for x in by.values()), "requests": {t: x[1] for t, x in by.items()}}
            say(f"paced, {name}: R {out[name]['per_request_ms']:.2f} ms per request, E {out[name]['per_event_us']:.1f} "
                f"us per event ({out[name]})")
        return out
    finally:
        for p in procs:
            p.stop()


def report(eng: dict | None, fake: dict | None, clients: int, seconds: float) -> str:
    lines = ["## Router CPU", "",
             "`.venv/bin/python bench/router_cpu.py --report` (`bench/router_cpu.py` says what each part does). "
             "CPU of each process over the phase divided by the tokens the clients received; the baseline is "
             "main before issue #31 (its router re-made every token's event), run beside in the same session.", ""]
    if eng:
        lines += [f"**Engines** ({CONCURRENT} concurrent streamed requests of {TOKENS} tokens, greedy, real vLLM "
                  f"engines, one OpenMP thread each; completions, and chats of a 48-word user message; {REPS} runs of "
                  "each path, interleaved: the router's figure is all of them together, then each):", "",
                  "| path | tokens | wall s | router (or relay) ms/token | decode vLLM ms/token | prefill vLLM ms/token | "
                  "sidecars + control plane ms/token |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, p in eng.items():
            if name == "ttft_ms":
                continue
            m = p["ms_per_token"]
            each = ", ".join(f"{x:.3f}" for x in p["router_ms_per_token_each"])
            router = f"**{m['router']:.3f}** ({each})" if p["cpu_s"].get("router") else "-"
            lines.append(f"| {name} | {p['tokens']} | {p['wall_s']:.1f} | {router} | {m['decode vLLM']:.3f} | "
                         f"{m['prefill vLLM']:.3f} | {m['sidecars + control plane + etcd']:.3f} |")
        for endpoint in ENDPOINTS:
            mine, base, limit = (next((p["ms_per_token"]["router"] for n, p in eng.items() if n.startswith(path)
                                       and p.get("endpoint", "completions") == endpoint), None)
                                 for path in ("through the router", "through the baseline", LIMIT))
            if mine and base and limit:
                lines += ["", f"Same run, {endpoint}: the router's CPU per token is **{mine / limit:.2f}x** "
                              f"the bare TCP relay's (the limit) and **{mine / base:.2f}x** the baseline router's."]
        t = eng["ttft_ms"]
        alone = t["prefill alone"]["p50"]
        lines += ["", f"TTFT (sequential, interleaved, n={t['router']['n']} each), p50 / p90: through the router "
                      f"{t['router']['p50']:.1f} / {t['router']['p90']:.1f} ms (**{t['router']['p50'] / alone:.2f}x** "
                      f"the prefill engine alone), through the baseline router {t['baseline router']['p50']:.1f} / "
                      f"{t['baseline router']['p90']:.1f} ms ({t['baseline router']['p50'] / alone:.2f}x), the prefill "
                      f"engine alone {alone:.1f} / {t['prefill alone']['p90']:.1f} ms.", ""]
    if fake and set(fake) - {PACED}:
        lines += [f"**Fake upstream** ({clients} clients streaming {TOKENS}-token answers back to back for "
                  f"{seconds:g} s, every request reserved on a simulated decode engine; the stand-in engine, the "
                  "clients and the control plane on the same 2 cores):", "",
                  "| router | tokens/s | router us/token | tokens per router CPU second | requests | TTFT p50 ms | "
                  "CPU s: router, stand-in engine, clients, control plane | decode events passed / made |",
                  "|---|---:|---:|---:|---:|---:|---|---|"]
        for w, g in fake.items():
            if w == PACED:
                continue
            c = g["cpu_s"]
            rm = g.get("router_metrics", {})
            passed = rm.get('continuation_events_total{how="passed"}')
            made = rm.get('continuation_events_total{how="made"}')
            ev = f"{passed:.0f} / {made:.0f}" if passed is not None else "-"
            label = f"{w} worker{'s' if w != 1 else ''}" if isinstance(w, int) else w
            lines.append(f"| {label} | {g['tokens_per_s']:.0f} | {g['router_ms_per_token'] * 1e3:.1f} | "
                         f"{g['tokens_per_router_core_s']:.0f} | {g['requests']} | {g['ttft_ms_p50']:.1f} | "
                         f"{c['router']:.1f}, {c['upstream']:.1f}, {c['bench (clients)']:.1f}, "
                         f"{c['control plane']:.1f} | {ev} |")
    if fake and PACED in fake:
        lines += paced_report(fake[PACED], clients)
    return "\n".join(lines)


def paced_report(paced: dict, clients: int) -> list[str]:
    long_, short = PACED_TOKENS
    lines = ["", f"**Per request and per event** ({clients} clients, the stand-in streaming one event every "
             f"{PACE_MS:g} ms, answers of {long_} and {short} tokens, {PACED_ROUNDS} x {PACED_S:g} s each, "
             "alternating; CPU per request fitted as R + E x events; the push path's requests ask for a presence "
             "penalty):", "",
             f"| | R: ms per request | E: us per event | ms per {long_}-token request | ms per {short}-token request | "
             f"requests ({long_} + {short}) | errors |", "|---|---:|---:|---:|---:|---:|---:|"]
    names = {"router": "the router (1 worker), first-token path", "relay": "bare TCP relay (the limit)"}
    for name, p in paced.items():
        at = p["ms_per_request_at"]
        lines.append(f"| {names.get(name, name)} | "
                     f"{p['per_request_ms']:.2f} | {p['per_event_us']:.1f} | {at[long_]:.2f} | {at[short]:.2f} | "
                     f"{' + '.join(str(v) for v in p['requests'].values())} | {p['errors']} |")
    r, l = paced["router"], paced["relay"]
    lines += ["", f"Above the relay, first-token path: **{r['per_request_ms'] - l['per_request_ms']:.2f} ms per "
              f"request** ({(r['per_request_ms'] - l['per_request_ms']) * 1e3 / long_:.1f} us of a {long_}-token "
              f"answer's per-token figure) and **{r['per_event_us'] - l['per_event_us']:.1f} us per event**."]
    for mine, path in (("router", "first-token path"), (PUSHED, "push path")):
        p = paced.get(mine)
        base = next((v for k, v in paced.items() if k.startswith("baseline router") and k.endswith(path)), None)
        if p and base:
            lines += [f"Against the baseline router, {path}: **{p['per_event_us'] / base['per_event_us']:.2f}x** its "
                      f"CPU per event and **{p['ms_per_request_at'][long_] / base['ms_per_request_at'][long_]:.2f}x** "
                      f"per {long_}-token request ({p['per_event_us'] - l['per_event_us']:.1f} us per event above "
                      "the relay)."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("engines", "fake", "paced", "both"), default="both",
                    help="paced: the fake part's paced table alone")
    ap.add_argument("--seconds", type=float, default=20.0, help="fake part: seconds per worker count")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--workers", default="1,2", help="fake part: router worker counts")
    ap.add_argument("--baseline", default=BASELINE, help="the git ref whose router runs beside, for comparison")
    ap.add_argument("--report", action="store_true", help="write docs/BENCHMARKS.md's section")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="fake part: the stand-in writes one event every "
                    "this many ms (an engine's pace) instead of all at once")
    args = ap.parse_args()
    if args.report and args.part != "both":
        ap.error("--report writes the whole section: every part (--part both)")
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    logs = tempfile.mkdtemp(prefix="router-cpu-")
    say(f"logs in {logs}")
    eng = engines_part(model, os.path.join(logs, "engines"), args.baseline) if args.part in ("engines", "both") \
        else None
    fake = fake_part(model, os.path.join(logs, "fake"), args.seconds, args.clients,
                     [int(w) for w in args.workers.split(",")], args.baseline, args.pace_ms, args.part == "paced") \
        if args.part in ("fake", "paced", "both") else None
    text = report(eng, fake, args.clients, args.seconds)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"engines": eng, "fake": fake}, f, indent=1, default=str)
    if args.report:
        update_section("router-cpu", text)


if __name__ == "__main__":
    main()

"""End to end: kvpush (connector + router) against vLLM's own NIXL connectors and one plain engine.

    .venv/bin/python bench/e2e.py            # ~8-10 minutes on 2 cores; writes its section of
                                             # docs/BENCHMARKS.md and docs/e2e.png
    .venv/bin/python bench/e2e.py --quick    # a smoke run (fewer requests, no report)
    .venv/bin/python bench/e2e.py --configs aggregated,kvpush   # a subset (no report unless --report)

Same tiny local model (kvpush/tiny_model.py), same prompts, same machine, one
run; each configuration is started, measured and stopped in turn:

  aggregated : one plain vLLM engine, no connector;
  pull       : prefill + decode engines with vLLM's NixlConnector (pull, READ) behind
               bench/pd_proxy.py (prefill with max_tokens=1 and do_remote_decode, then
               decode with the prefill answer's kv_transfer_params);
  push       : the same with vLLM's NixlPushConnector (decode registers its blocks with
               prefill by a NIXL notification, prefill WRITEs once prefill has finished);
  kvpush     : kvpush/stack.py: etcd, control plane, sidecars, both engines with
               KVPushConnector, and the router (reserve first, prefill and decode at once,
               layer-wise push);
  prefill alone: the limit, measured inside the kvpush stack: the same kind of request
               with max_tokens=1 straight to the prefill engine, no transfer.

Load, per configuration: for each prompt length, sequential requests, then Poisson
arrivals at each rate. Every prompt is distinct (no prefix-cache hits); the same
prompts go to every configuration, and greedy text (ignore_eos, fixed length) is
compared with the aggregated engine's. Every request and every phase has a timeout:
a hang is recorded as a result, and the configuration's remaining phases are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request

import numpy as np
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import CpuMeter, pct, update_section  # noqa: E402
from kvpush import engines  # noqa: E402
from kvpush.etcd_server import free_port  # noqa: E402
from kvpush.procs import ManagedProcess, ProcessFailed, file_exists, http_ok, python  # noqa: E402

MODEL = "tiny"
CONFIGS = ("aggregated", "pull", "push", "kvpush")
LENGTHS = (128, 1024)
MAX_TOKENS = 32
REQUEST_TIMEOUT_S = 20.0      # one request (the tiny model answers in well under a second)
PHASE_TIMEOUT_S = 30.0        # one Poisson phase: its answers after the last arrival
SEQ_PHASE_S = 60.0            # one sequential phase (requests not sent by then are reported as such)
START_TIMEOUT_S = 240.0
T0 = time.monotonic()

WORDS = ("push pull prefill decode block layer cache token engine sidecar reserve landing staging "
         "transfer memory router proxy request stream latency throughput model weight tensor batch "
         "queue schedule agent write read notify handshake lease registry control plane etcd quick "
         "brown fox jumps over lazy dog river mountain forest city light shadow window garden "
         "number letter signal system network packet socket thread process core").split()


def say(msg: str) -> None:
    print(f"[e2e {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- prompts

def make_prompts(model_dir: str, tokens: int, count: int, tag: str) -> list[str]:
    """``count`` distinct prompts of about ``tokens`` tokens (the engine adds BOS)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    out = []
    for i in range(count):
        rng = random.Random(f"{tag}-{tokens}-{i}")
        words = [f"Request {tag} {i}:"] + [rng.choice(WORDS) for _ in range(tokens)]
        ids = tok.encode(" ".join(words), add_special_tokens=False).ids[:tokens - 1]
        out.append(tok.decode(ids))
    return out


# ---------------------------------------------------------------- client

def stream_request(url: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    started = time.perf_counter()
    out = {"ok": False, "start": started, "ttft_s": None, "total_s": None, "tokens": 0, "text": "", "error": ""}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                text = "".join(c.get("text", "") for c in chunk.get("choices") or [])
                if chunk.get("choices") and out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - started
                out["text"] += text
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"].get("completion_tokens", 0)
                if time.perf_counter() - started > timeout:
                    raise TimeoutError(f"still streaming after {timeout:.0f} s")
        out["total_s"] = time.perf_counter() - started
        out["ok"] = out["ttft_s"] is not None
        if not out["ok"]:
            out["error"] = "no tokens"
    except urllib.error.HTTPError as exc:
        out["error"] = f"HTTP {exc.code}: {exc.read()[:200]!r}"
    except (OSError, TimeoutError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["end"] = time.perf_counter()
    return out


class Hung(RuntimeError):
    pass


def run_sequential(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    results = []
    deadline = time.monotonic() + SEQ_PHASE_S
    for prompt in prompts:
        left = deadline - time.monotonic()
        if left <= 1:
            results.append({"ok": False, "error": "not sent: the phase's time budget was spent", "unsent": True})
            continue
        r = stream_request(url, prompt, max_tokens, min(REQUEST_TIMEOUT_S, left))
        if not r["ok"] and r["ttft_s"] is None and ("timed out" in r["error"] or "Timeout" in r["error"]):
            r["hung"] = True  # not one token in the timeout: a hang (a slow stream is only a timeout)
        results.append(r)
        if r.get("hung"):
            break
    return results


def run_poisson(url: str, prompts: list[str], max_tokens: int, rate: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(rng.exponential(1.0 / rate, len(prompts)))
    offsets -= offsets[0]
    results: list[dict | None] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = stream_request(url, prompts[i], max_tokens, REQUEST_TIMEOUT_S)

    t0 = time.perf_counter()
    threads = []
    for i, off in enumerate(offsets):
        while time.perf_counter() - t0 < off:
            time.sleep(min(0.002, off - (time.perf_counter() - t0)) if off > time.perf_counter() - t0 else 0)
        th = threading.Thread(target=one, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    return [r if r is not None else {"ok": False, "error": "no answer by the phase timeout"}
            for r in results]


def pct_inf(values, q: float) -> float:
    """pct(), except that with infinite values (requests that never saw a token) it takes the
    next higher sample instead of interpolating (inf - inf would make it NaN)."""
    if all(np.isfinite(v) for v in values):
        return pct(values, q)
    return float(np.percentile(np.asarray(values, dtype=float), q, method="higher"))


def summarize(results: list[dict], max_tokens: int) -> dict:
    ok = [r for r in results if r.get("ok")]
    # TTFT over every request sent: one that never saw a token counts as infinite (the
    # percentiles then read "timeout" rather than quietly dropping the slowest requests).
    ttft = [r["ttft_s"] if r.get("ttft_s") is not None else float("inf") for r in results if not r.get("unsent")]
    tpot = [(r["total_s"] - r["ttft_s"]) / max(1, (r["tokens"] or max_tokens) - 1) for r in ok if max_tokens > 1]
    span = (max(r["end"] for r in ok) - min(r["start"] for r in ok)) if ok else float("nan")
    return {"n": len(results), "ok": len(ok), "hung": sum(1 for r in results if r.get("hung")),
            "unsent": sum(1 for r in results if r.get("unsent")),
            "timeouts": sum(1 for r in results if not r.get("ok") and ("imeout" in r.get("error", "")
                                                                          or "timed out" in r.get("error", ""))),
            "errors": sorted({r["error"][:120] for r in results if not r.get("ok")}),
            "ttft_p50_ms": pct_inf(ttft, 50) * 1e3, "ttft_p90_ms": pct_inf(ttft, 90) * 1e3,
            "tpot_p50_ms": pct(tpot, 50) * 1e3 if tpot else float("nan"),
            "req_per_s": len(ok) / span if ok and span > 0 else float("nan"),
            "tok_per_s": sum((r["tokens"] or max_tokens) for r in ok) / span if ok and span > 0 else float("nan"),
            "ttfts_ms": [t * 1e3 for t in ttft if np.isfinite(t)]}


# ---------------------------------------------------------------- configurations

class Deployment:
    """Processes of one configuration: ``url`` takes client requests; ``cpu_procs`` are metered."""

    def __init__(self, name: str, log_dir: str) -> None:
        self.name, self.log_dir = name, log_dir
        self.procs: list[ManagedProcess] = []
        self.url = ""
        self.prefill_url = ""
        self.cpu_procs: dict[str, psutil.Process] = {}
        self.stack = None

    def _start(self, name: str, cmd: list[str], env: dict | None = None) -> ManagedProcess:
        proc = ManagedProcess(name, cmd, os.path.join(self.log_dir, f"{self.name}-{name}.log"), env=env,
                              cwd=str(ROOT))
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


def start_aggregated(dep: Deployment, model_dir: str) -> None:
    port = free_port()
    proc = dep._start("vllm", engines.vllm_command(model_dir, port, MODEL), env=engines.engine_env())
    say("starting one plain vLLM engine (30-40 s on 2 cores) ...")
    dep.url = f"http://127.0.0.1:{port}"
    proc.wait_until(http_ok(dep.url + "/health"), START_TIMEOUT_S, "serving", say)
    dep.cpu_procs = {"engine+": psutil.Process(proc.pid)}


_taken: set[int] = set()


def quiet_port() -> int:
    """A free port below Linux's ephemeral range (32768+): free_port() hands out an
    ephemeral port that the kernel may give to some other process's socket (vLLM's
    own ZMQ sockets, a test run beside us) before the engine binds it, and a NIXL
    side-channel listener that loses that race dies in its thread, leaving an engine
    that never becomes healthy."""
    import socket
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 30000)
        if port in _taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _taken.add(port)
        return port


def nixl_config(connector: str, role: str) -> dict:
    return {"kv_connector": connector, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu"}


def start_nixl(dep: Deployment, model_dir: str, connector: str) -> None:
    urls, procs = {}, {}
    for role in ("prefill", "decode"):
        port = quiet_port()
        urls[role] = f"http://127.0.0.1:{port}"
        env = engines.engine_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(quiet_port()),
                                  "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"})
        procs[role] = dep._start(f"vllm-{role}", engines.vllm_command(
            model_dir, port, MODEL, nixl_config(connector, role)), env=env)
    say(f"starting prefill + decode engines with vLLM's {connector} (about a minute on 2 cores) ...")
    for role in ("prefill", "decode"):
        procs[role].wait_until(http_ok(urls[role] + "/health"), START_TIMEOUT_S, "serving", say)
    port = free_port()
    ready = os.path.join(dep.log_dir, f"{dep.name}-proxy.ready")
    if os.path.exists(ready):
        os.remove(ready)
    proxy = dep._start("proxy", [python(), "-m", "bench.pd_proxy", "--prefill", urls["prefill"], "--decode",
                                 urls["decode"], "--port", str(port), "--ready-file", ready],
                       env={"PYTHONPATH": str(ROOT)})
    proxy.wait_until(file_exists(ready), 60, "serving", say)
    dep.url, dep.prefill_url = f"http://127.0.0.1:{port}", urls["prefill"]
    dep.cpu_procs = {"prefill engine+": psutil.Process(procs["prefill"].pid),
                     "decode engine+": psutil.Process(procs["decode"].pid), "proxy/router": psutil.Process(proxy.pid)}
    say(f"{connector}: engines and proxy serving on {dep.url}")


def start_kvpush(dep: Deployment, model_dir: str) -> None:
    from kvpush.stack import Stack, StackSpec
    dep.stack = Stack(StackSpec(model_dir=model_dir, log_dir=os.path.join(dep.log_dir, "kvpush")), progress=say)
    dep.stack.start()
    s = dep.stack
    dep.url, dep.prefill_url = s.router_url, s.prefill_url
    dep.cpu_procs = {"prefill engine+": psutil.Process(s.process("vllm-prefill").pid),
                     "decode engine+": psutil.Process(s.process("vllm-decode").pid),
                     "proxy/router": psutil.Process(s.process("router").pid),
                     "prefill sidecar": psutil.Process(s.process("sidecar-prefill").pid),
                     "decode sidecar": psutil.Process(s.process("sidecar-decode").pid),
                     "control plane": psutil.Process(s.process("controlplane").pid)}
    if s.etcd is not None and getattr(s.etcd, "proc", None) is not None:
        dep.cpu_procs["etcd"] = psutil.Process(s.etcd.proc.pid)


def kvpush_counters(dep: Deployment) -> dict:
    if dep.stack is None:
        return {}
    time.sleep(0.3)  # the connectors flush their counters at the end of an engine step
    return {name: dict(data.get("counters", {})) for name, data in dep.stack.stats().items()}


def counter_delta(before: dict, after: dict) -> dict:
    return {eng: {k: v if k.endswith("_max") else v - before.get(eng, {}).get(k, 0) for k, v in c.items()}
            for eng, c in after.items()}


# ---------------------------------------------------------------- one configuration

def measure(name: str, model_dir: str, log_dir: str, prompts: dict, rates: list[float], quick: bool) -> dict:
    out = {"name": name, "status": "ok", "phases": {}, "notes": [], "loadavg_start": os.getloadavg()[0]}
    dep = Deployment(name, log_dir)
    started = time.monotonic()
    try:
        try:
            {"aggregated": lambda: start_aggregated(dep, model_dir),
             "pull": lambda: start_nixl(dep, model_dir, "NixlConnector"),
             "push": lambda: start_nixl(dep, model_dir, "NixlPushConnector"),
             "kvpush": lambda: start_kvpush(dep, model_dir)}[name]()
        except ProcessFailed as exc:
            out["status"] = f"did not start: {str(exc).splitlines()[0][:200]}"
            say(f"{name}: {out['status']}")
            return out
        out["start_s"] = time.monotonic() - started
        say(f"{name}: serving after {out['start_s']:.0f} s; warming up")
        for length in LENGTHS:
            r = stream_request(dep.url, prompts[("warm", length)][0], MAX_TOKENS, REQUEST_TIMEOUT_S)
            if not r["ok"]:
                out["notes"].append(f"warm-up at {length} tokens failed: {r['error']}")
                if "imed out" in r["error"] or "Timeout" in r["error"]:
                    out["status"] = f"hung on the warm-up request ({length} tokens): no answer in {REQUEST_TIMEOUT_S:.0f} s"
                    say(f"{name}: {out['status']}")
                    return out
        # Idle CPU (a busy-polling NIXL progress thread shows here).
        meter = CpuMeter(dict(dep.cpu_procs))
        meter.start()
        time.sleep(2.0)
        out["idle_pct"] = {k: v / 2.0 * 100 for k, v in meter.stop().items()}
        before = kvpush_counters(dep) if name == "kvpush" else None
        meter.start()
        t_load = time.monotonic()
        hung = False
        for length in LENGTHS:
            say(f"{name}: {length}-token prompts, sequential ({len(prompts[('seq', length)])} requests)")
            c0 = kvpush_counters(dep)
            res = run_sequential(dep.url, prompts[("seq", length)], MAX_TOKENS)
            out["phases"][f"seq-{length}"] = res
            out.setdefault("phase_counters", {})[f"seq-{length}"] = counter_delta(c0, kvpush_counters(dep))
            if any(r.get("hung") for r in res):
                hung = True
                break
            for ri, rate in enumerate(rates):
                say(f"{name}: {length}-token prompts, Poisson {rate:g}/s ({len(prompts[('poisson', length, ri)])} requests)")
                c0 = kvpush_counters(dep)
                res = run_poisson(dep.url, prompts[("poisson", length, ri)], MAX_TOKENS, rate, seed=ri * 7 + length)
                out["phases"][f"poisson{rate:g}-{length}"] = res
                out.setdefault("phase_counters", {})[f"poisson{rate:g}-{length}"] = \
                    counter_delta(c0, kvpush_counters(dep))
                if not any(r.get("ttft_s") is not None for r in res):  # not one token: a hang, not load
                    for r in res:
                        r["hung"] = True
                    hung = True
                    break
            if hung:
                break
        out["load_s"] = time.monotonic() - t_load
        out["loadavg_end"] = os.getloadavg()[0]
        out["cpu_s"] = meter.stop()
        out["cpu_requests"] = sum(len(v) for v in out["phases"].values())
        if hung:
            bad = next(k for k, v in out["phases"].items() if any(r.get("hung") for r in v))
            done = sum(1 for v in out["phases"].values() for r in v if r.get("ok"))
            out["status"] = f"hung in {bad} after {done} completed requests (no answer in {REQUEST_TIMEOUT_S:.0f} s)"
            say(f"{name}: {out['status']}")
        if name == "kvpush":
            out["counters"] = counter_delta(before or {}, kvpush_counters(dep))
            # The limit: the prefill engine alone, max_tokens=1, no transfer (distinct prompts).
            for length in LENGTHS:
                say(f"prefill alone: {length}-token prompts, sequential, max_tokens=1")
                out["phases"][f"prefill-{length}"] = run_sequential(dep.prefill_url, prompts[("p1", length)], 1)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not crash half-way
        out["status"] = f"error: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        say(f"{name}: stopping")
        dep.stop()
    return out


# ---------------------------------------------------------------- report

def fmt(x: float, nd: int = 1) -> str:
    if x is not None and x == float("inf"):
        return "timeout"
    return "-" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def build_tables(results: dict, rates: list[float], ref_texts: dict) -> tuple[list[str], dict]:
    rows = ["| configuration | prompt tokens | load | ok / sent | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | "
            "req/s | output tok/s | same text as aggregated | TTFT p50 / pull |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary: dict = {}
    phases = [f"seq-{L}" for L in LENGTHS] + [f"poisson{r:g}-{L}" for L in LENGTHS for r in rates]
    order = ["aggregated", "prefill alone", "pull", "push", "kvpush"]
    for name in order:
        src = "kvpush" if name == "prefill alone" else name
        res = results.get(src)
        for phase in phases:
            if name == "prefill alone":
                if not phase.startswith("seq"):
                    continue
                key = phase.replace("seq", "prefill")
            else:
                key = phase
            length = int(phase.rsplit("-", 1)[1])
            load = "sequential" if phase.startswith("seq") else f"Poisson {phase[7:].split('-')[0]}/s"
            label = name if name != "prefill alone" else "prefill alone (P, max_tokens=1, no transfer)"
            if res is None:
                rows.append(f"| {label} | {length} | {load} | not run: not selected | | | | | | | |")
                continue
            data = res["phases"].get(key)
            if data is None:
                why = res["status"] if res["status"] != "ok" else "skipped"
                rows.append(f"| {label} | {length} | {load} | not run: {why} | | | | | | | |")
                continue
            mt = 1 if name == "prefill alone" else MAX_TOKENS
            s = summarize(data, mt)
            summary[(name, key)] = s
            same = "-"
            if name not in ("aggregated", "prefill alone"):
                pairs = [(r["text"], ref_texts.get((key, i))) for i, r in enumerate(data) if r.get("ok")]
                pairs = [(a, b) for a, b in pairs if b is not None]
                same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}" if pairs else "-"
            ratio = "-"
            pull = summary.get(("pull", phase))
            if pull and np.isfinite(pull["ttft_p50_ms"]) and np.isfinite(s["ttft_p50_ms"]):
                ratio = f"{s['ttft_p50_ms'] / pull['ttft_p50_ms']:.2f}"
            okcell = f"{s['ok']}/{s['n']}" + (f" ({s['timeouts']} timed out)" if s["timeouts"] else "") + \
                (f" ({s['unsent']} not sent)" if s["unsent"] else "")
            rows.append(f"| {label} | {length} | {load} | {okcell} | {fmt(s['ttft_p50_ms'])} | "
                        f"{fmt(s['ttft_p90_ms'])} | {fmt(s['tpot_p50_ms'], 2) if mt > 1 else '-'} | "
                        f"{fmt(s['req_per_s'], 2)} | {fmt(s['tok_per_s'], 0) if mt > 1 else '-'} | {same} | {ratio} |")
    return rows, summary


def write_report(results: dict, rates: list[float], ref_texts: dict, counts: dict, wall_s: float,
                 command: str) -> None:
    rows, summary = build_tables(results, rates, ref_texts)
    lines = ["## End to end: kvpush vs vLLM's NIXL connectors (pull, push) and one engine", "",
             f"Command: `{command}` ({wall_s:.0f} s wall on this machine: {os.cpu_count()} cores, no GPU; "
             "vLLM 0.32 CPU build, float32, block size 32, max-model-len 2048, enforce-eager). "
             "Each configuration was started, measured and stopped in turn, in one run, with the same prompts.", "",
             f"Model: the tiny random-weight Llama (kvpush/tiny_model.py: 4 layers, hidden 256, 2 KV heads x 64). "
             f"Requests: {counts['seq']} sequential per prompt length, then {counts['poisson']} Poisson arrivals "
             f"per length at each of {', '.join(f'{r:g}/s' for r in rates)}; {MAX_TOKENS} output tokens each "
             "(greedy, ignore_eos), every prompt distinct (no prefix-cache hits), one warm-up request per length "
             "per configuration not counted. Timeouts: "
             f"{REQUEST_TIMEOUT_S:.0f} s per request, {SEQ_PHASE_S:.0f} s per sequential phase, answers due "
             f"{PHASE_TIMEOUT_S:.0f} s after a Poisson phase's last arrival (a request past its timeout counts "
             "as timed out and its TTFT as infinite in the percentiles); a hang is a result and "
             "ends that configuration's measurement.", "",
             "TTFT is measured by the client, through the proxy/router for P/D: for pull and push the proxy "
             "(bench/pd_proxy.py) sends the prefill request (max_tokens=1, `do_remote_decode`), waits for it, then "
             "sends the decode request with the prefill answer's `kv_transfer_params` (same X-Request-Id on both; "
             "the push connector matches on it). kvpush's router reserves decode blocks, then sends prefill and "
             "decode at once. TPOT = (total - TTFT) / (tokens - 1). \"prefill alone\" is the kvpush stack's "
             "prefill engine answering max_tokens=1 directly (no transfer): the floor for P/D TTFT. "
             "Another engineer's test runs shared this 2-core machine during the run: expect noise.", "",
             *rows, ""]
    # Targets
    def s(name, key):
        return summary.get((name, key))
    tgt = ["### Targets", ""]
    for L in LENGTHS:
        k, pull, pa, agg = s("kvpush", f"seq-{L}"), s("pull", f"seq-{L}"), s("prefill alone", f"prefill-{L}"), \
            s("aggregated", f"seq-{L}")
        if k is None:
            tgt.append(f"- {L} tokens: kvpush not measured.")
            continue
        parts = []
        if pull and np.isfinite(pull["ttft_p50_ms"]):
            r = k["ttft_p50_ms"] / pull["ttft_p50_ms"]
            parts.append(f"TTFT p50 / pull = {r:.2f} (target <= 0.25: {'met' if r <= 0.25 else 'MISSED'})")
        else:
            parts.append("TTFT p50 / pull: pull not measured")
        if pa and np.isfinite(pa["ttft_p50_ms"]):
            r = k["ttft_p50_ms"] / pa["ttft_p50_ms"]
            parts.append(f"TTFT p50 / prefill alone = {r:.2f} (target <= 1.1: {'met' if r <= 1.1 else 'MISSED'})")
        if agg and np.isfinite(agg["tpot_p50_ms"]):
            r = k["tpot_p50_ms"] / agg["tpot_p50_ms"]
            parts.append(f"TPOT p50 / aggregated = {r:.2f} (target <= 1.2: {'met' if r <= 1.2 else 'MISSED'})")
        for rate in rates:
            kp = s("kvpush", f"poisson{rate:g}-{L}")
            pp = s("pull", f"poisson{rate:g}-{L}")
            if kp and np.isfinite(kp["ttft_p90_ms"]):
                r = kp["ttft_p90_ms"] / k["ttft_p50_ms"]
                sat = ""
                if pp and pull and np.isfinite(pp["ttft_p90_ms"]):
                    sat = f"; pull's p90 there is {pp['ttft_p90_ms'] / pull['ttft_p50_ms']:.1f}x its sequential p50"
                parts.append(f"at {rate:g}/s kvpush TTFT p90 / its sequential p50 = {r:.2f} "
                             f"(target <= 2: {'met' if r <= 2 else 'MISSED'}{sat})")
        tgt.append(f"- {L} tokens: " + "; ".join(parts) + ".")
    # Status, CPU, counters
    lines += tgt + ["", "### Per configuration: status, start time, CPU", "",
                    "CPU = CPU seconds per process over the measured load (all phases above, prefill-alone excluded) "
                    "divided by the requests sent; idle = % of one core over 2 s with no requests.", "",
                    "| configuration | status | start s | load s | machine load avg (1 min) at start / end of load "
                    "| CPU ms/request by process | idle % core by process |",
                    "|---|---|---:|---:|---|---|---|"]
    for name in CONFIGS:
        res = results.get(name)
        if res is None:
            lines.append(f"| {name} | not run: not selected | | | | | |")
            continue
        n = max(1, res.get("cpu_requests", 0))
        cpu = ", ".join(f"{k} {v / n * 1e3:.0f}" for k, v in res.get("cpu_s", {}).items()) or "-"
        idle = ", ".join(f"{k.rstrip('+')} {v:.0f}" for k, v in res.get("idle_pct", {}).items()) or "-"
        status = res["status"] + ("; " + "; ".join(res["notes"]) if res["notes"] else "")
        la = f"{fmt(res.get('loadavg_start'))} / {fmt(res.get('loadavg_end'))}"
        lines.append(f"| {name} | {status} | {fmt(res.get('start_s'), 0)} | {fmt(res.get('load_s'), 0)} | {la} | "
                     f"{cpu} | {idle} |")
    kv = results.get("kvpush", {}).get("counters")
    if kv:
        d, p = kv.get("decode-0", {}), kv.get("prefill-0", {})
        lines += ["", f"kvpush connector counters over the load: decode loads by push {d.get('loads_landed', 0)}, "
                  f"load errors {d.get('load_errors', 0)}, prompt tokens not recomputed {d.get('tokens_loaded', 0)}; "
                  f"prefill bytes staged {p.get('bytes_staged', 0) / 2**20:.1f} MiB."]
        pcs = results["kvpush"].get("phase_counters", {})
        if pcs:
            cells = []
            for key, c in pcs.items():
                d = c.get("decode-0", {})
                n = d.get("loads_landed", 0)
                if n:
                    cells.append(f"{key}: {d.get('load_wait_ms_total', 0) / n:.0f} ms mean, "
                                 f"running max {d.get('load_wait_ms_max', 0)} ms ({n} loads)")
            lines += ["", "kvpush decode engine's wait for the pushed KV (connector counter `load_wait_ms`, per "
                      "phase): " + "; ".join(cells) + "."]
    lines += ["", "Reading this: vLLM's NIXL connectors (pull and push) create their NIXL agents with the progress "
              "thread on, and it busy-polls (the idle column: most of a core per engine with no requests). On "
              "this 2-core machine the two engines then starve each other and everything beside them, which "
              "inflates the baselines' TTFT and TPOT far beyond the cost of the transfer itself; on a GPU host "
              "with cores to spare most of that penalty goes away, so the ratios to pull here overstate what "
              "the push design alone buys. kvpush's sidecars drive NIXL progress themselves and idle at ~0%. "
              "The machine was shared with another engineer's test runs (load average column; 2 cores): "
              "single runs of a few requests move by 2x between runs (a first run the same day measured kvpush "
              "sequential TTFT p50 154 / 359 ms at 128 / 1024 tokens and prefill alone 14 / 254 ms), so read "
              "differences under ~2x as noise.", "",
              "![TTFT CDF per configuration](e2e.png)", ""]
    update_section("e2e", "\n".join(lines))
    plot(results, rates, ROOT / "docs" / "e2e.png")


def plot(results: dict, rates: list[float], path: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    panels = [("seq", L) for L in LENGTHS] + [(f"poisson{r:g}", L) for r in rates for L in LENGTHS]
    cols = len(LENGTHS)
    fig, axes = plt.subplots(len(panels) // cols, cols, figsize=(6 * cols, 3.6 * (len(panels) // cols)), squeeze=False)
    colors = {"aggregated": "tab:gray", "prefill alone": "black", "pull": "tab:red", "push": "tab:orange",
              "kvpush": "tab:blue"}
    for ax, (kind, L) in zip(axes.flat, panels):
        series = [(n, results.get(n, {}).get("phases", {}).get(f"{kind}-{L}")) for n in CONFIGS]
        if kind == "seq":
            series.append(("prefill alone", results.get("kvpush", {}).get("phases", {}).get(f"prefill-{L}")))
        for name, data in series:
            sent = [r for r in (data or []) if not r.get("unsent")]
            vals = sorted(r["ttft_s"] * 1e3 for r in sent if r.get("ttft_s") is not None)
            if not vals:
                continue
            # Over the requests sent: one that never saw a token keeps the curve below 1.
            y = np.arange(1, len(vals) + 1) / len(sent)
            ax.step([vals[0]] + vals, [0.0] + list(y), where="post", color=colors.get(name),
                    label=f"{name} ({len(vals)}/{len(sent)} got a token)",
                    linestyle="--" if name == "prefill alone" else "-")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("TTFT, ms (client-side)")
        ax.set_ylabel("CDF")
        load = "sequential" if kind == "seq" else f"Poisson {kind[7:]}/s"
        ax.set_title(f"{L}-token prompts, {load}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------- main

def reference_texts(results: dict) -> dict:
    """The aggregated engine's answer to each prompt, by phase and index."""
    ref = {}
    for key, data in results.get("aggregated", {}).get("phases", {}).items():
        for i, r in enumerate(data):
            if r.get("ok"):
                ref[(key, i)] = r["text"]
    return ref


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer requests, no report")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--rates", default="2,8", help="Poisson arrival rates, requests/s (comma-separated)")
    ap.add_argument("--seq", type=int, default=6, help="sequential requests per prompt length")
    ap.add_argument("--poisson", type=int, default=12, help="Poisson requests per prompt length and rate")
    ap.add_argument("--report", action="store_true", help="write the report even for a subset of configurations")
    ap.add_argument("--from-results", metavar="JSON", help="only re-render the report from a saved run's results.json")
    args = ap.parse_args()
    if args.from_results:
        saved = json.loads(pathlib.Path(args.from_results).read_text())
        meta = saved.pop("_meta")
        write_report(saved, meta["rates"], reference_texts(saved), meta["counts"], meta["wall_s"], meta["command"])
        say("re-rendered docs/BENCHMARKS.md (e2e section) and docs/e2e.png")
        return
    selected = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(selected) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown configurations: {sorted(unknown)}")
    rates = [float(r) for r in args.rates.split(",")]
    n_seq, n_poisson = (3, 6) if args.quick else (args.seq, args.poisson)

    from kvpush.tiny_model import DEFAULT_DIR, ensure_model
    say("the tiny model (generated on first use) ...")
    model_dir = os.path.abspath(ensure_model(str(ROOT / DEFAULT_DIR)))
    prompts = {}
    for L in LENGTHS:
        prompts[("warm", L)] = make_prompts(model_dir, L, 1, "warm")
        prompts[("seq", L)] = make_prompts(model_dir, L, n_seq, "seq")
        prompts[("p1", L)] = make_prompts(model_dir, L, n_seq, "p1")
        for ri, _ in enumerate(rates):
            prompts[("poisson", L, ri)] = make_prompts(model_dir, L, n_poisson, f"poisson{ri}")
    log_dir = tempfile.mkdtemp(prefix="e2e-", dir=str(ROOT / ".kvpush")) if (ROOT / ".kvpush").is_dir() \
        else tempfile.mkdtemp(prefix="kvpush-e2e-")
    say(f"logs in {log_dir}; configurations: {', '.join(selected)}; rates {rates}; "
        f"{n_seq} sequential + {n_poisson} Poisson per length and rate")
    results: dict = {}
    for name in [c for c in CONFIGS if c in selected]:
        results[name] = measure(name, model_dir, log_dir, prompts, rates, args.quick)
        for key, data in results[name]["phases"].items():
            s = summarize(data, 1 if key.startswith("prefill") else MAX_TOKENS)
            say(f"  {name:10s} {key:16s} ok {s['ok']}/{s['n']}  TTFT p50 {fmt(s['ttft_p50_ms'])} ms "
                f"p90 {fmt(s['ttft_p90_ms'])} ms  TPOT p50 {fmt(s['tpot_p50_ms'], 2)} ms  {fmt(s['req_per_s'], 2)} req/s")
        say(f"{name}: {results[name]['status']}")
    wall = time.monotonic() - T0
    # Reference texts: the aggregated engine's answer to each prompt, by phase and index.
    ref = reference_texts(results)
    cmd = ".venv/bin/python bench/e2e.py" + ("" if " ".join(sys.argv[1:]) == "" else " " + " ".join(sys.argv[1:]))
    counts = {"seq": n_seq, "poisson": n_poisson}
    raw = pathlib.Path(log_dir) / "results.json"
    raw.write_text(json.dumps({**results, "_meta": {"rates": rates, "counts": counts, "wall_s": wall,
                                                      "command": cmd}}, default=str))
    say(f"raw results in {raw}; {wall:.0f} s in all")
    if not args.quick and (args.report or set(selected) == set(CONFIGS)):
        write_report(results, rates, ref, counts, wall, cmd)
        say("wrote docs/BENCHMARKS.md (e2e section) and docs/e2e.png")
    rows, _ = build_tables(results, rates, ref)
    print("\n".join(rows))


if __name__ == "__main__":
    main()

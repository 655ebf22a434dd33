"""End to end: kvpush (connector + router) against vLLM's own NIXL connectors and one plain engine.

    .venv/bin/python bench/e2e.py            # ~8-10 minutes on 2 cores; writes its section of
                                             # docs/BENCHMARKS.md and docs/e2e.png
    .venv/bin/python bench/e2e.py --quick    # a smoke run (fewer requests, no report)
    .venv/bin/python bench/e2e.py --configs aggregated,kvpush   # a subset (no report unless --report)

Same tiny local model (kvpush/app/tiny_model.py), same prompts, same machine, one
run; each configuration is started, measured and stopped in turn:

  aggregated : one plain vLLM engine, no connector;
  pull       : prefill + decode engines with vLLM's NixlConnector (pull, READ) behind
               bench/pd_proxy.py (prefill with max_tokens=1 and do_remote_decode, then
               decode with the prefill answer's kv_transfer_params);
  push       : the same with vLLM's NixlPushConnector (decode registers its blocks with
               prefill by a NIXL notification, prefill WRITEs once prefill has finished);
  kvpush     : kvpush/app/stack.py: etcd, control plane, sidecars, both engines with
               KVPushConnector, and the router (reserve first, prefill and decode at once,
               layer-wise push);
  prefill alone: the limit, measured inside the kvpush stack: the same kind of request
               with max_tokens=1 straight to the prefill engine, no transfer;
  decode alone: TPOT's reference: the kvpush stack's decode engine serving plain
               requests by itself (the same threads as in the pair).

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
import sys
import tempfile
import time
import traceback

import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import CpuMeter  # noqa: E402
from kvpush.app import engines  # noqa: E402
from kvpush.app.etcd_server import free_port  # noqa: E402
from kvpush.app.procs import ManagedProcess, ProcessFailed, file_exists, http_ok, python  # noqa: E402

from bench.e2e_report import build_tables, fmt, write_report  # noqa: E402
from bench.loadgen import (CONFIGS, LENGTHS, MAX_TOKENS, MODEL, REQUEST_TIMEOUT_S, START_TIMEOUT_S, T0,  # noqa: E402
                           make_prompts, run_poisson, run_sequential, say, stream_request, summarize)

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
    proc = dep._start("vllm", engines.vllm_command(model_dir, port, MODEL),
                      env=engines.engine_env(ipc_dir=dep.log_dir))
    say("starting one plain vLLM engine (30-40 s on 2 cores) ...")
    dep.url = f"http://127.0.0.1:{port}"
    proc.wait_until(http_ok(dep.url + "/health"), START_TIMEOUT_S, "serving", say)
    dep.cpu_procs = {"engine+": psutil.Process(proc.pid)}


def nixl_config(connector: str, role: str) -> dict:
    return {"kv_connector": connector, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu"}


def start_nixl(dep: Deployment, model_dir: str, connector: str) -> None:
    urls, procs = {}, {}
    for role in ("prefill", "decode"):
        port = free_port()
        urls[role] = f"http://127.0.0.1:{port}"
        env = engines.engine_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                  "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}, pair=True, ipc_dir=dep.log_dir)
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
    from kvpush.app.stack import Stack, StackSpec
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
            # TPOT's reference: the decode engine serving plain requests alone, same threads.
            for length in LENGTHS:
                say(f"decode alone: {length}-token prompts, sequential, no transfer")
                out["phases"][f"decode-{length}"] = run_sequential(dep.stack.decode_url, prompts[("d1", length)],
                                                                   MAX_TOKENS)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not crash half-way
        out["status"] = f"error: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        say(f"{name}: stopping")
        dep.stop()
    return out


# ---------------------------------------------------------------- report

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

    from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
    say("the tiny model (generated on first use) ...")
    model_dir = os.path.abspath(ensure_model(str(ROOT / DEFAULT_DIR)))
    prompts = {}
    for L in LENGTHS:
        prompts[("warm", L)] = make_prompts(model_dir, L, 1, "warm")
        prompts[("seq", L)] = make_prompts(model_dir, L, n_seq, "seq")
        prompts[("p1", L)] = make_prompts(model_dir, L, n_seq, "p1")
        prompts[("d1", L)] = make_prompts(model_dir, L, n_seq, "d1")
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
                f"p90 {fmt(s['ttft_p90_ms'])} ms  token-2 p50 {fmt(s['token2_p50_ms'], 2)} ms  "
                f"TPOT p50 {fmt(s['tpot_p50_ms'], 2)} ms  {fmt(s['req_per_s'], 2)} req/s")
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

"""A bounded soak: steady load through the router against real engines, with clients that
give up part way and one fault injected at a time, then the registry checked in etcd.

One real stack on loopback: a 3-member etcd cluster (``--etcd-members``), two
control-plane replicas (every client is given both, and every etcd member), sidecars, one prefill and two decode vLLM engines with our connector, and the
router. Requests arrive at a steady rate, streamed or not; some clients go away before
their first token, some in the middle of the stream. Every ``--fault-every`` seconds one
fault from the list is injected, in turn:

    prefill_sidecar   kill -9 the prefill sidecar, start it again
    decode_sidecar    kill -9 a decode sidecar, start it again
    vllm_engine       kill -9 a vLLM engine (API server and EngineCore), start it again
    controlplane      kill -9 one control-plane replica of the two, start it again
    etcd              stop etcd (not pause: every member), start it again on the same data
    etcd_leader       kill -9 the etcd cluster's leader, start it again once another leads

Every answer is compared with what an aggregated engine (a decode vLLM engine asked
directly, no kvpush) answers for the same prompt, greedy. At the end, once quiet, etcd
is read directly: reservations still live (leaked), blocks in two live reservations
(double-booked) and every other invariant (``kvpush/controlplane/invariants.py``).

    .venv/bin/python bench/soak.py                     # 10 minutes; writes docs/BENCHMARKS.md
    .venv/bin/python bench/soak.py --minutes 1 --fault-every 15 --no-report
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import cpu_seconds, update_section  # noqa: E402
from bench.loadgen import make_prompts  # noqa: E402
from kvpush.app.stack import Stack, StackSpec  # noqa: E402
from kvpush.app.tiny_model import ensure_model  # noqa: E402
from kvpush.controlplane.metrics import _LATENCY_BUCKETS  # noqa: E402

LARGEST_BUCKET = max(_LATENCY_BUCKETS)  # the Reserve histogram's last finite bound
FAULTS = ("prefill_sidecar", "decode_sidecar", "vllm_engine", "controlplane", "etcd", "etcd_leader")
MAX_TOKENS = 8
CLIENT_TIMEOUT_S = 120  # a request not answered by then is a hang


def say(msg: str) -> None:
    print(f"[soak] {msg}", flush=True)


# -- the clients -----------------------------------------------------------------------------------
def ask(url: str, prompt: str, stream: bool, give_up: str) -> dict:
    """One client. ``give_up``: "" (reads the whole answer), "before_first" (goes away before
    any token) or "mid_stream" (after two events). What it saw: status, text, error kind."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "stream": stream}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    out = {"give_up": give_up, "stream": stream, "status": 0, "text": "", "error": "", "started": time.monotonic()}
    try:
        timeout = 0.05 if give_up == "before_first" else CLIENT_TIMEOUT_S
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out["status"] = resp.status
            if not stream:
                out["text"] = json.load(resp)["choices"][0]["text"]
            else:
                events = 0
                for raw in resp:
                    line = raw.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error"] = f"stream error event: {str(event['error'])[:80]}"
                    out["text"] += "".join(c.get("text", "") for c in event.get("choices") or [])
                    events += 1
                    if give_up == "mid_stream" and events == 2:
                        break
    except urllib.error.HTTPError as exc:
        out["status"], out["error"] = exc.code, f"HTTP {exc.code}"
    except TimeoutError:
        out["error"] = "gave up (as planned)" if give_up == "before_first" else "timeout (a hang)"
    except OSError as exc:
        out["error"] = "gave up (as planned)" if give_up == "before_first" else f"{type(exc).__name__}"
    out["seconds"] = time.monotonic() - out["started"]
    return out


class Load:
    """Requests at a steady rate, each in its own thread, until stopped."""

    def __init__(self, url: str, prompts: list[str], rate: float, seed: int = 7) -> None:
        self.url, self.prompts, self.rate = url, prompts, rate
        self.rng = random.Random(seed)
        self.results: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _one(self, prompt: str, stream: bool, give_up: str) -> None:
        r = ask(self.url, prompt, stream, give_up)
        with self.lock:
            self.results.append((prompt, r))

    def run(self) -> None:
        next_at = time.monotonic()
        while not self.stop.is_set():
            roll = self.rng.random()
            give_up = "before_first" if roll < 0.1 else "mid_stream" if roll < 0.2 else ""
            stream = give_up == "mid_stream" or self.rng.random() < 0.5
            t = threading.Thread(target=self._one, args=(self.rng.choice(self.prompts), stream, give_up), daemon=True)
            t.start()
            self.threads.append(t)
            next_at += 1.0 / self.rate
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def join(self) -> int:
        """Wait for every request; how many never finished (hangs)."""
        deadline = time.monotonic() + CLIENT_TIMEOUT_S + 10
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self.threads)


# -- CPU, across the lives of processes that faults kill ------------------------------------------
class CpuLedger:
    """CPU seconds per process name, summed over each of its lives (a process killed by a
    fault and started again is one name): read at every window and just before a kill.
    Each life counts from its start, so its start's cost is included (the first one's and
    every restart's)."""

    PROCS = ("router", "controlplane", "controlplane-1", "sidecar-prefill", "sidecar-decode", "sidecar-decode-1",
             "vllm-prefill", "vllm-decode", "vllm-decode-1")

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.total: dict[str, float] = collections.defaultdict(float)
        self._seen: dict[tuple[str, int], float] = {}

    @staticmethod
    def _cpu(pid: int) -> float:
        try:  # with its descendants: a vLLM engine's EngineCore and workers
            return cpu_seconds(psutil.Process(pid), children=True)
        except psutil.Error:
            return -1.0

    def sample(self) -> None:
        lives = [(name, self.stack.live(name).pid) for name in self.PROCS if self._alive(name)]
        etcd = self.stack.etcd
        for member in getattr(etcd, "members", [etcd] if etcd is not None else []):
            if member.proc is not None:
                lives.append(("etcd" if member is etcd else f"etcd-{member.name}", member.proc.pid))
        for name, pid in lives:
            now = self._cpu(pid)
            if now < 0:
                continue
            self.total[name] += now - self._seen.get((name, pid), 0.0)
            self._seen[(name, pid)] = now

    def _alive(self, name: str) -> bool:
        try:
            self.stack.live(name)
            return True
        except StopIteration:
            return False


# -- the faults ------------------------------------------------------------------------------------
def inject(stack: Stack, fault: str, turn: int, ledger: CpuLedger) -> str:
    """Inject ``fault`` (its ``turn``-th time: which process it hits rotates) and recover
    from it (start again what was killed); what was done."""
    ledger.sample()  # the life about to end is counted to its last moment
    if fault == "prefill_sidecar":
        stack.live("sidecar-prefill").kill()
        stack.restart("sidecar-prefill")
        return "prefill sidecar killed -9 and started again"
    if fault == "decode_sidecar":
        name = ("sidecar-decode", "sidecar-decode-1")[turn % 2]
        stack.live(name).kill()
        stack.restart(name)
        return f"{name} killed -9 and started again"
    if fault == "vllm_engine":
        engine_id = ("decode-0", "prefill-0", "decode-1")[turn % 3]
        role = engine_id.split("-")[0]
        name = "vllm-" + (role if engine_id.endswith("-0") else engine_id)
        stack.live(name).kill_group()
        stack.restart_engine(role, engine_id)
        return f"vLLM {engine_id} (API server and EngineCore) killed -9 and started again"
    if fault == "controlplane":
        name = ("controlplane", "controlplane-1")[turn % 2]
        stack.live(name).kill()
        time.sleep(2.0)
        stack.restart(name)
        return f"control-plane replica {name} killed -9, started again 2 s later"
    if fault == "etcd":
        stack.etcd.stop(remove_data=False)
        time.sleep(3.0)
        stack.etcd.start()
        members = len(getattr(stack.etcd, "members", ()))
        return f"etcd ({members} members, all) stopped, started again 3 s later on its data" if members else \
            "etcd stopped, started again 3 s later on its data"
    if fault == "etcd_leader":
        cluster = stack.etcd
        old = cluster.leader()
        killed = time.monotonic()
        cluster.members[old].kill()
        new = cluster.new_leader()
        elected = time.monotonic() - killed
        cluster.restart(old)
        return (f"etcd leader {cluster.members[old].name} of {len(cluster.members)} killed -9 "
                f"({cluster.members[new].name} leading {elected:.1f} s later), started again")
    raise ValueError(f"unknown fault {fault!r}")


# -- Reserve latency over time, from the replicas' histograms ---------------------------------------
def reserve_buckets(urls: list[str]) -> dict[float, float]:
    """Cumulative Reserve latency bucket counts, summed over the replicas answering."""
    out: dict[float, float] = collections.defaultdict(float)
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for m in re.finditer(r'^kvpush_reserve_latency_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
            out[float(m.group(1))] += float(m.group(2))
    return dict(out)


def p99_between(before: dict, after: dict) -> tuple[float, int]:
    """(the bucket bound the 99th percentile of the Reserves between two scrapes falls in, their count)."""
    bounds = sorted(after)
    # A replica that restarted counts from zero: a negative delta means "only after".
    delta = {b: after[b] - before.get(b, 0.0) if after[b] >= before.get(b, 0.0) else after[b] for b in bounds}
    total = delta[bounds[-1]] if bounds else 0
    if not total:
        return float("nan"), 0
    for b in bounds:
        if delta[b] >= 0.99 * total:
            return b, int(total)
    return float("inf"), int(total)


# -- the run ---------------------------------------------------------------------------------------
def reference_answers(stack: Stack, prompts: list[str]) -> dict[str, str]:
    """What an aggregated engine answers: a decode vLLM engine asked directly, no kvpush."""
    want = {}
    for p in prompts:
        r = ask(stack.urls["decode-0"], p, False, "")
        assert r["status"] == 200, r
        want[p] = r["text"]
    return want


def registry_at_the_end(stack: Stack, timeout_s: float = 60.0):
    from kvpush.controlplane.invariants import check

    async def wait():
        deadline = time.monotonic() + timeout_s
        while True:
            report = await check(stack.etcd.endpoint, quiet=True, quarantine_ms=stack.spec.quarantine_ms)
            if (report.ok and not report.live) or time.monotonic() > deadline:
                return report
            await asyncio.sleep(0.5)
    return asyncio.run(wait())


def soak(minutes: float, rate: float, fault_every: float, faults: tuple[str, ...], seed: int = 7,
         etcd_members: int = 3) -> dict:
    if "etcd_leader" in faults and etcd_members < 3:
        raise ValueError("the etcd_leader fault needs a cluster: etcd_members >= 3")
    model = os.path.abspath(ensure_model(os.path.join(ROOT, ".kvpush", "models", "tiny-llama")))
    logs = tempfile.mkdtemp(prefix="kvpush-soak-")
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, decode_engines=2, controlplanes=2, deadline_ms=20_000,
                            quarantine_ms=2_000, etcd_members=etcd_members), progress=say)
    try:
        stack.start()
        prompts = make_prompts(model, 200, 6, "soak") + make_prompts(model, 900, 2, "soak-long")
        want = reference_answers(stack, prompts)
        ledger = CpuLedger(stack)
        ledger.sample()
        load = Load(stack.router_url, prompts, rate, seed)
        loader = threading.Thread(target=load.run, daemon=True)
        started = time.monotonic()
        loader.start()
        injected, windows = [], []
        buckets = reserve_buckets(stack.cp_metrics)
        i, turns = 0, collections.Counter()
        # Every fault of the list at least once, even when slow recoveries push the last
        # past the planned minutes (a sidecar's restart takes 3 to 8 s on a loaded machine),
        # and a whole gap of load after a fault injected past them.
        while True:
            remaining = minutes * 60 - (time.monotonic() - started)
            wait = min(fault_every, remaining) if remaining > 0 and i >= len(faults) else fault_every
            time.sleep(max(0.0, wait))
            now_buckets = reserve_buckets(stack.cp_metrics)
            windows.append((round(time.monotonic() - started), *p99_between(buckets, now_buckets)))
            buckets = now_buckets
            ledger.sample()
            if time.monotonic() - started >= minutes * 60 - 1 and i >= len(faults):
                break
            fault = faults[i % len(faults)]
            i += 1
            at = time.monotonic() - started
            what = inject(stack, fault, turns[fault], ledger)
            turns[fault] += 1
            injected.append((round(at), fault, what, round(time.monotonic() - started - at, 1)))
            say(f"t={at:.0f}s {what} (recovered in {injected[-1][3]} s)")
        load.stop.set()
        loader.join()
        hung = load.join()
        wall = time.monotonic() - started
        ledger.sample()
        cpu = {k: v / wall for k, v in sorted(ledger.total.items())}
        report = registry_at_the_end(stack)
        return summarize(load.results, want, injected, windows, report, hung, cpu, minutes, rate, etcd_members)
    finally:
        stack.stop()


def summarize(results, want, injected, windows, report, hung, cpu, minutes, rate, etcd_members=1) -> dict:
    served = [(p, r) for p, r in results if not r["give_up"]]
    ok = [(p, r) for p, r in served if r["status"] == 200 and not r["error"]]
    wrong = [(p, r) for p, r in ok if r["text"] != want[p]]
    errors = collections.Counter(r["error"] or f"HTTP {r['status']}" for p, r in served
                                 if r["status"] != 200 or r["error"])
    double = [v for v in report.violations if "in two live reservations" in v or "reused by" in v]
    other = [v for v in report.violations if v not in double and not v.startswith("system is quiet")]
    return {"minutes": minutes, "rate": rate, "etcd_members": etcd_members, "sent": len(results), "served": len(served), "ok": len(ok),
            "wrong": len(wrong), "errors": dict(errors), "gave_up": sum(1 for _, r in results if r["give_up"]),
            "hung": hung, "faults": injected, "reserve_p99": windows, "leaked": len(report.live),
            "double_booked": len(double), "violations": other[:20], "cpu": cpu}


def report_text(s: dict) -> str:
    lines = [
        "## Soak: steady load with faults (issue #13)",
        "",
        f"`bench/soak.py`: {s['minutes']:g} minutes at {s['rate']:g} requests/s through the router ("
        f"{'a ' + str(s['etcd_members']) + '-member etcd cluster' if s['etcd_members'] > 1 else 'etcd'}, two "
        "control-plane replicas, sidecars, one prefill and two decode vLLM engines, tiny model), prompts of 200 and "
        f"900 tokens, {MAX_TOKENS} output tokens, greedy; one client in ten goes away before its first token and "
        "one in ten in the middle of the stream. A fault from the list below in turn, each followed by its "
        "recovery (the killed process started again). Answers compared with an aggregated engine's; the registry "
        "read from etcd at the end, once quiet.",
        "",
        "| | |",
        "|---|---|",
        f"| requests sent | {s['sent']} ({s['gave_up']} clients gave up as planned) |",
        f"| read to the end | {s['served']}: {s['ok']} answered 200 |",
        f"| wrong answers | **{s['wrong']}** |",
        f"| errors the clients saw | {', '.join(f'{k}: {v}' for k, v in sorted(s['errors'].items())) or 'none'} |",
        f"| requests that never finished (hangs) | **{s['hung']}** |",
        f"| reservations live at the end (leaked) | **{s['leaked']}** |",
        f"| blocks double-booked | **{s['double_booked']}** |",
        f"| other invariant violations | {len(s['violations'])} |",
        "",
        "| t (s) | fault | what was done | recovered in (s) |",
        "|---|---|---|---|",
    ]
    lines += [f"| {t} | {f} | {what} | {rec} |" for t, f, what, rec in s["faults"]]
    lines += ["", "Reserve p99 by window (the control planes' histograms; a bucket's upper bound; a window with "
              "etcd's restart or its leader's loss in it holds the Reserves that waited for etcd):", "",
              "| window ending at t (s) | Reserves | p99 <= (ms) |", "|---|---|---|"]
    lines += [f"| {t} | {n} | {1000 * p:g} |" if p != float("inf") else f"| {t} | {n} | > {1000 * LARGEST_BUCKET:g} |"
              for t, p, n in s["reserve_p99"]]
    lines += ["", "CPU (cores, averaged over the run; each process over all its lives, each counted from its start, "
              "its first start and its restarts included): " +
              ", ".join(f"{k} {v:.2f}" for k, v in s["cpu"].items())]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second")
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--etcd-members", type=int, default=3, help="1: one etcd node (no etcd_leader fault)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    faults = tuple(args.faults) if args.etcd_members >= 3 else tuple(f for f in args.faults if f != "etcd_leader")
    results = soak(args.minutes, args.rate, args.fault_every, faults, etcd_members=args.etcd_members)
    text = report_text(results)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    if not args.no_report:
        update_section("soak", text)


if __name__ == "__main__":
    main()

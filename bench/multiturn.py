"""Multi-turn chat through kvpush: KV-aware reservations against kvpush without them and
one aggregated engine with prefix caching, and the crossover that sets the default
--local-prefill-tokens.

    .venv/bin/python bench/multiturn.py --report   # ~20 minutes on 2 cores; writes the
                                                   # "Multi-turn" and "Conditional
                                                   # disaggregation" sections of docs/BENCHMARKS.md
    .venv/bin/python bench/multiturn.py --quick    # a smoke run (fewer of everything, no report)

One run, one machine, real parts: etcd, a control plane, a prefill and two decode vLLM
engines with prefix caching (the decode engines publish their KV events, their sidecars
follow them), and one aggregated vLLM engine beside them. Every configuration sees the
same conversations, with every engine's prefix cache emptied before it; the sequential
phase runs in rounds (``--rounds``, 5), each round every configuration in turn with
conversations of its own, so that a shared machine's drift falls on all of them alike,
and the turns ≥ 2 ratio comes with a bootstrap interval over conversations (how far
this run's ratio may sit from what more conversations would show; a paired one: every
configuration sees the same turns):

  aggregated : the one plain engine, prefix caching on (vLLM's default);
  kvpush     : a router without KV-aware routing (kvpush before it): the decode engine
               is chosen by free blocks alone, the whole prompt is reserved and pushed;
  kv-aware   : a router sending each prompt's block keys, --local-prefill-tokens at the
               value measured in the crossover phase (or --local-prefill-tokens);
  kv-aware P/D : the same, never decode alone (--local-prefill-tokens 0);
  and, in each round, the engines' own share of the same turns: sent straight to a decode
  engine holding the conversation and to the prefill engine holding the previous prompts
  (no router, no push), so that the report says what each path adds to its engine's work.

Conversations: turn 1 is a ~1,000-token prompt; each later turn is the previous prompt,
its answer and a new message, up to ~1,700 tokens at turn 4. Sequential (the
conversations' turns interleaved round-robin, one request at a time: bytes pushed are
read per request) and Poisson (each conversation sends its next turn a random think time
after its answer). The sequential phase's greedy answers are compared token for token
with the aggregated engine's; where a conversation parts, the report says where and how
close the two tokens' logprobs were.

Crossover: with a conversation's prefix on a decode engine, turns adding N new tokens
served by that engine alone and by the P/D path (alternating), for a range of N, while the
decode engines are kept busy with background streams (as decode engines are). Reports
each side's TTFT and the background streams' inter-token gaps; the default threshold is
the smallest N at which the P/D path's TTFT p50 is no worse than decode alone's.
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
import urllib.request

import numpy as np
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpush.app import engines  # noqa: E402
from kvpush.app.etcd_server import free_port  # noqa: E402
from kvpush.app.procs import ManagedProcess, http_ok  # noqa: E402
from kvpush.app.stack import Stack, StackSpec, complete  # noqa: E402
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model  # noqa: E402
from bench.common import CpuMeter, pct, update_section  # noqa: E402
from bench.multiturn_report import first_divergence, kv_aware_label, merged, report  # noqa: E402

T0 = time.monotonic()
MODEL = "tiny"
ANSWER_TOKENS = 128  # a chat answer (--answer-tokens): the decode engine holds it, the prefill engine never computed it
TIMEOUT_S = 60.0
DECODES = ("decode-0", "decode-1")
STALL_WINDOW_S = 0.5  # after a turn is sent: its prefill, push, load and first steps on either path


def say(msg: str) -> None:
    print(f"[multiturn {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def ids(n: int, seed) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(7, 1000) for _ in range(n)]


def rotated(items, k: int) -> list:
    """Round ``k``'s order of the configurations: each round starts one further along, so
    that drift and a warming machine do not fall on one configuration's turn always."""
    items = list(items)
    return items[k % len(items):] + items[:k % len(items)]


def ask(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion: TTFT, the answer's token ids, gaps between chunks."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    started = time.perf_counter()
    out = {"ttft_s": None, "token_ids": [], "arrivals": [], "error": ""}
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    got = choice.get("token_ids") or []
                    if got:
                        now = time.perf_counter()
                        if out["ttft_s"] is None:
                            out["ttft_s"] = now - started
                        out["arrivals"].append(now)
                        out["token_ids"] += got
    except Exception as exc:  # a failure is a result, reported
        out["error"] = f"{type(exc).__name__}: {exc}"
    if len(out["token_ids"]) != max_tokens and not out["error"]:
        out["error"] = f"{len(out['token_ids'])} tokens, not {max_tokens}"
    return out


class Background:
    """Streams kept running on each decode engine (straight to it, plain requests): decode
    engines serve other requests' tokens while a prompt arrives. Records their gaps."""

    def __init__(self, urls: dict[str, str], per_engine: int) -> None:
        self.urls, self.per_engine = urls, per_engine
        self.stop = threading.Event()
        self.gaps: dict[str, list[tuple[float, float]]] = {e: [] for e in urls}  # (arrival, gap since the last)
        self.threads: list[threading.Thread] = []

    def _run(self, engine: str, seed: str) -> None:
        i = 0
        while not self.stop.is_set():
            r = ask(self.urls[engine], ids(64, f"bg-{seed}-{i}"), max_tokens=400)
            arr = r["arrivals"]
            self.gaps[engine] += [(b, b - a) for a, b in zip(arr, arr[1:])]
            i += 1

    def __enter__(self) -> "Background":
        for engine in self.urls:
            for k in range(self.per_engine):
                th = threading.Thread(target=self._run, args=(engine, f"{engine}-{k}"), daemon=True)
                th.start()
                self.threads.append(th)
        time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for th in self.threads:
            th.join(TIMEOUT_S)

    def usual(self, engine: str) -> float:
        return pct([g for _, g in self.gaps[engine]], 50)

    def stall(self, engine: str, t0: float, window_s: float) -> float:
        """The longest gap of ``engine``'s streams in [t0, t0 + window_s] less their usual gap
        (read once the streams ended: a stream's gaps are recorded when it ends)."""
        inside = [g for at, g in self.gaps[engine] if t0 <= at <= t0 + window_s]
        return (max(inside) if inside else 0.0) - self.usual(engine)


class Bench:
    def __init__(self, answer: int = ANSWER_TOKENS) -> None:
        self.answer = answer  # every turn's answer, in tokens
        self.logs = tempfile.mkdtemp(prefix="kvpush-multiturn-")
        self.model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
        dev = {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache between configurations
        self.stack = Stack(StackSpec(model_dir=self.model, log_dir=self.logs, decode_engines=2, kv_aware=True,
                                     engine_env=dev, deadline_ms=30_000, quarantine_ms=1_000), progress=say)
        port = free_port()
        self.agg_url = f"http://127.0.0.1:{port}"
        self.agg = ManagedProcess("vllm-aggregated", engines.vllm_command(self.model, port, MODEL),
                                  os.path.join(self.logs, "vllm-aggregated.log"),
                                  env=engines.engine_env(dev, ipc_dir=self.logs), cwd=engines.ROOT)
        self.routers: dict[str, str] = {}

    def start(self) -> None:
        self.stack.start()
        self.agg.wait_until(http_ok(self.agg_url + "/health"), 300, "serving", say)
        self.routers["kvpush"] = self.stack.add_router("router-plain", kv_aware=False)
        self.routers["kv-aware P/D"] = self.stack.add_router("router-pd", extra=("--local-prefill-tokens", "0"))
        self.routers["decode alone"] = self.stack.add_router("router-local",
                                                             extra=("--local-prefill-tokens", "1000000"))

    def stop(self) -> None:
        self.stack.stop()
        self.agg.stop()

    def cpu_meter(self) -> CpuMeter:
        procs = {"aggregated engine+": psutil.Process(self.agg.pid)}
        for p in self.stack.procs:
            if p.alive():
                procs[p.name + "+"] = psutil.Process(p.pid)
        return CpuMeter(procs)

    def forget(self) -> None:
        """Every engine's prefix cache emptied, the decode engines' reports with it."""
        urls = [self.agg_url, *self.stack.urls.values()]
        for url in urls:
            req = urllib.request.Request(f"{url}/reset_prefix_cache", method="POST")
            for _ in range(50):
                with urllib.request.urlopen(req, timeout=30) as resp:
                    if b"false" not in resp.read():
                        break
                time.sleep(0.2)
        for eid in DECODES:  # vLLM publishes the reset with its next step
            ask(self.stack.urls[eid], ids(8, "poke"), max_tokens=1)
        time.sleep(1.5)  # the sidecars' next reports (every 0.25 s) reach the control plane

    def staged(self) -> int:
        return self.stack.stats().get("prefill-0", {}).get("counters", {}).get("bytes_staged", 0)

    # -------------------------------------------------------------- crossover
    def loads(self) -> dict[str, int]:
        stats = self.stack.stats()
        return {e: stats.get(e, {}).get("counters", {}).get("loads_started", 0) for e in DECODES}

    def sweep(self, sizes: list[int], reps: int, modes: tuple[str, ...] = ("pd", "alone")) -> dict:
        """For each N: a 1,000-token turn through the P/D router (its decode engine then holds it
        and its answer; the prefill engine only the prompt), then a turn adding N tokens by the
        P/D path or by that engine alone, alternating (``direct``: straight to that engine, no
        router: decode alone's floor). Each turn's TTFT, start and engine."""
        out = {n: {"errors": [], **{m: [] for m in modes}, **{m + "_at": [] for m in modes}} for n in sizes}
        for rep in range(reps):
            for n in sizes:
                for mode in (modes if rep % 2 == 0 else modes[::-1]):
                    base = ids(1000, f"x-{n}-{rep}-{mode}-{time.monotonic_ns()}")
                    before = self.loads()
                    first = ask(self.routers["kv-aware P/D"], base, self.answer)  # a chat answer, held by decode only
                    time.sleep(0.6)  # the decode engine's events, its sidecar's report; counters written
                    served = [e for e, v in self.loads().items() if v > before[e]]
                    if first["error"] or len(served) != 1:
                        out[n]["errors"].append(first["error"] or f"turn 1 loaded on {served or 'no engine'}")
                        continue
                    prompt = base + first["token_ids"] + ids(n, f"x-new-{n}-{rep}-{mode}")
                    t0 = time.perf_counter()
                    url = (self.stack.urls[served[0]] if mode == "direct" else
                           self.routers["kv-aware P/D" if mode == "pd" else "decode alone"])
                    r = ask(url, prompt, max_tokens=2)
                    if r["error"]:
                        out[n]["errors"].append(r["error"])
                        continue
                    out[n][mode].append(r["ttft_s"] * 1e3)
                    out[n][mode + "_at"].append((served[0], t0))
                    time.sleep(STALL_WINDOW_S)  # the next turn's stall window starts clean
        return out

    def crossover(self, sizes: list[int], reps: int, background: int) -> dict:
        """What a local prefill of N tokens saves the request (idle engines: the P/D path's
        TTFT p50 less decode alone's), against what it costs the streams that decode engine
        serves (busy: the longest gap of its background stream in the STALL_WINDOW_S after the
        turn was sent, less the usual gap). The crossover is the smallest N whose stall exceeds
        what it saves. The P/D path's stall is reported beside it, not weighed: on these
        shared cores it is the prefill engine's work competing for the CPU, which engines on
        their own GPUs do not do to each other."""
        self.forget()
        idle = self.sweep(sizes, reps, ("pd", "alone", "direct"))
        say("idle: " + ", ".join(f"N={n}: P/D {pct(v['pd'], 50):.0f} / alone {pct(v['alone'], 50):.0f} ms"
                                 for n, v in idle.items()))
        self.forget()
        with Background({e: self.stack.urls[e] for e in DECODES}, background) as bg:
            busy = self.sweep(sizes, 2 * reps)  # (its stalls vary more than the idle TTFTs)
        rows = {}
        for n in sizes:
            saved = pct(idle[n]["pd"], 50) - pct(idle[n]["alone"], 50)
            stall = {m: pct([bg.stall(e, t0, STALL_WINDOW_S) * 1e3 for e, t0 in busy[n][m + "_at"]], 50)
                     for m in ("pd", "alone")}
            rows[n] = {"idle": idle[n], "busy": busy[n], "saved": saved, "stall_alone": stall["alone"],
                       "stall_pd": stall["pd"]}
            say(f"N={n}: saves {saved:.1f} ms; stalls decode's streams {stall['alone']:.1f} ms alone, "
                f"{stall['pd']:.1f} ms by P/D")
        # From there on for every larger N too: one noisy row does not decide it.
        chosen = next((n for i, n in enumerate(sizes)
                       if all(rows[m]["stall_alone"] > rows[m]["saved"] for m in sizes[i:])), None)
        for n in sizes:
            for err in rows[n]["idle"]["errors"] + rows[n]["busy"]["errors"]:
                say(f"N={n}: error: {err}")
        usual = pct([bg.usual(e) * 1e3 for e in DECODES], 50)
        return {"rows": rows, "threshold": chosen, "background": background, "reps": reps, "usual_gap": usual}

    # -------------------------------------------------------------- conversations
    def conversations(self, name: str, url: str, convs: int, turns: int, first: int, new: int,
                      reference: dict | None, round_: int = 0) -> dict:
        """Sequential: the conversations' turns round-robin, bytes staged read per request.
        Each round has conversations of its own (the same in every configuration)."""
        self.forget()
        prompts = {c: ids(first, f"conv-{c}" if not round_ else f"conv-{round_}-{c}") for c in range(convs)}
        rows: dict[int, list[dict]] = {t: [] for t in range(1, turns + 1)}
        answers: dict[tuple[int, int], list[int]] = {}
        asked: dict[tuple[int, int], list[int]] = {}
        meter = self.cpu_meter()
        meter.start()
        t_start = time.perf_counter()
        for t in range(1, turns + 1):
            for c in range(convs):
                before = self.staged()
                asked[(c, t)] = prompts[c]
                r = ask(url, prompts[c], self.answer)
                time.sleep(0.3)  # the connectors' counters reach their files; decode's events its sidecar
                rows[t].append({"ttft_ms": r["ttft_s"] * 1e3 if r["ttft_s"] else float("inf"),
                                "staged": self.staged() - before, "tokens": len(prompts[c]), "error": r["error"],
                                "new": len(prompts[c]) if t == 1 else new + self.answer})
                answers[(c, t)] = r["token_ids"]
                prompts[c] = prompts[c] + r["token_ids"] + ids(new, f"conv-{round_}-{c}-turn-{t + 1}")
        wall = time.perf_counter() - t_start
        cpu = meter.stop()
        wrong = sum(1 for k, v in answers.items() if reference is not None and reference.get(k) != v)
        equal = sum(1 for k, v in answers.items() if v and (reference is None or reference.get(k) == v))
        parted = []
        for c in range(convs):  # where each conversation first parted from the aggregated engine's
            t = next((t for t in range(1, turns + 1) if reference and reference.get((c, t)) != answers[(c, t)]), None)
            if t is not None:
                ref, got = reference[(c, t)], answers[(c, t)]
                token = first_divergence(ref, got)
                parted.append({"conv": c, "turn": t, "token": token, **self.gap(asked[(c, t)], ref, got, token)})
        return {"name": name, "rows": rows, "answers": answers, "wrong": wrong, "equal": equal, "cpu": cpu,
                "wall": wall, "divergences": parted}

    def gap(self, prompt: list[int], ref: list[int], got: list[int], token: int) -> dict:
        """Where two answers part, the aggregated engine's logprob of its own token less the
        other's, computed again now (its cache was emptied since, so in one prefill: close to,
        not the same sums as, the answer's own decode steps; a tie may even turn over)."""
        if token >= min(len(ref), len(got)):
            return {"gap_nats": None, "why": "an answer ended early (its request failed)"}
        try:
            top = complete(self.agg_url, prompt + ref[:token], 1, model=MODEL, timeout=TIMEOUT_S, logprobs=5,
                           return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["top_logprobs"][0]
        except Exception as exc:  # one explanation lost, not the run
            return {"gap_nats": None, "why": f"the logprobs request failed ({type(exc).__name__}: {exc})"}
        mine, other = top.get(f"token_id:{ref[token]}"), top.get(f"token_id:{got[token]}")
        if mine is None or other is None:
            return {"gap_nats": None, "why": "a token not among the aggregated engine's top 5"}
        return {"gap_nats": mine - other, "why": ""}

    def limit(self, convs: int, turns: int, first: int, new: int, round_: int = 0) -> dict:
        """The engines' own share of a later turn, no router and no push: each turn straight to
        a decode engine that holds the conversation (its previous prompts and the answers it
        computed: what decode alone computes) and straight to the prefill engine holding only
        the previous prompts (what kvpush without KV-aware routing computes before its first
        token), on engines of the same setting: what each configuration's path adds to its
        engine's own work (router, Reserve, push) is its TTFT less these."""
        self.forget()
        decode, prefill = self.stack.urls[DECODES[0]], self.stack.urls["prefill-0"]
        rows: dict[str, list[float]] = {"decode": [], "prefill": []}
        errors: list[str] = []
        for c in range(convs):
            prompt = ids(first, f"limit-{round_}-{c}")
            for t in range(1, turns + 1):
                sides = ("decode", "prefill") if (c + t) % 2 == 0 else ("prefill", "decode")
                answer: list[int] = []
                for side in sides:
                    # (decode answers in full, holding its answer as in a conversation; prefill
                    # computes up to the first token, as the first-token path asks of it)
                    r = ask(decode, prompt, self.answer) if side == "decode" else ask(prefill, prompt, max_tokens=1)
                    if r["error"]:
                        errors.append(f"{side}: {r['error']}")
                    elif t > 1:
                        rows[side].append(r["ttft_s"] * 1e3)
                    if side == "decode":
                        answer = r["token_ids"]
                    time.sleep(0.3)
                prompt = prompt + answer + ids(new, f"limit-{round_}-{c}-turn-{t + 1}")
        return {"rows": rows, "errors": errors}

    def poisson(self, name: str, url: str, convs: int, turns: int, first: int, new: int, think_s: float,
                seed: int, round_: int = 0) -> dict:
        """Each conversation sends its next turn an exponential think time after its answer.
        A round's conversations (and think times) are the same in every configuration, and
        each turn keeps its conversation's place, so the rounds pair up like the sequential ones."""
        self.forget()
        rows: dict[int, list[float]] = {t: [float("inf")] * convs for t in range(1, turns + 1)}
        errors: list[str] = []

        def run(c: int) -> None:
            rng = np.random.default_rng([seed, round_, c])
            prompt = ids(first, f"pconv-{round_}-{c}")
            time.sleep(rng.exponential(think_s))
            for t in range(1, turns + 1):
                r = ask(url, prompt, self.answer)
                if r["error"]:
                    errors.append(r["error"])
                elif r["ttft_s"]:
                    rows[t][c] = r["ttft_s"] * 1e3
                prompt = prompt + r["token_ids"] + ids(new, f"pconv-{round_}-{c}-turn-{t + 1}")
                time.sleep(rng.exponential(think_s))
        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in range(convs)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(TIMEOUT_S * turns)
        errors += [f"conversation {c} still running when the round ended" for c, th in enumerate(threads)
                   if th.is_alive()]  # it would write into the next configuration's round
        return {"name": name, "rows": rows, "errors": errors}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run: fewer of everything, no report")
    p.add_argument("--report", action="store_true", help="write the sections of docs/BENCHMARKS.md")
    p.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="the kv-aware router's threshold (default: the crossover measured here)")
    p.add_argument("--skip-crossover", action="store_true")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of the sequential phase, each of every configuration in turn (drift on a shared "
                        "machine then falls on all of them alike)")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                   help="each turn's answer; another than the default writes its own section of the report (turn 4 "
                        "and its answer must fit the engines' 2,048 tokens: at most 192 with the full run's turns)")
    args = p.parse_args()
    quick = args.quick
    sizes = [32, 256] if quick else [16, 32, 64, 128, 256, 512]
    convs, turns, first, new = (2, 3, 600, 48) if quick else (4, 4, 1000, 64)
    rounds = 1 if quick else args.rounds
    bench = Bench(args.answer_tokens)
    try:
        bench.start()
        cross = None
        if not args.skip_crossover:
            cross = bench.crossover(sizes, reps=2 if quick else 5, background=1)
            say(f"crossover: {cross['threshold']}")
        threshold = args.local_prefill_tokens
        if threshold is None:  # none in the range: decode alone was no worse up to the largest N measured
            threshold = (cross["threshold"] if cross["threshold"] is not None else max(sizes)) if cross else 0
        bench.routers["kv-aware"] = bench.stack.add_router("router-kv", extra=("--local-prefill-tokens",
                                                                                 str(threshold)))
        say(f"kv-aware router with --local-prefill-tokens {threshold}")
        runs: list[list[dict]] = [[] for _ in range(4)]
        limits: list[dict] = []
        for k in range(rounds):
            reference = bench.conversations("aggregated", bench.agg_url, convs, turns, first, new, None, k)
            runs[0].append(reference)
            # the reference first, then the others in this round's order
            for i, name in rotated(enumerate(("kvpush", "kv-aware", "kv-aware P/D"), start=1), k):
                runs[i].append(bench.conversations(name, bench.routers[name], convs, turns, first, new,
                                                   reference["answers"], k))
                say(f"round {k + 1}: {name}: done, {runs[i][-1]['wrong']} answers differ "
                    f"{runs[i][-1]['divergences'] or ''}")
            limits.append(bench.limit(convs, turns, first, new, k))
            say(f"round {k + 1}: the engines' limit: done, {len(limits[-1]['errors'])} errors")
        seq = [merged(r) for r in runs]
        seq[-2]["name"] = kv_aware_label(threshold)
        # Poisson, in rounds too, each round the configurations in another order (drift and a
        # warm machine fall on each alike).
        configs = (("aggregated", bench.agg_url), ("kvpush", bench.routers["kvpush"]),
                   (kv_aware_label(threshold), bench.routers["kv-aware"]))
        poi_runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
        for k in range(rounds):
            for name, url in rotated(configs, k):
                poi_runs[name].append(bench.poisson(name, url, convs, turns, first, new, 1.0, seed=7, round_=k))
            say(f"poisson round {k + 1}: done")
        poi = [{"name": name, "rows": {t: [x for r in runs_ for x in r["rows"][t]] for t in runs_[0]["rows"]},
                "errors": [e for r in runs_ for e in r["errors"]]} for name, runs_ in poi_runs.items()]
        meta = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "rounds": rounds, "convs": convs,
                "turns": turns, "first": first, "new": new, "think_s": 1.0, "answer": bench.answer,
                "threshold": threshold, "stall_window_s": STALL_WINDOW_S}
        lim = {side: [x for r in limits for x in r["rows"][side]] for side in ("decode", "prefill")}
        lim["errors"] = [e for r in limits for e in r["errors"]]
        multi, cross_text = report(cross or {"rows": {}, "threshold": None, "reps": 0, "background": 0},
                                   seq, poi, meta, lim)
        print(cross_text + "\n\n" + multi)
        raw = os.path.join(bench.logs, "multiturn.json")  # every turn's figures, to look again without a rerun
        with open(raw, "w") as f:
            json.dump({"meta": meta, "crossover": cross, "limit": lim, "poisson": poi,
                       "sequential": [{k: v for k, v in r.items() if k != "answers"} for r in seq]}, f, default=str)
        say(f"raw figures: {raw}")
        if args.report and not quick:
            update_section("multiturn" if bench.answer == ANSWER_TOKENS else f"multiturn-answer-{bench.answer}",
                           multi)
            if cross:
                update_section("local-prefill", cross_text)
    finally:
        bench.stop()


if __name__ == "__main__":
    main()

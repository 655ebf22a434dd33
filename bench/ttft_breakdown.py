"""Where a kvpush request's time to first token goes, step by step, beside the limit
(the prefill engine alone). One real stack (etcd, control plane, sidecars, a prefill
and a decode vLLM engine with our connector, the router); sequential requests, so
each timeline is the request's own. The engines trace their side
(``kvpush/trace.py``: ``KVPUSH_TRACE_DIR``); the router's ``served`` log line
gives the request's arrival and its reservation id, which ties the two together.

    .venv/bin/python bench/ttft_breakdown.py            # ~4 minutes; writes docs/BENCHMARKS.md
    .venv/bin/python bench/ttft_breakdown.py --n 4 --no-report   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import CpuMeter, pct, update_section  # noqa: E402
from bench.loadgen import make_prompts, stream_request  # noqa: E402
from kvpush.trace import ENV as TRACE_ENV, read_traces  # noqa: E402
from kvpush.app.stack import Stack, StackSpec  # noqa: E402
from kvpush.app.tiny_model import ensure_model  # noqa: E402

LENGTHS = (128, 1024)
MAX_TOKENS = 4
GAP_S = 0.25  # between requests: each one's timeline is its own

# (label, how it is found), in the order they happen; times are ms after the router received it.
MILESTONES = (
    ("handover_awaited", "prefill: the request reached the prefill scheduler (HTTP, tokenize) and awaits its reservation"),
    ("handover_heard", "prefill sidecar: the reservation heard by its watch"),
    ("reserved", "router: Reserve answered (the prefill request left before it)"),
    ("handover_received", "prefill: its scheduler has the reservation (the request was held until then)"),
    ("prefill_started", "prefill: the step with the request began (BEGIN)"),
    ("decode_planned", "decode: the request is waiting for its KV (no blocks yet)"),
    ("first_layer", "prefill: layer 0 staged and pushed"),
    ("last_layer", "prefill: last layer staged and pushed"),
    ("landed", "decode: LANDED heard by its scheduler"),
    ("prefill_done", "prefill: forward pass over"),
    ("prefill_answered", "router: prefill's answer in, its token sent to the client (the first token)"),
    ("loaded", "decode: admitted, step prepared, KV copied into vLLM's blocks"),
    ("decode_forward", "decode: forward pass over the first token (computes the second) over"),
    ("second_token", "router: decode's first token sent to the client (the second token)"),
)


def say(msg: str) -> None:
    print(f"[breakdown] {msg}", flush=True)


def served_lines(path: str) -> list[dict]:
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            if '"served"' in line:
                try:
                    out.append(json.loads(line[line.index("{"):]))
                except ValueError:
                    pass
    return out


def timeline(served: dict, events: list, num_layers: int) -> dict[str, float]:
    """Milestones of one request, ms after the router received it."""
    t0, res, key = served["received_unix"], served["reservation_id"], served.get("request_id")
    ms = {"counted": served.get("counted_ms"), "reserved": served.get("reserved_ms"),
          "prefill_answered": served.get("prefill_answered_ms"), "second_token": served.get("second_token_ms")}
    mine = {}
    for t, engine, event, rid, detail in events:
        if rid == res or rid == key:
            key = (event, detail) if event == "layer_staged" else event
            mine.setdefault(key, t)
    pick = {"handover_awaited": "handover_awaited", "handover_heard": "handover_heard",
            "handover_received": "handover_received",
            "prefill_started": "push_begin", "decode_planned": "load_planned", "landed": "landed",
            "prefill_done": "push_end", "loaded": "loaded", "first_layer": ("layer_staged", "0"),
            "last_layer": ("layer_staged", str(num_layers - 1))}
    for label, key in pick.items():
        if key in mine:
            ms[label] = (mine[key] - t0) * 1e3
    if "loaded" in mine:  # the decode engine's next forward pass runs the prefill engine's token
        after = [t for t, engine, event, _, _ in events if engine == "decode-0" and event == "forward_done"
                 and t > mine["loaded"]]
        if after:
            ms["decode_forward"] = (after[0] - t0) * 1e3
    return ms


def run(n: int, log_dir: str) -> dict:
    model_dir = ensure_model()
    trace_dir = os.path.join(log_dir, "traces")
    stack = Stack(StackSpec(model_dir=model_dir, log_dir=log_dir, engine_env={TRACE_ENV: trace_dir},
                            sidecar_env={TRACE_ENV: trace_dir}), progress=say)
    stack.start()
    try:
        procs = {"prefill engine+": stack.process("vllm-prefill"), "decode engine+": stack.process("vllm-decode"),
                 "router": stack.process("router"), "prefill sidecar": stack.process("sidecar-prefill"),
                 "decode sidecar": stack.process("sidecar-decode"), "control plane": stack.process("controlplane")}
        meter_procs = {k: psutil.Process(p.proc.pid) for k, p in procs.items()}
        if stack.etcd is not None and getattr(stack.etcd, "proc", None) is not None:
            meter_procs["etcd"] = psutil.Process(stack.etcd.proc.pid)
        # The same stack behind a second router that reserves before it sends the prefill
        # request (the prefill engine given as a bare URL): the handover's A/B, interleaved.
        seq_url = stack.add_router("router-seq", handover=False)
        for length in LENGTHS:  # warm every path
            for i, prompt in enumerate(make_prompts(model_dir, length, 3, "bd-warm")):
                stream_request(stack.router_url, prompt, MAX_TOKENS, 30)
                stream_request(seq_url, prompt + " seq", MAX_TOKENS, 30)
                stream_request(stack.prefill_url, prompt + f" {i}", 1, 30)
        results = {}
        for length in LENGTHS:
            say(f"{length}-token prompts: {n} each through the router (handover), the router that reserves first, "
                "and the prefill engine alone, interleaved")
            meter = CpuMeter(meter_procs)
            cpu: dict = {}
            kv, seq, alone = [], [], []
            t_start = time.time()
            for a, b, c in zip(make_prompts(model_dir, length, n, "bd-kv"), make_prompts(model_dir, length, n, "bd-seq"),
                               make_prompts(model_dir, length, n, "bd-alone")):
                meter.start()
                kv.append(stream_request(stack.router_url, a, MAX_TOKENS, 30))
                time.sleep(GAP_S)
                for k, v in meter.stop().items():
                    cpu[k] = cpu.get(k, 0.0) + v
                seq.append(stream_request(seq_url, b, MAX_TOKENS, 30))
                time.sleep(GAP_S)
                alone.append(stream_request(stack.prefill_url, c, 1, 30))
                time.sleep(GAP_S)
            # Token 2 is a new request on decode: the least any new request costs there is a
            # one-token prompt answered with one token, sent straight to the decode engine.
            floor = []
            for i in range(n):
                floor.append(stream_request(stack.decode_url, [1 + i % 50], 1, 30))
                time.sleep(GAP_S)
            results[length] = {"kv": kv, "seq": seq, "alone": alone, "floor": floor, "window": (t_start, time.time()),
                               "cpu": cpu}
        time.sleep(0.5)
        served = served_lines(os.path.join(log_dir, "router.log"))
        served_seq = served_lines(os.path.join(log_dir, "router-seq.log"))
        events = read_traces(trace_dir)
        for length, r in results.items():
            t_start, t_end = r["window"]
            mine = [s for s in served if t_start <= s.get("received_unix", 0) <= t_end]
            r["timelines"] = [timeline(s, events, stack.layout.num_layers) for s in mine]
            r["seq_timelines"] = [timeline(s, events, stack.layout.num_layers) for s in served_seq
                                  if t_start <= s.get("received_unix", 0) <= t_end]
            for key, data in (("ttft_ms", r["kv"]), ("seq_ttft_ms", r["seq"]), ("alone_ms", r["alone"]),
                              ("floor_ms", r["floor"])):
                r[key] = [x["ttft_s"] * 1e3 for x in data if x["ok"]]
            r["token2_ms"] = [(x["t2_s"] - x["ttft_s"]) * 1e3 for x in r["kv"] if x["ok"] and x.get("t2_s")]
            r["tpot_ms"] = [(x["total_s"] - x["ttft_s"]) / (MAX_TOKENS - 1) * 1e3 for x in r["kv"] if x["ok"]]
            r["counters"] = stack.stats()
            del r["kv"], r["seq"], r["alone"], r["floor"]
        return results
    finally:
        stack.stop()


def med(values) -> float:
    """The median of what was measured (a milestone a request lacks is None)."""
    return pct([v for v in values if v is not None], 50)


def report(results: dict, n: int) -> str:
    lines = [
        "## TTFT breakdown: where a kvpush request's first and second tokens wait",
        "",
        f"`.venv/bin/python bench/ttft_breakdown.py` (one stack, {n} sequential requests per prompt length, "
        f"{MAX_TOKENS} tokens each, {GAP_S:.2f} s apart; the engines' own timeline from `KVPUSH_TRACE_DIR`, the "
        "router's arrival time and reservation id from its `served` log line). Median ms after the router "
        "received the request; each engine runs one OpenMP thread (`kvpush.app.engines.PD_PAIR_ENV`).",
        "",
        "| milestone | " + " | ".join(f"{length} tokens" for length in results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for label, what in MILESTONES:
        row = [f"{med([t.get(label) for t in r['timelines']]):.1f}" for r in results.values()]
        lines.append(f"| {what} | " + " | ".join(row) + " |")
    row_ttft = [f"**{med(r['ttft_ms']):.1f}**" for r in results.values()]
    row_alone = [f"{med(r['alone_ms']):.1f}" for r in results.values()]
    row_ratio = [f"{med(r['ttft_ms']) / med(r['alone_ms']):.2f}x" for r in results.values()]

    def seg(tls, a, b):
        return med([t[b] - t[a] for t in tls if t.get(a) is not None and t.get(b) is not None])
    lines += ["| client: TTFT through the router | " + " | ".join(row_ttft) + " |",
              "| client: TTFT through the router that reserves first (same stack, interleaved) | "
              + " | ".join(f"{med(r['seq_ttft_ms']):.1f}" for r in results.values()) + " |",
              "| limit: prefill engine alone (`max_tokens=1`, client TTFT) | " + " | ".join(row_alone) + " |",
              "| TTFT / prefill alone | " + " | ".join(row_ratio) + " |",
              "| TTFT / prefill alone, reserving first | "
              + " | ".join(f"{med(r['seq_ttft_ms']) / med(r['alone_ms']):.2f}x" for r in results.values()) + " |",
              "| reserving first: its Reserve segment (ms) | "
              + " | ".join(f"{seg(r['seq_timelines'], 'counted', 'reserved'):.1f}" for r in results.values()) + " |",
              "| client: token-2 latency (second token - first) | "
              + " | ".join(f"{med(r['token2_ms']):.1f}" for r in results.values()) + " |",
              "| client: TPOT over the request | " + " | ".join(f"{med(r['tpot_ms']):.1f}" for r in results.values())
              + " |",
              "| floor of token 2: any new request on decode (a one-token prompt, one token, straight to it) | "
              + " | ".join(f"{med(r['floor_ms']):.1f}" for r in results.values()) + " |", ""]
    lines += ["Segments (median of each request's own differences, ms):", "",
              "| segment | " + " | ".join(f"{length}" for length in results) + " |",
              "|---|" + "---:|" * len(results)]
    segments = (("router: count prompt tokens", None, "counted"),
                ("router: Reserve (gRPC to the control plane, one etcd transaction), beside the prefill request",
                 "counted", "reserved"),
                ("router -> the prefill sidecar hears the reservation (Reserve, then the watch)", "counted",
                 "handover_heard"),
                ("router -> the request at the prefill scheduler (its HTTP, tokenization)", "counted",
                 "handover_awaited"),
                ("router -> prefill scheduler has the reservation", "counted", "handover_received"),
                ("the request held for its reservation (about 0 when the reservation came first)", "handover_awaited",
                 "handover_received"),
                ("router -> prefill step start (HTTP, tokenize, schedule, the reservation)", "counted",
                 "prefill_started"),
                ("prefill forward up to the last layer's push", "prefill_started", "last_layer"),
                ("last layer pushed -> decode hears LANDED", "last_layer", "landed"),
                ("prefill forward over -> its answer at the router (first token out)", "prefill_done",
                 "prefill_answered"),
                ("first token out -> decode admitted, KV copied (router -> decode HTTP, vLLM admission)",
                 "prefill_answered", "loaded"),
                ("copied -> decode's forward pass over", "loaded", "decode_forward"),
                ("decode forward over -> second token out at the router", "decode_forward", "second_token"))
    for what, a, b in segments:
        row = []
        for r in results.values():
            diffs = [t[b] - (t[a] if a else 0.0) for t in r["timelines"]
                     if t.get(b) is not None and (a is None or t.get(a) is not None)]
            row.append(f"{med(diffs):.1f}")
        lines.append(f"| {what} | " + " | ".join(row) + " |")
    lines += ["", "CPU per request during the router phase (ms of CPU time; 2 cores):", "",
              "| process | " + " | ".join(f"{length}" for length in results) + " |",
              "|---|" + "---:|" * len(results)]
    names = list(next(iter(results.values()))["cpu"])
    for name in names:  # metered around the handover router's requests only
        row = [f"{r['cpu'][name] * 1e3 / max(1, len(r['timelines'])):.1f}" for r in results.values()]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=12, help="sequential requests per prompt length and path")
    ap.add_argument("--no-report", action="store_true", help="print the tables, leave docs/BENCHMARKS.md alone")
    args = ap.parse_args()
    log_dir = tempfile.mkdtemp(prefix="kvpush-breakdown-")
    say(f"logs in {log_dir}")
    results = run(args.n, log_dir)
    text = report(results, args.n)
    print(text)
    with open(os.path.join(log_dir, "results.json"), "w") as f:
        json.dump({str(k): {kk: vv for kk, vv in v.items() if kk != "counters"} for k, v in results.items()}, f)
    if not args.no_report:
        update_section("ttft-breakdown", text)
        say("docs/BENCHMARKS.md updated")


if __name__ == "__main__":
    main()

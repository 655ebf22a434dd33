"""The end-to-end benchmark's tables, its docs/BENCHMARKS.md section and its TTFT CDF plot."""

from __future__ import annotations

import os
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import update_section  # noqa: E402

from bench.loadgen import (CONFIGS, LENGTHS, MAX_TOKENS, PHASE_TIMEOUT_S, REQUEST_TIMEOUT_S, SEQ_PHASE_S,  # noqa: E402
                           summarize)

def fmt(x: float, nd: int = 1) -> str:
    if x is not None and x == float("inf"):
        return "timeout"
    return "-" if x is None or not np.isfinite(x) else f"{x:.{nd}f}"


def build_tables(results: dict, rates: list[float], ref_texts: dict) -> tuple[list[str], dict]:
    rows = ["| configuration | prompt tokens | load | ok / sent | TTFT p50 ms | TTFT p90 ms | token-2 p50 ms | "
            "TPOT p50 ms | req/s | output tok/s | same text as aggregated | TTFT p50 / pull |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    summary: dict = {}
    phases = [f"seq-{L}" for L in LENGTHS] + [f"poisson{r:g}-{L}" for L in LENGTHS for r in rates]
    order = ["aggregated", "prefill alone", "decode alone", "pull", "push", "kvpush"]
    alone = {"prefill alone": "prefill", "decode alone": "decode"}
    for name in order:
        src = "kvpush" if name in alone else name
        res = results.get(src)
        for phase in phases:
            if name in alone:
                if not phase.startswith("seq"):
                    continue
                key = phase.replace("seq", alone[name])
            else:
                key = phase
            length = int(phase.rsplit("-", 1)[1])
            load = "sequential" if phase.startswith("seq") else f"Poisson {phase[7:].split('-')[0]}/s"
            label = {"prefill alone": "prefill alone (P, max_tokens=1, no transfer)",
                     "decode alone": "decode alone (D, plain requests, no transfer)"}.get(name, name)
            if res is None:
                rows.append(f"| {label} | {length} | {load} | not run: not selected | | | | | | | | |")
                continue
            data = res["phases"].get(key)
            if data is None:
                why = res["status"] if res["status"] != "ok" else "skipped"
                rows.append(f"| {label} | {length} | {load} | not run: {why} | | | | | | | | |")
                continue
            mt = 1 if name == "prefill alone" else MAX_TOKENS
            s = summarize(data, mt)
            summary[(name, key)] = s
            same = "-"
            if name not in ("aggregated", "prefill alone", "decode alone"):
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
                        f"{fmt(s['ttft_p90_ms'])} | {fmt(s['token2_p50_ms'], 2) if mt > 1 else '-'} | "
                        f"{fmt(s['tpot_p50_ms'], 2) if mt > 1 else '-'} | "
                        f"{fmt(s['req_per_s'], 2)} | {fmt(s['tok_per_s'], 0) if mt > 1 else '-'} | {same} | {ratio} |")
    return rows, summary


def write_report(results: dict, rates: list[float], ref_texts: dict, counts: dict, wall_s: float,
                 command: str) -> None:
    rows, summary = build_tables(results, rates, ref_texts)
    lines = ["## End to end: kvpush vs vLLM's NIXL connectors (pull, push) and one engine", "",
             f"Command: `{command}` ({wall_s:.0f} s wall on this machine: {os.cpu_count()} cores, no GPU; "
             "vLLM 0.32 CPU build, float32, block size 32, max-model-len 2048, enforce-eager). "
             "Each configuration was started, measured and stopped in turn, in one run, with the same prompts.", "",
             f"Model: the tiny random-weight Llama (kvpush/app/tiny_model.py: 4 layers, hidden 256, 2 KV heads x 64). "
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
             "the push connector matches on it). kvpush's router reserves decode blocks, sends the prefill "
             "request, streams the prefill engine's sampled token to the client the moment it answers, and has "
             "decode continue from the prompt plus that token (decode loads the pushed KV and computes one "
             "token). Token-2 = the second streamed chunk's time minus the first's. TPOT = (total - TTFT) / (tokens - 1). \"prefill alone\" is the kvpush stack's "
             "prefill engine answering max_tokens=1 directly (no transfer): the floor for P/D TTFT. "
             "The load-average column below shows how busy the 2 cores were around each configuration. "
             "Every P/D pair (pull, push, kvpush) runs its two engines with one unbound OpenMP thread each "
             "(`kvpush.app.engines.PD_PAIR_ENV`); the aggregated engine, alone on the machine, keeps vLLM's "
             "default (one bound thread per core).", "",
             *rows, ""]
    # Targets
    def s(name, key):
        return summary.get((name, key))
    tgt = ["### Targets", ""]
    for L in LENGTHS:
        k, pull, pa, agg = s("kvpush", f"seq-{L}"), s("pull", f"seq-{L}"), s("prefill alone", f"prefill-{L}"), \
            s("aggregated", f"seq-{L}")
        da = s("decode alone", f"decode-{L}")
        if k is None:
            tgt.append(f"- {L} tokens: kvpush not measured.")
            continue
        parts = []
        if pull and np.isfinite(pull["ttft_p50_ms"]):
            r = k["ttft_p50_ms"] / pull["ttft_p50_ms"]
            parts.append(f"TTFT p50 / pull = {r:.2f} (reported beside the floor; prefill alone / pull = "
                         f"{pa['ttft_p50_ms'] / pull['ttft_p50_ms']:.2f})" if pa else f"TTFT p50 / pull = {r:.2f}")
        else:
            parts.append("TTFT p50 / pull: pull not measured")
        if pa and np.isfinite(pa["ttft_p50_ms"]):
            r = k["ttft_p50_ms"] / pa["ttft_p50_ms"]
            parts.append(f"TTFT p50 / prefill alone = {r:.2f} (target <= 1.1: {'met' if r <= 1.1 else 'MISSED'})")
        if np.isfinite(k["token2_p50_ms"]) and np.isfinite(k["tpot_p50_ms"]):
            r = k["token2_p50_ms"] / k["tpot_p50_ms"]
            parts.append(f"token-2 p50 / TPOT p50 = {r:.2f} (target <= 1.5: {'met' if r <= 1.5 else 'MISSED'})")
        if da and np.isfinite(da["tpot_p50_ms"]):
            r = k["tpot_p50_ms"] / da["tpot_p50_ms"]
            r2 = k["tpot_after2_p50_ms"] / da["tpot_after2_p50_ms"]
            parts.append(f"TPOT p50 / decode alone = {r:.2f} (target <= 1.05: {'met' if r <= 1.05 else 'MISSED'}; "
                         f"from the second token on, token-2's gap apart: {r2:.2f}, "
                         f"{'met' if r2 <= 1.05 else 'MISSED'})")
        if agg and np.isfinite(agg["tpot_p50_ms"]):
            parts.append(f"TPOT p50 / aggregated = {k['tpot_p50_ms'] / agg['tpot_p50_ms']:.2f}")
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
              "thread on, and it busy-polls (the idle column: most of a core per engine with no requests); "
              "kvpush's sidecars drive NIXL progress themselves and idle at ~0%. Every P/D pair runs one OpenMP "
              "thread per engine, the stand-in for separate machines. kvpush's first token is the prefill "
              "engine's own: its TTFT is the prefill engine's time plus the router's hop and whatever of the "
              "Reserve and handover the prefill's own HTTP, tokenization and scheduling does not hide, and "
              "the push work the prefill engine does during its forward pass (staging each layer); the "
              "second token pays decode's admission of a new request, its forward pass over the first token "
              "and the way back (the TTFT breakdown below has each step). On 2 cores every process the "
              "handover wakes competes with the prefill engine it is meant to run beside. With a few "
              "requests per phase, single runs on this machine move by 20-50%, so read small differences "
              "as noise.",
              "",
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


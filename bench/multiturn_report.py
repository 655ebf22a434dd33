"""The report of ``bench/multiturn.py``: its rounds merged, the turns >= 2 ratios with
bootstrap intervals, and the "Multi-turn" and "Conditional disaggregation" sections of
docs/BENCHMARKS.md."""

from __future__ import annotations

import numpy as np

from bench.common import pct


def merged(runs: list[dict]) -> dict:
    """One configuration's rounds as one run (answers keyed by round too)."""
    out = {"name": runs[0]["name"], "rows": {t: [] for t in runs[0]["rows"]}, "answers": {}, "wrong": 0,
           "equal": 0, "cpu": {}, "wall": 0.0, "divergences": []}
    for k, r in enumerate(runs):
        for t, rows in r["rows"].items():
            out["rows"][t] += rows
        out["answers"].update({(k, *key): v for key, v in r["answers"].items()})
        out["wrong"] += r["wrong"]
        out["equal"] += r["equal"]
        out["divergences"] += [{**d, "round": k + 1} for d in r.get("divergences", [])]
        out["wall"] += r["wall"]
        for proc, sec in r["cpu"].items():
            out["cpu"][proc] = out["cpu"].get(proc, 0.0) + sec
    return out


def ratio_interval(xs: list[float], base: list[float], convs: list[int], n: int = 5000,
                   seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of p50(xs) / p50(base): how far this one run's ratio may sit
    from what more conversations would show. Both lists hold the same turns in the same
    order, so a turn is drawn with both its measurements (what makes one turn slower than
    another falls on both sides of the ratio alike); ``convs`` names each turn's
    conversation, and whole conversations are drawn (a conversation's turns share its
    context and its place in the run, so they are not independent draws)."""
    rng = np.random.default_rng(seed)
    a, b, g = np.asarray(xs, dtype=float), np.asarray(base, dtype=float), np.asarray(convs)
    if not len(a) == len(b) == len(g):
        raise ValueError(f"unpaired turns: {len(a)} against {len(b)}, {len(g)} conversation places")
    members = [np.flatnonzero(g == c) for c in np.unique(g)]
    if len({len(m) for m in members}) != 1:
        raise ValueError("conversations with different numbers of turns")
    places = np.stack(members)  # conversation x its turns
    idx = places[rng.integers(0, len(places), (n, len(places)))].reshape(n, -1)
    r = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    return float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def later_turns(rows: dict[int, list]) -> tuple[list[float], list[int]]:
    """A configuration's turns >= 2 (TTFT, ms) and each one's conversation place in its run."""
    ttft = [x["ttft_ms"] if isinstance(x, dict) else x for t in sorted(rows) if t > 1 for x in rows[t]]
    return ttft, [c for t in sorted(rows) if t > 1 for c in range(len(rows[t]))]


def later_ratios(phase: str, runs: list[dict], paired_by: str) -> list[str]:
    """The report's line for turns >= 2: each configuration's TTFT p50 against kvpush
    without KV-aware reservations (turns paired across configurations)."""
    later = {r["name"]: later_turns(r["rows"]) for r in runs}
    if "kvpush" not in later or not later["kvpush"][0]:
        return []
    base, convs = later["kvpush"]
    b50 = pct(base, 50)
    return ["", f"{phase}, turns ≥ 2 ({len(base)} per configuration, {len(set(convs))} conversations), TTFT p50 "
            f"against kvpush without KV-aware reservations (95% paired bootstrap interval over conversations: "
            f"{paired_by}): " + ", ".join(
                f"{name} {pct(v, 50) / b50:.3f}x ({fmt(pct(v, 50))} ms; "
                "{:.3f}-{:.3f})".format(*ratio_interval(v, base, convs))
                for name, (v, _) in later.items() if name != "kvpush") + f"; kvpush {fmt(b50)} ms."]


def fmt(v: float) -> str:
    return "timeout" if not np.isfinite(v) else f"{v:.0f}"


# Two candidates this close are a float32 near-tie: a different order of the same sums
# (another chunking of the prompt, KV computed in a prefill rather than during decode) can
# swap them. A transfer that corrupted KV would move the logits far more than this.
NEAR_TIE_NATS = 1e-3


def first_divergence(ref: list[int], got: list[int]) -> int | None:
    """The index of the first token where two greedy answers part (None: equal)."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def divergence_lines(seq: list[dict]) -> list[str]:
    """What each answer that differs from the aggregated engine's says: where its
    conversation first parted (later turns follow from different text) and the two tokens'
    logprobs there as the aggregated engine computes them again (``gap_nats``: its own
    token's less the other's; ``why``: what kept the gap from being measured)."""
    lines = []
    for r in seq:
        for d in r.get("divergences", []):
            gap, where = d.get("gap_nats"), (f"round {d['round']}, conversation {d['conv'] + 1}, turn {d['turn']}"
                                             + (f", token {d['token'] + 1}" if d.get("token") is not None else ""))
            if gap is None:
                lines.append(f"- {r['name']}: {where}: {d.get('why') or 'no gap measured'}: **look into it**")
            else:
                verdict = "a float32 near-tie" if abs(gap) < NEAR_TIE_NATS else "**not a near-tie: look into it**"
                lines.append(f"- {r['name']}: {where}: the aggregated engine, computing it again, puts its own "
                             f"token {gap:+.1e} nats from the other: {verdict}")
    return ["", "Answers that differ from the aggregated engine's (where each conversation first parted; "
            "places counted from 1):", *lines] if lines else []


def kv_aware_label(threshold: int) -> str:
    """The name the report gives the kv-aware configuration (the router's threshold in it)."""
    return f"kv-aware (local < {threshold})"


def report(cross: dict, seq: list[dict], poi: list[dict], meta: dict, lim: dict | None = None) -> tuple[str, str]:
    """The multi-turn section and the crossover section of docs/BENCHMARKS.md."""
    lines = [f"Measured {meta['date']} by `bench/multiturn.py` ({meta['cpus']} cores, one run; the tiny "
             "float32 Llama of `kvpush/app/tiny_model.py`, block size 32; {rounds} round(s) of {convs} conversations of "
             "{turns} turns, each round every configuration in turn, with conversations of its own; turn 1 "
             "{first} tokens, each later turn +{new} new tokens and the previous answer's "
             "{answer}).".format(**meta), ""]
    lines += ["### Sequential: TTFT per turn (ms, p50 / p90 over the conversations), and what the prefill "
              "engine staged to push (p50)", "",
              "| turn | " + " | ".join(r["name"] for r in seq) + " |",
              "|---|" + "---|" * len(seq)]
    turns = sorted(seq[0]["rows"])
    for t in turns:
        cells = []
        for r in seq:
            ttft = [x["ttft_ms"] for x in r["rows"][t]]
            cells.append(f"{fmt(pct(ttft, 50))} / {fmt(pct(ttft, 90))}")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    for t in turns:
        lines.append(f"| KiB staged, turn {t} (per token the turn added) | " + " | ".join(
            staged_cell(r, t) for r in seq) + " |")
    lines.append("| answers equal to the aggregated engine's | " + " | ".join(
        f"{r['equal']} of {len(r['answers'])}" for r in seq) + " |")
    lines.append("| CPU seconds (all processes) / wall seconds | " + " | ".join(
        f"{sum(r['cpu'].values()):.0f} / {r['wall']:.0f}" for r in seq) + " |")
    lines += divergence_lines(seq)
    later = {r["name"]: later_turns(r["rows"])[0] for r in seq}
    base = later.get("kvpush")
    b50 = pct(base, 50) if base else float("nan")
    lines += later_ratios("Sequential", seq, "every configuration sees the same turns")
    alone = later.get(kv_aware_label(meta["threshold"]))
    if lim and lim["decode"] and lim["prefill"] and base and alone:
        d50, p50, a50 = pct(lim["decode"], 50), pct(lim["prefill"], 50), pct(alone, 50)
        lines += ["", f"Where turns ≥ 2 spend their time (p50, ms; the engines' share measured in the same rounds, "
                  f"{len(lim['decode'])} turns each, {len(lim['errors'])} errors): straight to an engine, no router "
                  f"and no push, a decode engine holding the conversation computes the rest in {fmt(d50)} "
                  f"(decode alone's own work) and the prefill engine holding the previous prompts computes its part "
                  f"in {fmt(p50)} (the work before kvpush's first token; ratio {d50 / p50:.3f}x). kvpush's path "
                  f"adds {b50 - p50:+.0f} to its engine's share (router, Reserve, push); the kv-aware path adds "
                  f"{a50 - d50:+.0f} to decode's (router hop, the Reserve beside it). At 0.5x kvpush, the kv-aware "
                  f"path would have {0.5 * b50 - d50:.0f} ms beyond decode's own work."]
    lines += ["", f"### Poisson: conversations sending their next turn a random think time (mean "
              f"{meta['think_s']} s) after their answer, all at once; {meta['rounds']} round(s) of {meta['convs']} "
              "conversations, each round every configuration in turn (in a rotating order) with the same "
              "conversations and think times; TTFT p50 / p90 (ms)", "",
              "| turn | " + " | ".join(r["name"] for r in poi) + " |", "|---|" + "---|" * len(poi)]
    for t in turns:
        lines.append(f"| {t} | " + " | ".join(f"{fmt(pct(r['rows'][t], 50))} / {fmt(pct(r['rows'][t], 90))}"
                                              for r in poi) + " |")
    lines.append("| errors | " + " | ".join(str(len(r["errors"])) for r in poi) + " |")
    lines += later_ratios("Poisson", poi, "the same conversations and think times in each configuration's "
                          "round; their arrivals, and so their queueing, differ")
    cross_lines = [f"Measured {meta['date']} by `bench/multiturn.py` ({meta['cpus']} cores): a 1,000-token "
                   f"prompt and its {meta['answer']}-token answer on a decode engine, then a turn adding N tokens, "
                   "served by the P/D path (KV-aware: only the rest pushed) or by that decode engine alone, "
                   f"alternating, {cross['reps']} of each per N with the engines otherwise idle, then "
                   f"{2 * cross['reps']} of each with "
                   f"{cross['background']} background stream(s) on each decode engine (their usual inter-token "
                   f"gap: {cross.get('usual_gap', float('nan')):.1f} ms). TTFT p50 / p90 (ms). *Saves*: the P/D "
                   "path's idle TTFT p50 less decode alone's. *Stall*: p50 over turns of the longest gap the "
                   f"serving decode engine's background stream saw in the {meta['stall_window_s']} s after the turn was "
                   "sent, less its usual gap. *Direct*: the same turn sent straight to that decode engine, "
                   "no router (decode alone's floor).", "",
                   "| N | idle: P/D | idle: alone | idle: direct | busy: P/D | busy: alone | saves (ms) "
                   "| stall, alone (ms) | stall, P/D (ms) | errors |",
                   "|---|---|---|---|---|---|---|---|---|---|"]
    for n, v in cross["rows"].items():
        i, b = v["idle"], v["busy"]
        cross_lines.append(
            f"| {n} | {fmt(pct(i['pd'], 50))} / {fmt(pct(i['pd'], 90))} | {fmt(pct(i['alone'], 50))} / "
            f"{fmt(pct(i['alone'], 90))} | {fmt(pct(i['direct'], 50))} / {fmt(pct(i['direct'], 90))} | "
            f"{fmt(pct(b['pd'], 50))} / {fmt(pct(b['pd'], 90))} | "
            f"{fmt(pct(b['alone'], 50))} / {fmt(pct(b['alone'], 90))} | {v['saved']:.1f} | {v['stall_alone']:.1f} "
            f"| {v['stall_pd']:.1f} | {len(i['errors']) + len(b['errors'])} |")
    cross_lines += ["", "Crossover (the smallest N from which on a local prefill stalls the decode engine's other "
                    "streams longer than it saves the turn): "
                    f"**{cross['threshold'] if cross['threshold'] is not None else 'none in the range'}**."]
    return "\n".join(lines), "\n".join(cross_lines)


def staged_cell(r: dict, t: int) -> str:
    rows = r["rows"][t]
    kib = pct([x["staged"] / 1024 for x in rows], 50)
    if not kib:
        return "0"
    return f"{kib:.0f} ({pct([x['staged'] / x['new'] for x in rows], 50):.0f} B)"

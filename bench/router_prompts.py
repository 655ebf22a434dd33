"""The router's CPU per request by the prompt's length and form: what a long prompt costs
the router before the first token (reading it, tokenizing a text or a chat, the
reservation's block keys, the prefill answer's prompt ids, decode's continuation body,
the output text's detokenizer). ``router_cpu.py`` measures per token with 64-token
prompts; this says what real prompts add.

    .venv/bin/python bench/router_prompts.py --report   # ~4 minutes on 2 cores; writes the
                                                        # "Router CPU by prompt" section

One stack without engines (etcd, a control plane, a simulated decode engine registered for
reservations) and a stand-in engine (``stand_in.py``) that answers the prefill request at
once (a completion's or a chat's, with the prompt's ids) and streams decode's 20-token
continuation one event every 5 ms. In front of it, interleaved for each prompt: this
router, the router of ``--baseline`` (by default main before this work), both KV-aware
(block keys with each Reserve; every request on the first-token path, the short first
turn of a conversation too), and for completions the bare TCP relay straight to the
stand-in (bench/tcp_relay.py: what a proxy pays to carry the request, no first-token
path). 8 clients for 4 s per router and prompt, two rounds; each process's CPU divided by
the requests it answered. Prompts: token ids (64, 1,024, 4,096), English text, and chats
with a long history, the last two of about the same token counts.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import tempfile

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import CpuMeter, update_section  # noqa: E402
from bench.router_cpu import baseline_checkout, other_router, say, stand_in, tcp_relay  # noqa: E402
from bench.stand_in import SimulatedDecode, prompt_ids  # noqa: E402
from bench.stand_in import drive as clients_streaming  # noqa: E402
from kvpush.app import engines  # noqa: E402
from kvpush.app.stack import Stack, StackSpec  # noqa: E402
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model  # noqa: E402

BASELINE = "25f4b38"  # main before the long-prompt work (session 25)
TOKENS = 20
CLIENTS = 8
SECONDS = 4.0
ROUNDS = 2
PACE_MS = 5.0
CLIENT_SPAN = 10_000_000  # request numbers of one client: client x CLIENT_SPAN + n
LENGTHS = (64, 1024, 4096)
SENTENCE = ("The prefill engine computes the prompt's KV cache while the sidecar writes each layer into blocks "
            "reserved on a decode engine, which starts generating the moment the last write lands. ")


def text(i: int, tokens: int) -> str:
    """English of about ``tokens`` tokens (the tiny model's BPE: about 3.7 characters a
    token here), different per request (a number in each sentence)."""
    out, n = [], 0
    while n < tokens * 3.7:
        s = f"{i}.{len(out)} {SENTENCE}"
        out.append(s)
        n += len(s)
    return "".join(out)


def chat(i: int, tokens: int) -> list[dict]:
    """A conversation of about ``tokens`` tokens: turns of a user and an assistant."""
    turns, n = [{"role": "system", "content": "You are a concise assistant."}], 0
    while n < tokens * 3.3:
        s = f"Turn {len(turns)} of {i}: {SENTENCE}"
        turns.append({"role": "user" if len(turns) % 2 else "assistant", "content": s})
        n += len(s)
    if turns[-1]["role"] != "user":
        turns.append({"role": "user", "content": f"And then, {i}?"})
    return turns


def chat_turn(i: int, tokens: int) -> list[dict]:
    """Request ``i`` of a client: the next turn of its conversation, whose history grows
    turn by turn to about ``tokens`` (then a new conversation begins), as a chat client
    sends its history again with each question."""
    client, n = divmod(i, CLIENT_SPAN)
    users = _turns(tokens)
    whole = chat(client * 1000 + n // len(users), tokens)
    return whole[:users[n % len(users)] + 1]


@functools.lru_cache
def _turns(tokens: int) -> list[int]:
    return [k for k, m in enumerate(chat(0, tokens)) if m["role"] == "user"]


def prompts() -> list[tuple[str, str, object]]:
    """(label, endpoint, request body's prompt fields per request number)."""
    out = [(f"ids, {n}", "completions", lambda i, n=n: {"prompt": prompt_ids(i, n)}) for n in LENGTHS]
    out += [(f"text, ~{n}", "completions", lambda i, n=n: {"prompt": text(i, n)}) for n in LENGTHS]
    out += [(f"chat, ~{n}", "chats", lambda i, n=n: {"messages": chat(i, n)}) for n in LENGTHS[1:]]
    out += [(f"chat turns, to ~{n}", "chats", lambda i, n=n: {"messages": chat_turn(i, n)}) for n in LENGTHS[1:]]
    return out


_DRIVES = iter(range(1, 1 << 30))


def drive(url: str, make, seconds: float) -> dict:
    """CLIENTS clients streaming requests made by ``make`` (of a request number) for
    ``seconds``; request numbers never repeat between calls (no router has seen a prompt
    before, but a conversation's earlier turns)."""
    first = next(_DRIVES) * 1000
    return asyncio.run(clients_streaming(url, CLIENTS, seconds, TOKENS,
                                         lambda c, n: make(c * CLIENT_SPAN + first + n)))


def run(model: str, logs: str, baseline: str) -> dict:
    os.makedirs(logs, exist_ok=True)
    from kvpush.router.tokens import HFTokenCounter
    counter = HFTokenCounter(model)
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, engines=False, deadline_ms=3000, quarantine_ms=100),
                  progress=say)
    procs = []
    try:
        stack.start()
        sim = SimulatedDecode(stack.controlplane, stack.engine_token)
        upstream, port, engine_args = stand_in(stack, model, PACE_MS)
        procs.append(upstream)
        # (Every request on the first-token path: a conversation's short first turn too.)
        args = (*engine_args, "--prefix-block-size", str(engines.BLOCK_SIZE), "--local-prefill-tokens", "0")
        mine, mine_url = other_router(stack, "router", engines.ROOT, args)
        base, base_url = other_router(stack, "router-baseline", baseline_checkout(baseline), args)
        relay, relay_url = tcp_relay(stack, port)
        procs += [mine, base, relay]
        who = {"router": (mine_url, mine), f"baseline ({baseline})": (base_url, base), "relay": (relay_url, relay)}
        out: dict = {}
        for label, endpoint, make in prompts():
            bodies = [make(i) for i in range(64)]  # (the turns of a conversation: their mean)
            n = round(sum(len(counter.chat_ids(b["messages"]) if "messages" in b else counter.completion_ids(b["prompt"]))
                          for b in bodies) / len(bodies))
            row = out.setdefault(label, {"endpoint": endpoint, "tokens": n, "by": {}})
            names = [w for w in who if w != "relay" or endpoint == "completions"]
            for rnd in range(ROUNDS):
                for name in names if rnd % 2 == 0 else names[::-1]:
                    url, proc = who[name]
                    if rnd == 0:
                        drive(url, make, 0.5)  # warm
                    meter = CpuMeter({"p+": psutil.Process(proc.pid)})
                    meter.start()
                    got = drive(url, make, SECONDS)
                    cpu = meter.stop()["p"]
                    acc = row["by"].setdefault(name, {"cpu_s": 0.0, "requests": 0, "errors": 0, "error_sample": []})
                    acc["cpu_s"] += cpu
                    acc["requests"] += got["requests"]
                    acc["errors"] += len(got["errors"])
                    acc["error_sample"] += got["errors"][:3]
            for name, acc in row["by"].items():
                acc["ms_per_request"] = 1e3 * acc["cpu_s"] / max(acc["requests"], 1)
            say(f"{label} ({n} tokens): " + ", ".join(f"{k} {v['ms_per_request']:.2f} ms/request"
                                                      f"{' ERRORS ' + str(v['error_sample'][:1]) if v['errors'] else ''}"
                                                      for k, v in row["by"].items()))
        sim.stop()
        return out
    finally:
        for p in procs:
            p.stop()
        stack.stop()


def report(out: dict, baseline: str) -> str:
    base = f"baseline ({baseline})"
    lines = ["## Router CPU by prompt", "",
             "`.venv/bin/python bench/router_prompts.py --report` (the script says what it does): the router's CPU "
             f"per request of a {TOKENS}-token streamed answer, by the prompt's form and length, beside the router "
             f"of {baseline} and a bare TCP relay, interleaved in one run ({CLIENTS} clients, {ROUNDS} x "
             f"{SECONDS:g} s each). \"Per token at 200\": what the per-request CPU adds to each token of a "
             "200-token answer.", "",
             "| prompt | tokens (mean) | router ms/request | baseline ms/request | router / baseline | relay ms/request | "
             "router per token at 200, us | requests (router, baseline) | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, row in out.items():
        by = row["by"]
        r, b, relay = by["router"], by[base], by.get("relay")
        errors = sum(v["errors"] for v in by.values())
        relay_ms = f"{relay['ms_per_request']:.2f}" if relay else "-"
        lines.append(f"| {label} | {row['tokens']} | **{r['ms_per_request']:.2f}** | {b['ms_per_request']:.2f} | "
                     f"{r['ms_per_request'] / b['ms_per_request']:.2f} | {relay_ms} | "
                     f"{r['ms_per_request'] * 1e3 / 200:.0f} | {r['requests']}, {b['requests']} | {errors} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=BASELINE, help="the git ref whose router runs beside")
    ap.add_argument("--report", action="store_true", help="write docs/BENCHMARKS.md's section")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    out = run(model, tempfile.mkdtemp(prefix="router-prompts-"), args.baseline)
    text_ = report(out, args.baseline)
    print(text_)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.report:
        update_section("router-prompts", text_)


if __name__ == "__main__":
    main()

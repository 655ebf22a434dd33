"""`kvpush demo`: the whole system on loopback, a few requests, a summary.

It generates the tiny random-weight model (first run only), starts the embedded
etcd, a control plane, a prefill and a decode sidecar, a prefill and a decode
vLLM engine (CPU) with the kvpush connector, and the router; sends a handful of
requests through the router (streaming, sequential, so each one's counters are
its own) and the same prompts to the decode engine alone for reference; prints
per request the TTFT, whether the KV arrived by push, the bytes moved and
whether the text matches; checks the registry against its invariants; and
shuts everything down. Logs stay in the log directory.
"""

from __future__ import annotations

import asyncio
import os
import time

from kvpush.controlplane.invariants import check
from kvpush.app.stack import Stack, StackSpec, complete
from kvpush.app.table import render

PROMPTS = [
    "The quick brown fox",
    "Disaggregated serving splits prefill and decode across engines so that",
    " ".join(["A longer prompt that spans several KV blocks of thirty-two tokens each."] * 6),
    " ".join(["Push the KV cache while the prefill is still computing the next layer."] * 14),
]


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def counters(stack: Stack) -> dict:
    stats = stack.stats()
    return {name: data.get("counters", {}) for name, data in stats.items()}


def main(args) -> int:
    from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
    logs = os.path.abspath(args.keep_logs)
    os.makedirs(logs, exist_ok=True)
    say("generating the tiny random-weight model (first run only) ...")
    model_dir = ensure_model(DEFAULT_DIR)
    spec = StackSpec(model_dir=os.path.abspath(model_dir), log_dir=logs)
    stack = Stack(spec, progress=say)
    rows, ok = [], True
    try:
        stack.start()
        prompts = (PROMPTS * ((args.requests + len(PROMPTS) - 1) // len(PROMPTS)))[:args.requests]
        for i, prompt in enumerate(prompts):
            before = counters(stack)
            got = complete(stack.router_url, prompt, max_tokens=16, stream=True)
            time.sleep(0.3)  # the connectors write their counters at the end of an engine step
            after = counters(stack)
            delta = {eng: {k: v - before.get(eng, {}).get(k, 0) for k, v in c.items()} for eng, c in after.items()}
            pushed = delta.get("decode-0", {}).get("loads_landed", 0) > 0
            moved = delta.get("prefill-0", {}).get("bytes_staged", 0)
            reference = complete(stack.decode_url, prompt, max_tokens=16)["choices"][0]["text"]
            same = got["text"] == reference
            ok &= same and pushed
            rows.append([i, len(prompt.split()), f"{got['ttft_s'] * 1e3:.0f}", "push" if pushed else "recompute",
                         f"{moved / 1024:.0f}", "yes" if same else "NO", repr(got["text"][:24])])
        print()
        print(render(["#", "words", "TTFT ms", "KV arrived by", "KiB pushed", "same text as one engine",
                      "output"], rows))
        totals = counters(stack)
        print()
        say(f"decode engine: {totals.get('decode-0', {}).get('loads_landed', 0)} loads by push, "
            f"{totals.get('decode-0', {}).get('tokens_loaded', 0)} prompt tokens not recomputed, "
            f"{totals.get('decode-0', {}).get('load_errors', 0)} load errors")
        time.sleep(1.0)
        report = asyncio.run(check(stack.etcd.endpoint, quiet=True))
        say(f"registry invariants (read from etcd directly): {'all hold' if report.ok else report.summary()}")
        ok &= report.ok
    finally:
        say("shutting everything down ...")
        stack.stop()
        say(f"done; logs in {logs}")
    return 0 if ok else 1

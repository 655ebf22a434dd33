"""Load for the end-to-end benchmark: prompts of exact token lengths, streamed
requests with TTFT/TPOT, sequential and Poisson phases, and their summaries."""

from __future__ import annotations

import json
import os
import pathlib
import random
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import pct  # noqa: E402

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
    out = {"ok": False, "start": started, "ttft_s": None, "t2_s": None, "total_s": None, "tokens": 0, "text": "",
           "error": ""}
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
                elif chunk.get("choices") and out["t2_s"] is None:
                    out["t2_s"] = time.perf_counter() - started  # the second token's chunk
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
        # One clock read per turn: reading it twice could make the sleep negative.
        while (left := off - (time.perf_counter() - t0)) > 0:
            time.sleep(min(0.002, left))
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
    # Token-2 latency: first token to second. On kvpush's first-token path the first comes
    # from the prefill engine and the second is decode's first step after the landing.
    token2 = [r["t2_s"] - r["ttft_s"] for r in ok if r.get("t2_s") is not None]
    # The steady decode rate, without the token-2 gap (which is reported by itself above).
    tpot2 = [(r["total_s"] - r["t2_s"]) / max(1, (r["tokens"] or max_tokens) - 2) for r in ok
             if r.get("t2_s") is not None and max_tokens > 2]
    span = (max(r["end"] for r in ok) - min(r["start"] for r in ok)) if ok else float("nan")
    return {"n": len(results), "ok": len(ok), "hung": sum(1 for r in results if r.get("hung")),
            "unsent": sum(1 for r in results if r.get("unsent")),
            "timeouts": sum(1 for r in results if not r.get("ok") and ("imeout" in r.get("error", "")
                                                                          or "timed out" in r.get("error", ""))),
            "errors": sorted({r["error"][:120] for r in results if not r.get("ok")}),
            "ttft_p50_ms": pct_inf(ttft, 50) * 1e3, "ttft_p90_ms": pct_inf(ttft, 90) * 1e3,
            "tpot_p50_ms": pct(tpot, 50) * 1e3 if tpot else float("nan"),
            "token2_p50_ms": pct(token2, 50) * 1e3 if token2 else float("nan"),
            "tpot_after2_p50_ms": pct(tpot2, 50) * 1e3 if tpot2 else float("nan"),
            "req_per_s": len(ok) / span if ok and span > 0 else float("nan"),
            "tok_per_s": sum((r["tokens"] or max_tokens) for r in ok) / span if ok and span > 0 else float("nan"),
            "ttfts_ms": [t * 1e3 for t in ttft if np.isfinite(t)]}


# ---------------------------------------------------------------- configurations


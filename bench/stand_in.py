"""A stand-in engine and the clients that drive it: what the router benchmarks put in
front of a router when no engine is to be the limit.

    .venv/bin/python bench/stand_in.py PORT --model DIR [--pace-ms MS]   # serve one

The stand-in answers the prefill request at once (one token, its ids, the push report)
and writes decode's continuation as vLLM writes its events: all at once, or one event
every ``--pace-ms`` (an engine's pace). ``SimulatedDecode`` registers a decode engine
with the control plane (blocks to reserve, no engine behind it), so that every request
through a router is reserved and takes the first-token path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import pct  # noqa: E402

PROMPT = 64


def prompt_ids(i: int, n: int = PROMPT) -> list[int]:
    return [100 + (i * 7 + k * 13) % 800 for k in range(n)]


async def stream(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """One streamed request (a chat if ``body`` has messages): TTFT (s) and the content
    events received (one per token here: greedy, one token a step)."""
    started = time.perf_counter()
    ttft, events, pending = None, 0, b""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with session.post(url + path, json=body) as r:
        if r.status != 200:
            return {"error": f"{r.status}: {(await r.read())[:200]!r}"}
        async for data in r.content.iter_any():
            if ttft is None:
                ttft = time.perf_counter() - started
            *whole, pending = (pending + data).split(b"\n\n")
            for e in whole:
                if b'"token_ids":[' in e:
                    # (one event may carry several tokens: vLLM merges outputs its server is late for)
                    events += len(json.loads(e[6:])["choices"][0]["token_ids"])
                elif b'"text":' in e or (b'"content":' in e and b'"role":' not in e):  # (a chat's first event: its role)
                    events += 1
    return {"ttft": ttft, "tokens": events, "error": None}


def stand_in_app(model: str, pace_ms: float = 0.0, handover=None):
    """A stand-in engine: prefill answers (one token, its ids, the push report) at once;
    decode's continuation is written whole, as vLLM writes its events, in one write.
    ``handover``: async (the router's request id) -> the reservation id, for a prefill
    request sent before its Reserve answered (as the prefill sidecar hears it by watch)."""
    from aiohttp import web
    from tokenizers import Tokenizer
    from tokenizers.decoders import DecodeStream
    from kvpush.contract.transfer_params import push_report
    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    text = " ".join(["Push each layer while the next one is still being computed, and decode starts at once."] * 40)
    out_ids = tok.encode(text, add_special_tokens=False).ids
    streams: dict[tuple[int, int], bytes] = {}

    def rendered(n: int, prompt_len: int) -> bytes:
        key = (n, prompt_len)
        if key not in streams:
            ds = DecodeStream(ids=out_ids[:1], skip_special_tokens=True)
            parts = []
            for i, t in enumerate(out_ids[1:n + 1]):
                choice = {"index": 0, "text": ds.step(tok, t) or "", "logprobs": None,
                          "finish_reason": "length" if i == n - 1 else None, "stop_reason": None,
                          "prompt_token_ids": list(range(prompt_len)) if i == 0 else None, "token_ids": [t]}
                parts.append(b"data: " + json.dumps({"id": "cmpl-fake", "object": "text_completion", "created": 1,
                                                     "model": "tiny", "choices": [choice]},
                                                    ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")
            usage = {"prompt_tokens": prompt_len, "total_tokens": prompt_len + n, "completion_tokens": n}
            parts.append(b"data: " + json.dumps({"id": "cmpl-fake", "object": "text_completion", "created": 1,
                                                 "model": "tiny", "choices": [], "usage": usage},
                                                separators=(",", ":")).encode() + b"\n\ndata: [DONE]\n\n")
            streams[key] = b"".join(parts)
        return streams[key]

    async def reported(body: dict, answer: dict) -> dict:
        """A prefill answer with the push report an engine adds when a reservation reached it."""
        kv = (body.get("kv_transfer_params") or {}).get("kvpush") or {}
        if "await" in kv and handover is not None:
            kv = {"reservation_id": await handover(kv["await"]["request_id"], kv["await"]["wait_ms"] / 1e3)}
        if kv.get("reservation_id"):
            answer["kv_transfer_params"] = push_report(kv["reservation_id"], True)
        return answer

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, str):  # (a text prompt: its ids as an engine would return them)
            prompt = tok.encode(prompt).ids
        if not body.get("stream"):
            choice = {"index": 0, "text": tok.decode(out_ids[:1]), "logprobs": None, "finish_reason": "length",
                      "stop_reason": None, "prompt_token_ids": prompt, "token_ids": out_ids[:1]}
            answer = {"id": "cmpl-fake-p", "object": "text_completion", "created": 1, "model": "tiny",
                      "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1,
                                                     "total_tokens": len(prompt) + 1}}
            return web.json_response(await reported(body, answer))
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        whole = rendered(int(body["max_tokens"]), len(prompt))
        if not pace_ms:
            await resp.write(whole)
            return resp
        for event in whole.split(b"\n\n")[:-1]:   # one event a step, as an engine streams them
            await resp.write(event + b"\n\n")
            await asyncio.sleep(pace_ms / 1e3)
        return resp

    chat_tok = []  # (the HF tokenizer, for chat templates: loaded at the first chat)

    async def chat(request: web.Request) -> web.Response:
        """A chat's prefill request (one token, its ids, the push report); decode's
        continuation is a completion."""
        body = await request.json()
        if body.get("stream"):
            return web.json_response({"error": "the stand-in streams completions only"}, status=501)
        if not chat_tok:
            from transformers import AutoTokenizer
            chat_tok.append(AutoTokenizer.from_pretrained(model, local_files_only=True))
        prompt = list(chat_tok[0].apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
        choice = {"index": 0, "message": {"role": "assistant", "content": tok.decode(out_ids[:1])}, "logprobs": None,
                  "finish_reason": "length", "stop_reason": None, "token_ids": out_ids[:1]}
        answer = {"id": "chatcmpl-fake-p", "object": "chat.completion", "created": 1, "model": "tiny",
                  "choices": [choice], "prompt_token_ids": prompt,
                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": 1, "total_tokens": len(prompt) + 1}}
        return web.json_response(await reported(body, answer))

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/{engine}/v1/completions", handle)   # (one stand-in serving several engines' URLs)
    return app


class SimulatedDecode:
    """A decode engine registered with the control plane (blocks to reserve), no engine behind it."""

    def __init__(self, controlplane: str, token: str) -> None:
        self.controlplane, self.token = controlplane, token
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)

    async def _start(self) -> None:
        from kvpush.app.simulated import SimulatedEngine
        from kvpush.client.control_plane import ControlPlaneClient
        self.client = ControlPlaneClient(self.controlplane, self.token)
        self.engine = SimulatedEngine(self.client, "sim-decode", num_blocks=200_000, model="tiny")
        await self.engine.register()

    def stop(self) -> None:
        async def stop():
            await self.engine.stop()
            await self.client.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


async def drive(url: str, clients: int, seconds: float, tokens: int, prompt=None) -> dict:
    """``clients`` loops, each streaming one request after another, for ``seconds``;
    ``prompt(client, n)``: the prompt's fields of a client's n-th request (by default 64
    token ids, different per request)."""
    body = {"model": "tiny", "max_tokens": tokens, "stream": True}
    stop_at = time.monotonic() + seconds
    results: list[dict] = []
    prompt = prompt or (lambda i, n: {"prompt": prompt_ids(i * 1000 + n)})

    async def client(i: int, s: aiohttp.ClientSession) -> None:
        n = 0
        while time.monotonic() < stop_at:
            results.append(await stream(s, url, dict(body, **prompt(i, n))))
            n += 1
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        await asyncio.gather(*(client(i, s) for i in range(clients)))
    return {"requests": len(results), "tokens": sum(r.get("tokens", 0) for r in results),
            "errors": [r["error"] for r in results if r["error"]] +
                      [f"{r['tokens']} tokens, not {tokens}" for r in results if not r["error"] and r["tokens"] != tokens],
            "ttft_ms_p50": pct([r["ttft"] * 1e3 for r in results if r.get("ttft")], 50)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("port", type=int)
    ap.add_argument("--model", required=True, help="the model directory (its tokenizer)")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="one event every this many ms, not all at once")
    args = ap.parse_args()
    from aiohttp import web
    web.run_app(stand_in_app(args.model, args.pace_ms), host="127.0.0.1", port=args.port, access_log=None,
                print=None)


if __name__ == "__main__":
    main()

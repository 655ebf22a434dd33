"""The first-token path's text against vLLM's own detokenizer and response classes, with
the tiny model's byte-level BPE (its multi-byte characters are several tokens each).

A stand-in engine plays vLLM with a script for a model: it answers the prefill request,
decode's continuation and, as the reference, the client's request whole (the aggregated
engine), making every text with vLLM's ``FastIncrementalDetokenizer`` (stop strings
included) and writing every event with vLLM's response classes. The router's answer must
equal the aggregated one: the streamed events byte for byte but for the id and
``created`` (the prefill engine's), for outputs whose first token ends inside a
character, stop strings across the first and second tokens and later, chats and
completions, streamed and whole. The router passes decode's text on past the boundary,
so these are the cases where that could go wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import types

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvpush.app import engines
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
from kvpush.contract.transfer_params import push_report
from kvpush.router.app import build_app
from kvpush.router.config import DecodeEngine, RouterConfig
from kvpush.router.tokens import HFTokenCounter
from tests.controlplane.helpers import make_tenant

vllm_detok = pytest.importorskip("vllm.v1.engine.detokenizer", reason="vLLM is installed by scripts/setup.sh")
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, DeltaMessage)
from vllm.entrypoints.openai.completion.protocol import (  # noqa: E402
    CompletionResponseStreamChoice, CompletionStreamResponse)
from vllm.entrypoints.serve.engine.protocol import UsageInfo  # noqa: E402

MODEL = "tiny"


class ScriptedVllm:
    """vLLM's OpenAI server for a model that is a script: a prompt ``P`` (its token ids)
    is continued by ``S``, and so is any prompt ``P + S[:k]`` (by ``S[k:]``)."""

    def __init__(self, counter: HFTokenCounter) -> None:
        self.counter = counter
        from transformers import AutoTokenizer
        self.hf = AutoTokenizer.from_pretrained(counter.model_dir, local_files_only=True)
        self.scripts: list[tuple[list[int], list[int]]] = []
        self.bodies: list[dict] = []

    def continuation(self, prompt: list[int]) -> list[int]:
        for p, s in self.scripts:
            k = len(prompt) - len(p)
            if 0 <= k <= len(s) and prompt == p + s[:k]:
                return s[k:]
        raise AssertionError(f"no script continues {prompt[-5:]}")

    def _detokenizer(self, prompt: list[int], body: dict):
        params = types.SimpleNamespace(stop=body.get("stop"), min_tokens=body.get("min_tokens", 0),
                                       include_stop_str_in_output=bool(body.get("include_stop_str_in_output")),
                                       skip_special_tokens=True, spaces_between_special_tokens=True)
        request = types.SimpleNamespace(sampling_params=params, request_id="x", prompt_token_ids=prompt)
        return vllm_detok.FastIncrementalDetokenizer(self.hf, request)

    def steps(self, prompt: list[int], body: dict):
        """(token ids, delta text, finish_reason, stop_reason) per engine step, as vLLM's
        output processor makes them (one token a step, the length limit, stop strings)."""
        detok = self._detokenizer(prompt, body)
        script = self.continuation(prompt)
        for i, t in enumerate(script[:body["max_tokens"]]):
            finish = "length" if i == body["max_tokens"] - 1 else None
            stop = detok.update([t], False)
            reason = None
            if stop is not None:
                finish, reason = "stop", stop
            text = detok.get_next_output_text(finish is not None, delta=True)
            yield [t], text, finish, reason
            if finish is not None:
                return

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        prompt = self.counter.chat_ids(body["messages"]) if chat else self.counter.completion_ids(body["prompt"])
        kv = (body.get("kv_transfer_params") or {}).get("kvpush") or {}
        ids_back = bool(body.get("return_token_ids"))
        rid, created = ("chatcmpl-" if chat else "cmpl-") + f"{len(self.bodies)}", 1000 + len(self.bodies)
        steps = list(self.steps(prompt, body))
        out_ids = [t for s in steps for t in s[0]]
        usage = UsageInfo(prompt_tokens=len(prompt), completion_tokens=len(out_ids),
                          total_tokens=len(prompt) + len(out_ids))
        if not body.get("stream"):
            text = "".join(s[1] for s in steps)
            choice = {"index": 0, "logprobs": None, "finish_reason": steps[-1][2], "stop_reason": steps[-1][3],
                      "token_ids": out_ids if ids_back else None}
            answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                      "model": MODEL, "choices": [choice], "usage": usage.model_dump()}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                answer["prompt_token_ids"] = prompt if ids_back else None
            else:
                choice.update(text=text, prompt_token_ids=prompt if ids_back else None)
            if "reservation_id" in kv:
                answer["kv_transfer_params"] = push_report(kv["reservation_id"], True)
            return web.json_response(answer)
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        if chat:
            first = ChatCompletionStreamResponse(id=rid, object="chat.completion.chunk", created=created, model=MODEL,
                                                 choices=[ChatCompletionResponseStreamChoice(
                                                     index=0, delta=DeltaMessage(role="assistant", content=""),
                                                     logprobs=None, finish_reason=None)],
                                                 prompt_token_ids=prompt if ids_back else None, prompt_text=None)
            await resp.write(f"data: {first.model_dump_json(exclude_unset=True)}\n\n".encode())
        for i, (ids, text, finish, reason) in enumerate(steps):
            if chat:
                if finish is None:
                    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=text),
                                                                logprobs=None, finish_reason=None,
                                                                token_ids=ids if ids_back else None)
                else:
                    choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=text),
                                                                logprobs=None, finish_reason=finish,
                                                                stop_reason=reason,
                                                                token_ids=ids if ids_back else None)
                chunk = ChatCompletionStreamResponse(id=rid, object="chat.completion.chunk", created=created,
                                                     choices=[choice], model=MODEL)
            else:
                chunk = CompletionStreamResponse(id=rid, object="text_completion", created=created, model=MODEL,
                                                 choices=[CompletionResponseStreamChoice(
                                                     index=0, text=text, logprobs=None, finish_reason=finish,
                                                     stop_reason=reason,
                                                     prompt_token_ids=prompt if ids_back and i == 0 else None,
                                                     token_ids=ids if ids_back else None)])
            await resp.write(f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n".encode())
            await asyncio.sleep(0.001)   # an engine's steps: the events arrive one by one
        if (body.get("stream_options") or {}).get("include_usage"):
            cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
            last = cls(id=rid, created=created, model=MODEL, choices=[], usage=usage)
            await resp.write(f"data: {last.model_dump_json(exclude_unset=False, exclude_none=True)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        return app


@pytest.fixture(scope="module")
def counter():
    model = ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR))
    c = HFTokenCounter(model)
    c.model_dir = model
    return c


@pytest_asyncio.fixture
async def system(counter, cp, admin, engine_client, etcd):
    from kvpush.app.simulated import SimulatedEngine
    engine = ScriptedVllm(counter)
    server = TestServer(engine.app(), handler_cancellation=True)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    sim = SimulatedEngine(engine_client, "decode-0", num_blocks=4096, model=MODEL)
    await sim.register()
    tenant = await make_tenant(admin, cp.address, "text")
    cfg = RouterConfig(controlplane=cp.address, token=tenant.metadata[0][1].split()[1], model=MODEL,
                       prefill_urls=(url,), decode=(DecodeEngine("decode-0", url),), max_model_len=1000)
    router = TestServer(build_app(cfg, counter), handler_cancellation=True)
    await router.start_server()
    session = aiohttp.ClientSession()
    yield engine, url, str(router.make_url("")).rstrip("/"), session
    await session.close()
    await router.close()
    await server.close()
    await tenant.close()
    await sim.stop()


async def ask(session, url: str, endpoint: str, body: dict) -> tuple[list[bytes] | None, dict | None]:
    async with session.post(f"{url}/v1/{endpoint}", json=body) as r:
        raw = await r.read()
        assert r.status == 200, raw
    if body.get("stream"):
        return [e for e in raw.split(b"\n\n") if e], None
    return None, json.loads(raw)


async def continuation_events(session, url: str) -> dict:
    async with session.get(f"{url}/metrics") as r:
        text = await r.text()
    return {how: float(m.group(1)) if (m := re.search(
        r'kvpush_router_continuation_events_total\{how="%s"\} (\S+)' % how, text)) else 0.0
        for how in ("passed", "made")}


def normal(events: list[bytes]) -> list[bytes]:
    """The events less what differs between any two answers: the id and ``created``."""
    return [re.sub(rb'"created":\d+', b'"created":0', re.sub(rb'"id":"[^"]*"', b'"id":"-"', e)) for e in events]


def split_chars(counter) -> list[int]:
    """Tokens that hold part of a multi-byte character (each alone decodes to U+FFFD)."""
    rust = counter._rust
    return [t for t in range(counter.vocab_size) if "\ufffd" in rust.decode([t])]


def scripts(counter, n: int, seed: int) -> list[list[int]]:
    """Outputs rich in characters split across tokens; the first ``n // 2`` start with one."""
    rng = random.Random(seed)
    parts = [counter._rust.encode(x, add_special_tokens=False).ids for x in ("é", "ü", "日本", "😀", " é")]
    words = [counter._rust.encode(x, add_special_tokens=False).ids for x in (" the", " push", "ed", " KV", ",")]
    out = []
    for i in range(n):
        s: list[int] = []
        if i < n // 2:
            s += rng.choice(parts)
        while len(s) < 14:
            s += rng.choice(parts + words)
        out.append(s[:14])
    return out


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
async def test_router_text_equals_vllm_aggregated(system, counter, endpoint, monkeypatch):
    engine, engine_url, router_url, session = system
    from kvpush.router import relay
    relayed = []   # events relayed from decode's connection's callback (relay.Passthrough)
    feed = relay.Passthrough.feed
    monkeypatch.setattr(relay.Passthrough, "feed", lambda self, data, size=0: relayed.append(data) or feed(self, data))
    partial_first = 0
    for i, script in enumerate(scripts(counter, 12, seed=7 + len(endpoint))):
        if endpoint == "completions":
            base = {"model": MODEL, "prompt": f"Script {i}: the KV moves", "max_tokens": 10}
            prompt = counter.completion_ids(base["prompt"])
        else:
            base = {"model": MODEL, "messages": [{"role": "user", "content": f"Script {i}: the KV moves"}],
                    "max_tokens": 10}
            prompt = counter.chat_ids(base["messages"])
        engine.scripts.append((prompt, script))
        partial_first += counter.ends_partial(prompt, script[0])
        # The reference text, whole, to take stop strings from: across the first and
        # second tokens, inside decode's text, and one never in it.
        _, whole = await ask(session, engine_url, endpoint, base)
        c = whole["choices"][0]
        text = c["text"] if endpoint == "completions" else c["message"]["content"]
        head = len(counter._rust.decode([script[0]]).rstrip("\ufffd"))
        stops = [None, [text[max(0, head - 1):head + 2] or "zz"], [text[6:8] or "zz", "never"]]
        for stop in stops:
            for include in (False, True):
                if include and stop is None:
                    continue
                for stream in (False, True):
                    body = dict(base, stream=stream)
                    if stop is not None:
                        body.update(stop=stop, include_stop_str_in_output=include)
                    if stream:
                        body["stream_options"] = {"include_usage": True}
                    if i % 3 == 0:
                        body["return_token_ids"] = True
                    what = (i, script, stop, include, stream)
                    want_events, want = await ask(session, engine_url, endpoint, body)
                    before = await continuation_events(session, router_url)
                    got_events, got = await ask(session, router_url, endpoint, body)
                    after = await continuation_events(session, router_url)
                    if stop is None and not counter.ends_partial(prompt, script[0]):
                        # Past the first of decode's events, all but the last went on as bytes.
                        assert (after["made"] - before["made"], after["passed"] - before["passed"]) == (2, 7), what
                    if stream:
                        assert b"".join(normal(got_events)) == b"".join(normal(want_events)), repr(what)
                    else:
                        for a in (got, want):
                            a.pop("id"), a.pop("created"), a.pop("kv_transfer_params", None)
                            a["choices"][0].pop("prompt_token_ids", None)
                        assert got == want, repr((what, got["choices"], want["choices"]))
    async with session.get(f"{router_url}/metrics") as r:
        metrics_text = await r.text()
    assert "kvpush_router_fallbacks_total{" not in metrics_text, metrics_text   # all went by the first-token path
    assert len(relayed) > 50, len(relayed)   # (most of the streamed answers past their boundary)
    assert partial_first >= 6   # the cases where decode's own first text is wrong were there
    # Decode was given the stop strings where its text is passed on, never where its
    # prompt ends inside a character.
    continued = [b for b in engine.bodies if isinstance(b.get("prompt"), list) and b.get("stop")]
    assert continued and all(not counter.ends_partial(b["prompt"][:-1], b["prompt"][-1]) for b in continued)

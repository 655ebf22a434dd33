"""Stand-ins for the router's tests: an OpenAI-ish engine (records bodies, streams,
can fail or stall, answers like vLLM with token ids) and a fast-detokenizer tokenizer."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from kvpush.contract.transfer_params import push_report
from kvpush.router.tokens import WhitespaceCounter


class FakeEngine:
    """An OpenAI-ish server: records bodies; streams three chunks; can fail or stall."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bodies: list[dict] = []
        self.fail = False
        self.stall = asyncio.Event()
        self.stall.set()
        self.cancelled = 0
        self.answer: tuple[int, dict] | None = None   # a fixed (status, body) answer
        self.mode = ""          # "token_ids": answer like vLLM with return_token_ids (prefill: one token;
        self.first = 7          # decode: a stream of ids 10, 11, ... up to max_tokens)
        self.finish = "length"
        self.pushes = True      # what the prefill answer's push report says
        self.handover = None    # async (router's request id) -> reservation id, for awaited reservations
        self.chunk_delay = 0.0  # seconds between streamed token chunks (token_ids mode)
        self.linger = 0.0       # seconds between [DONE] and the end of the body (token_ids mode)
        self.chunks, self.chunk_bytes = 3, 0  # the plain stream: how many chunks, each of this much text
        # Requests guessed decode alone (kvpush "alone") wait for this, as a connector holds
        # one whose prompt its prefix cache lacks.
        self.holds_alone = asyncio.Event()
        self.holds_alone.set()
        self.decode_text = lambda t: f" w{t}"   # decode's text for token t (WordTokenizer's)
        self.break_after: int | None = None      # decode's stream: the connection aborted after this many events
        self.error_after: int | None = None      # ... or an error event after this many
        self.silent_after: int | None = None     # ... or nothing more after this many (a hung engine)
        self.break_mid_event = False             # the break comes after the start of one more event

    async def _with_token_ids(self, request: web.Request, body: dict):
        base = {"id": f"cmpl-{self.name}", "created": 1, "model": "tiny"}
        if not body.get("stream"):
            choice = {"index": 0, "token_ids": [self.first], "finish_reason": self.finish, "stop_reason": None,
                      "logprobs": None}
            if request.path.endswith("/chat/completions"):
                choice["message"] = {"role": "assistant", "content": f" w{self.first}"}
                return web.json_response(dict(base, object="chat.completion", usage={"prompt_tokens": 3},
                                              prompt_token_ids=[1, 2, 3], choices=[choice]))
            choice.update(text=f" w{self.first}", prompt_token_ids=[1, 2, 3])
            kv = (body.get("kv_transfer_params") or {}).get("kvpush") or {}
            if "await" in kv and self.handover is not None:  # as a prefill sidecar hands it over
                kv = {"reservation_id": await self.handover(kv["await"]["request_id"])}
            report = push_report(kv["reservation_id"], self.pushes) if "reservation_id" in kv else None
            return web.json_response(dict(base, object="text_completion", usage={"prompt_tokens": 3},
                                          choices=[choice], kv_transfer_params=report))
        resp = web.StreamResponse()
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        include = bool(body.get("include_stop_str_in_output"))
        hold = max(map(len, stop)) - 1 if stop and not include else 0
        text, sent = "", 0
        first = 6 + len(body["prompt"])  # ids 10, 11, ... after a 4-token prompt: a resumed prompt goes on
        for i in range(body["max_tokens"]):
            if self.break_after is not None and i == self.break_after:
                if self.break_mid_event:
                    await resp.write(b'data: {"id":"cmpl-')
                    await asyncio.sleep(0.05)  # (read before the reset, which would drop it)
                request.transport.abort()   # the engine dies part way
                return resp
            if self.silent_after is not None and i == self.silent_after:
                await asyncio.sleep(3600)   # ... or hangs (until the router closes the connection)
            if self.error_after is not None and i == self.error_after:  # ... or says it failed, as vLLM does
                await resp.write(b'data: {"error": {"message": "engine failed", "code": 500}}\n\n')
                return resp
            finish, reason = ("length" if i == body["max_tokens"] - 1 else None), None
            new = self.decode_text(first + i)
            text += new
            for s in stop:  # vLLM's rule, simply: the stop string found in the new text, cut
                at = text.find(s, max(0, len(text) - len(new) - len(s) + 1))
                if at != -1:
                    text, finish, reason = text[:at + len(s) if include else at], "stop", s
                    break
            upto = len(text) - (hold if finish is None else 0)
            # As vLLM writes them (field order, compact JSON); the text as WordTokenizer makes it.
            chunk = dict(base, object="text_completion", choices=[{
                "index": 0, "text": text[sent:upto] if upto > sent else "", "logprobs": None,
                "finish_reason": finish, "stop_reason": reason,
                "prompt_token_ids": body["prompt"] if i == 0 else None, "token_ids": [first + i]}])
            sent = max(sent, upto)
            await resp.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
            if finish is not None:
                break
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        usage = {"prompt_tokens": 4, "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps(dict(base, choices=[], usage=usage))}\n\ndata: [DONE]\n\n".encode())
        if self.linger:
            await asyncio.sleep(self.linger)
        return resp

    def app(self) -> web.Application:
        async def handle(request: web.Request):
            body = await request.json()
            self.bodies.append(body)
            if self.fail:
                return web.json_response({"error": "boom"}, status=500)
            if self.answer is not None:
                status, payload = self.answer
                return web.json_response(payload, status=status)
            try:
                await self.stall.wait()
                if "alone" in ((body.get("kv_transfer_params") or {}).get("kvpush") or {}):
                    await self.holds_alone.wait()
                if "token_ids" in self.mode:
                    return await self._with_token_ids(request, body)
                if not body.get("stream"):
                    return web.json_response({"object": "text_completion", "engine": self.name,
                                              "choices": [{"text": " hi", "index": 0}]})
                resp = web.StreamResponse()
                resp.content_type = "text/event-stream"
                await resp.prepare(request)
                for i in range(self.chunks):
                    if self.break_after is not None and i == self.break_after:
                        if self.break_mid_event:
                            await resp.write(b'data: {"choices": [{"te')
                            await asyncio.sleep(0.05)  # (read before the reset, which would drop it)
                        request.transport.abort()   # the engine dies part way (at 0: after its headers)
                        return resp
                    if self.silent_after is not None and i == self.silent_after:
                        await asyncio.sleep(3600)   # ... or hangs (until the router closes the connection)
                    text = "x" * self.chunk_bytes if self.chunk_bytes else f"t{i}"
                    await resp.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
                    await asyncio.sleep(0.01)
                await resp.write(b"data: [DONE]\n\n")
                return resp
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        app.router.add_post("/v1/chat/completions", handle)
        return app


class WordTokenizer(WhitespaceCounter):
    """A fast-detokenizer stand-in: token id t is the text " w{t}"."""
    fast = True
    vocab_size = 1000

    def output_text(self, prompt_ids, skip_special_tokens=True):
        class Words:
            def step(self, t):
                return f" w{t}"
        return Words()

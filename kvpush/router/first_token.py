"""The first-token path's answers: the prefill engine's first token (the head) and
decode's continuation (the tail) made into the one answer a single engine would give.

    prefill: the client's request, max_tokens=1, return_token_ids ──▶ Head
             (its prompt ids, first token, text, logprobs, id/created/model)
    decode : /v1/completions, prompt = head.prompt_ids + [head.token_id],
             max_tokens - 1, streamed, return_token_ids ──▶ Tail, chunk by chunk
    client : the first token's text, then the tail's, made here from decode's token ids
             (kvpush/router/tokens.py says why), usage and logprobs joined

Completions and chats share it: decode always runs a completion (its prompt is token
ids); the client's endpoint decides the shape of what goes back. The response's id,
``created`` and ``model`` are the prefill engine's.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import json

from kvpush.router.ask import Ask
from kvpush.router.errors import error_body

# Fields of the client's request that decode does not get as they are: the prompt is
# the prefill engine's tokens plus its first token; the rest is set by decode_body.
_NOT_FOR_DECODE = frozenset((
    "prompt", "messages", "echo", "n", "best_of", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "min_tokens", "logprobs", "top_logprobs", "return_token_ids", "add_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "suffix", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
    "include_reasoning", "mm_processor_kwargs", "media_io_kwargs", "kv_transfer_params", "request_id",
    "response_format", "functions", "function_call", "stop"))


_LOGPROB_KEYS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")  # a completion's logprobs object


class BadHead(ValueError):
    """The prefill engine's answer lacks what the first-token path needs (token ids)."""


@dataclasses.dataclass
class Head:
    raw: dict                     # the prefill engine's answer
    prompt_ids: list[int]
    token_id: int
    text: str                     # completions: the choice's text; chat: the content
    logprobs: dict | None         # completions' logprobs object
    finish_reason: str | None
    stop_reason: object
    usage: dict

    @property
    def finished(self) -> bool:
        """Prefill's token ended the request (EOS, a stop token): decode has nothing to do."""
        return self.finish_reason == "stop"


def parse_head(endpoint: str, answer: dict) -> Head:
    try:
        choice = answer["choices"][0]
        ids = choice.get("token_ids") or []
        prompt_ids = choice.get("prompt_token_ids") if endpoint == "completions" else answer.get("prompt_token_ids")
        if len(ids) != 1 or not prompt_ids:
            raise BadHead(f"prefill answered {len(ids)} token ids and {len(prompt_ids or [])} prompt ids")
        text = choice.get("text", "") if endpoint == "completions" else (choice.get("message") or {}).get("content")
        return Head(raw=answer, prompt_ids=list(prompt_ids), token_id=int(ids[0]), text=text or "",
                    logprobs=choice.get("logprobs") if endpoint == "completions" else None,
                    finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"),
                    usage=answer.get("usage") or {})
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise BadHead(f"prefill's answer is not a completion: {exc}") from None


def prefill_body(body: dict, kv_transfer_params: dict | None, first_token: bool) -> dict:
    """The request as the prefill engine gets it: one token, not streamed, push on
    (``kv_transfer_params`` None: a plain request, the KV is not pushed)."""
    drop = ("stream", "stream_options", "max_completion_tokens", "n", "best_of")
    out = {k: v for k, v in body.items() if k not in drop}
    out.update(max_tokens=1, stream=False)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    if body.get("min_tokens"):
        out["min_tokens"] = 1  # vLLM refuses min_tokens > max_tokens
    if first_token:
        out["return_token_ids"] = True
    return out


def decode_body(ask: Ask, head: Head, model: str, kv_transfer_params: dict | None) -> dict:
    """Decode's continuation (``kv_transfer_params`` None: it computes the prompt itself)."""
    out = {k: v for k, v in ask.body.items() if k not in _NOT_FOR_DECODE}
    out.update(model=model, prompt=head.prompt_ids + [head.token_id], stream=True,
               stream_options={"include_usage": True}, return_token_ids=True)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    if ask.max_tokens is not None:
        out["max_tokens"] = ask.max_tokens - 1
    if ask.min_tokens > 1:
        out["min_tokens"] = ask.min_tokens - 1
    if ask.logprobs is not None:
        out["logprobs"] = ask.logprobs
    return out


def resume_body(d_body: dict, tail: "Tail") -> dict | None:
    """Decode's continuation again, on another engine, after the first broke part way:
    its prompt is everything generated so far, so the client's stream goes on where it
    stopped (greedy decoding gives the same tokens). None: nothing is left to generate."""
    done = len(tail.token_ids)
    out = {k: v for k, v in d_body.items() if k != "kv_transfer_params"}
    out["prompt"] = list(d_body["prompt"]) + tail.token_ids
    if "max_tokens" in d_body:
        out["max_tokens"] = d_body["max_tokens"] - done
        if out["max_tokens"] <= 0:
            return None
    if d_body.get("min_tokens"):
        out["min_tokens"] = max(0, d_body["min_tokens"] - done)
    tail.resumed()
    return out


@dataclasses.dataclass
class Piece:
    """What one decode chunk adds to the answer."""
    text: str
    token_ids: list[int]
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: object


class Tail:
    """Decode's continuation, joined onto the head as it streams in, and the generated
    text as vLLM's detokenizer keeps it (``vllm/v1/engine/detokenizer.py``): stop
    strings are matched here, on the whole generated text, because only here are the
    prefill engine's token and decode's tokens one text (decode is not given them: it
    could not see a stop string that begins in the first token). While streaming,
    the last ``max(len(stop)) - 1`` characters are held back, as vLLM holds them."""

    def __init__(self, ask: Ask, head: Head, output_text) -> None:
        self.ask = ask
        self.head = head
        self.out = output_text
        self.gen = self.out.step(head.token_id)  # all generated text so far: prefill's token's, first
        stop = ask.body.get("stop") or []
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        self.include_stop = bool(ask.body.get("include_stop_str_in_output"))
        self.hold = max(len(x) for x in self.stop) - 1 if self.stop and not self.include_stop else 0
        self.sent = 0                           # characters of gen already streamed
        self.token_ids: list[int] = []          # decode's, after the head's
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.stopped_here = False               # a stop string ended it: decode is to be closed
        self.logprobs: dict | None = None
        lp = head.logprobs
        # Completion logprobs' text offsets count the tokens' strings from the answer's start.
        self._offset = (lp["text_offset"][-1] + len(lp["tokens"][-1] or "")) if lp and lp.get("tokens") else 0

    def resumed(self) -> None:
        """Another engine continues from here: its logprobs' text offsets count from
        its own output's start, which is the text so far."""
        self._offset = len(self.gen)

    def head_text(self) -> str:
        """What the first streamed event may show: the first token's text, less what a
        stop string could still claim."""
        self.sent = max(0, len(self.gen) - self.hold)
        return self.gen[:self.sent]

    def add(self, chunk: dict) -> Piece | None:
        choices = chunk.get("choices") or []
        if not choices or self.finish_reason is not None:
            return None
        c = choices[0]
        ids = [int(t) for t in (c.get("token_ids") or [])]
        finish, stop_reason = c.get("finish_reason"), c.get("stop_reason")
        # vLLM does not detokenize the token that stopped a request (EOS or a stop token
        # id) unless stop strings are to be included in the output.
        skipped = ids[-1] if ids and finish == "stop" and not self.include_stop else None
        new = ids[:-1] if skipped is not None else ids
        before = 1 + len(self.token_ids)  # output tokens so far, the head's included
        offsets = [len(self.gen)]
        for t in new:
            self.gen += self.out.step(t)
            offsets.append(len(self.gen))
        if skipped is not None:
            offsets.append(len(self.gen))
        kept = ids
        if self.stop and before + len(ids) > self.ask.min_tokens:
            check_from = offsets[max(self.ask.min_tokens - before, 0)]
            hit = _find_stop(self.gen, len(self.gen) - check_from, self.stop, self.include_stop)
            if hit is not None:
                stop_str, cut = hit
                end = len(self.gen) if cut == -1 else cut
                if not self.include_stop:
                    end += len(stop_str)
                kept = ids[:bisect.bisect_left(offsets, end, lo=1)]
                if cut != -1:
                    self.gen = self.gen[:cut]
                finish, stop_reason, self.stopped_here = "stop", stop_str, True
        self.token_ids += kept
        logprobs = c.get("logprobs")
        if logprobs:
            logprobs = dict(logprobs, text_offset=[o + self._offset for o in logprobs.get("text_offset") or []])
            if self.logprobs is None:
                self.logprobs = {k: [] for k in _LOGPROB_KEYS}
            for k in self.logprobs:
                self.logprobs[k] += logprobs.get(k) or []
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, stop_reason
        upto = len(self.gen) - (0 if finish is not None else self.hold)
        text = self.gen[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return Piece(text, kept, logprobs, finish, stop_reason if finish is not None else None)

    @property
    def completion_tokens(self) -> int:
        return 1 + len(self.token_ids)

    def usage(self) -> dict:
        """As vLLM streams it: the counts, and the prompt's details where the engine gives them."""
        prompt = self.head.usage.get("prompt_tokens", len(self.head.prompt_ids))
        out = {"prompt_tokens": prompt, "total_tokens": prompt + self.completion_tokens,
               "completion_tokens": self.completion_tokens}
        if self.head.usage.get("prompt_tokens_details") is not None:
            out["prompt_tokens_details"] = self.head.usage["prompt_tokens_details"]
        return out


def _joined_logprobs(head: Head, tail: Tail | None) -> dict | None:
    if head.logprobs is None:
        return None
    out = {k: list(head.logprobs.get(k) or []) for k in _LOGPROB_KEYS}
    if tail is not None and tail.logprobs:
        for k in out:
            out[k] += tail.logprobs[k]
    return out


def final_answer(ask: Ask, head: Head, tail: Tail | None) -> dict:
    """The whole answer, non-streamed (``tail`` None: the head was all of it)."""
    out = copy.deepcopy(head.raw)
    out.pop("kv_transfer_params", None)
    choice = out["choices"][0]
    token_ids = [head.token_id] + (tail.token_ids if tail else [])
    text = tail.gen if tail else head.text
    if ask.endpoint == "completions":
        choice["text"] = text
        choice["logprobs"] = _joined_logprobs(head, tail)
        if not ask.return_token_ids:
            choice["prompt_token_ids"] = None
    else:
        choice["message"]["content"] = text
        if not ask.return_token_ids:
            out["prompt_token_ids"] = None
    choice["token_ids"] = token_ids if ask.return_token_ids else None
    if tail is not None:
        choice["finish_reason"], choice["stop_reason"] = tail.finish_reason, tail.stop_reason
        out["usage"] = dict(out.get("usage") or {}, **{k: v for k, v in tail.usage().items()
                                                        if k != "prompt_tokens_details"})
    return out


class Chunks:
    """Server-sent events in the client's endpoint's shape, as vLLM streams them."""

    def __init__(self, ask: Ask, head: Head) -> None:
        self.ask = ask
        raw = head.raw
        self._base = {"id": raw.get("id"), "object": "text_completion" if ask.endpoint == "completions"
                      else "chat.completion.chunk", "created": raw.get("created"), "model": raw.get("model")}
        self.head = head

    def _event(self, obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def _choice(self, text: str, token_ids: list[int], logprobs, finish, stop_reason, first: bool = False) -> dict:
        if self.ask.endpoint == "completions":
            c = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
            if self.ask.return_token_ids:
                c["prompt_token_ids"] = self.head.prompt_ids if first else None
        else:
            c = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                c["stop_reason"] = stop_reason
        if self.ask.return_token_ids:
            c["token_ids"] = token_ids
        return c

    def chunk(self, choice: dict, usage: dict | None = None) -> bytes:
        obj = dict(self._base, choices=[choice])
        if usage is not None and self.ask.continuous_usage:
            obj["usage"] = usage
        return self._event(obj)

    def head_events(self, usage: dict, text: str) -> bytes:
        h = self.head
        out = b""
        if self.ask.endpoint == "chat":
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            obj = dict(self._base, choices=[role])
            if self.ask.return_token_ids:
                obj["prompt_token_ids"] = h.prompt_ids
            out += self._event(obj)
        finish = h.finish_reason if h.finished or self.ask.max_tokens == 1 else None
        out += self.chunk(self._choice(text, [h.token_id], h.logprobs, finish, h.stop_reason if finish else None,
                                       first=True), usage)
        return out

    def piece(self, p: Piece, usage: dict) -> bytes:
        return self.chunk(self._choice(p.text, p.token_ids, p.logprobs, p.finish_reason, p.stop_reason), usage)

    def usage_event(self, usage: dict) -> bytes:
        return self._event(dict(self._base, choices=[], usage=usage)) if self.ask.include_usage else b""

    def error_event(self, message: str, status: int) -> bytes:
        return self._event(error_body(message, status))

    DONE = b"data: [DONE]\n\n"


def _find_stop(text: str, new_chars: int, stop: list[str], include: bool) -> tuple[str, int] | None:
    """vLLM's stop-string rule: among the stop strings found in the last ``new_chars``
    characters (plus what a string could straddle), the one that ends first, then the
    first in the list; returns it and where the text is cut (-1: not at all)."""
    if not new_chars:
        return None
    best, best_at, best_end = None, 0, None
    for s in stop:
        at = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if at != -1 and (best_end is None or at + len(s) < best_end):
            best, best_at, best_end = s, at, at + len(s)
    if best is None:
        return None
    if include:
        return best, (-1 if best_end >= len(text) else best_end)
    return best, best_at

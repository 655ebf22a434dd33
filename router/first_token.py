"""The first-token path's answers: the prefill engine's first token (the head) and
decode's continuation (the tail) made into the one answer a single engine would give.

    prefill: the client's request, max_tokens=1, return_token_ids ──▶ Head
             (its prompt ids, first token, text, logprobs, id/created/model)
    decode : /v1/completions, prompt = head.prompt_ids + [head.token_id],
             max_tokens - 1, streamed, return_token_ids ──▶ Tail, chunk by chunk
    client : head.text first, then the tail's text, made here from decode's token ids
             (router/tokens.py says why), usage and logprobs joined

Completions and chats share it: decode always runs a completion (its prompt is token
ids); the client's endpoint decides the shape of what goes back. The response's id,
``created`` and ``model`` are the prefill engine's.
"""

from __future__ import annotations

import copy
import dataclasses
import json

from router.ask import Ask

# Fields of the client's request that decode does not get as they are: the prompt is
# the prefill engine's tokens plus its first token; the rest is set by decode_body.
_NOT_FOR_DECODE = frozenset((
    "prompt", "messages", "echo", "n", "best_of", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "min_tokens", "logprobs", "top_logprobs", "return_token_ids", "add_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "suffix", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort",
    "include_reasoning", "mm_processor_kwargs", "media_io_kwargs", "kv_transfer_params", "request_id",
    "response_format", "functions", "function_call"))


class BadHead(ValueError):
    """The prefill engine's answer lacks what the first-token path needs (token ids)."""


@dataclasses.dataclass
class Head:
    raw: dict                     # the prefill engine's answer
    prompt_ids: list[int]
    token_id: int
    text: str                     # completions: the choice's text (with the echoed prompt); chat: the content
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


@dataclasses.dataclass
class Piece:
    """What one decode chunk adds to the answer."""
    text: str
    token_ids: list[int]
    logprobs: dict | None
    finish_reason: str | None
    stop_reason: object


class Tail:
    """Decode's continuation, joined onto the head as it streams in."""

    def __init__(self, ask: Ask, head: Head, output_text) -> None:
        self.ask = ask
        self.head = head
        self.out = output_text
        self.out.step(head.token_id)  # the head's text is prefill's own; this only advances the stream
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.logprobs: dict | None = None
        lp = head.logprobs
        # Completion logprobs' text offsets count the tokens' strings from the answer's start.
        self._offset = (lp["text_offset"][-1] + len(lp["tokens"][-1] or "")) if lp and lp.get("tokens") else 0
        self.decode_usage: dict = {}

    def add(self, chunk: dict) -> Piece | None:
        if chunk.get("usage"):
            self.decode_usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            return None
        c = choices[0]
        ids = [int(t) for t in (c.get("token_ids") or [])]
        finish = c.get("finish_reason")
        texts = []
        for i, t in enumerate(ids):
            # vLLM does not detokenize the token that stopped a request (EOS or a stop token id)
            # unless the stop string is to be included.
            last_stop = finish == "stop" and i == len(ids) - 1 and not self.ask.body.get("include_stop_str_in_output")
            texts.append("" if last_stop else self.out.step(t))
        text = "".join(texts)
        self.text += text
        self.token_ids += ids
        logprobs = c.get("logprobs")
        if logprobs:
            logprobs = dict(logprobs, text_offset=[o + self._offset for o in logprobs.get("text_offset") or []])
            if self.logprobs is None:
                self.logprobs = {k: [] for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
            for k in self.logprobs:
                self.logprobs[k] += logprobs.get(k) or []
        if finish is not None:
            self.finish_reason, self.stop_reason = finish, c.get("stop_reason")
        return Piece(text, ids, logprobs, finish, c.get("stop_reason") if finish is not None else None)

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
    out = {k: list(head.logprobs.get(k) or []) for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}
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
    text = head.text + (tail.text if tail else "")
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

    def head_events(self, usage: dict) -> bytes:
        h = self.head
        out = b""
        if self.ask.endpoint == "chat":
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            obj = dict(self._base, choices=[role])
            if self.ask.return_token_ids:
                obj["prompt_token_ids"] = h.prompt_ids
            out += self._event(obj)
        finish = h.finish_reason if h.finished or self.ask.max_tokens == 1 else None
        out += self.chunk(self._choice(h.text, [h.token_id], h.logprobs, finish, h.stop_reason if finish else None,
                                       first=True), usage)
        return out

    def piece(self, p: Piece, usage: dict) -> bytes:
        return self.chunk(self._choice(p.text, p.token_ids, p.logprobs, p.finish_reason, p.stop_reason), usage)

    def usage_event(self, usage: dict) -> bytes:
        return self._event(dict(self._base, choices=[], usage=usage)) if self.ask.include_usage else b""

    def error_event(self, message: str, status: int) -> bytes:
        return self._event({"error": {"message": message, "type": "BadGatewayError", "param": None, "code": status}})

    DONE = b"data: [DONE]\n\n"

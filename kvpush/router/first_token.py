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
from kvpush.router.relay import Relay, event, js
from kvpush.router.streams import DecodeStreamError

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


_PROMPT_IDS = b'"prompt_token_ids":['


def _prompt_ids_at(payload: bytes) -> tuple[int, int] | None:
    """Where an answer's or event's prompt ids are: the start of their key and their
    closing bracket (the key cannot be inside a string: a JSON string's quotes are
    escaped); None where they are not a list."""
    at = payload.find(_PROMPT_IDS)
    end = payload.find(b"]", at) if at >= 0 else -1
    return (at, end) if end >= 0 else None


def _without_prompt_ids(payload: bytes) -> bytes:
    """A decode event less the prompt's ids, which its first event repeats (all of them:
    it is asked for token ids) and nothing here reads (the client's are the prefill
    engine's): not parsed, 0.3 ms of the router's CPU a request at 6,800 tokens."""
    span = _prompt_ids_at(payload)
    return payload if span is None else payload[:span[0]] + b'"prompt_token_ids":null' + payload[span[1] + 1:]


class IdsJson(list):
    """Token ids that keep the JSON text an engine wrote them in (``json``, "" if none):
    the bodies sent to engines write that text (``body_json``), not thousands of ids
    encoded again (0.4 ms of the router's CPU for decode's prompt at 6,800 tokens)."""
    json: str = ""


def prompt_json(payload: bytes, prompt_ids: list) -> str:
    """The prompt ids' JSON text in the prefill engine's answer ``payload`` (parsed, with
    ``prompt_ids`` its ids): what is between the brackets, or "" where it is not plainly
    there (digits and commas, as many ids as were parsed)."""
    span = _prompt_ids_at(payload)
    if span is None:
        return ""
    raw = payload[span[0] + len(_PROMPT_IDS):span[1]]
    if raw.count(b",") + 1 != len(prompt_ids) or raw.translate(None, b"0123456789, "):
        return ""
    return raw.decode()


def body_json(body: dict) -> str:
    """A body for an engine as JSON (the router's HTTP session's ``json_serialize``):
    ``json.dumps``, a prompt that is ``IdsJson`` written from its kept text."""
    prompt = body.get("prompt")
    if type(prompt) is not IdsJson or not prompt.json:
        return json.dumps(body)
    rest = json.dumps({k: v for k, v in body.items() if k != "prompt"})
    return '{"prompt": [' + prompt.json + ("]}" if rest == "{}" else "], " + rest[1:])


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
    prompt_json: str = ""         # the prompt ids as the answer wrote them (``prompt_json``)

    @property
    def finished(self) -> bool:
        """Prefill's token ended the request (EOS, a stop token): decode has nothing to do."""
        return self.finish_reason == "stop"


def parse_head(endpoint: str, answer: dict, payload: bytes = b"") -> Head:
    """The prefill engine's answer (``payload``, parsed: ``answer``) as the head."""
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
                    usage=answer.get("usage") or {}, prompt_json=prompt_json(payload, prompt_ids))
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


def decode_body(ask: Ask, head: Head, model: str, kv_transfer_params: dict | None, stop: bool = False) -> dict:
    """Decode's continuation (``kv_transfer_params`` None: it computes the prompt itself).
    ``stop``: decode is given the stop strings (its text is to be passed on: ``Tail``)."""
    out = {k: v for k, v in ask.body.items() if k not in _NOT_FOR_DECODE}
    if stop and ask.body.get("stop"):
        out["stop"] = ask.body["stop"]
    prompt = IdsJson(head.prompt_ids + [head.token_id])
    if head.prompt_json:
        prompt.json = f"{head.prompt_json},{head.token_id}"
    out.update(model=model, prompt=prompt, stream=True, stream_options={"include_usage": True},
               return_token_ids=True)
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
    stopped (greedy decoding gives the same tokens). None: nothing is left to generate.
    The router makes the text again from here (the other engine's prompt may end inside
    a character, where its first text is not to be trusted), so that engine is not given
    the stop strings: they are matched here."""
    tail.rejoin()
    done = len(tail.token_ids)
    out = {k: v for k, v in d_body.items() if k not in ("kv_transfer_params", "stop")}
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
    text as vLLM's detokenizer keeps it (``vllm/v1/engine/detokenizer.py``).

    At the boundary the router makes the text itself, from decode's token ids: only
    here are the prefill engine's token and decode's tokens one text. Stop strings are
    matched here on the whole generated text (one may begin in the first token's text)
    and, while streaming, the last ``max(len(stop)) - 1`` characters are held back, as
    vLLM holds them.

    Past the boundary (``passing``), decode's events are passed on (``Relay``): its
    text is then the aggregated engine's, character for character. It is settled when
    - decode's detokenizer agrees with the aggregated engine's: always, unless its prompt
      ends inside a UTF-8 character (``partial_head``: its first text then starts with
      the whole prompt's, tokens.py); then after its first text;
    - and, with stop strings (decode is given them, unless ``partial_head``), once
      decode's own text is at least ``reach`` long: from then on no stop string can
      reach back into the first token's text, and decode holds back what the
      aggregated engine holds.
    """

    def __init__(self, ask: Ask, head: Head, output_text, relay: Relay | None = None,
                 partial_head: bool = False) -> None:
        self.ask = ask
        self.head = head
        self.out = output_text
        self.gen = self.out.step(head.token_id)  # all generated text so far: prefill's token's, first
        self._head_len = len(self.gen)
        stop = ask.body.get("stop") or []
        self.stop = [stop] if isinstance(stop, str) else list(stop)
        self.include_stop = bool(ask.body.get("include_stop_str_in_output"))
        # How far back of new text a stop string may begin; that much is held back from
        # the stream unless the stop string is to be included.
        self.reach = max(len(x) for x in self.stop) - 1 if self.stop else 0
        self.hold = 0 if self.include_stop else self.reach
        self.sent = 0                           # characters of gen already streamed
        self.token_ids: list[int] = []          # decode's, after the head's (those passed: in relay)
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.stopped_here = False               # a stop string ended it: decode is to be closed
        self.logprobs: dict | None = None
        self.relay = relay
        self.passing = False
        self._await_text = partial_head         # decode's first text is not to be trusted
        self.passed_events = 0                  # decode's events passed on as bytes
        self.made_events = 0                    # ... and parsed and made again here
        lp = head.logprobs
        # Completion logprobs' text offsets count the tokens' strings from the answer's start.
        self._offset = (lp["text_offset"][-1] + len(lp["tokens"][-1] or "")) if lp and lp.get("tokens") else 0

    def resumed(self) -> None:
        """Another engine continues from here: its logprobs' text offsets count from
        its own output's start, which is the text so far."""
        self._offset = len(self.gen)

    def rejoin(self) -> None:
        """Stop passing: the text passed is made here again (the router's detokenizer
        stepped through its tokens), so that the router goes on from where it is."""
        relay, self.relay, self.passing = self.relay, None, False
        if relay is None:
            return
        relay.take_text()
        for t in (ids := relay.take_ids()):
            self.gen += self.out.step(t)
        self.token_ids += ids
        self.sent = max(self.sent, len(self.gen) - self.hold)

    def settle(self) -> None:
        """The text and token ids passed, joined onto ``gen`` and ``token_ids`` (the whole
        answer). What ``gen`` held back at the switch, decode's text has sent since."""
        if self.passing:
            self.gen = self.gen[:self.sent] + self.relay.take_text()
            self.token_ids += self.relay.take_ids()

    def head_text(self) -> str:
        """What the first streamed event may show: the first token's text, less what a
        stop string could still claim."""
        self.sent = max(0, len(self.gen) - self.hold)
        return self.gen[:self.sent]

    def take(self, payload: bytes) -> "bytes | Piece | None":
        """One of decode's events (the JSON after ``data:``): the client's event as
        bytes when passed on, else what it adds (None: nothing)."""
        relay = self.relay
        if self.passing:
            parts = relay.steady(payload)
            if parts is not None:
                relay.keep(*parts)
                self.passed_events += 1
                return relay.client_event(*parts)
        try:
            chunk = json.loads(_without_prompt_ids(payload))
        except ValueError as exc:
            raise DecodeStreamError(f"decode sent what is not JSON: {exc}") from None
        if not isinstance(chunk, dict):
            raise DecodeStreamError("decode sent an event that is not an object")
        if "error" in chunk:
            raise DecodeStreamError(str(chunk["error"]))
        if relay is not None:
            relay.learn(payload)
        return self.add(chunk)

    def add(self, chunk: dict) -> Piece | None:
        choices = chunk.get("choices") or []
        if not choices or self.finish_reason is not None:
            return None
        self.made_events += 1
        c = choices[0]
        ids = [int(t) for t in (c.get("token_ids") or [])]
        finish, stop_reason = c.get("finish_reason"), c.get("stop_reason")
        if self.passing:  # decode's text, as it is
            text = c.get("text") or ""
            self.relay.keep(js(text), ",".join(map(str, ids)).encode())
            if finish is not None:
                self.finish_reason, self.stop_reason = finish, stop_reason
            return Piece(text, ids, None, finish, stop_reason if finish is not None else None)
        # vLLM does not detokenize the token that stopped a request (EOS or a stop token
        # id) unless stop strings are to be included in the output. (A stop string decode
        # matched is named by its stop_reason, a string; its token was detokenized.)
        skipped = ids[-1] if ids and finish == "stop" and not self.include_stop \
            and not isinstance(stop_reason, str) else None
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
        if self.relay is not None and finish is None:
            if c.get("text"):
                self._await_text = False
            self.passing = not self._await_text and len(self.gen) - self._head_len >= self.reach
        return Piece(text, kept, logprobs, finish, stop_reason if finish is not None else None)

    @property
    def received(self) -> bool:
        """Decode sent a token already."""
        return bool(self.token_ids) or (self.relay is not None and any(self.relay.ids))

    @property
    def completion_tokens(self) -> int:
        return 1 + len(self.token_ids) + (self.relay.count() if self.relay is not None else 0)

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
    if tail is not None:
        tail.settle()
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

    _event = staticmethod(event)

    def _choice(self, text: str, token_ids: list[int], logprobs, finish, stop_reason, first: bool = False) -> dict:
        """In vLLM's field order, with the fields it sets (``Relay`` writes the same)."""
        ids = token_ids if self.ask.return_token_ids else None
        if self.ask.endpoint == "completions":
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason,
                    "prompt_token_ids": self.head.prompt_ids if first and self.ask.return_token_ids else None,
                    "token_ids": ids}
        c = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            c["stop_reason"] = stop_reason
        c["token_ids"] = ids
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
            obj = dict(self._base, choices=[role], prompt_token_ids=h.prompt_ids if self.ask.return_token_ids else None,
                       prompt_text=None)
            out += self._event(obj)
        finish = h.finish_reason if h.finished or self.ask.max_tokens == 1 else None
        out += self.chunk(self._choice(text, [h.token_id], h.logprobs, finish, h.stop_reason if finish else None,
                                       first=True), usage)
        return out

    def piece(self, p: Piece, usage: dict) -> bytes:
        return self.chunk(self._choice(p.text, p.token_ids, p.logprobs, p.finish_reason, p.stop_reason), usage)

    def usage_event(self, usage: dict) -> bytes:
        if not self.ask.include_usage:
            return b""
        # As vLLM writes the last event: without null fields (a whole answer's usage has them).
        return self._event(dict(self._base, choices=[], usage={k: v for k, v in usage.items() if v is not None}))


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

"""A client's request, validated before anything is reserved, and the path it takes.

Everything that decides what a request costs the decode pool is checked here, with
the engines' own limits and messages (vLLM's OpenAI server): the prompt's form and
length against the model's context, ``max_tokens``, ``n``, the numeric sampling
fields. A request the engines would refuse is refused here, before a Reserve: a
reservation for a request that decode then rejects holds its blocks until the
deadline, so this is what keeps clients from pinning the pool. Anything not checked
here is checked by the prefill engine, which sees every field first; the router
releases the reservation on every answer that is not a success.

The paths (``Ask.path``):

``first_token``  the prefill engine samples the first token and the router streams
                 it at once; decode continues from the prompt plus that token with
                 the prompt's KV pushed into its reservation (computes one token);
``push``         prefill pushes the KV, decode computes every output token (the
                 request uses something whose state would not carry over from the
                 prefill engine's token: output penalties, structured output, chat
                 logprobs, echo, a seeded draw, ...);
``prefill_only`` ``max_tokens`` of 1: the prefill engine's answer is the answer,
                 nothing is reserved;
``decode_only``  what one reservation cannot serve (``n > 1``, a list of prompts,
                 beam search, prompt embeddings): decode serves it alone, at once.
``Ask.why`` says why a request is not on ``first_token`` (counted by reason).
"""

from __future__ import annotations

import dataclasses
import math

from kvpush.router.errors import ApiError

FIRST_TOKEN, PUSH, PREFILL_ONLY, DECODE_ONLY = "first_token", "push", "prefill_only", "decode_only"
COMPLETION_MAX_TOKENS_DEFAULT = 16  # vLLM's (and OpenAI's) default for /v1/completions


@dataclasses.dataclass(frozen=True)
class Limits:
    max_model_len: int | None      # None: unknown (the engines check it)
    vocab_size: int | None = None
    max_logprobs: int = 20         # vLLM's default --max-logprobs


@dataclasses.dataclass(frozen=True)
class Ask:
    endpoint: str                  # "completions" or "chat"
    body: dict                     # as the client sent it
    num_tokens: int                # prompt tokens as the router counts them (the reservation's size)
    max_tokens: int | None         # output tokens after vLLM's clamp to the context (None: context unknown)
    min_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None           # completions' top-k logprobs (None: not asked)
    return_token_ids: bool
    path: str
    why: str = ""
    prompt_ids: tuple[int, ...] = ()  # one prompt's token ids as the router made them (KV-aware routing)
    cache_salt: str | None = None     # the engines salt its first block's hash with it (KV-aware routing)


def _int(body: dict, name: str, default=None):
    """pydantic's lax int, as vLLM parses it: ints, bools, integral floats and numeric strings."""
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ApiError(f"{name} must be an integer, got {value!r}", param=name)


def _num(body: dict, name: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ApiError(f"{name} must be a number, got {value!r}", param=name)
    try:
        out = float(value)
    except ValueError:
        raise ApiError(f"{name} must be a number, got {value!r}", param=name) from None
    if not math.isfinite(out):
        raise ApiError(f"{name} must be finite, got {value!r}", param=name)
    return out


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _range(name: str, value, lo=None, hi=None, lo_open=False, what="") -> None:
    if value is None:
        return
    if lo is not None and (value < lo or (lo_open and value == lo)) or hi is not None and value > hi:
        raise ApiError(f"{name} must be {what}, got {value}.", param=name)


def check_prompt(prompt, limits: Limits) -> list:
    """The prompts a completion request carries (more than one: a batch), each a string
    or a list of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt must be a non-empty string, a list of strings or a list of token ids",
                           param="prompt")
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("prompt must be a non-empty string, a list of strings or a list of token ids, "
                       f"got {type(prompt).__name__}", param="prompt")
    if _all_ids(prompt):
        _check_ids(prompt, limits)
        return [prompt]
    if all(isinstance(p, str) and p for p in prompt):
        return prompt
    if all(isinstance(p, list) and p and _all_ids(p) for p in prompt):
        for p in prompt:
            _check_ids(p, limits)
        return prompt
    raise ApiError("prompt must be a non-empty string, a list of non-empty strings, a list of token ids or a "
                   "list of lists of token ids", param="prompt")


def _all_ids(items: list) -> bool:
    """Whether every item is an int (JSON's integers; true and false are bools, not ints
    here). The types gathered in C: a third of the time of an isinstance per item."""
    return set(map(type, items)) == {int}


def _check_ids(ids: list[int], limits: Limits) -> None:
    vocab = limits.vocab_size
    for t in ids:
        if t < 0 or (vocab is not None and t >= vocab):
            raise ApiError(f"Token id {t} is out of vocabulary", param="prompt")


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of messages", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string 'role'", param="messages")


def _check_sampling(body: dict, endpoint: str, limits: Limits) -> None:
    _range("temperature", _num(body, "temperature"), lo=0, what="non-negative")
    _range("top_p", _num(body, "top_p"), lo=0, hi=1, lo_open=True, what="in (0, 1]")
    _range("min_p", _num(body, "min_p"), lo=0, hi=1, what="in [0, 1]")
    for name in ("presence_penalty", "frequency_penalty"):
        _range(name, _num(body, name), lo=-2, hi=2, what="in [-2, 2]")
    _range("repetition_penalty", _num(body, "repetition_penalty"), lo=0, lo_open=True, what="greater than zero")
    top_k = _int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise ApiError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {top_k}.", param="top_k")
    _int(body, "seed")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError("stop must be a string or a list of strings", param="stop")
    if endpoint == "completions":
        _range("logprobs", _int(body, "logprobs"), lo=0, hi=limits.max_logprobs,
               what=f"between 0 and {limits.max_logprobs}")
        _bool(body, "echo")
    else:
        _bool(body, "logprobs")
        _range("top_logprobs", _int(body, "top_logprobs"), lo=0, hi=limits.max_logprobs,
               what=f"between 0 and {limits.max_logprobs}")


def _max_tokens(body: dict, endpoint: str, num_tokens: int, limits: Limits) -> int | None:
    """vLLM's effective output budget: the asked number (or the endpoint's default),
    clamped to what the context leaves after the prompt."""
    name = "max_tokens"
    asked = _int(body, "max_tokens")
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        name, asked = "max_completion_tokens", _int(body, "max_completion_tokens")
    if asked is None and endpoint == "completions":
        asked = COMPLETION_MAX_TOKENS_DEFAULT
    if asked is not None and asked < 1:
        raise ApiError(f"{name} must be at least 1, got {asked}.", param=name)
    ctx = limits.max_model_len
    if ctx is None:
        return asked
    if asked is not None and asked > ctx:
        raise ApiError(f"{name}={asked} cannot be greater than max_model_len={ctx}. "
                       "Please request fewer output tokens.", param=name)
    if num_tokens > ctx:
        raise ApiError(f"This model's maximum context length is {ctx} tokens. However, your prompt contains "
                       f"{num_tokens} input tokens, which exceeds this limit even without any output tokens. "
                       "Please reduce the length of the input prompt.", param="input_tokens")
    left = ctx - num_tokens
    out = left if asked is None else min(asked, left)
    if out < 1:
        raise ApiError(f"{name} must be at least 1, got {out}. (the prompt of {num_tokens} tokens fills the "
                       f"model's context of {ctx})", param=name)
    return out


# Fields whose effect depends on the output so far: the prefill engine's first token
# would be in decode's prompt, not its output, and they would see another history.
_HISTORY = ("bad_words", "repetition_detection", "thinking_token_budget", "watermarking", "vllm_xargs",
            "logits_processors")
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _why_not_first_token(body: dict, endpoint: str, fast_detokenizer: bool) -> str:
    if any(_num(body, k) for k in ("presence_penalty", "frequency_penalty")):
        return "output_penalties"
    if any(body.get(k) for k in _HISTORY):
        return "history_dependent"
    rf = body.get("response_format")
    if any(body.get(k) is not None for k in _STRUCTURED) or (isinstance(rf, dict) and rf.get("type") != "text"):
        return "structured_output"
    if body.get("tools"):
        return "tools"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if endpoint == "chat" and body.get("logprobs"):
        return "chat_logprobs"
    if body.get("suffix"):
        return "suffix"
    if endpoint == "completions" and body.get("echo"):
        return "echo"  # vLLM echoes no prompt text when token ids are asked for, as the first-token path does
    if body.get("spaces_between_special_tokens") is False or body.get("skip_special_tokens") is False:
        return "special_tokens"
    if body.get("seed") is not None and (body.get("temperature") is None or float(body["temperature"]) > 0):
        # A seeded draw: decode's generator would begin again at the second token, so the
        # answer would repeat, but not be the one engine's. On the push path decode draws
        # every token from the seed, as the aggregated engine does.
        return "seeded_sampling"
    if not fast_detokenizer:
        return "slow_tokenizer"
    return ""


def parse(endpoint: str, body: dict, counter, limits: Limits) -> Ask:
    """Validate ``body`` (raises ``ApiError``) and choose its path."""
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise ApiError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if not isinstance(opts, dict):
            raise ApiError("stream_options must be an object", param="stream_options")
    opts = opts or {}
    n = _int(body, "n", 1)
    if n is None or n < 1:
        raise ApiError(f"n must be at least 1, got {n}.", param="n")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of < n:
        raise ApiError(f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.",
                       param="best_of")
    _check_sampling(body, endpoint, limits)
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        # (vLLM's own words; its further rules on the salt are left to the engines)
        raise ApiError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")

    prompts: list = []
    if endpoint == "chat":
        _check_messages(body.get("messages"))
    elif body.get("prompt_embeds") is None:
        prompts = check_prompt(body.get("prompt"), limits)
    batch = len(prompts) or 1
    prompt_ids: tuple[int, ...] = ()
    try:
        if endpoint == "chat":
            prompt_ids = tuple(counter.chat_ids(body["messages"]))
            num_tokens = len(prompt_ids)
        else:  # the longest prompt of a batch (prompt embeddings: unknown here)
            each = [counter.completion_ids(p) for p in prompts]
            num_tokens = max((len(ids) for ids in each), default=1)
            prompt_ids = tuple(each[0]) if len(each) == 1 else ()
    except Exception as exc:
        raise ApiError(f"cannot tokenize the prompt: {type(exc).__name__}: {exc}",
                       param="messages" if endpoint == "chat" else "prompt") from None
    max_tokens = _max_tokens(body, endpoint, num_tokens, limits)
    min_tokens = _int(body, "min_tokens", 0) or 0
    if min_tokens < 0:
        raise ApiError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.", param="min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise ApiError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                       param="min_tokens")

    if batch > 1:
        path, why = DECODE_ONLY, "prompt_list"
    elif n > 1 or (best_of or 1) > 1:
        path, why = DECODE_ONLY, "n"
    elif _bool(body, "use_beam_search"):
        path, why = DECODE_ONLY, "beam_search"
    elif body.get("prompt_embeds") is not None:
        path, why = DECODE_ONLY, "prompt_embeds"
    elif max_tokens == 1:
        path, why = PREFILL_ONLY, ""
    else:
        why = _why_not_first_token(body, endpoint, getattr(counter, "fast", False))
        path = PUSH if why else FIRST_TOKEN
    logprobs = _int(body, "logprobs") if endpoint == "completions" else None
    return Ask(endpoint=endpoint, body=body, num_tokens=num_tokens, max_tokens=max_tokens, min_tokens=min_tokens,
               stream=stream, include_usage=_bool(opts, "include_usage"),
               continuous_usage=_bool(opts, "continuous_usage_stats"), logprobs=logprobs,
               return_token_ids=_bool(body, "return_token_ids"), path=path, why=why, prompt_ids=prompt_ids,
               cache_salt=cache_salt)

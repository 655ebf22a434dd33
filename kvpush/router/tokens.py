"""The model's tokenizer in the router: counting prompt tokens as the engines will
(to reserve enough blocks and check the context before reserving), and turning
output token ids into text exactly as vLLM does.

The ids themselves also name the prompt's blocks for KV-aware routing
(``kvpush/contract/block_hash.py``): a tokenization that differs from the engine's
only misses an overlap. Completions add special tokens like vLLM's completion endpoint; chats go through the
model's chat template with the generation prompt, like vLLM's chat endpoint. A count
that is off only costs a recompute on decode (the connectors refuse a reservation
that is too small), never a wrong answer: the prompt decode continues from is the
prefill engine's own tokenization, not this one.

Why the router makes the output text itself on the first-token path: vLLM's fast
detokenizer primes a ``tokenizers`` ``DecodeStream`` with the prompt ids. Decode's
prompt ends with the prefill engine's first token, and when that token ends inside a
UTF-8 character (a byte-level BPE emits multi-byte characters as several tokens) the
primed stream returns the *whole prompt's text* with the next token. An aggregated
engine never primes with a partial character (its first token is output, not
prompt). So the router steps one ``DecodeStream`` primed with the real prompt through
every output token, as the aggregated engine would, and uses decode's ids, not its
text.
"""

from __future__ import annotations

from typing import Protocol


class TokenCounter(Protocol):
    fast: bool                      # output text can be made here (OutputText)
    vocab_size: int | None

    def completion_ids(self, prompt) -> list[int]: ...
    def chat_ids(self, messages: list[dict]) -> list[int]: ...
    def ends_partial(self, prompt_ids: list[int], token_id: int, skip_special_tokens: bool = True) -> bool: ...


class OutputText:
    """One request's output text, token by token, as vLLM's FastIncrementalDetokenizer
    makes it (a DecodeStream primed with the prompt ids, one step per output token)."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream
        self._tok = tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tok, token_id) or ""
        except (OverflowError, TypeError):
            return ""


class HFTokenCounter:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        backend = getattr(self._tok, "backend_tokenizer", None)
        self._rust = backend if getattr(self._tok, "is_fast", False) else None
        self.fast = self._rust is not None
        self.vocab_size = len(self._tok)

    def completion_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            return prompt  # already token ids
        return list(self._tok(prompt)["input_ids"])

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def output_text(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> OutputText:
        return OutputText(self._rust, prompt_ids, skip_special_tokens)

    def ends_partial(self, prompt_ids: list[int], token_id: int, skip_special_tokens: bool = True) -> bool:
        """Whether decode's prompt (the prompt and the first token) ends inside a UTF-8
        character: its detokenizer's first text is then not the aggregated engine's. (A
        character's bytes are in the last four tokens at most; eight is a margin.)"""
        if self._rust is None:
            return True
        return self._rust.decode(list(prompt_ids[-8:]) + [token_id], skip_special_tokens).endswith("\ufffd")


class WhitespaceCounter:
    """For tests with fake engines only: one token per whitespace-separated word (its
    length as the id), one more per prompt; four per chat message and two per chat."""

    fast = False
    vocab_size = None

    def ends_partial(self, prompt_ids, token_id, skip_special_tokens=True) -> bool:
        return False

    def completion_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return [1] + [len(w) for w in str(prompt).split()]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        ids = [1, 1]
        for m in messages:
            ids += [2, 2, 2, 2] + [len(w) for w in str(m.get("content", "")).split()]
        return ids

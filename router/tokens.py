"""Counting prompt tokens exactly as the engines will, to reserve enough blocks.

The engines tokenize with the model's own tokenizer, so the router loads the same
files from the model directory: completions add special tokens like vLLM's
completion endpoint, chats go through the model's chat template with the
generation prompt, like vLLM's chat endpoint. A count that is off only costs a
recompute on decode (the connectors refuse a reservation that is too small), never
a wrong answer.
"""

from __future__ import annotations

from typing import Protocol


class TokenCounter(Protocol):
    def completion(self, prompt) -> int: ...
    def chat(self, messages: list[dict]) -> int: ...


class HFTokenCounter:
    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def completion(self, prompt) -> int:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return len(prompt)  # already token ids
        if isinstance(prompt, list):
            raise ValueError("batched prompts are not supported by the router")
        return len(self._tok(prompt)["input_ids"])

    def chat(self, messages: list[dict]) -> int:
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return len(ids)


class WhitespaceCounter:
    """For tests with fake engines only: one token per whitespace-separated word."""

    def completion(self, prompt) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        return len(str(prompt).split()) + 1

    def chat(self, messages: list[dict]) -> int:
        return sum(len(str(m.get("content", "")).split()) + 4 for m in messages) + 2

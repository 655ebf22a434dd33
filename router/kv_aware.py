"""KV-aware routing, the router's part: the prompt's block keys for the Reserve, and a
guess, before the Reserve answers, of whether a conversation's next turn will be served
by decode alone.

The router already tokenizes each prompt (``router/tokens.py``); hashing those ids the
way the decode engines hash their prefix-cache blocks (``kvpush/contract/block_hash.py``)
lets the control plane pick the decode engine that already holds the longest prefix of
the prompt, typically the one that served the conversation's previous turn. Off unless
``prefix_block_size`` is set (it must be the decode engines' block size).

The guess: a long prompt's prefill request normally leaves with its Reserve, so that the
prefill engine parses and schedules it while the control plane decides; when the answer
is decode_alone it is taken back. In multi-turn chat that is most later turns, and each
of those doomed requests costs the prefill engine a parse, a schedule and an abort (on
shared cores it also takes CPU from the decode engine computing the turn: 3.4 ms of TTFT
p50 on docs/BENCHMARKS.md's machine). A turn that extends one this router sent, by fewer
new tokens than the threshold once the most its answer could have added is counted (the
decode engine that served it computed that answer and holds it), is likely to be served
by decode alone: its prefill request waits for the Reserve's answer instead. The guess
only chooses between sending the prefill request early or after the answer; the Reserve
still decides, so a wrong guess costs that turn the overlap, never its answer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvpush.contract.block_hash import BlockHasher
from router import metrics
from router.config import RouterConfig

RECENT_TURNS = 65_536  # prompts remembered by their last full block's key (10 MB measured, full)
UNBOUNDED = 1 << 40


class RecentTurns:
    """The prompts this router sent on, each remembered by its last full block's key
    with how many tokens it and its answer may cover. Block keys are chained, so a later
    prompt holding that key at the same place starts with that whole prompt."""

    def __init__(self, capacity: int = RECENT_TURNS) -> None:
        self.capacity = capacity
        self._ends: OrderedDict[int, int] = OrderedDict()  # key -> tokens of prompt + answer (at most)

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, keys: Sequence[int], covers: int) -> None:
        """A prompt of ``keys`` sent on; with its answer it covers at most ``covers`` tokens."""
        if not keys:
            return
        self._ends[keys[-1]] = covers
        self._ends.move_to_end(keys[-1])
        while len(self._ends) > self.capacity:
            self._ends.popitem(last=False)

    def rest(self, keys: Sequence[int], num_tokens: int) -> int | None:
        """Tokens of a prompt (``keys``, ``num_tokens`` long) beyond the longest remembered
        prompt it extends and that prompt's answer; None when it extends none."""
        for i in range(len(keys) - 1, -1, -1):
            covers = self._ends.get(keys[i])
            if covers is not None:
                self._ends.move_to_end(keys[i])
                return max(0, num_tokens - covers)
        return None


class KvAware:
    def __init__(self, cfg: RouterConfig) -> None:
        self.hasher = (BlockHasher(cfg.prefix_block_size, cfg.prefix_hash, cfg.prefix_hash_seed)
                       if cfg.prefix_block_size else None)
        self.threshold = cfg.local_prefill_tokens
        self.turns = RecentTurns() if self.hasher is not None and self.threshold else None

    def keys(self, prompt_ids: Sequence[int], cache_salt: str | None = None) -> tuple[int, ...]:
        """The prompt's block keys (none when off or the prompt unknown); a salted
        request's keys are salted as its engines salt them, so they match only blocks
        computed with the same salt."""
        if self.hasher is None or not prompt_ids:
            return ()
        return tuple(self.hasher.keys(prompt_ids, cache_salt))

    def reserve_fields(self, keys: Sequence[int]) -> dict:
        """The ReserveRequest fields naming the prompt's blocks."""
        if not keys:
            return {}
        return {"block_keys": keys, "block_keys_block_size": self.hasher.block_size}

    def likely_alone(self, keys: Sequence[int], num_tokens: int) -> bool | None:
        """Whether the Reserve will likely answer decode_alone: the prompt extends one this
        router sent by fewer than the threshold's tokens beyond it and its answer. None: no
        guess (routing by keys or decode alone is off)."""
        if self.turns is None or not keys:
            return None
        rest = self.turns.rest(keys, num_tokens)
        return rest is not None and rest < self.threshold

    def sent(self, keys: Sequence[int], num_tokens: int, max_tokens: int | None) -> None:
        """Remember a prompt sent on (to be served whichever way), and the most its answer
        may add: decode computes that answer, so a next turn need not bring it."""
        if self.turns is not None:
            # (None: the context is unknown, so is the answer's bound: any extension may be its answer)
            self.turns.add(keys, num_tokens + (max_tokens if max_tokens is not None else UNBOUNDED))

    def observed(self, reservation):
        """Count a granted reservation's prompt and what its decode engine held of it."""
        if self.hasher is not None:
            metrics.PREFIX_TOKENS.labels(kind="asked").inc(reservation.num_tokens)
            metrics.PREFIX_TOKENS.labels(kind="cached").inc(reservation.cached_tokens)
        return reservation

"""KV-aware routing, the router's part: the prompt's block keys for the Reserve, and a
guess, before the Reserve answers, of whether a conversation's next turn will be served
by decode alone.

The router already tokenizes each prompt (``kvpush/router/tokens.py``); hashing those ids the
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
by decode alone: its prefill request waits for the Reserve's answer instead, and the turn
goes at once, beside the Reserve, to the decode engine that served the turn it extends
(``AloneParams``): that engine computes the rest as soon as it sees it holds the prefix,
so a guessed turn does not wait for the Reserve's round trip. The Reserve still decides:
when it answers otherwise, the router takes the request back (the engine held it, "not
yet", if it lacked the prefix; at worst it computed a rest shorter than the threshold),
so a wrong guess costs that turn the overlap, never its answer.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections import OrderedDict, deque
from typing import Sequence

from kvpush.contract.block_hash import BlockHasher
from kvpush.router import metrics
from kvpush.router.config import RouterConfig

RECENT_TURNS = 65_536  # prompts remembered by their last full block's key (14 MB measured, full)
UNBOUNDED = 1 << 40
HOLD_FLOOR_MS = 20  # a guessed turn's shortest hold: a withdrawal's way to the engine's scheduler, with room


@dataclasses.dataclass(frozen=True)
class Guess:
    alone: bool      # the Reserve will likely answer decode_alone
    rest: int        # the prompt's tokens beyond the turn it extends and that turn's answer
    engine_id: str   # the decode engine that served that turn ("" not known)


class RecentTurns:
    """The prompts this router sent on, each remembered by its last full block's key
    with how many tokens it and its answer may cover, and the decode engine that served
    it. Block keys are chained, so a later prompt holding that key at the same place
    starts with that whole prompt."""

    def __init__(self, capacity: int = RECENT_TURNS) -> None:
        self.capacity = capacity
        self._ends: OrderedDict[int, tuple[int, str]] = OrderedDict()  # key -> (prompt + answer at most, engine)

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, key: int, covers: int) -> None:
        """A prompt whose last full block's key is ``key`` sent on; with its answer it
        covers at most ``covers`` tokens."""
        self._ends[key] = (covers, "")
        self._ends.move_to_end(key)
        while len(self._ends) > self.capacity:
            self._ends.popitem(last=False)

    def served(self, key: int, engine_id: str) -> None:
        """The prompt ending in block ``key`` (added before) is served by decode engine ``engine_id``."""
        entry = self._ends.get(key)
        if entry is not None:
            self._ends[key] = (entry[0], sys.intern(engine_id))  # (one string per engine, not per turn)

    def extends(self, keys: Sequence[int], num_tokens: int) -> tuple[int, str] | None:
        """For a prompt (``keys``, ``num_tokens`` long) extending remembered ones: its tokens
        beyond the longest of them and that prompt's answer, and the engine that served it;
        None when it extends none."""
        for i in range(len(keys) - 1, -1, -1):
            entry = self._ends.get(keys[i])
            if entry is not None:
                self._ends.move_to_end(keys[i])
                return max(0, num_tokens - entry[0]), entry[1]
        return None


class GuessHold:
    """How long a decode engine holds a guessed turn it lacks the prefix of (``AloneParams``'
    ``hold_ms``). Long enough for the router to take it back when the Reserve answers
    otherwise, and no longer: when the control plane answered decode alone from a view that
    had not yet heard of an eviction, nobody takes the turn back and it waits out the whole
    hold before it is computed. So: twice the p99 of this router's recent Reserve round trips
    (a wrong guess is taken back one round trip after it left), within [floor, ceiling]; the
    ceiling (the Reserve's own timeout and a margin) until enough round trips are seen, and as
    they grow (a slow control plane answers late, so it is waited for longer)."""

    WINDOW = 256      # round trips remembered
    MIN_SEEN = 32     # before that many, the ceiling
    EVERY = 16        # round trips between two recomputations (a sort of the window)

    def __init__(self, floor_ms: int, ceiling_ms: int) -> None:
        self.floor_ms, self.ceiling_ms = floor_ms, max(floor_ms, ceiling_ms)
        self._recent: deque[float] = deque(maxlen=self.WINDOW)
        self._unsorted = 0
        self.ms = self.ceiling_ms
        metrics.GUESS_HOLD.set(self.ms / 1000)

    def observe(self, seconds: float) -> None:
        """One Reserve's round trip, whatever it answered (a timeout counts as its timeout)."""
        self._recent.append(seconds)
        self._unsorted += 1
        if len(self._recent) >= self.MIN_SEEN and self._unsorted >= self.EVERY:
            self._unsorted = 0
            ordered = sorted(self._recent)
            p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
            self.ms = int(min(self.ceiling_ms, max(self.floor_ms, round(2000 * p99))))
            metrics.GUESS_HOLD.set(self.ms / 1000)


class KvAware:
    def __init__(self, cfg: RouterConfig, hold_ceiling_ms: int) -> None:
        self.hasher = (BlockHasher(cfg.prefix_block_size, cfg.prefix_hash, cfg.prefix_hash_seed)
                       if cfg.prefix_block_size else None)
        self.threshold = cfg.local_prefill_tokens
        self.turns = RecentTurns() if self.hasher is not None and self.threshold else None
        self.hold = GuessHold(HOLD_FLOOR_MS, hold_ceiling_ms)
        self.siblings = None  # the other workers of this router (siblings.Siblings), told what this one sends

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

    def guess(self, keys: Sequence[int], num_tokens: int) -> Guess | None:
        """Whether the Reserve will likely answer decode_alone: the prompt extends one this
        router sent by fewer than the threshold's tokens beyond it and its answer. None: no
        guess (routing by keys or decode alone is off)."""
        if self.turns is None or not keys:
            return None
        found = self.turns.extends(keys, num_tokens)
        if found is None:
            return Guess(False, num_tokens, "")
        rest, engine_id = found
        return Guess(rest < self.threshold, rest, engine_id)

    def served(self, keys: Sequence[int], engine_id: str) -> None:
        """The Reserve chose ``engine_id`` for the prompt of ``keys`` (decode alone or P/D)."""
        if self.turns is not None and keys:
            self.turns.served(keys[-1], engine_id)
            if self.siblings is not None:
                self.siblings.tell("s", keys[-1], engine_id)

    def sent(self, keys: Sequence[int], num_tokens: int, max_tokens: int | None) -> None:
        """Remember a prompt sent on (to be served whichever way), and the most its answer
        may add: decode computes that answer, so a next turn need not bring it."""
        if self.turns is not None and keys:
            # (None: the context is unknown, so is the answer's bound: any extension may be its answer)
            covers = num_tokens + (max_tokens if max_tokens is not None else UNBOUNDED)
            self.turns.add(keys[-1], covers)
            if self.siblings is not None:
                self.siblings.tell("a", keys[-1], covers)

    def heard(self, fields: list[str]) -> None:
        """What a sibling worker told (``siblings.Siblings``): a turn it sent, or who served it."""
        if self.turns is None:
            return
        kind, key, value = fields
        if kind == "a":
            self.turns.add(int(key), int(value))
        elif kind == "s":
            self.turns.served(int(key), value)

    def observed(self, reservation):
        """Count a granted reservation's prompt and what its decode engine held of it."""
        if self.hasher is not None:
            metrics.PREFIX_TOKENS.labels(kind="asked").inc(reservation.num_tokens)
            metrics.PREFIX_TOKENS.labels(kind="cached").inc(reservation.cached_tokens)
        return reservation

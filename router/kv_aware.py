"""KV-aware routing, the router's part: the prompt's block keys for the Reserve.

The router already tokenizes each prompt (``router/tokens.py``); hashing those ids the
way the decode engines hash their prefix-cache blocks (``kvpush/contract/block_hash.py``)
lets the control plane pick the decode engine that already holds the longest prefix of
the prompt, typically the one that served the conversation's previous turn. Off unless
``prefix_block_size`` is set (it must be the decode engines' block size).
"""

from __future__ import annotations

from kvpush.contract.block_hash import BlockHasher
from router import metrics
from router.config import RouterConfig


class KvAware:
    def __init__(self, cfg: RouterConfig) -> None:
        self.hasher = (BlockHasher(cfg.prefix_block_size, cfg.prefix_hash, cfg.prefix_hash_seed)
                       if cfg.prefix_block_size else None)

    def reserve_fields(self, prompt_ids, cache_salt: str | None = None) -> dict:
        """The ReserveRequest fields naming the prompt's blocks (none when off or unknown);
        a salted request's keys are salted as its engines salt them, so they match only
        blocks computed with the same salt."""
        if self.hasher is None or not prompt_ids:
            return {}
        return {"block_keys": self.hasher.keys(prompt_ids, cache_salt), "block_keys_block_size": self.hasher.block_size}

    def observed(self, reservation):
        """Count a granted reservation's prompt and what its decode engine held of it."""
        if self.hasher is not None:
            metrics.PREFIX_TOKENS.labels(kind="asked").inc(reservation.num_tokens)
            metrics.PREFIX_TOKENS.labels(kind="cached").inc(reservation.cached_tokens)
        return reservation

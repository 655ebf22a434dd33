"""The model's limits the router checks requests against: its context length, from
an engine's ``/v1/models`` (or ``--max-model-len``), its vocabulary, ``--max-logprobs``."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from kvpush import log
from kvpush.router import ask as asks
from kvpush.router.config import RouterConfig
from kvpush.router.fleet import Fleet
from kvpush.router.tokens import TokenCounter

_log = log.get("router")
RETRY_S = 5.0


class ModelLimits:
    def __init__(self, cfg: RouterConfig, counter: TokenCounter, session: aiohttp.ClientSession,
                 engines: Fleet) -> None:
        self.cfg, self.counter, self.session, self.engines = cfg, counter, session, engines
        self._limits: asks.Limits | None = None
        self._asked = -1e9  # monotonic: when an engine was last asked
        self._lock = asyncio.Lock()

    async def get(self) -> asks.Limits:
        """Until an engine answers, asked again at most every RETRY_S, not by every
        request (the engines check the context themselves meanwhile)."""
        if self._limits is not None:
            return self._limits
        async with self._lock:
            if self._limits is None and time.monotonic() - self._asked >= RETRY_S:
                self._asked = time.monotonic()
                ctx = self.cfg.max_model_len or await self._engine_max_model_len()
                if ctx is not None:
                    self._limits = asks.Limits(ctx, self.counter.vocab_size, self.cfg.max_logprobs)
        return self._limits or asks.Limits(None, self.counter.vocab_size, self.cfg.max_logprobs)

    async def _engine_max_model_len(self) -> int | None:
        for url in self.engines.prefill_urls() + self.engines.decode_urls():
            try:
                async with self.session.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    for card in (await r.json()).get("data", []):
                        if card.get("id") == self.cfg.model and card.get("max_model_len"):
                            return int(card["max_model_len"])
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError) as exc:
                _log.warning("cannot read the model's context length", url=url, error=str(exc))
        return None

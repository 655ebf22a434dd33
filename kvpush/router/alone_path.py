"""Serving a request on one engine alone, no push: the fallbacks (no reservation, a failed
engine), conditional disaggregation (a Reserve answered ``decode_alone``), and a turn the
router guesses will be decode alone, sent ahead of its Reserve to the decode engine that
served the turn it extends (``kvpush.router.kv_aware``). Part of ``kvpush.router.dispatch.Dispatcher``
(its ``AlonePath`` base): it uses the dispatcher's upstream, engines, reserve and release."""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from kvpush import log
from kvpush.contract.transfer_params import AloneParams
from kvpush.router import ask as asks
from kvpush.router import metrics
from kvpush.router.errors import ApiError
from kvpush.router.upstream import Sent, nothing_sent

_log = log.get("router")


class AlonePath:
    def _alone_url(self, *failed: str) -> str | None:
        """Where a request is served whole: the least loaded decode engine not among
        ``failed``, else a prefill engine (it is a whole vLLM engine too: the local
        fallback when no decode engine is left), else None."""
        for urls in (self.engines.decode_urls(), self.engines.prefill_urls()):
            others = [u for u in urls if u not in failed]
            if others:
                return self._least_loaded(others)
        return None

    def _send_ahead(self, ask: asks.Ask, url: str) -> Sent:
        """A turn guessed to be decode alone, sent now, beside its Reserve, to ``url``: the
        decode engine that served the turn it extends. That engine computes it as soon as it
        finds it holds all but a rest under the threshold, else holds it unstarted; the
        caller keeps it only if the Reserve answers decode_alone on that engine."""
        kv = AloneParams(ask.num_tokens - self.cfg.local_prefill_tokens + 1,
                         self.kv_aware.hold.ms).as_kv_transfer_params()
        return self.up.send(url, ask.endpoint, dict(ask.body, kv_transfer_params=kv))

    async def _local_prefill(self, ask: asks.Ask, decision, request: web.Request,
                             timings: dict, sent: Sent | None = None) -> web.StreamResponse:
        """Conditional disaggregation: ``decision`` (a Reserve answered decode_alone) names the
        decode engine that lacks so little of the prompt that it computes the rest itself
        (``sent``: the request already on its way there)."""
        metrics.LOCAL_PREFILL.labels(reason="cached_prefix" if decision.cached_tokens else "short_prompt").inc()
        timings["local_decided"] = time.perf_counter()
        return await self._decode_alone(ask.endpoint, ask.body, request, "local_prefill",
                                        self.engines.decode_url(decision.engine_id), timings, sent)

    async def _decode_alone(self, endpoint: str, body: dict, request: web.Request,
                            path: str = "fallback", url: str | None = None,
                            timings: dict | None = None, sent: Sent | None = None) -> web.StreamResponse:
        """The request served by a decode engine by itself (``url``, else the least loaded;
        ``sent``: the request already sent there; ``path`` labels its TTFT)."""
        if sent is None:
            url = url or self._alone_url()
            if url is None:
                raise ApiError(f"no engine is available for model {self.cfg.model!r}", 503)
            sent = self.up.send(url, endpoint, body)
        try:
            return await self.up.relay(sent, request, path, timings)
        except aiohttp.ClientError as exc:
            other = self._alone_url(sent.url)
            if other is None or not nothing_sent(exc, body):
                raise
            await self._decode_failed(None, f"{type(exc).__name__}: {exc}", other)
            return await self.up.proxy(other, endpoint, body, request, "retry")

    async def _decode_failed(self, res_id: str | None, why: str, other: str) -> None:
        """A reservation's decode engine failed before answering and ``other`` takes the
        request: the reservation is released (its KV is on the failed engine), and counted."""
        if res_id is not None:
            await self.release(res_id, why)
        metrics.FALLBACKS.labels(reason="decode_failed").inc()
        _log.warning("decode failed; serving on another decode engine", reservation_id=res_id or "",
                     error=why[:200], decode=other)


"""A request's Reserve and its Release, in the registry that holds it. Part of
``kvpush.router.dispatch.Dispatcher`` (its ``Reserving`` base): it uses the dispatcher's
registries, engines (``fleet.Fleet``) and KV-aware routing."""

from __future__ import annotations

import time

import grpc

from kvpush import log
from kvpush.client.registries import MOVE_ON, NotAsked, Registry
from kvpush.client.reserve_stream import ReserveRefused
from kvpush.contract.v1 import scheduler_pb2
from kvpush.router import ask as asks
from kvpush.router import metrics
from kvpush.router.errors import ApiError

_log = log.get("router")
# (Reasons as ``reserve`` gives them; "registry_down": the registry was not asked, resting.)
_MOVE_ON = frozenset(code.name.lower() for code in MOVE_ON) | {"registry_down"}


class Reserving:
    def _least_loaded(self, urls) -> str:
        if not urls:
            raise ApiError(f"no prefill engine is available for model {self.cfg.model!r}", 503)
        return min(urls, key=lambda u: self.outstanding.get(u, 0))

    @property
    def keep_s(self) -> float:
        """How long a grant's registry is remembered: past its deadline nothing is asked of it."""
        return self.cfg.deadline_ms / 1000 + 60

    def first_share_s(self, reg: Registry) -> float:
        """The time a Reserve in ``reg`` is given when its refusal would be asked again in
        another (``reserve_elsewhere``): half the timeout, so a registry that does not answer
        leaves time for the next; all of it when no other registry has a prefill engine."""
        others = any(r is not reg and self.engines.prefill_urls(r) for r in self.registries.all)
        return self.cfg.reserve_timeout_s / (2 if others else 1)

    async def reserve(self, request_id: str, ask: asks.Ask, prefill_url: str, keys=(), preferred: str = "",
                      reg: Registry | None = None, move_on: bool = False, timeout: float | None = None,
                      skip: Registry | None = None):
        """(the reservation, "", its prefill engine's URL), its decode engine one the router can
        reach; or (None, why, ``prefill_url``) when serving without push. ``prefill_url``: the
        prefill engine chosen in ``reg`` (``Fleet.choose``), named in the reservation where its
        id is known; ``keys``: the prompt's block keys (KV-aware routing); ``preferred``: the
        decode engine to choose where it qualifies. With ``move_on`` the other registries are
        asked after ``reg`` has no room or does not answer, each with its least loaded prefill
        engine (so the URL returned may be another), except ``skip``. ``timeout``: for all the
        registries asked (default: ``--reserve-timeout``)."""
        reg = reg or self.registries.all[0]
        picks = {reg: prefill_url}

        def request_for(r: Registry):
            url = picks.get(r)
            if not url:
                urls = self.engines.prefill_urls(r)
                if not urls:
                    return None
                url = picks[r] = self._least_loaded(urls)
            return scheduler_pb2.ReserveRequest(
                request_id=request_id, num_tokens=ask.num_tokens, model=self.cfg.model,
                deadline_ms=self.cfg.deadline_ms, prefill_engine_id=self.engines.prefill_id(url) if url else "",
                local_prefill_tokens=self.cfg.local_prefill_tokens,
                preferred_engine_id=preferred if r is reg else "", **self.kv_aware.reserve_fields(keys))

        def observe(r: Registry, outcome: str) -> None:
            if len(self.registries.all) > 1:
                metrics.REGISTRY_RESERVES.labels(registry=r.name, outcome=outcome).inc()

        order = [r for r in self.registries.order(reg, self.engines.load) if r is not skip] if move_on else [reg]
        started = time.perf_counter()
        try:
            granted_in, res = await self.registries.reserve(
                request_for, self.cfg.reserve_timeout_s if timeout is None else timeout, order, self.keep_s, observe)
        except NotAsked:  # (no round trip: nothing to learn the Reserve's latency from)
            return None, "registry_down", prefill_url
        except ReserveRefused as exc:
            self._observe(time.perf_counter() - started)
            return None, exc.code.name.lower(), prefill_url
        self._observe(time.perf_counter() - started)
        if self.engines.decode_url(res.engine_id) is None:
            if not res.decode_alone:  # (decode_alone: nothing is held)
                await self.release(res.id, "router has no address for this decode engine")
            return None, "unknown_decode_engine", prefill_url
        self.kv_aware.served(keys, res.engine_id)
        return self.kv_aware.observed(res), "", picks[granted_in]

    def _observe(self, elapsed: float) -> None:
        metrics.RESERVE_LATENCY.observe(elapsed)
        self.kv_aware.hold.observe(elapsed)

    async def reserve_elsewhere(self, request_id: str, ask: asks.Ask, keys, refused_in: Registry | None, why: str,
                                left_s: float):
        """After ``refused_in`` refused for room or did not answer (``why``), the same Reserve in
        the other registries, least loaded first, each with its own prefill engine, within
        ``left_s`` (what the first ask left of the timeout): ``reserve``'s answer, or None
        when there is no other to ask or no time left."""
        if refused_in is None or len(self.registries.all) == 1 or why not in _MOVE_ON or left_s <= 0:
            return None
        other = next((r for r in self.registries.order(None, self.engines.load)
                      if r is not refused_in and self.engines.prefill_urls(r)), None)
        if other is None:
            return None
        return await self.reserve(request_id, ask, "", keys, reg=other, move_on=True, timeout=left_s,
                                  skip=refused_in)

    async def release(self, res_id: str, reason: str) -> None:
        reg = self.registries.of(res_id)
        if reg is None:  # (remembered until well past its deadline: it has ended by now)
            _log.info("release: reservation long past its deadline, not asked", reservation_id=res_id)
            return
        try:
            await reg.cp.scheduler.Release(scheduler_pb2.ReleaseRequest(reservation_id=res_id, reason=reason[:500]),
                                           metadata=reg.cp.metadata, timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: it ended already
                _log.warning("release failed", reservation_id=res_id, code=exc.code().name, registry=reg.name)

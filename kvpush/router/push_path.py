"""The push path of a request (``kvpush.router.ask``: PUSH): prefill pushes the KV and, at once,
decode loads it and computes every output token. Part of ``kvpush.router.dispatch.Dispatcher``
(its ``PushPath`` base): it uses the dispatcher's upstream, failover and release."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from kvpush import log
from kvpush.contract.states import DECODE, PREFILL
from kvpush.contract.transfer_params import PushParams
from kvpush.router import ask as asks
from kvpush.router.failover import with_reservation
from kvpush.router.first_token import prefill_body
from kvpush.router.upstream import nothing_sent

_log = log.get("router")


class PushPath:
    async def _push(self, ask: asks.Ask, prefill_url: str, decode_url: str, request: web.Request, timings: dict,
                    held: list) -> web.StreamResponse:
        """``held``: [the reservation decode loads], kept current through a move."""
        params = PushParams.from_reservation(held[0], PREFILL)
        p_body = prefill_body(ask.body, params.as_kv_transfer_params(), first_token=False)
        d_body = dict(ask.body, kv_transfer_params=params.for_role(DECODE).as_kv_transfer_params())
        prefill = asyncio.create_task(self._prefill_then_release(prefill_url, ask.endpoint, p_body, held, timings))
        try:
            why, response, exc = await self._push_decode(decode_url, ask, d_body, request, timings)
            tried = [decode_url]
            if why:
                # Failed before the client got a byte: the prefill engine still pushes (or
                # holds) the KV, so the reservation moves and the KV follows it there.
                moved = await self.failover.relocate(held[0], why)
                if moved is not None:
                    held[:] = [moved[0]]
                    tried.append(moved[1])
                    why, response, exc = await self._push_decode(moved[1], ask, with_reservation(d_body, moved[0]),
                                                                 request, timings)
            if why:
                prefill.cancel()
                other = self._alone_url(*tried)
                if other is not None:  # the KV is lost to this request: another engine computes it
                    return await self._decode_elsewhere(ask, other, held[0].id, why, request)
                await self.release(held[0].id, why)
                if exc is not None:
                    raise exc
        except BaseException:
            prefill.cancel()
            raise
        if response.status != 200:
            prefill.cancel()
            await self.release(held[0].id, f"decode answered {response.status}")
        return response

    async def _push_decode(self, url: str, ask: asks.Ask, d_body: dict, request: web.Request, timings: dict):
        """The push path's decode request to ``url``: (why it failed before the client got
        anything, or "", the response, the error it failed with)."""
        try:
            response = await self.up.proxy(url, ask.endpoint, d_body, request, "push", timings)
        except aiohttp.ClientError as exc:
            # Unreachable, or broke before the client got a byte (a whole answer is sent
            # only once complete): safe to serve elsewhere.
            if not nothing_sent(exc, ask):
                raise
            return f"decode unreachable: {exc}", None, exc
        if response.status >= 500 and not response.prepared:
            return f"decode answered {response.status}", response, None
        return "", response, None

    async def _decode_elsewhere(self, ask: asks.Ask, url: str, res_id: str, why: str,
                                request: web.Request) -> web.StreamResponse:
        """The reservation's decode engine failed before answering anything: its KV is lost
        to this request, so another decode engine serves it alone (computing the prompt)."""
        await self._decode_failed(res_id, why, url)
        return await self.up.proxy(url, ask.endpoint, ask.body, request, "retry")

    async def _prefill_then_release(self, url: str, endpoint: str, body: dict, held: list, timings: dict) -> None:
        """``held``: [the reservation decode loads] (a move replaces it)."""
        try:
            status, text = await self.up.post(url, endpoint, body, timings)
            if status != 200:
                raise RuntimeError(f"prefill answered {status}: {text[:200]!r}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Decode is waiting for KV that will not come: end the wait now.
            _log.warning("prefill failed; aborting its reservation", reservation_id=held[0].id, error=str(exc))
            await self.release(held[0].id, f"prefill failed: {exc}")

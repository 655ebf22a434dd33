"""Decode failover, the router's half: a reservation's decode engine failed before it
loaded the KV, so the control plane moves the reservation to another decode engine
(``Scheduler.Relocate``), the prefill engine's sidecar pushes the KV it still holds
staged into it, and the decode request goes there: the prefill is not paid twice.
Whatever cannot be moved (consumed, no other engine with room, the prefill engine
gone, the control plane unreachable) is served as before, decode computing the prompt."""

from __future__ import annotations

from typing import Awaitable, Callable

import grpc

from kvpush.client.registries import Registries
from kvpush import log
from kvpush.contract.states import DECODE
from kvpush.contract.transfer_params import PushParams
from kvpush.contract.v1 import scheduler_pb2
from kvpush.router import metrics
from kvpush.router.fleet import Fleet

_log = log.get("router")


class Failover:
    def __init__(self, registries: Registries, engines: Fleet, release: Callable[[str, str], Awaitable[None]],
                 enabled: bool = True, timeout_s: float = 1.0, keep_s: float = 90.0) -> None:
        self.registries = registries
        self.engines = engines
        self.keep_s = keep_s
        self.release = release
        self.enabled = enabled
        self.timeout_s = timeout_s

    async def relocate(self, res, why: str):
        """(the reservation that replaces ``res``, its decode engine's URL), or None."""
        reg = self.registries.of(res.id) if res is not None else None
        if reg is None or not self.enabled:
            return None
        try:  # (in the registry holding it: the reservation moves to another of its engines)
            moved = await reg.cp.scheduler.Relocate(
                scheduler_pb2.RelocateRequest(reservation_id=res.id, reason=why[:1000]),
                metadata=reg.cp.metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            metrics.RELOCATIONS.labels(outcome=exc.code().name.lower()).inc()
            _log.info("reservation not moved", reservation_id=res.id, code=exc.code().name,
                      details=(exc.details() or "")[:200])
            return None
        self.registries.granted(moved.id, reg, self.keep_s)
        url = self.engines.decode_url(moved.engine_id)
        if url is None:  # the router cannot reach it: the move is no use to this request
            metrics.RELOCATIONS.labels(outcome="unknown_decode_engine").inc()
            await self.release(moved.id, "router has no address for this decode engine")
            return None
        metrics.RELOCATIONS.labels(outcome="moved").inc()
        _log.warning("decode failed; reservation moved, its KV pushed again from the prefill engine's staging",
                     reservation_id=res.id, moved_to=moved.id, decode=moved.engine_id, error=why[:200])
        return moved, url


def with_reservation(d_body: dict, res) -> dict:
    """The decode request ``d_body`` loading ``res`` instead of the reservation it named."""
    return dict(d_body, kv_transfer_params=PushParams.from_reservation(res, DECODE).as_kv_transfer_params())

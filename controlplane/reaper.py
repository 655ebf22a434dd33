"""Ends reservations whose world went away: deadline leases that ran out, engines
that died or restarted. Reacts to view changes at once and sweeps every few
seconds for anything missed (say, while etcd was unreachable or no replica ran).
Several replicas may race to end the same reservation; the CAS lets one win."""

from __future__ import annotations

import asyncio

from controlplane import errors
from controlplane.lifecycle import Lifecycle
from controlplane.lifecycle_states import State
from controlplane.view import EngineChange, ReservationChange, View
from kvpush import log

_log = log.get("reaper")


class Reaper:
    def __init__(self, view: View, lifecycle: Lifecycle, sweep_interval: float = 2.0) -> None:
        self._view = view
        self._lifecycle = lifecycle
        self._sweep_interval = sweep_interval
        self._work: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._unsubscribe = None

    def start(self) -> None:
        self._unsubscribe = self._view.subscribe(self._on_change)
        self._tasks = [asyncio.create_task(self._worker(), name="reaper"),
                       asyncio.create_task(self._sweeper(), name="reaper-sweep")]

    async def stop(self) -> None:
        if self._unsubscribe:
            self._unsubscribe()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _on_change(self, change: object) -> None:
        if isinstance(change, ReservationChange) and change.expired and change.old is not None:
            self._work.put_nowait(("expired", change.old))
        elif isinstance(change, EngineChange) and change.old is not None:
            if change.new is None:
                self._work.put_nowait(("engine", (change.old.engine_id, None, "decode engine deregistered or "
                                                  "its sidecar's lease expired")))
            elif change.new.incarnation != change.old.incarnation:
                self._work.put_nowait(("engine", (change.old.engine_id, change.new.incarnation,
                                                  "decode engine restarted (new incarnation)")))

    async def _worker(self) -> None:
        while True:
            kind, item = await self._work.get()
            try:
                if kind == "expired":
                    await self._lifecycle.record_expiry(item)
                else:
                    engine_id, keep, reason = item
                    await self._lifecycle.fail_engine(engine_id, reason, keep_incarnation=keep)
            except errors.ApiError as exc:
                _log.warning("reaper step failed; the sweep will retry", kind=kind, error=exc.message)
            except Exception:
                _log.exception("reaper step crashed")

    async def sweep(self) -> int:
        """End FAILED each live reservation whose engine (this incarnation) is gone."""
        orphans = [rec for rec in self._view.live_reservations()
                   if (eng := self._view.engine(rec.engine_id)) is None or eng.incarnation != rec.incarnation]
        ended = 0
        for rec in orphans:
            try:
                await self._lifecycle.transition(rec.id, State.FAILED, "decode engine is gone")
                ended += 1
            except errors.ApiError:
                pass
        return ended

    async def _sweeper(self) -> None:
        await self._view.ready.wait()
        while True:
            try:
                await self.sweep()
            except Exception:
                _log.exception("sweep failed")
            await asyncio.sleep(self._sweep_interval)


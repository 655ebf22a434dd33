"""Ends reservations whose world went away: deadline leases that ran out, engines
that died or restarted. Reacts to view changes at once and sweeps every few
seconds for anything missed (say, while etcd was unreachable or no replica ran).
Several replicas may race to end the same reservation; the CAS lets one win."""

from __future__ import annotations

import asyncio

from kvpush.controlplane import errors
from kvpush.controlplane.lifecycle import Lifecycle
from kvpush.contract.states import UNLANDED, State
from kvpush.controlplane.view import EngineChange, ReservationChange, View
from kvpush import log

_log = log.get("reaper")
SWEEP_SLICE = 2_000  # live reservations checked per loop turn


class Reaper:
    def __init__(self, view: View, lifecycle: Lifecycle, sweep_interval: float = 2.0) -> None:
        self._view = view
        self._lifecycle = lifecycle
        self._sweep_interval = sweep_interval
        self._expired: list = []      # records whose deadline lease ran out
        self._engines: list = []      # (engine id, incarnation to keep, reason)
        self._wake = asyncio.Event()
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
            self._expired.append(change.old)
        elif isinstance(change, EngineChange) and change.old is not None:
            if change.new is None:
                self._engines.append((change.old.engine_id, None,
                                      "decode engine deregistered or its sidecar's lease expired"))
            elif change.new.incarnation != change.old.incarnation:
                self._engines.append((change.old.engine_id, change.new.incarnation,
                                      "decode engine restarted (new incarnation)"))
            else:
                return
        else:
            return
        self._wake.set()

    async def _worker(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Take everything queued: a whole lease's worth of reservations expires at once.
            expired, self._expired = self._expired, []
            engines, self._engines = self._engines, []
            try:
                if expired:
                    await self._lifecycle.record_expiries(expired)
                for engine_id, keep, reason in engines:
                    current = self._view.engine(engine_id)
                    if current is not None:
                        # Registered again since the event: its current life (and what
                        # that life began, e.g. pushes) is not what ended.
                        keep = current.incarnation
                    await self._lifecycle.fail_engine(engine_id, reason, keep_incarnation=keep)
            except errors.ApiError as exc:
                _log.warning("reaper step failed; the sweep will retry", error=exc.message)
            except Exception:
                _log.exception("reaper step crashed")

    async def sweep(self) -> int:
        """End FAILED each live reservation whose engine (this incarnation) is gone or
        unavailable, and each one not yet landed whose named prefill engine (that life)
        is gone or unavailable. It walks every live
        reservation, a slice per loop turn: at 100,000 live one walk took the loop for
        over 100 ms, every sweep (docs/SCALING.md)."""
        view = self._view
        orphans, abandoned = [], []
        live = view.live_reservations()
        for first in range(0, len(live), SWEEP_SLICE):
            if first:
                await asyncio.sleep(0)
            for rec in live[first:first + SWEEP_SLICE]:
                eng = view.engine(rec.engine_id)
                if eng is None or eng.incarnation != rec.incarnation or eng.unavailable:
                    orphans.append(rec)
                elif rec.state in UNLANDED and rec.prefill_engine_id and (
                        (pre := view.engine(rec.prefill_engine_id)) is None or pre.unavailable
                        or (rec.prefill_incarnation and pre.incarnation != rec.prefill_incarnation)):
                    abandoned.append(rec)
        ended = 0
        if orphans:
            ended += await self._lifecycle.end_many(orphans, State.FAILED, "decode engine is gone or unavailable")
        if abandoned:
            ended += await self._lifecycle.end_many(abandoned, State.FAILED, "prefill engine died before its push landed")
        return ended

    async def _sweeper(self) -> None:
        await self._view.ready.wait()
        while True:
            try:
                await self.sweep()
            except Exception:
                _log.exception("sweep failed")
            await asyncio.sleep(self._sweep_interval)


"""Follows ``Registry.WatchEngineReservations`` and cancels the local pushes and
landings of reservations that end (RELEASED, EXPIRED, FAILED); on a prefill engine
it also hands the reservations named for it to the handover (``kvpush/sidecar/handover.py``),
and says when one is CONSUMED (its staging, held for a failover, can go).
After a break it subscribes again with a snapshot and checks every local reservation
missing from it (``LookupReservation``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from kvpush.contract.states import ENDED_BY_CONTROL_PLANE, State
from kvpush.contract.v1 import registry_pb2, scheduler_pb2, types_pb2

from kvpush.sidecar.membership import (Backoff, ControlPlaneLink, Membership, ServiceConfig,
                            guarded, rpc_error_text, status_code)

log = logging.getLogger("kvpush.sidecar")


# -- the reservation watch -------------------------------------------------------------------------
class ReservationWatch:
    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine_id: str, membership: Membership,
                 live_reservations: Callable[[], list[str]], on_ended: Callable[..., None],
                 on_reserved: Callable[[types_pb2.Reservation], None] | None = None):
        self.link = link
        self.config = config
        self.engine_id = engine_id
        self.membership = membership
        self.live_reservations = live_reservations
        self.on_ended = on_ended  # (reservation id, reason, its terminal State or None when gone)
        self.on_reserved = on_reserved  # prefill: a reservation named for this engine, not yet pushed
        self.subscribed = asyncio.Event()  # the snapshot is in: changes from here on are seen
        self.subscriptions = 0
        self.events = 0
        self._stopping = False
        self._call = None
        self._wake = asyncio.Event()
        self._reconciling: set[asyncio.Task] = set()

    async def run(self) -> None:
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self._stopping:
            await self._until_connected()
            if self._stopping:
                break
            client = self.link.client
            snapshot: set[str] = set()
            try:
                self._call = call = client.registry.WatchEngineReservations(
                    registry_pb2.WatchEngineReservationsRequest(engine_id=self.engine_id, include_snapshot=True),
                    metadata=client.metadata)
                while (event := await guarded(call.read())) is not grpc.aio.EOF:
                    self.events += 1
                    if event.kind == scheduler_pb2.ReservationEvent.SNAPSHOT:
                        snapshot.add(event.reservation.id)
                        self._apply(event.reservation)
                    elif event.kind == scheduler_pb2.ReservationEvent.SNAPSHOT_END:
                        self.subscriptions += 1
                        self.subscribed.set()
                        backoff.reset()
                        self._spawn(self._reconcile(snapshot))
                    else:
                        self._apply(event.reservation)
                why = "stream ended"
            except Exception as exc:
                why = rpc_error_text(exc)
                if status_code(exc) == grpc.StatusCode.UNIMPLEMENTED:
                    backoff = Backoff(30.0, 30.0)  # an older control plane: ask again now and then
            finally:
                self._call = None
                self.subscribed.clear()
            if self._stopping:
                break
            log.warning("reservation watch broke (%s); subscribing again", why)
            try:
                await asyncio.wait_for(self._wake.wait(), backoff.next())
            except asyncio.TimeoutError:
                pass

    async def _until_connected(self) -> None:
        if self.membership.connected.is_set():
            return
        waits = [asyncio.ensure_future(self.membership.connected.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _apply(self, reservation: types_pb2.Reservation) -> None:
        if reservation.state == types_pb2.RESERVED and self.on_reserved is not None:
            self.on_reserved(reservation)
        if reservation.state in ENDED_BY_CONTROL_PLANE or reservation.state == State.CONSUMED:
            state = State(reservation.state)
            self.on_ended(reservation.id, f"reservation {state.name}" + (f": {reservation.reason}"
                                                                         if reservation.reason else ""), state)

    async def _reconcile(self, snapshot: set[str]) -> None:
        """Local work for reservations the snapshot does not list may have ended while
        we were not subscribed: ask about each."""
        client = self.link.client
        for rid in [r for r in self.live_reservations() if r not in snapshot]:
            try:
                res = await guarded(client.registry.LookupReservation(
                    registry_pb2.LookupReservationRequest(reservation_id=rid), metadata=client.metadata,
                    timeout=self.config.rpc_timeout_s))
            except Exception as exc:
                if status_code(exc) == grpc.StatusCode.NOT_FOUND:
                    self.on_ended(rid, "reservation no longer exists")
                elif status_code(exc) != grpc.StatusCode.INVALID_ARGUMENT:
                    log.info("could not check reservation %s: %s", rid, rpc_error_text(exc))
                continue
            self._apply(res)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._reconciling.add(task)
        task.add_done_callback(self._reconciling.discard)

    async def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._call is not None:
            self._call.cancel()
        for task in list(self._reconciling):
            task.cancel()
        await asyncio.gather(*self._reconciling, return_exceptions=True)

"""Where a Reserve goes when this replica's own engines are not the place for it.

A replica follows only its own slots (following.py). A Reserve that should go to an engine
it does not follow (none of its own has room, another replica's summary shows clearly more
room, the router prefers an engine in another slot) goes one of two ways:

* **forwarded** to the engine's owner, which commits it among its own engines on its exact
  view (forwarding.py sends it, once, as it came). Only the service
  layer can do that, so the ask ends here with ``Forward`` and comes back, marked not to
  be forwarded again, if the owner cannot take it (gone, slow, or its room was taken);
* **widened**: this replica follows the engines' slots for a while (following.py) and
  plans the ask again once they are in its view, committing it itself. The per-engine
  fence keeps that correct whoever commits; it costs a read of those slots and the owner's
  transactions may collide with ours.

An ask is forwarded at most once and widened at most once, so the detour is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from kvpush.controlplane import errors, keys, metrics
from kvpush.controlplane.candidates import RoomElsewhere
from kvpush.controlplane.following import Following
from kvpush.controlplane.ownership import Ownership
from kvpush.controlplane.records import TenantRecord
from kvpush.controlplane.reserve_plan import ReserveAsk
from kvpush.controlplane.view import View


class Forward(Exception):
    """An ask's outcome: send it to replica ``replica`` at ``address``, preferring ``engine_id``."""

    def __init__(self, replica: str, address: str, engine_id: str) -> None:
        super().__init__(f"forward to {replica} ({address}) for {engine_id}")
        self.replica = replica
        self.address = address
        self.engine_id = engine_id


class Elsewhere:
    def __init__(self, view: View, requeue: Callable[[ReserveAsk], None], ownership: Ownership | None,
                 following: Following | None) -> None:
        self._view = view
        self._requeue = requeue
        self._ownership = ownership
        self._following = following
        self._room = RoomElsewhere(view)
        self._tasks: set[asyncio.Task] = set()

    @property
    def partitioned(self) -> bool:
        """Whether this view follows only some slots (else nothing is elsewhere)."""
        return self._following is not None and self._view.following is not None

    def room(self, ask: ReserveAsk, tenant: TenantRecord) -> tuple[float, str]:
        """(free fraction, engine id) of the roomiest engine elsewhere that ``ask`` fits on, as
        the owners last told (free_summary.py); (-1.0, "") when none."""
        return self._room.best(ask.model, tenant, ask.prefill_layout, ask.num_tokens)

    def send(self, ask: ReserveAsk, tenant: TenantRecord, engine_id: str = "",
             slots: set[int] | None = None) -> bool:
        """Send ``ask`` towards ``engine_id`` (or, widening, the engines in ``slots``; default:
        every engine that could take it): forwarded to its owner when the ask may be and the
        owner is known and this replica does not follow the engine, else widened. False when
        neither is possible (or ``ask`` was forwarded here): the caller decides here."""
        if ask.forwarded:
            return False
        if ask.may_forward and engine_id and self.partitioned and self._ownership is not None \
                and keys.slot_of(engine_id) not in self._view.following:
            owner = self._ownership.owner_of(engine_id)
            record = self._view.replicas.get(owner)
            if owner != self._ownership.replica_id and record is not None and record.reachable:
                ask.future.set_exception(Forward(owner, record.reachable, engine_id))
                return True
        return self.widen(ask, tenant, slots)

    def widen(self, ask: ReserveAsk, tenant: TenantRecord, slots: set[int] | None = None) -> bool:
        """Follow ``slots`` (default: those of every engine that could take ``ask``; following.py
        keeps them a while) and plan ``ask`` again once they are in the view. False when there
        are none, or it was widened once already."""
        view = self._view
        if not self.partitioned or ask.widened:
            return False
        if slots is None:
            slots = {keys.slot_of(eid) for eid, entry in view.engines.items()
                     if entry.record.is_decode and entry.record.model == ask.model
                     and tenant.allows(entry.record.pool) and not entry.record.unavailable}
        slots = slots - view.following
        if not slots:
            return False
        ask.widened = True
        metrics.RESERVE_WIDENED.inc()
        self._following.borrow(slots)
        self._replan_when_covered(ask, slots)
        return True

    def usage_unknown(self, ask: ReserveAsk, tenant: TenantRecord) -> bool:
        """Whether ``tenant``'s quota cannot be counted here yet: this replica does not follow
        its part of the request index (following.py takes it on while the tenant's Reserves
        come here); ``ask`` is then planned again once it does, or refused."""
        following = self._view.following
        if following is None:
            return False
        if tenant.name in following:
            if self._following is not None:
                self._following.keep(tenant.name)
            return False
        if self._following is None:
            raise errors.unavailable(f"this replica does not count tenant {tenant.name!r}'s usage")
        self._following.borrow([tenant.name])
        self._replan_when_covered(ask, {tenant.name}, required=True)
        return True

    def _replan_when_covered(self, ask: ReserveAsk, needs: set[int | str], required: bool = False) -> None:
        async def replan() -> None:
            try:
                covered = await self._following.until_covered(needs)
            except asyncio.CancelledError:
                if not ask.future.done():
                    ask.future.set_exception(errors.unavailable("control plane is shutting down"))
                raise
            if ask.future.done():
                return
            if covered or not required:
                self._requeue(ask)
            else:
                ask.future.set_exception(errors.unavailable(
                    "this control-plane replica could not follow the tenant's usage in time; retry"))
        task = asyncio.create_task(replan())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()

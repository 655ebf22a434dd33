"""Which slots this replica's view follows, and why (kvpush/controlplane/follow.py does it).

A replica follows the slots it owns (ownership.py), so the requests of the others' engines
never reach it. On top of those it follows what its own clients need while they need it:

* a sidecar's reservation stream: that engine's slot (a decode engine's reservations
  live there; a prefill engine's are copied there, keys.push);
* a Reserve that belongs on engines it does not follow and could not be forwarded to
  their owner (elsewhere.py): their slots, for ``LINGER_S`` after the last such Reserve;
* a Reserve for a tenant with a quota: that tenant's part of the request index, which
  holds its usage (request_index.py), for ``LINGER_S`` after its last such Reserve (a
  replica that serves the tenant nothing never follows it);
* what no single slot answers: ``ListEngines`` asked for exact counts, ``DeleteTenant``,
  and a tenant's reservation watch where the peers cannot be reached: every slot.
  (``GetEngine`` takes its engine's slot; ``ListEngines`` by default gives the others'
  engines from their owners' free summary; a tenant's watch is gathered from every replica,
  watch_gather.py.)

Needs linger ``LINGER_S`` after they end, so a sidecar reconnecting does not make the
replica drop a slot and read it again. ``--follow all`` makes a replica follow every slot
whatever it owns (the behaviour before ownership).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Iterable

from kvpush import log
from kvpush.controlplane import errors, keys, metrics
from kvpush.controlplane.follow import Interest
from kvpush.controlplane.ownership import Ownership
from kvpush.controlplane.view import View

_log = log.get("following")

ALL = -1           # a need for every slot (a need is a slot, an int, or a tenant's index, its name)
LINGER_S = 10.0    # a need is kept this long after it ends
RECHECK_S = 0.5    # ownership and needs' linger are looked at again this often
COVER_WAIT_S = 10.0


class Following:
    def __init__(self, view: View, ownership: Ownership, follow_all: bool = False) -> None:
        self._view = view
        self._ownership = ownership
        self.follow_all = follow_all
        self._needs: collections.Counter[int | str] = collections.Counter()
        self._lingering: dict[int | str, float] = {}  # need -> monotonic time it may go
        self.interest = Interest(self.wanted)
        self._last: frozenset[int | str] | None = None

    def wanted(self) -> frozenset[int | str] | None:
        now = time.monotonic()
        for need, until in list(self._lingering.items()):
            if until <= now:
                del self._lingering[need]
        needed = set(self._needs) | set(self._lingering)
        if self.follow_all or ALL in needed:
            return None
        parts = self._ownership.owned | needed
        return None if sum(isinstance(p, int) for p in parts) == keys.SLOTS else frozenset(parts)

    def recheck(self) -> None:
        """Poke the follow if what this replica should follow changed."""
        wanted = self.wanted()
        if wanted != self._last:
            self._last = wanted
            slots = keys.SLOTS if wanted is None else sum(isinstance(p, int) for p in wanted)
            _log.info("following", slots=slots, tenants="all" if wanted is None else len(wanted) - slots)
            metrics.FOLLOWED_SLOTS.set(slots)
            self.interest.poke()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.recheck()
            try:
                await asyncio.wait_for(stop.wait(), RECHECK_S)
            except asyncio.TimeoutError:
                pass

    def covers(self, needs: Iterable[int | str]) -> bool:
        following = self._view.following
        return following is None or (ALL not in needs and all(n in following for n in needs))

    async def until_covered(self, slots: Iterable[int | str], timeout_s: float | None = None) -> bool:
        slots = tuple(slots)
        deadline = time.monotonic() + (COVER_WAIT_S if timeout_s is None else timeout_s)
        while not self.covers(slots):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    @contextlib.asynccontextmanager
    async def needing(self, slots: Iterable[int | str]):
        """Follow ``slots`` (or ``[ALL]``; tenants' names: their request indexes) while the
        body runs, and ``LINGER_S`` after."""
        slots = tuple(slots)
        self._needs.update(slots)
        self.recheck()
        try:
            if not await self.until_covered(slots):
                raise errors.unavailable("this control-plane replica could not follow the registry's part this "
                                         "call needs in time (etcd slow or unreachable); retry")
            yield
        finally:
            self._needs.subtract(slots)
            until = time.monotonic() + LINGER_S
            for slot in slots:
                if self._needs[slot] <= 0:
                    del self._needs[slot]
                self._lingering[slot] = max(self._lingering.get(slot, 0.0), until)

    def keep(self, need: int | str) -> None:
        """``need``, followed already, is kept ``LINGER_S`` from now (a quota tenant's Reserve)."""
        self._lingering[need] = time.monotonic() + LINGER_S

    def borrow(self, slots: Iterable[int | str]) -> None:
        """Follow ``slots`` for ``LINGER_S`` from now (a Reserve's room beyond its own engines;
        a quota tenant's usage)."""
        until = time.monotonic() + LINGER_S
        for slot in slots:
            self._lingering[slot] = max(self._lingering.get(slot, 0.0), until)
        self.recheck()

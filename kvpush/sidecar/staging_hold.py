"""Prefill: staging kept after a push for a decode failover, until a relocation takes
it, the decode side has the KV, or its time is over (``kvpush/sidecar/push.py`` decides when)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from kvpush.sidecar.outbound import Outbound


class StagingHold:
    """Held requests by reservation id, oldest first. Each is held ``hold_s`` from the
    last ``arm`` (never past its reservation's deadline); then ``on_over`` is called."""

    def __init__(self, hold_s: float, on_over: Callable[[Outbound], None]) -> None:
        self.hold_s = hold_s
        self.on_over = on_over
        self._held: dict[str, Outbound] = {}

    @property
    def enabled(self) -> bool:
        return self.hold_s > 0

    def __len__(self) -> int:
        return len(self._held)

    def get(self, reservation_id: str) -> Outbound | None:
        return self._held.get(reservation_id)

    def add(self, ob: Outbound) -> None:
        ob.held = True
        self._held[ob.target.reservation_id] = ob
        self.arm(ob)

    def arm(self, ob: Outbound) -> None:
        if ob.hold_timer is not None:
            ob.hold_timer.cancel()
        hold = self.hold_s
        if ob.target.deadline_unix_ms:
            hold = min(hold, max(0.0, ob.target.deadline_unix_ms / 1000.0 - time.time()))
        try:
            ob.hold_timer = asyncio.get_running_loop().call_later(hold, self._over, ob, ob.generation)
        except RuntimeError:  # no loop (synchronous use in tests): held until released
            ob.hold_timer = None

    def _over(self, ob: Outbound, generation: int) -> None:
        if ob.held and ob.generation == generation:
            self.on_over(ob)

    def remove(self, ob: Outbound) -> None:
        if ob.hold_timer is not None:
            ob.hold_timer.cancel()
            ob.hold_timer = None
        if ob.held:
            ob.held = False
            self._held.pop(ob.target.reservation_id, None)

    @property
    def units(self) -> int:
        """Staging units held (each freed at once when a new push needs room)."""
        return sum(ob.num_units for ob in self._held.values())

    def evictable(self) -> Outbound | None:
        """The oldest held request whose staging can be freed at once (no write reads it)."""
        return next((ob for ob in self._held.values() if not ob.inflight and not ob.stale_inflight), None)

"""The pusher's decode-failover half: staging held after a push, and pushed again from
it into the reservation that replaced one whose decode engine failed (``relocate``).

Decode failover: a request's staging is *held* (``hold_s``) after its final write, and
after a failure on the decode side (a write failed, its reservation ended FAILED),
rather than freed, so that if its decode engine dies before loading it the KV is pushed
again from staging into the reservation that replaces it, without a second prefill.
Held staging goes at CONSUMED (``release_held``), at a release or the deadline, after
``hold_s`` (counted from the engine's END), and first of all whenever a new request
needs the room (``_make_room``): holding never refuses a push. A tensor-parallel
request is held and moved whole, every rank's shares (the successor is on a decode
engine of the same TP: the staging is split for it).
"""

from __future__ import annotations

import asyncio
import logging

from kvpush.contract.states import PushState
from kvpush.contract.target import PushTarget
from kvpush.sidecar.outbound import Outbound, PushError
from kvpush.sidecar.peers import PeerUnavailable

log = logging.getLogger("kvpush.sidecar.push")


class HeldPushes:
    """Mixed into ``PushEngine`` (``kvpush/sidecar/push.py``), whose state it shares."""

    def release_held(self, reservation_id: str, reason: str = "consumed") -> bool:
        """Its decode engine has the KV (CONSUMED): the staging is not needed any more."""
        ob = self.held.get(reservation_id)
        if ob is None:
            return False
        self._drop_held(ob, reason)
        return True

    def relocate(self, old_reservation_id: str, target: PushTarget) -> str:
        """Push a request's staged KV again, into ``target``, the reservation that replaced
        ``old_reservation_id`` (its decode engine failed). "" when under way, else why not
        (the staging is gone, or the new target cannot take it)."""
        if self.held.get(target.reservation_id) or self._outbound_of(target.reservation_id):
            return ""  # heard again (a watch's snapshot after a break): under way already
        ob = self.held.get(old_reservation_id) or self._outbound_of(old_reservation_id)
        if ob is None or ob.state.terminal and not ob.held:
            return f"no staged KV for reservation {old_reservation_id} (freed, or never staged here)"
        if not ob.holdable:
            return f"reservation {old_reservation_id} was not heard as naming this engine: its staging is not held"
        why = ob.misfit(target)
        if why:
            return why
        if not ob.held:  # still pushing to the old one (the move was heard before its end)
            self._fail(ob, f"moved to {target.reservation_id}", state=PushState.CANCELLED, hold=True)
        self.held.remove(ob)
        pieces = ob.retarget(target)
        self._ended.pop(ob.request_id, None)
        self.counters["relocated"] += 1
        log.info("pushing %s again from staging, into reservation %s on %s (was %s)", ob.request_id,
                 target.reservation_id, target.engine_id, old_reservation_id)
        ob.peer = None
        if self.peers.cached(target.engine_id, target.incarnation) or self.peers.resolver is None:
            try:
                peer = self.peers.get(target.engine_id, target.incarnation)
                self._check_peer(peer, target, ob.geom.num_blocks)
            except (PushError, PeerUnavailable, ValueError) as exc:
                self._fail(ob, f"engine {target.engine_id}: {exc}")
                return str(exc)
            self._attach_peer(ob, peer)
            for piece in pieces:
                if not ob.state.terminal:
                    self._push_piece(ob, *piece)
        else:
            ob.queued.extend(pieces)
            resolving = ob.state
            ob.state = PushState.RESOLVING
            asyncio.get_running_loop().create_task(self._resolve(ob, after=resolving),
                                                   name=f"resolve-{target.engine_id}")
        return ""


    def _outbound_of(self, reservation_id: str) -> Outbound | None:
        for ob in self._requests.values():
            if ob.target.reservation_id == reservation_id:
                return ob
        return None

    def _hold_over(self, ob: Outbound) -> None:
        self.counters["hold_expired"] += 1
        self._drop_held(ob, "hold time over")

    def _drop_held(self, ob: Outbound, reason: str) -> None:
        if not ob.held:
            return
        log.debug("staging of %s (reservation %s) freed: %s", ob.request_id, ob.target.reservation_id, reason)
        self.held.remove(ob)
        self._forget(ob)
        self._maybe_free(ob)

    def _make_room(self) -> bool:
        """Free the oldest held staging for a new request; False when none is held."""
        victim = self.held.evictable()
        if victim is None:
            return False
        self.counters["hold_evicted"] += 1
        self._drop_held(victim, "its staging was needed for a new request")
        return True


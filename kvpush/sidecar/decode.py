"""The decode sidecar: owns the landing pool prefill sidecars write into, and tells its
engine when a reservation has landed.

It never initiates a transfer. Serves QUERY, SUBSCRIBE (an event when the reservation
ends: LANDED, FAILED, CANCELLED) and CONSUMED (the engine copied it out). The table of
incoming reservations is ``kvpush/sidecar/landing.py``. With ``kv_events`` set it also follows the
engine's prefix-cache events (``kvpush/sidecar/kv_events.py``): ``held`` is what the engine holds,
``on_prefix_change`` hears each change (the service reports them to the control plane).
"""

from __future__ import annotations

import collections
from typing import Callable

from kvpush.channel import frames as F
from kvpush.contract.block_hash import BlockHasher
from kvpush.sidecar.base import SidecarBase, SidecarConfig
from kvpush.sidecar.channel_server import Connection
from kvpush.sidecar.kv_events import HeldBlocks, HeldChange, KvEventFollower
from kvpush.sidecar.landing import LandingEvent, LandingTable
from kvpush.sidecar.pools import LandingPool
from kvpush.sidecar.transport.base import Transport


class DecodeSidecar(SidecarBase):
    def __init__(self, config: SidecarConfig, on_landing_event: Callable[[LandingEvent], None] | None = None,
                 transport_factory: Callable[[SidecarConfig], Transport] | None = None):
        super().__init__(config, transport_factory)
        self.on_landing_event = on_landing_event
        self.landing: LandingTable | None = None
        self._subscriptions: dict[str, list[tuple[str, Callable]]] = {}
        self.recomputes: collections.Counter = collections.Counter()  # reason -> prompts decode computed itself
        self.held: HeldBlocks | None = None  # the engine's prefix cache, when its events are followed
        self.on_prefix_change: Callable[[HeldChange], None] | None = None
        self._follower: KvEventFollower | None = None

    def _make_pool(self, tag: str, rank: int) -> LandingPool:
        return LandingPool.create(tag, self.config.layout, self.config.num_blocks, self.rank_device(rank))

    def _start_role(self) -> None:
        c = self.config
        self.landing = LandingTable(self.pools, c.incarnation, self.driver, c.landing, self._landing_event)
        self.landing.trace = self.trace
        self.driver.on_notif = self.landing.handle_notif
        if c.kv_events is not None:
            src = c.kv_events
            self.held = HeldBlocks(BlockHasher(c.layout.block_size, src.algorithm, src.seed))
            self._follower = KvEventFollower(src.endpoint, self.held, src.topic, self._prefix_change)
            self._follower.start()

    def _stop_role(self) -> None:
        if self._follower is not None:
            self._follower.close()
        if self.landing is not None:
            self.landing.close()

    def _prefix_change(self, change: HeldChange) -> None:
        if self.on_prefix_change is not None:
            self.on_prefix_change(change)

    def cancel_reservation(self, reservation_id: str, reason: str = "cancelled", hold: bool = False) -> bool:
        return self.landing.cancel(reservation_id, reason)

    def live_reservations(self) -> list[str]:
        return self.landing.live_reservations() if self.landing is not None else []

    def stats(self) -> dict:
        out = super().stats()
        out.update(self.landing.counters)
        out.update(landing_blocks=self.pool.num_units, ranks=len(self.pools), landing_blocks_landed=self.landing.landed_blocks(),
                   recomputes=dict(self.recomputes))
        if self.held is not None:
            out.update(prefix_blocks_held=len(self.held), prefix_events=dict(self.held.counters),
                       prefix_unusable=self.held.unusable)
        return out

    def on_admin(self, conn: Connection, request: dict):
        if request.get("op") == "prefix_overlap":  # tests and tools: how much of a prompt the engine holds
            if self.held is None:
                raise ValueError("this sidecar does not follow its engine's KV events (--kv-events)")
            keys = self.held.hasher.keys([int(t) for t in request["token_ids"]], request.get("cache_salt"))
            blocks = self.held.overlap(keys)
            return {"blocks": blocks, "tokens": blocks * self.held.hasher.block_size, "prompt_blocks": len(keys)}
        return super().on_admin(conn, request)

    def _landing_event(self, event: LandingEvent) -> None:
        if self.on_landing_event is not None:
            self.on_landing_event(event)

    # -- ChannelHandler -------------------------------------------------------------------------
    def on_query(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        return _state(self.landing.expect(reservation_id))

    def on_subscribe(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        def deliver(event: LandingEvent) -> None:
            subs = self._subscriptions.get(conn.owner, [])
            if (reservation_id, deliver) in subs:
                subs.remove((reservation_id, deliver))
            conn.send_event(_state(event))
            self.trace("event_sent", reservation_id, event.state.value)

        self._subscriptions.setdefault(conn.owner, []).append((reservation_id, deliver))
        return _state(self.landing.subscribe(reservation_id, deliver))

    def on_consumed(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        # A worker consumes its rank's share; the scheduler (a reservation the engine will not
        # load) gives back the whole engine's.
        self.landing.consume(reservation_id, None if conn.whole_engine else conn.rank)
        return _state(self.landing.query(reservation_id))

    def on_recomputed(self, conn: Connection, reservation_id: str, reason: str) -> None:
        self.recomputes[reason or "other"] += 1
        self.trace("recomputed", reservation_id, reason)

    def on_disconnect(self, conn: Connection) -> None:
        super().on_disconnect(conn)
        for rid, callback in self._subscriptions.pop(conn.owner, []):
            self.landing.unsubscribe(rid, callback)


def _state(event: LandingEvent) -> F.StateEvent:
    """The one conversion of a landing event to the channel's frame."""
    return F.StateEvent(event.reservation_id, event.state.value, event.reason, "", event.num_tokens, event.src_tp)

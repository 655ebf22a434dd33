"""Decode, scheduler side: what the local sidecar says about the reservations the engine awaits.

The decode scheduler admits a request only once its KV has landed, and then
the worker copies it in that same step, before the forward pass (a
synchronous load). So the scheduler itself must hear LANDED: this watch holds
one channel client in the scheduler's process, subscribes to each awaited
reservation, and keeps the last state heard per reservation (events arrive on
the client's reader thread). ``wait_change`` lets an idle scheduler sleep
until something arrives instead of spinning through empty steps.

Reservations the engine will not load (a local prefix-cache hit, a request
that ended first) are *released*: consumed as soon as they land, so their
landing blocks go back before the control plane's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvpush.connector.sidecar_link import SchedulerChannel, SidecarInfo
from kvpush.connector.sidecar_client import ChannelError, SidecarClient
from kvpush.contract.states import LandingState

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers



class LandingWatch(SchedulerChannel):
    def __init__(self, connect: Callable[[], tuple[SidecarClient, SidecarInfo]]):
        super().__init__(connect)
        self.on_landed: Callable[[str], None] | None = None  # (reservation id), on the reader thread: tracing
        self._cv = threading.Condition()
        self._states: dict[str, tuple[LandingState, int]] = {}  # reservation -> (last state heard, tokens)
        self._src_tp: dict[str, int] = {}  # landed reservations pushed by a TP > 1 prefill: its TP
        self._released: dict[str, float] = {}  # reservation -> give-up time (monotonic)
        self._generation = 0  # bumped on every LANDED or end heard
        self._consumed_releases = 0  # released reservations consumed since the last take

    # -- the reservations a request waits for ---------------------------------------------------------
    def watch(self, reservation_id: str) -> tuple[LandingState, int]:
        """Subscribe to a reservation; its state now. ``ChannelError`` if the sidecar is unreachable."""
        event = self._client_or_reconnect().subscribe(reservation_id)
        self._record(event.reservation_id, event.state, event.num_tokens, event.src_tp)
        return self.state(reservation_id)

    def state(self, reservation_id: str) -> tuple[LandingState, int]:
        with self._cv:
            return self._states.get(reservation_id, (LandingState.UNKNOWN, 0))

    def src_tp(self, reservation_id: str) -> int:
        """The TP of the prefill engine that pushed a landed reservation."""
        with self._cv:
            return self._src_tp.get(reservation_id, 1)

    @property
    def generation(self) -> int:
        with self._cv:
            return self._generation

    def wait_change(self, generation: int, timeout_s: float) -> bool:
        """Sleep until a LANDED or an end is heard after ``generation`` was read (or timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._generation != generation, timeout_s)

    def forget(self, reservation_id: str) -> None:
        with self._cv:
            self._src_tp.pop(reservation_id, None)
            if reservation_id not in self._released:
                self._states.pop(reservation_id, None)

    def recomputed(self, reservation_id: str, reason: str) -> None:
        """Tell the sidecar the engine computes this reservation's prompt itself."""
        try:
            if self._client is not None:
                self._client.recomputed_nowait(reservation_id, reason)
        except (ChannelError, OSError) as exc:  # a closed channel: the count is lost, not the request
            log.debug("could not tell the sidecar of a recompute: %s", exc)

    def release(self, reservation_id: str, give_up: float) -> None:
        """The engine will not load this reservation: consume it once it lands (until ``give_up``)."""
        with self._cv:
            state = self._states.get(reservation_id, (LandingState.UNKNOWN, 0))[0]
            if state.ended:
                self._states.pop(reservation_id, None)
                return
            self._released[reservation_id] = give_up
        if state == LandingState.LANDED:
            self._consume_released(reservation_id)

    def housekeeping(self) -> None:
        """Give up releases past their time (the control plane's deadline frees those blocks)."""
        now = time.monotonic()
        with self._cv:
            for res in [r for r, give_up in self._released.items() if give_up <= now]:
                del self._released[res]
                self._states.pop(res, None)
        if self._client is not None:
            self._client.events()  # handled as they came (_on_event): drop the client's copies

    def take_consumed_releases(self) -> int:
        with self._cv:
            n, self._consumed_releases = self._consumed_releases, 0
            return n

    @property
    def released(self) -> int:
        with self._cv:
            return len(self._released)

    # -- events (the client's reader thread) -------------------------------------------------------
    def _attach(self, client: SidecarClient) -> None:
        client.on_event = self._on_event

    def _on_event(self, event) -> None:
        if not event.request_id:
            self._record(event.reservation_id, event.state, event.num_tokens, event.src_tp)

    def _record(self, reservation_id: str, state: str, num_tokens: int, src_tp: int = 1) -> None:
        state = LandingState(state)  # the channel carries the value: converted here, once
        arrived = state == LandingState.LANDED or state.ended
        with self._cv:
            current = self._states.get(reservation_id)
            if current is not None and (current[0] == LandingState.LANDED or current[0].ended) and not state.ended:
                return  # a late subscribe answer never undoes what an event said
            self._states[reservation_id] = (state, num_tokens)
            if state == LandingState.LANDED and src_tp != 1:
                self._src_tp[reservation_id] = src_tp
            elif state.ended:
                self._src_tp.pop(reservation_id, None)
            released = reservation_id in self._released
            if arrived:
                self._generation += 1
                self._cv.notify_all()
        if state == LandingState.LANDED and self.on_landed is not None:
            self.on_landed(reservation_id)
        if released and state == LandingState.LANDED:
            self._consume_released(reservation_id)
        elif released and state.ended:
            with self._cv:
                self._released.pop(reservation_id, None)
                self._states.pop(reservation_id, None)

    def _consume_released(self, reservation_id: str) -> None:
        with self._cv:
            if self._released.pop(reservation_id, None) is None:
                return  # consumed already (event and release raced)
            self._states.pop(reservation_id, None)
            self._consumed_releases += 1
        try:
            self._client.consumed_nowait(reservation_id)
        except (ChannelError, AttributeError) as exc:
            log.warning("CONSUMED for released reservation %s not sent: %s", reservation_id, exc)

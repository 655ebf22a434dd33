"""The decode sidecar's table of incoming reservations.

The decode side never initiates a transfer: prefill sidecars write into its
landing pool and notify it. This table turns their notifications into states:

    (unknown) --BEGIN--> PUSHING --LANDED notice, checks pass--> LANDED --consume--> CONSUMED
         any live state --ABORT notice / bad LANDED--> FAILED
         any live state, or LANDED --cancel (control plane: deadline, release)--> CANCELLED
         EXPECTED/PUSHING for longer than ``landing_timeout_s`` (when set) --> FAILED

Tensor parallelism: every rank has a landing pool (the same block ids on each); one
LANDED notice covers every rank's share, and the reservation is CONSUMED once every
rank's connector has copied its share out (``consume`` per rank).

LANDED is set only from the LANDED notification, which the pusher sends with
its final write after every other write of the reservation is DONE, so
partial data is never LANDED. Before accepting it the table checks that the
notice is for this incarnation, that the block size and ids fit the pool and,
when the pusher sent checksums, that every block's bytes match.

A state change goes to subscribers (the local connector, through the
channel) at once: the engine waits on it, and a subscriber only queues a
frame. It goes to ``on_event`` (the sidecar main reports to the control
plane) with ``call_soon``, off the path that handles notifications.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Callable

from kvpush.contract.layout import LayoutError
from kvpush.contract.states import LandingState
from kvpush.trace import Trace
from kvpush.sidecar import notify
from kvpush.channel.geometry import DestGeometry
from kvpush.sidecar.descriptors import blocks_segment_map, block_checksums
from kvpush.sidecar.pools import LandingPool
from kvpush.sidecar.progress import ProgressDriver

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LandingEvent:
    reservation_id: str
    state: LandingState
    reason: str = ""
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    source_agent: str = ""
    src_tp: int = 1  # the pusher's tensor-parallel ranks: how its heads landed (kvpush/channel/head_plan.py)


@dataclasses.dataclass(frozen=True)
class LandingConfig:
    hot_timeout_s: float = 10.0  # poll hot at most this long after a BEGIN or an expect()
    keep_ended_s: float = 60.0  # answer queries about ended reservations this long
    # FAILED when nothing LANDED this long after the engine expected it or a pusher
    # began (0: off). A safety net for when the control plane cannot tell us.
    landing_timeout_s: float = 0.0


@dataclasses.dataclass
class _Entry:
    state: LandingState
    updated: float
    reason: str = ""
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    source: str = ""
    subscribers: list = dataclasses.field(default_factory=list)
    created: float = 0.0
    src_tp: int = 1
    consumed_ranks: set = dataclasses.field(default_factory=set)

    def event(self, rid: str) -> LandingEvent:
        return LandingEvent(rid, self.state, self.reason, self.block_ids, self.num_tokens, self.source, self.src_tp)


class LandingTable:
    def __init__(self, pools: list[LandingPool], incarnation: str, driver: ProgressDriver,
                 config: LandingConfig = LandingConfig(),
                 on_event: Callable[[LandingEvent], None] | None = None):
        self.pools = pools  # one per rank, laid out alike
        self.pool = pools[0]
        self.incarnation = incarnation
        self.driver = driver
        self.config = config
        self.on_event = on_event
        self._entries: dict[str, _Entry] = {}
        self._next_gc = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.counters: dict[str, int] = {"landed": 0, "failed": 0, "ignored": 0, "final_notices": 0}
        self.trace = Trace.off()

    # -- notifications ----------------------------------------------------------------
    def handle_notif(self, sender: str, message: bytes) -> None:
        try:
            notice = notify.decode(message)
        except notify.NotifError as exc:
            self.counters["ignored"] += 1
            log.warning("ignoring notification from %s: %s", sender, exc)
            return
        if notice.incarnation != self.incarnation:
            self.counters["ignored"] += 1
            log.warning("ignoring %s for %s: incarnation %r is not ours (%r)", notice.kind,
                        notice.reservation_id, notice.incarnation, self.incarnation)
            return
        rid = notice.reservation_id
        self.trace("notif", rid, notice.kind)
        entry = self._entry(rid)
        if entry.state.terminal:
            log.info("%s notice for %s ignored: already %s", notice.kind, rid, entry.state.value)
            return
        entry.source = sender
        if notice.kind in (notify.BEGIN, notify.FINAL):
            self._set(rid, entry, LandingState.PUSHING)
            if notice.kind == notify.FINAL:  # the last write is on its way: see its end promptly
                self.counters["final_notices"] += 1
                self.driver.expect_at(rid, time.monotonic() + notice.eta_s, self.config.hot_timeout_s)
            else:
                self.driver.expect(rid, self.config.hot_timeout_s)
            self._arm_timeout()
        elif notice.kind == notify.ABORT:
            self._set(rid, entry, LandingState.FAILED, f"pusher aborted: {notice.reason}")
        elif notice.kind == notify.LANDED:
            problem = self._check_landed(notice)
            if problem:
                self._set(rid, entry, LandingState.FAILED, problem)
            else:
                entry.block_ids, entry.num_tokens, entry.src_tp = notice.block_ids, notice.num_tokens, notice.src_tp
                self._set(rid, entry, LandingState.LANDED)

    def _check_landed(self, notice: notify.PushNotice) -> str:
        layout = self.pool.layout
        if notice.block_size != layout.block_size:
            return f"block size {notice.block_size} != landing pool's {layout.block_size}"
        if notice.num_tokens <= 0:
            return "no tokens"
        geom = DestGeometry.for_layout(layout, notice.block_size, notice.num_tokens)
        if len(notice.block_ids) != geom.num_blocks:
            return f"{len(notice.block_ids)} blocks for {notice.num_tokens} tokens (need {geom.num_blocks})"
        if min(notice.block_ids) < 0 or max(notice.block_ids) >= self.pool.num_blocks:
            return "block ids outside the landing pool"
        try:
            dataclasses.replace(layout, tp_size=notice.src_tp)  # (KvLayout holds the rule)
        except LayoutError:
            return f"a prefill engine of tp {notice.src_tp} cannot hold our {layout.num_kv_heads} KV heads"
        if notice.checksums is None:
            return ""
        if self.pool.memory.mem_kind != "DRAM":  # debug checksums read host memory; a VRAM pool has none
            self.counters["unverifiable"] = self.counters.get("unverifiable", 0) + 1
            return ""
        if len(notice.checksums) != geom.num_blocks:
            return "wrong number of checksums"
        base = self.pool.base_address
        mine = block_checksums(geom, layout.num_layers, self.pool.memory.host_view(), base,
                               lambda layer: blocks_segment_map(notice.block_ids, geom.block_layer_bytes,
                                                                base + layer * self.pool.layer_stride))
        bad = [notice.block_ids[i] for i, (a, b) in enumerate(zip(mine, notice.checksums)) if a != b]
        if bad:
            return f"checksum mismatch in landing blocks {bad[:8]}"
        self.counters["verified"] = self.counters.get("verified", 0) + 1
        return ""

    # -- the local engine's calls ---------------------------------------------------------
    def query(self, reservation_id: str) -> LandingEvent:
        entry = self._entries.get(reservation_id)
        if entry is None:
            return LandingEvent(reservation_id, LandingState.UNKNOWN)
        return entry.event(reservation_id)

    def expect(self, reservation_id: str) -> LandingEvent:
        """The engine is waiting for this reservation: poll hot for it."""
        entry = self._entry(reservation_id)
        if entry.state == LandingState.UNKNOWN:
            entry.state = LandingState.EXPECTED
        if not entry.state.terminal:
            self.driver.expect(reservation_id, self.config.hot_timeout_s)
            self._arm_timeout()
        return entry.event(reservation_id)

    def subscribe(self, reservation_id: str, callback: Callable[[LandingEvent], None]) -> LandingEvent:
        """Call ``callback`` once when the reservation ends; returns its state now
        (if already ended, the callback is not called: the answer is the event)."""
        event = self.expect(reservation_id)
        if not event.state.terminal:
            self._entries[reservation_id].subscribers.append(callback)
        return event

    def unsubscribe(self, reservation_id: str, callback) -> None:
        entry = self._entries.get(reservation_id)
        if entry is not None and callback in entry.subscribers:
            entry.subscribers.remove(callback)

    def cancel(self, reservation_id: str, reason: str = "cancelled") -> bool:
        """The control plane ended the reservation (deadline, release): a late LANDED is
        ignored, and a LANDED one not yet consumed can no longer be (its blocks are
        free again and may be reserved for someone else)."""
        entry = self._entry(reservation_id)
        if entry.state.terminal and entry.state != LandingState.LANDED:
            return False
        self._set(reservation_id, entry, LandingState.CANCELLED, reason)
        return True

    def consume(self, reservation_id: str, rank: int | None = None) -> bool:
        """The engine (``rank`` of it; None: all of it) copied its KV out, or will not;
        once every rank has, the blocks can go back to the control plane."""
        entry = self._entries.get(reservation_id)
        if entry is None or entry.state != LandingState.LANDED:
            return False
        if rank is None:
            entry.consumed_ranks.update(range(len(self.pools)))
        elif 0 <= rank < len(self.pools):
            entry.consumed_ranks.add(rank)
        else:
            return False
        if len(entry.consumed_ranks) == len(self.pools):
            self._set(reservation_id, entry, LandingState.CONSUMED)
        return True

    def live_reservations(self) -> list[str]:
        """Reservations still expected here, or landed and not yet consumed."""
        return [rid for rid, e in self._entries.items()
                if not e.state.terminal or e.state == LandingState.LANDED]

    def landed_blocks(self) -> int:
        """Landing blocks holding KV that landed and was not consumed yet."""
        return sum(len(e.block_ids) for e in self._entries.values() if e.state == LandingState.LANDED)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # -- internals --------------------------------------------------------------------------
    def _entry(self, rid: str) -> _Entry:
        entry = self._entries.get(rid)
        if entry is None:
            self._gc()
            now = time.monotonic()
            entry = self._entries[rid] = _Entry(LandingState.UNKNOWN, now, created=now)
        return entry

    def _arm_timeout(self) -> None:
        timeout = self.config.landing_timeout_s
        if timeout > 0 and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(min(1.0, timeout / 2), self._fail_overdue)

    def _fail_overdue(self) -> None:
        """Once a second while anything is awaited: FAILED for what waited too long."""
        self._timer = None
        timeout, now, waiting = self.config.landing_timeout_s, time.monotonic(), False
        for rid, entry in list(self._entries.items()):
            if entry.state in (LandingState.EXPECTED, LandingState.PUSHING):
                if now - entry.created >= timeout:
                    self._set(rid, entry, LandingState.FAILED, f"nothing landed within {timeout:g} s")
                else:
                    waiting = True
        if waiting:
            self._arm_timeout()

    def _set(self, rid: str, entry: _Entry, state: LandingState, reason: str = "") -> None:
        entry.state, entry.reason, entry.updated = state, reason, time.monotonic()
        if not state.terminal:
            return
        self.driver.unexpect(rid)
        if state == LandingState.LANDED:
            self.counters["landed"] += 1
        elif state == LandingState.FAILED:
            self.counters["failed"] += 1
            log.warning("reservation %s FAILED: %s", rid, reason, extra={"reservation_id": rid})
        event = entry.event(rid)
        subscribers, entry.subscribers = entry.subscribers, []
        for callback in subscribers:
            try:
                callback(event)
            except Exception:
                log.exception("subscriber of %s failed", rid)
        if self.on_event is not None:
            asyncio.get_running_loop().call_soon(self.on_event, event)

    def _gc(self) -> None:
        now = time.monotonic()
        if now < self._next_gc:  # at most once a second: this walks the whole table
            return
        self._next_gc = now + 1.0
        cutoff = now - self.config.keep_ended_s
        stale = [rid for rid, e in self._entries.items() if e.updated < cutoff and
                 (e.state.terminal or not e.subscribers)]
        for rid in stale:
            del self._entries[rid]

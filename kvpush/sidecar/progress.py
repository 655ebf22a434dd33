"""Driving NIXL progress from the sidecar's asyncio loop, cheaply.

With NIXL's progress thread off, nothing moves unless somebody calls into the
agent. On this stack (UCX over tcp + cma: RMA is emulated over active
messages) that matters on *both* ends: the initiator's WRITE only reaches DONE
after the target has progressed, and a notification is only seen when the
target polls. So a sidecar polls:

* **hot** (``hot_interval_s``, sub-millisecond) while transfers are in flight
  or a push towards it is known to be under way (``expect``): this is on the
  critical path of the last layer, so it must be fine-grained;
* **fine** (``fine_interval_s``, ~0.1 ms) in a short window announced by
  ``expect_at``: around the moment a known final write should complete (the
  pusher sends its estimate ahead), so the notification that ends the push is
  seen within a tenth of a millisecond; the window is bounded, so a wrong
  estimate costs a few polls, never a spinning loop;
* **warm** (``warm_interval_s``) for a short while after activity, to catch
  follow-ups (the next request, a connection set-up) without a slow start;
* **idle** (``idle_interval_s``) otherwise: a few cheap wake-ups a second, so an
  idle sidecar stays far below 2% of a core.

asyncio's own timers have 1 ms resolution (epoll), too coarse for the hot
interval, so the driver ticks on a periodic Linux ``timerfd`` watched by the
loop (``Ticker``): sub-millisecond polls without blocking the loop, spinning,
or a coroutine switch per tick. Where timerfd is unavailable it falls back to
``loop.call_later``.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import time
from typing import Callable

from kvpush.sidecar.transport.base import DONE, ERR, PROC, Transport

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PollPolicy:
    # Measured on the 2-core VM: one loop wake-up costs ~30-40 us of CPU whatever
    # the period, so hot polling costs ~8% of a core at 0.5 ms (~4% at 1 ms,
    # ~15% at 0.2 ms) and adds half a period on average to the last layer.
    hot_interval_s: float = 0.0005
    # ~35% of a core while fine, for well under a millisecond per request.
    fine_interval_s: float = 0.0001
    fine_window_s: float = 0.003  # longest fine window after the expected moment
    warm_interval_s: float = 0.002
    warm_window_s: float = 0.1
    idle_interval_s: float = 0.05


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Ticker:
    """Calls ``callback`` every ``interval`` seconds from the asyncio loop.

    A periodic Linux timerfd watched by the loop: sub-millisecond periods
    without a coroutine, a future or a re-arm per tick (a tick is one read of
    the fd and the callback); re-armed only when the period changes. Without
    timerfd, a ``call_later`` chain at asyncio's millisecond resolution.
    """

    _CLOCK_MONOTONIC = 1
    _TFD_NONBLOCK = 0o4000
    _TFD_CLOEXEC = 0o2000000

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]):
        self._loop = loop
        self._callback = callback
        self._interval = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._fd = -1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            self._settime = libc.timerfd_settime
            self._settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p]
            fd = libc.timerfd_create(self._CLOCK_MONOTONIC, self._TFD_NONBLOCK | self._TFD_CLOEXEC)
            if fd < 0:
                raise OSError(ctypes.get_errno(), "timerfd_create")
            self._fd = fd
            loop.add_reader(fd, self._on_fd)
        except (OSError, AttributeError, NotImplementedError) as exc:  # not Linux / no add_reader
            log.info("timerfd unavailable (%s); progress polls at asyncio timer resolution", exc)
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = -1

    @property
    def fine(self) -> bool:
        return self._fd >= 0

    def set_interval(self, seconds: float, fire_soon: bool = False) -> None:
        """Tick every ``seconds`` from now on; ``fire_soon``: the first tick right away."""
        self._interval = seconds
        if self._fd >= 0:
            period = max(1000, int(seconds * 1e9))
            first = 1000 if fire_soon else period  # 0 would disarm the timer
            spec = _Itimerspec(_Timespec(period // 1_000_000_000, period % 1_000_000_000),
                               _Timespec(first // 1_000_000_000, first % 1_000_000_000))
            if self._settime(self._fd, 0, ctypes.byref(spec), None) != 0:
                raise OSError(ctypes.get_errno(), "timerfd_settime")
        else:
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._loop.call_later(0 if fire_soon else seconds, self._on_later)

    def _on_fd(self) -> None:
        try:
            os.read(self._fd, 8)  # expiration count; missed ticks are not replayed
        except BlockingIOError:
            return
        self._run()

    def _on_later(self) -> None:
        self._handle = self._loop.call_later(self._interval, self._on_later)
        self._run()

    def _run(self) -> None:
        try:
            self._callback()
        except Exception:
            log.exception("progress tick failed")

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


@dataclasses.dataclass
class TrackedTransfer:
    handle: object
    deadline: float  # time.monotonic()
    on_done: Callable[[bool, str], None]  # (ok, error message): the outcome, as soon as known
    label: str
    posted_at: float
    # Called once NIXL has released the handle: only then has the transfer
    # stopped touching memory (a cancelled write may still read its source).
    on_released: Callable[[], None] | None = None


class ProgressDriver:
    """Polls the transport for transfer completions and notifications, adaptively.

    ``track`` a posted transfer to get its completion callback; ``expect`` a
    key (e.g. a reservation id) to stay hot until ``unexpect`` or its timeout;
    notifications go to ``on_notif(sender_agent, message)``.
    """

    def __init__(self, transport: Transport, policy: PollPolicy = PollPolicy(),
                 on_notif: Callable[[str, bytes], None] | None = None):
        self.transport = transport
        self.policy = policy
        self.on_notif = on_notif
        self._inflight: list[TrackedTransfer] = []
        self._unreleased: list[TrackedTransfer] = []  # failed transfers NIXL would not release yet
        self._expecting: dict[object, float] = {}  # key -> monotonic deadline
        self._fine: dict[object, tuple[float, float]] = {}  # key -> (fine from, fine until)
        self._last_activity = 0.0
        self._ticker: Ticker | None = None
        self._interval = policy.idle_interval_s
        self.polls = 0

    # -- registration -------------------------------------------------------------
    def track(self, handle, timeout_s: float, on_done: Callable[[bool, str], None], label: str = "",
              on_released: Callable[[], None] | None = None) -> None:
        now = time.monotonic()
        self._inflight.append(TrackedTransfer(handle, now + timeout_s, on_done, label, now, on_released))
        self.wake()

    def expect(self, key, timeout_s: float) -> None:
        self._expecting[key] = time.monotonic() + timeout_s
        self.wake()

    def expect_at(self, key, at: float, timeout_s: float) -> None:
        """Something ends for ``key`` at about ``at`` (monotonic): poll fine from one
        hot period before it until ``unexpect`` or ``fine_window_s`` after it; hot
        otherwise, until ``timeout_s``."""
        self._fine[key] = (at - self.policy.hot_interval_s, at + self.policy.fine_window_s)
        self.expect(key, timeout_s)
        self._retune()

    def unexpect(self, key) -> None:
        self._expecting.pop(key, None)
        self._fine.pop(key, None)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def wake(self) -> None:
        """There is work (a transfer posted, a push expected): poll now, then hot."""
        self._last_activity = time.monotonic()
        if self._ticker is not None and self._interval > self.policy.hot_interval_s:
            self._interval = self.next_interval()
            self._ticker.set_interval(self._interval, fire_soon=True)

    # -- polling --------------------------------------------------------------------
    def poll_once(self) -> bool:
        """One round of progress; True when anything happened."""
        self.polls += 1
        now = time.monotonic()
        busy = False
        if self._inflight:
            # Callbacks may post (and track) new transfers: they land in the
            # fresh list and are checked on the next round.
            current, self._inflight, still = self._inflight, [], []
            for xfer in current:
                state = self.transport.check(xfer.handle)
                if state == PROC and now < xfer.deadline:
                    still.append(xfer)
                    continue
                busy = True
                released = self.transport.release(xfer.handle)  # cancels it if still running
                if state == DONE:
                    self._complete(xfer, True, "")
                else:
                    self._complete(xfer, False, "transfer failed" if state == ERR else
                                   f"transfer not done after {now - xfer.posted_at:.3f} s")
                if released:
                    self._released(xfer)
                else:
                    self._unreleased.append(xfer)
            self._inflight = still + self._inflight
        if self._unreleased:
            stuck, self._unreleased = self._unreleased, []
            for xfer in stuck:
                if self.transport.release(xfer.handle):
                    self._released(xfer)
                else:
                    self._unreleased.append(xfer)
        notifs = self.transport.poll_notifs()
        for sender, messages in notifs.items():
            for message in messages:
                busy = True
                if self.on_notif is not None:
                    try:
                        self.on_notif(sender, message)
                    except Exception:
                        log.exception("notification handler failed for a message from %s", sender)
        if self._expecting:
            for key in [k for k, deadline in self._expecting.items() if deadline <= now]:
                del self._expecting[key]
        if self._fine:
            for key in [k for k, (_, until) in self._fine.items() if until <= now]:
                del self._fine[key]
        if busy:
            self._last_activity = now
        return busy

    def _complete(self, xfer: TrackedTransfer, ok: bool, error: str) -> None:
        try:
            xfer.on_done(ok, error)
        except Exception:
            log.exception("completion callback of %s failed", xfer.label)

    def _released(self, xfer: TrackedTransfer) -> None:
        if xfer.on_released is not None:
            try:
                xfer.on_released()
            except Exception:
                log.exception("release callback of %s failed", xfer.label)

    def next_interval(self) -> float:
        p = self.policy
        if self._fine:
            now = time.monotonic()
            if any(start <= now for start, _ in self._fine.values()):
                return p.fine_interval_s
        if self._inflight or self._expecting or self._unreleased:
            return p.hot_interval_s
        if time.monotonic() - self._last_activity < p.warm_window_s:
            return p.warm_interval_s
        return p.idle_interval_s

    def start(self) -> None:
        """Start ticking on the running loop (idle period until there is work)."""
        self._ticker = Ticker(asyncio.get_running_loop(), self._tick)
        self._interval = self.next_interval()
        self._ticker.set_interval(self._interval, fire_soon=True)

    def _tick(self) -> None:
        self.poll_once()
        self._retune()

    def _retune(self) -> None:
        if self._ticker is None:
            return
        want = self.next_interval()
        if want != self._interval:
            self._interval = want
            self._ticker.set_interval(want)

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.close()
            self._ticker = None
        for xfer in self._inflight + self._unreleased:  # the sidecar is going away: fail what is left
            self.transport.release(xfer.handle)
            if xfer in self._inflight:
                self._complete(xfer, False, "sidecar stopping")
            self._released(xfer)
        self._inflight.clear()
        self._unreleased.clear()


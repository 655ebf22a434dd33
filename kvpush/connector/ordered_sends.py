"""Channel frames that may go out only once the GPU has done something, in the order given.

A copy on the GPU is enqueued, not done, when ``stage`` or ``load`` returns: the PUSH
that lets the sidecar read the staged bytes, and the CONSUMED that lets it reuse the
landing blocks, must wait for it, and the forward pass must not. So the worker hands each
frame to ``OrderedSends.send`` with the copier's fence; one thread waits on the fences
(asleep: a blocking-sync CUDA event) and sends the frames, in the order they were given,
so that a request's END still follows its last PUSH. A frame with no fence and nothing
queued ahead of it (every frame of a CPU engine) is sent at once, on the caller's thread:
the CPU path keeps its timing and needs no thread.

All ``send`` calls come from one thread (the one running the forward pass).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

from kvpush.connector.copiers.copier import Fence

log = logging.getLogger(f"vllm.{__name__}")


class OrderedSends:
    def __init__(self, name: str = "kvpush-sends"):
        self._name = name
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0  # queued or being sent by the thread
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        return self._pending

    def send(self, fence: Fence | None, frame: Callable[[], None]) -> None:
        """Run ``frame()`` once ``fence`` (if any) has passed and every frame given before
        has run. ``frame`` handles its own errors; one that raises is logged."""
        with self._cond:
            inline = fence is None and self._pending == 0
            if not inline:
                if self._closed:
                    raise RuntimeError("OrderedSends is closed")
                self._pending += 1
                self._queue.append((fence, frame))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._cond.notify()
        if inline:
            _run_one(None, frame)

    def drain(self, timeout_s: float) -> bool:
        """Wait until everything given so far has been sent; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        if not self.drain(timeout_s):
            log.warning("kvpush: %d frames still waiting on the GPU at close; dropped", self._pending)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                fence, frame = self._queue.popleft()
            _run_one(fence, frame)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()


def _run_one(fence: Fence | None, frame: Callable[[], None]) -> None:
    try:
        if fence is not None:
            fence.wait()
        frame()
    except Exception:  # a frame must not take the sender down with it
        log.exception("kvpush: a channel frame failed")

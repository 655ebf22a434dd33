"""Whether the vLLM engine beside this sidecar is there, from its channel connections.

The engine's processes (its scheduler and each worker) hold channel connections to
the sidecar for as long as they live, each opened with ``engine: true`` in its HELLO
(benchmarks' and tools' connections are not the engine). When the last one closes
the engine has exited or crashed: after ``grace_s`` without a new one (a connector
reconnecting is not a death) the engine is unavailable, and ``on_change`` tells the
service, which tells the control plane. The first engine connection makes it
available again. A sidecar started with ``wait_for_engine`` is unavailable until its
engine first connects, so no reservation lands on an engine still loading its model.

Called on the event loop only (the channel server's callbacks run there).
"""

from __future__ import annotations

import asyncio
from typing import Callable

NOT_YET = "engine not connected yet"
GONE = "engine's connections to its sidecar closed (engine exited or crashed)"


class EnginePresence:
    def __init__(self, wait_for_engine: bool, grace_s: float = 1.0,
                 on_change: Callable[[str], None] | None = None):
        self.unavailable = NOT_YET if wait_for_engine else ""  # "" = available
        self.grace_s = grace_s
        self.on_change = on_change
        self.departures = 0
        self._links: set = set()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def links(self) -> int:
        return len(self._links)

    def connected(self, conn: object) -> None:
        self._links.add(conn)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._set("")

    def disconnected(self, conn: object) -> None:
        if conn not in self._links:
            return
        self._links.discard(conn)
        if not self._links and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.grace_s, self._gone)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _gone(self) -> None:
        self._timer = None
        if not self._links:
            self.departures += 1
            self._set(GONE)

    def _set(self, unavailable: str) -> None:
        if unavailable != self.unavailable:
            self.unavailable = unavailable
            if self.on_change is not None:
                self.on_change(unavailable)

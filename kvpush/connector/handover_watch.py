"""Prefill, scheduler side: the reservations of requests that arrived before them.

The router sends a prefill request without waiting for its Reserve answer
(``kvpush.contract.transfer_params.AwaitParams``); the prefill sidecar hears the reservation
through the control plane's watch (``kvpush/sidecar/handover.py``). This holds one channel
client in the scheduler's process: ``expect`` asks the sidecar (AWAIT) once per
request and keeps what comes back, at once or later by a RESERVATION frame on the
client's reader thread; ``wait_change`` lets an idle scheduler sleep until one
arrives instead of stepping through empty steps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvpush.connector.sidecar_link import SchedulerChannel
from kvpush.connector.sidecar_client import SidecarClient


class HandoverWatch(SchedulerChannel):
    def __init__(self, connect: Callable[[], tuple[SidecarClient, object]]):
        super().__init__(connect)
        self._cv = threading.Condition()
        self._params: dict[str, dict] = {}     # request id -> PushParams dict, once heard
        self._expected: set[str] = set()
        self.generation = 0                    # bumped on every reservation heard

    def _attach(self, client: SidecarClient) -> None:
        client.on_reservation = self._on_reservation

    def expect(self, request_id: str) -> None:
        """Ask the sidecar for the reservation made under ``request_id``."""
        with self._cv:
            self._expected.add(request_id)
        params = self._client_or_reconnect().await_reservation(request_id)
        if params is not None:
            self._on_reservation(request_id, params)

    def _on_reservation(self, request_id: str, params: dict) -> None:
        with self._cv:
            if request_id not in self._expected:
                return
            self._params[request_id] = params
            self.generation += 1
            self._cv.notify_all()

    def get(self, request_id: str) -> dict | None:
        with self._cv:
            return self._params.get(request_id)

    def forget(self, request_id: str) -> None:
        with self._cv:
            self._expected.discard(request_id)
            self._params.pop(request_id, None)

    def wait_change(self, generation: int, timeout_s: float) -> None:
        with self._cv:
            if self.generation == generation and timeout_s > 0:
                self._cv.wait(timeout_s)

"""Keeps the control plane's word on whether this engine can serve equal to the
sidecar's (``kvpush/sidecar/engine_presence.py``), through ``Registry.SetEngineAvailability``.

Each registration carries the availability of its moment, and its answer says what
the control plane stored; every change after it is sent, the newest state only,
retried with backoff while the control plane is away. A report refused because the
engine is not registered (or this life is not its current one) waits for the next
registration, which carries the state itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from kvpush.contract.v1 import registry_pb2, types_pb2
from kvpush.sidecar.membership import Backoff, ControlPlaneLink, ServiceConfig, guarded, rpc_error_text, status_code

log = logging.getLogger("kvpush.sidecar")
WAIT_FOR_REGISTRATION = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


class AvailabilityReport:
    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine_id: str, incarnation: str,
                 wanted: Callable[[], str]):
        """``wanted()``: the engine's availability now ("" or why it cannot serve)."""
        self.link, self.config = link, config
        self.engine_id, self.incarnation = engine_id, incarnation
        self.wanted = wanted
        self.acked: str | None = None  # what the control plane holds; None until registered
        self.reports = 0
        self._wake = asyncio.Event()
        self._stopping = False

    def registered(self, engine: types_pb2.Engine) -> None:
        self.acked = engine.unavailable
        self._wake.set()

    def changed(self, _unavailable: str = "") -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while not self._stopping and self.acked is not None and self.acked != (want := self.wanted()):
                client = self.link.client
                request = registry_pb2.SetEngineAvailabilityRequest(engine_id=self.engine_id,
                                                                    incarnation=self.incarnation, unavailable=want)
                try:
                    resp = await guarded(client.registry.SetEngineAvailability(
                        request, metadata=client.metadata, timeout=self.config.rpc_timeout_s))
                except Exception as exc:
                    if status_code(exc) in WAIT_FOR_REGISTRATION:
                        self.acked = None
                        break
                    log.warning("availability report failed (%s); retrying", rpc_error_text(exc))
                    await asyncio.sleep(backoff.next())
                    continue
                backoff.reset()
                self.acked = resp.engine.unavailable
                self.reports += 1
                if want:
                    log.warning("engine %s reported unavailable (%s); %d reservations ended", self.engine_id, want,
                                resp.reservations_failed)
                else:
                    log.info("engine %s reported available again", self.engine_id)

"""The engines a router sends requests to: fixed by ``--prefill``/``--decode``, or
followed from the registry (``Scheduler.WatchEngines``) when no flag names any.

Following the registry, an engine is served from the moment its sidecar registers it
with a serving URL and is available, and dropped when it deregisters, its lease runs
out, or its sidecar reports it unavailable (its vLLM engine went away). The watch is
a stream, not polling: a change reaches the router as etcd applies it. When the
stream breaks the router keeps the engines it knew (the control plane refuses
reservations on dead ones meanwhile) and watches again with a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush import log
from kvpush.contract.v1 import scheduler_pb2, types_pb2
from kvpush.router.config import DecodeEngine, RouterConfig

_log = log.get("router")
Event = scheduler_pb2.EngineEvent
RETRY_MIN_S, RETRY_MAX_S = 0.2, 5.0


@dataclasses.dataclass(frozen=True)
class Engines:
    """One consistent set: prefill (url, engine id) pairs, decode engines."""
    prefill: tuple[tuple[str, str], ...] = ()
    decode: tuple[DecodeEngine, ...] = ()


class EngineDirectory:
    def __init__(self, cfg: RouterConfig, cp: ControlPlaneClient | None = None):
        self.cfg = cfg
        self.cp = cp
        self.discovering = not (cfg.prefill_urls or cfg.decode)
        self.engines = Engines(tuple(zip(cfg.prefill_urls, cfg.prefill_ids or ("",) * len(cfg.prefill_urls))),
                               cfg.decode)
        self.ready = asyncio.Event()
        self.events = 0
        self.watches = 0
        self._known: dict[str, types_pb2.Engine] = {}
        self._task: asyncio.Task | None = None
        if not self.discovering:
            self.ready.set()

    # -- what the dispatcher asks ---------------------------------------------------------------
    def prefill_urls(self) -> list[str]:
        return [url for url, _ in self.engines.prefill]

    def prefill_id(self, url: str) -> str:
        return next((eid for u, eid in self.engines.prefill if u == url), "")

    def decode_urls(self) -> list[str]:
        return [d.url for d in self.engines.decode]

    def decode_url(self, engine_id: str) -> str | None:
        return next((d.url for d in self.engines.decode if d.engine_id == engine_id), None)

    def describe(self) -> dict:
        return {"source": "registry" if self.discovering else "flags",
                "prefill": {u: e for u, e in self.engines.prefill},
                "decode": {d.engine_id: d.url for d in self.engines.decode}}

    # -- following the registry -----------------------------------------------------------------
    def start(self) -> None:
        if self.discovering and self._task is None:
            self._task = asyncio.create_task(self._follow(), name="engine-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _follow(self) -> None:
        delay = RETRY_MIN_S
        while True:
            snapshot: dict[str, types_pb2.Engine] | None = {}
            try:
                self.watches += 1
                call = self.cp.scheduler.WatchEngines(scheduler_pb2.WatchEnginesRequest(model=self.cfg.model),
                                                      metadata=self.cp.metadata)
                async for event in call:
                    self.events += 1
                    if event.kind == Event.SNAPSHOT:
                        snapshot[event.engine.engine_id] = event.engine
                    elif event.kind == Event.SNAPSHOT_END:
                        self._known, snapshot = snapshot, None
                        self._publish()
                        self.ready.set()
                        delay = RETRY_MIN_S
                    elif event.kind == Event.CHANGED:
                        self._known[event.engine.engine_id] = event.engine
                        self._publish()
                    elif event.kind == Event.REMOVED:
                        known = self._known.get(event.engine.engine_id)
                        if known is not None and known.incarnation == event.engine.incarnation:
                            del self._known[event.engine.engine_id]
                            self._publish()
                _log.warning("engine watch ended by the control plane; watching again")
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                _log.warning("engine watch broke; keeping the engines known and watching again",
                             code=exc.code().name, error=(exc.details() or "")[:200], retry_s=round(delay, 2))
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    def _publish(self) -> None:
        usable = sorted((e for e in self._known.values() if e.serving_url and not e.unavailable),
                        key=lambda e: e.engine_id)
        engines = Engines(tuple((e.serving_url, e.engine_id) for e in usable if e.role == types_pb2.PREFILL),
                          tuple(DecodeEngine(e.engine_id, e.serving_url) for e in usable
                                if e.role == types_pb2.DECODE))
        if engines != self.engines:
            _log.info("engines changed", prefill=[u for u, _ in engines.prefill],
                      decode={d.engine_id: d.url for d in engines.decode})
            self.engines = engines

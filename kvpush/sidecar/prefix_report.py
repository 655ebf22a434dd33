"""Decode sidecar: what its engine's prefix cache holds, to the control plane, compactly.

The engine's KV events (``kvpush/sidecar/kv_events.py``) change the held set many times a
second while it serves; the control plane needs it only to choose a decode engine, so
changes are folded here and sent at most once per ``interval_s`` (one etcd write per
engine per interval, never one per event, and nothing on the token path), through
``Registry.ReportPrefixes`` (``kvpush/contract/prefixes.py`` for the snapshot/delta
rules). A snapshot (a new epoch) goes after every registration (a new lease took the
old report away), after the view was cleared (a gap in the events, a cache reset),
after any report that failed (the control plane may hold it or not), and every
``snapshot_every_s`` so a replica that lost its watch catches up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc

from kvpush.contract.prefixes import PrefixReport
from kvpush.sidecar.kv_events import HeldBlocks, HeldChange
from kvpush.sidecar.membership import Backoff, ControlPlaneLink, ServiceConfig, guarded, rpc_error_text, status_code

log = logging.getLogger("kvpush.sidecar")
WAIT_FOR_REGISTRATION = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


@dataclasses.dataclass(frozen=True)
class PrefixReportConfig:
    interval_s: float = 0.25  # at most one report this often
    snapshot_every_s: float = 30.0


class PrefixReporter:
    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine_id: str, incarnation: str,
                 held: HeldBlocks, block_size: int, timing: PrefixReportConfig = PrefixReportConfig()):
        self.link, self.config = link, config
        self.engine_id, self.incarnation = engine_id, incarnation
        self.held, self.block_size, self.timing = held, block_size, timing
        self.registered = False
        self.epoch, self.seq = 0, 0
        self._snapshot_due = True
        self._stored: dict[int, None] = {}
        self._removed: dict[int, None] = {}
        self._wake = asyncio.Event()
        self._stopping = False
        self.counters = {"snapshots": 0, "deltas": 0, "failed": 0}

    # -- inputs --------------------------------------------------------------------------------
    def on_registered(self) -> None:
        self.registered = True
        self._snapshot_due = True
        self._wake.set()

    def changed(self, change: HeldChange) -> None:
        if change.cleared:
            self._snapshot_due = True
        for key in change.removed:
            if self._stored.pop(key, 0) is not None:  # stored and gone within one interval: neither
                self._removed[key] = None
        for key in change.stored:
            self._removed.pop(key, None)
            self._stored[key] = None
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------------
    def _next(self) -> PrefixReport | None:
        if self._snapshot_due:
            self._snapshot_due = False
            self._stored.clear()
            self._removed.clear()
            self.epoch += 1
            self.seq = 0
            return PrefixReport(self.engine_id, self.incarnation, self.epoch, 0, tuple(self.held.keys()),
                                block_size=self.block_size)
        if not self._stored and not self._removed:
            return None
        self.seq += 1
        report = PrefixReport(self.engine_id, self.incarnation, self.epoch, self.seq, tuple(self._stored),
                              tuple(self._removed), self.block_size)
        self._stored.clear()
        self._removed.clear()
        return report

    async def run(self) -> None:
        backoff = Backoff(self.config.backoff_initial_s, self.config.backoff_max_s)
        loop = asyncio.get_running_loop()
        last_snapshot = loop.time()
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), self.timing.snapshot_every_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._stopping:
                break
            if loop.time() - last_snapshot >= self.timing.snapshot_every_s and self.seq > 0:
                self._snapshot_due = True  # (a last report that is a snapshot already lets a replica catch up)
            if not self.registered or self.held.unusable:
                continue
            report = self._next()
            if report is None:
                continue
            client = self.link.client
            try:
                await guarded(client.registry.ReportPrefixes(report.to_proto(), metadata=client.metadata,
                                                             timeout=self.config.rpc_timeout_s))
            except Exception as exc:
                self.counters["failed"] += 1
                self._snapshot_due = True  # the control plane may hold that report or not: start over
                if status_code(exc) in WAIT_FOR_REGISTRATION:
                    self.registered = False  # the next registration sends the snapshot
                else:
                    log.warning("prefix report failed (%s); retrying with a snapshot", rpc_error_text(exc))
                    await asyncio.sleep(backoff.next())
                    self._wake.set()
                continue
            backoff.reset()
            if report.snapshot:
                self.counters["snapshots"] += 1
                last_snapshot = loop.time()
            else:
                self.counters["deltas"] += 1
            await asyncio.sleep(self.timing.interval_s)  # what changes meanwhile goes in the next one

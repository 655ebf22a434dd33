"""Which prompt prefixes each decode engine holds, as this replica knows them.

Fed from the engines' prefix reports in etcd (``kvpush/contract/prefixes.py``; one key
per engine, bound to its lease) by the view's watch; read by Reserve to prefer the
decode engine that already holds most of a prompt. The rules that keep it from ever
claiming a block an engine dropped: a snapshot replaces an engine's keys; a delta is
applied only right after its predecessor; anything else (a gap, another incarnation)
forgets the engine's keys until its next snapshot.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from kvpush import log
from kvpush.contract.block_hash import leading_held
from kvpush.contract.prefixes import PrefixReport, PrefixReportError

_log = log.get("prefixes")


@dataclasses.dataclass
class _Held:
    incarnation: str
    epoch: int
    seq: int
    block_size: int
    keys: set
    synced: bool  # holds a snapshot and every delta since


class PrefixIndex:
    def __init__(self) -> None:
        self._engines: dict[str, _Held] = {}
        self.counters = {"snapshots": 0, "deltas": 0, "out_of_order": 0}

    def apply(self, report: PrefixReport) -> None:
        held = self._engines.get(report.engine_id)
        if report.snapshot:
            self._engines[report.engine_id] = _Held(report.incarnation, report.epoch, 0, report.block_size,
                                                    set(report.stored), True)
            self.counters["snapshots"] += 1
            return
        if (held is None or not held.synced or held.incarnation != report.incarnation
                or held.epoch != report.epoch or report.seq != held.seq + 1):
            if held is None or held.synced:
                self.counters["out_of_order"] += 1
                _log.info("prefix report out of order; engine's prefixes unknown until its next snapshot",
                          engine_id=report.engine_id, epoch=report.epoch, seq=report.seq)
            self._engines[report.engine_id] = _Held(report.incarnation, report.epoch, report.seq,
                                                    report.block_size, set(), False)
            return
        held.keys.difference_update(report.removed)
        held.keys.update(report.stored)
        held.seq = report.seq
        self.counters["deltas"] += 1

    def apply_value(self, engine_id: str, value: bytes | None) -> None:
        """An engine's report key as etcd holds it (None: deleted, with its engine)."""
        if value is None:
            return self.drop(engine_id)
        try:
            self.apply(PrefixReport.decode(value))
        except PrefixReportError as exc:
            _log.warning("unreadable prefix report; engine's prefixes unknown", engine_id=engine_id, error=str(exc))
            self.drop(engine_id)

    def drop(self, engine_id: str) -> None:
        self._engines.pop(engine_id, None)

    def overlaps(self, keys: Sequence[int], block_size: int) -> dict[tuple[str, str], int]:
        """(engine id, incarnation) -> leading blocks of a prompt (its keys, in order) the
        engine holds, for every engine known to hold its first block over blocks of
        ``block_size`` tokens (the others hold none of it)."""
        if not keys:
            return {}
        first = keys[0]
        return {(eid, held.incarnation): leading_held(keys, held.keys) for eid, held in self._engines.items()
                if held.synced and held.block_size == block_size and first in held.keys}

    def overlap(self, engine_id: str, incarnation: str, keys: Sequence[int], block_size: int) -> int:
        """One engine's share of ``overlaps``: 0 when unknown, of another incarnation, or hashed
        over other blocks."""
        return self.overlaps(keys, block_size).get((engine_id, incarnation), 0)

    def held_blocks(self, engine_id: str) -> int:
        held = self._engines.get(engine_id)
        return len(held.keys) if held is not None and held.synced else 0

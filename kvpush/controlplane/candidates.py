"""The decode engines a Reserve may choose among, as arrays.

A Reserve compares every engine that could take it (free fraction, room, quota). One
by one in Python that costs about a microsecond per engine per Reserve: at 1,000
engines it was most of a replica's CPU (docs/SCALING.md). Here the engines that fit a
shape (model, tenant's pools, prefill layout) are listed once per engine change and
compared as numpy arrays against the view's free counts, a few microseconds a Reserve
whatever the fleet's size.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvpush.controlplane.records import TenantRecord
from kvpush.controlplane.view import View
from kvpush.contract.engine import EngineRecord
from kvpush.contract.layout import KvLayout


@dataclasses.dataclass(frozen=True)
class Candidates:
    engines: tuple[EngineRecord, ...]   # by engine id
    index: dict[str, int]               # engine id -> position
    slots: np.ndarray                   # each one's slot in view.free_count.array
    num_blocks: np.ndarray
    block_size: np.ndarray
    divisor: np.ndarray                 # num_blocks, at least 1 (free fractions)
    one_block_size: int                 # the block size every candidate has (the usual case), else 0
    # No candidate, because every decode engine of the model open to the tenant has a
    # layout the prefill's cannot feed: why (naming both layouts), else "".
    unmappable: str = ""

    def need(self, num_tokens: int) -> np.ndarray | int:
        """Blocks ``num_tokens`` take on each candidate (one number when they all take the same)."""
        if self.one_block_size:
            return -(-num_tokens // self.one_block_size)
        return -(-num_tokens // self.block_size)

    @staticmethod
    def need_on(need: np.ndarray | int, i: int) -> int:
        return need if isinstance(need, int) else int(need[i])


class CandidateCache:
    """Candidates per shape, valid while the view's engines do not change."""

    def __init__(self, view: View) -> None:
        self._view = view
        self._version = -1
        self._by_shape: dict[tuple, Candidates] = {}

    def get(self, model: str, tenant: TenantRecord, layout: KvLayout | None) -> Candidates:
        view = self._view
        if view.engines_version != self._version:
            self._by_shape.clear()
            self._version = view.engines_version
        shape = (model, tenant.name, tuple(tenant.allowed_pools), layout)
        found = self._by_shape.get(shape)
        if found is None:
            engines = tuple(sorted(
                (eng for eng in (entry.record for entry in view.engines.values())
                 if eng.is_decode and not eng.unavailable and eng.model == model and tenant.allows(eng.pool)
                 and (layout is None or not layout.compatibility_error(eng.layout))
                 and eng.engine_id in view.allocated and eng.engine_id in view.pool_fences),
                key=lambda e: e.engine_id))
            unmappable = "" if engines or layout is None else self._unmappable(model, tenant, layout)
            num_blocks = np.array([e.num_blocks for e in engines], dtype=np.int64)
            sizes = {e.layout.block_size for e in engines}
            found = self._by_shape[shape] = Candidates(
                engines, {e.engine_id: i for i, e in enumerate(engines)},
                np.array([view.free_count.slot(e.engine_id) for e in engines], dtype=np.int64),
                num_blocks, np.array([e.layout.block_size for e in engines], dtype=np.int64),
                np.maximum(num_blocks, 1), sizes.pop() if len(sizes) == 1 else 0, unmappable)
        return found

    def _unmappable(self, model: str, tenant: TenantRecord, layout: KvLayout) -> str:
        others = sorted((eng for eng in (entry.record for entry in self._view.engines.values())
                         if eng.is_decode and eng.model == model and tenant.allows(eng.pool)),
                        key=lambda e: e.engine_id)
        if not others:
            return ""
        whys = [layout.feed_error(eng.layout) for eng in others]
        if not all(whys):
            return ""  # some could take it: they are unavailable or full, not unmappable
        more = f" (nor can {len(others) - 1} more)" if len(others) > 1 else ""
        return f"no decode engine of model {model!r} can take this prefill's KV: {others[0].engine_id}: {whys[0]}{more}"


class RoomElsewhere:
    """The decode engines a Reserve could take that this replica's view does not follow,
    with the free blocks their owners last told (free_summary.py), per shape: listed once
    per change of the engines, the slots followed or the summaries."""

    def __init__(self, view: View) -> None:
        self._view = view
        self._versions = (-1, -1)
        self._by_shape: dict[tuple, tuple] = {}

    def best(self, model: str, tenant: TenantRecord, layout: KvLayout | None, num_tokens: int) -> tuple[float, str]:
        """(free fraction, engine id) of the roomiest such engine with room for ``num_tokens``;
        (-1.0, "") when there is none."""
        view = self._view
        versions = (view.engines_version, view.free_told.version)
        if versions != self._versions:
            self._by_shape.clear()
            self._versions = versions
        shape = (model, tenant.name, tuple(tenant.allowed_pools), layout)
        found = self._by_shape.get(shape)
        if found is None:
            told = view.free_told.merged()
            engines = [eng for eng in (entry.record for entry in view.engines.values())
                       if eng.engine_id in told and eng.engine_id not in view.pool_fences and eng.is_decode
                       and not eng.unavailable and eng.model == model and tenant.allows(eng.pool)
                       and (layout is None or not layout.compatibility_error(eng.layout))]
            found = self._by_shape[shape] = (
                [e.engine_id for e in engines], np.array([told[e.engine_id] for e in engines], dtype=np.int64),
                np.array([max(e.num_blocks, 1) for e in engines], dtype=np.int64),
                np.array([e.layout.block_size for e in engines], dtype=np.int64),
                {e.engine_id: i for i, e in enumerate(engines)})
        ids, free, num_blocks, block_size, index = found
        if not ids:
            return -1.0, ""
        if spent := view.free_told.spent:  # (forwarded since the owners told: free_told.py)
            free = free.copy()
            for eid, blocks in spent.items():
                if (i := index.get(eid)) is not None:
                    free[i] = max(free[i] - blocks, 0)
        fraction = np.where(free >= -(-num_tokens // block_size), free / num_blocks, -1.0)
        i = int(fraction.argmax())
        return float(fraction[i]), ids[i]

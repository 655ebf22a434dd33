"""Choosing blocks in an engine's allocation bitmap.

Next fit from a per-engine cursor: reservations live briefly and end roughly in
the order they were made, so the blocks just past the last allocation are
usually free, and checking them costs O(blocks taken), not O(pool). When the
cursor's neighbourhood is busy we scan forward window by window for a run long
enough (still one extent: one NIXL descriptor per layer on the push path); only
when no run anywhere is long enough are several runs combined, longest first.
"""

from __future__ import annotations

import numpy as np

WINDOW = 4096


def free_runs(bitmap: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of free (False) blocks."""
    free = np.flatnonzero(~bitmap)
    if free.size == 0:
        return free, free
    breaks = np.flatnonzero(np.diff(free) != 1) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks, [free.size]))
    return free[first] + offset, last - first


def _first_run(bitmap: np.ndarray, n: int, start: int) -> int | None:
    """Start of the first free run of ``n`` blocks at or after ``start``, scanning
    windows (each overlapping the next by n-1 so no run is missed)."""
    size = bitmap.size
    pos = start
    while pos < size:
        end = min(pos + WINDOW + n - 1, size)
        starts, lengths = free_runs(bitmap[pos:end], pos)
        fit = np.flatnonzero(lengths >= n)
        if fit.size:
            return int(starts[fit[0]])
        pos += WINDOW
    return None


def allocate(bitmap: np.ndarray, n: int, cursor: int = 0) -> tuple[list[int] | None, int]:
    """Pick ``n`` free blocks (ascending ids) and mark them taken.

    Returns (blocks, new cursor); blocks is None when fewer than ``n`` are free."""
    if n <= 0:
        raise ValueError("n must be positive")
    size = bitmap.size
    if n > size:
        return None, cursor
    cursor = cursor if cursor + n <= size else 0
    if not bitmap[cursor:cursor + n].any():
        start = cursor
    else:
        start = _first_run(bitmap, n, cursor)
        if start is None and cursor:
            start = _first_run(bitmap[:cursor + n - 1], n, 0) if cursor + n - 1 <= size else None
    if start is not None:
        bitmap[start:start + n] = True
        return list(range(start, start + n)), (start + n) % size
    starts, lengths = free_runs(bitmap)
    if int(lengths.sum()) < n:
        return None, cursor
    parts, need = [], n
    for i in np.argsort(-lengths, kind="stable"):
        take = min(int(lengths[i]), need)
        parts.append(np.arange(starts[i], starts[i] + take))
        need -= take
        if need == 0:
            break
    chosen = np.sort(np.concatenate(parts))
    bitmap[chosen] = True
    return chosen.tolist(), cursor

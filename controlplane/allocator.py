"""Choosing blocks in an engine's allocation bitmap.

Best fit on runs of free blocks: a reservation that fits in one run gets the
smallest such run, so large runs survive for large prompts and most
reservations are one extent (one NIXL descriptor per layer on the push path).
Only when no run is long enough are several runs combined, longest first.
"""

from __future__ import annotations

import numpy as np


def free_runs(bitmap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the runs of free (False) blocks."""
    free = np.flatnonzero(~bitmap)
    if free.size == 0:
        return free, free
    breaks = np.flatnonzero(np.diff(free) != 1) + 1
    first = np.concatenate(([0], breaks))
    last = np.concatenate((breaks, [free.size]))
    return free[first], last - first


def allocate(bitmap: np.ndarray, n: int) -> list[int] | None:
    """Pick ``n`` free blocks (ascending ids) and mark them taken; None if fewer are free."""
    if n <= 0:
        raise ValueError("n must be positive")
    starts, lengths = free_runs(bitmap)
    if int(lengths.sum()) < n:
        return None
    fitting = np.flatnonzero(lengths >= n)
    if fitting.size:
        i = fitting[np.argmin(lengths[fitting])]
        chosen = np.arange(starts[i], starts[i] + n)
    else:
        parts, need = [], n
        for i in np.argsort(-lengths, kind="stable"):
            take = min(int(lengths[i]), need)
            parts.append(np.arange(starts[i], starts[i] + take))
            need -= take
            if need == 0:
                break
        chosen = np.sort(np.concatenate(parts))
    bitmap[chosen] = True
    return chosen.tolist()

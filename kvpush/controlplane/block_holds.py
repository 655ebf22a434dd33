"""Who holds an engine's blocks, as a replica's view marks them in the engine's
allocation bitmap: live reservations, and the quarantines of those that ended
unconsumed.

Two holders may hold one block at once. Replicas time a quarantine each by its own
clock (a record deleted by its lease is timed from when each replica hears of it), so
one replica's may end first: it grants the blocks again, and another replica applies
that grant over blocks it still quarantines. The block is free only when its last holder
lets go: were the bitmap cleared when that quarantine ends, the replica would grant the
block a second time, and etcd would let it (its fences are current: it applied the
grant). So the bitmap keeps one hold per set bit, and ``Overlaps`` the holds beyond the
first, per block: empty, except between two replicas' ends of one quarantine.
"""

from __future__ import annotations

import numpy as np


class Overlaps:
    def __init__(self) -> None:
        self._extra: dict[str, dict[int, int]] = {}  # engine -> block -> holds beyond the first

    def take(self, engine_id: str, bitmap: np.ndarray, start: int, count: int) -> int:
        """Blocks ``start``..+``count`` held once more; returns how many were free."""
        segment = bitmap[start:start + count]
        if not segment.any():
            segment[:] = True
            return count
        held = np.flatnonzero(segment) + start
        extra = self._extra.setdefault(engine_id, {})
        for block in held.tolist():
            extra[block] = extra.get(block, 0) + 1
        segment[:] = True
        return count - len(held)

    def give(self, engine_id: str, bitmap: np.ndarray, start: int, count: int) -> int:
        """Blocks ``start``..+``count`` held once less; returns how many are free now."""
        bitmap[start:start + count] = False
        extra = self._extra.get(engine_id)
        still = [b for b in extra if start <= b < start + count] if extra else []
        if not still:
            return count
        for block in still:
            extra[block] -= 1
            if not extra[block]:
                del extra[block]
        if not extra:
            del self._extra[engine_id]
        bitmap[still] = True
        return count - len(still)

    def forget(self, engine_id: str) -> None:
        """The engine's bitmap is made anew (a change of its record)."""
        self._extra.pop(engine_id, None)

    def __len__(self) -> int:
        return sum(len(e) for e in self._extra.values())

"""Each engine's free block count, kept in one numpy array so that a Reserve compares
every candidate engine in C (kvpush/controlplane/candidates.py)."""

from __future__ import annotations

import numpy as np


class FreeCounts:
    """Engine id -> blocks not in its bitmap, as a dict reads, kept in one numpy array
    (``array[slot(id)]``) so a Reserve compares every candidate engine in C, not one by
    one in Python. Slots are never reused within a view's life (ids are few and stable)."""

    def __init__(self) -> None:
        self.array = np.zeros(64, dtype=np.int64)
        self._slots: dict[str, int] = {}
        self._present: set[str] = set()

    def slot(self, engine_id: str) -> int:
        slot = self._slots.get(engine_id)
        if slot is None:
            slot = self._slots[engine_id] = len(self._slots)
            if slot >= len(self.array):
                self.array = np.concatenate([self.array, np.zeros(len(self.array), dtype=np.int64)])
        return slot

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._present

    def __getitem__(self, engine_id: str) -> int:
        if engine_id not in self._present:
            raise KeyError(engine_id)
        return int(self.array[self._slots[engine_id]])

    def __setitem__(self, engine_id: str, value: int) -> None:
        slot = self.slot(engine_id)  # first: it may grow (replace) the array
        self.array[slot] = value
        self._present.add(engine_id)

    def get(self, engine_id: str, default: int = 0) -> int:
        return self[engine_id] if engine_id in self._present else default

    def pop(self, engine_id: str, default=None):
        if engine_id not in self._present:
            return default
        value = self[engine_id]
        self._present.discard(engine_id)
        self.array[self._slots[engine_id]] = 0
        return value

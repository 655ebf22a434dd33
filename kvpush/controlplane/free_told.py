"""What the other replicas told of their engines' free blocks, as every view keeps it.

free_summary.py puts each replica's summary under ``keys.FREE/<replica id>``; the view
applies them here. ``version`` moves with every summary so the candidates' caches
(candidates.py) know when to look again; ``merged()`` is the one place two summaries
naming one engine (ownership moving between replicas) are reconciled: the lesser count,
since a summary only steers and too much room would steer a Reserve into a refusal.
"""

from __future__ import annotations

from kvpush.controlplane.records import decode_free


class FreeTold:
    def __init__(self, version: int = 0) -> None:
        self.by_replica: dict[str, dict[str, int]] = {}  # replica -> its engines' free blocks
        self.version = version
        self._merged: tuple[int, dict[str, int]] = (-1, {})

    def apply(self, replica: str, value: bytes | None) -> None:
        """A replica's summary was put (``value``) or went with its lease (None)."""
        if value is None:
            self.by_replica.pop(replica, None)
        else:
            self.by_replica[replica] = decode_free(value)
        self.version += 1

    def merged(self) -> dict[str, int]:
        """Engine id -> the free blocks its owner last told; the least where two told of
        one. Rebuilt only when a summary changed."""
        version, merged = self._merged
        if version != self.version:
            merged = {}
            for summary in self.by_replica.values():
                for eid, free in summary.items():
                    merged[eid] = min(free, merged.get(eid, free))
            self._merged = (self.version, merged)
        return merged

"""What the other replicas told of their engines' free blocks, as every view keeps it.

free_summary.py puts each replica's summary under ``keys.FREE/<replica id>``; the view
applies them here. ``version`` moves with every summary so the candidates' caches
(candidates.py) know when to look again; ``merged()`` is the one place two summaries
naming one engine (ownership moving between replicas) are reconciled: the lesser count,
since a summary only steers and too much room would steer a Reserve into a refusal. Blocks
this replica had reserved through an engine's owner (forwarding.py) since the owner last
told are counted off.
"""

from __future__ import annotations

from kvpush.controlplane.records import decode_free


class FreeTold:
    def __init__(self, version: int = 0) -> None:
        self.by_replica: dict[str, dict[str, int]] = {}  # replica -> its engines' free blocks
        self.version = version                           # moves with every summary
        self._merged: tuple[int, dict[str, int]] = (-1, {})
        # engine -> blocks reserved through its owner since it told (few: a summary clears its own)
        self.spent: dict[str, int] = {}

    def apply(self, replica: str, value: bytes | None) -> None:
        """A replica's summary was put (``value``) or went with its lease (None)."""
        if value is None:
            self.by_replica.pop(replica, None)
        else:
            summary = self.by_replica[replica] = decode_free(value)
            for eid in summary:
                self.spent.pop(eid, None)
        self.version += 1

    def count_spent(self, engine_id: str, blocks: int) -> None:
        """This replica just had ``blocks`` of ``engine_id`` reserved by its owner (a forwarded
        Reserve, forwarding.py): counted off until the owner tells again, or a burst of
        Reserves would all see the room the last summary told and all go there. (Not a new
        version: the candidates' arrays stay, and take these off as they are read.)"""
        self.spent[engine_id] = self.spent.get(engine_id, 0) + blocks

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

    def estimate(self, engine_id: str) -> int | None:
        """The free blocks told of ``engine_id``, less what was spent since; None if untold."""
        told = self.merged().get(engine_id)
        return None if told is None else max(told - self.spent.get(engine_id, 0), 0)

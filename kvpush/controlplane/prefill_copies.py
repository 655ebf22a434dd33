"""The copies of reservations under their prefill engines' slots (keys.push), as a view
keeps them: what each prefill sidecar's stream is told from. They count for nothing else
(blocks and usage are counted from the reservations' own keys)."""

from __future__ import annotations

from kvpush.controlplane import keys
from kvpush.controlplane.records import ReservationRecord


class PrefillCopies:
    def __init__(self) -> None:
        self._by_prefill: dict[str, dict[str, ReservationRecord]] = {}  # prefill engine -> id -> live copy

    def live(self, prefill_engine_id: str) -> list[ReservationRecord]:
        return list(self._by_prefill.get(prefill_engine_id, {}).values())

    def apply(self, prefill_engine_id: str, res_id: str, value: bytes | None
              ) -> tuple[ReservationRecord | None, ReservationRecord | None] | None:
        """Apply a put (``value``) or a delete (None) of one copy. Returns (old, new) when the
        stream should hear of it (new None: gone while live, its deadline lease ran out), else None."""
        copies = self._by_prefill.setdefault(prefill_engine_id, {})
        old = copies.pop(res_id, None)
        new = None if value is None else ReservationRecord.decode(value)
        if new is not None and new.state.live:
            copies[res_id] = new
        if not copies:
            del self._by_prefill[prefill_engine_id]
        if new is None:
            return (old, None) if old is not None else None
        return (old, new) if old is None or old.state != new.state else None

    def drop_slot(self, slot: int) -> None:
        for engine_id in [e for e in self._by_prefill if keys.slot_of(e) == slot]:
            del self._by_prefill[engine_id]

"""Prefill: the reservations the router named this engine for, by the router's request
id, until the engine's connector asks for them (the channel's AWAIT).

The router sends the prefill request without waiting for its Reserve answer; the
control plane's watch (``WatchEngineReservations``) brings the reservation here,
usually before vLLM has parsed, tokenized and scheduled the request, but not always,
so either may come first.
"""

from __future__ import annotations

import time

from kvpush.channel import frames as F
from kvpush.sidecar.channel_server import Connection


class Handover:
    """Prefill: reservations named for this engine, by the router's request id, until
    the engine asks for them (AWAIT). Either may come first: the watch usually brings
    the reservation before the request has been parsed and scheduled, but not always.
    Unasked ones are kept until their deadline, at most ``limit`` of them; an ask
    that no reservation answers (the Reserve was refused) is dropped after
    ``ask_ttl_s``, past any engine's wait (``AwaitParams.wait_ms`` is at most 60 s)."""

    def __init__(self, limit: int = 50_000, ask_ttl_s: float = 60.0) -> None:
        self.limit = limit
        self.ask_ttl_s = ask_ttl_s
        self._known: dict[str, tuple[dict, float]] = {}   # request id -> (params, expiry, monotonic)
        self._waiting: dict[str, list[tuple[Connection, float]]] = {}  # request id -> (asker, expiry)
        self.offered = self.delivered = self.dropped = 0

    def offer(self, request_id: str, params: dict, deadline_unix_ms: int) -> None:
        self.offered += 1
        waiting = self._waiting.pop(request_id, None)
        if waiting:
            body = F.encode_json({"request_id": request_id, "params": params})
            for conn, _ in waiting:
                conn.send(F.frame(F.RESERVATION, 0, body))
            self.delivered += 1
            return
        now = time.monotonic()
        self._known = self._room(self._known, lambda known: known if known[1] > now else None)
        self._known[request_id] = (params, now + max(0.0, deadline_unix_ms / 1000.0 - time.time()))

    def ask(self, request_id: str, conn: Connection) -> dict | None:
        now = time.monotonic()
        known = self._known.pop(request_id, None)
        if known is not None and known[1] > now:
            self.delivered += 1
            return known[0]
        self._waiting = self._room(self._waiting, lambda asks: [a for a in asks if a[1] > now] or None)
        self._waiting.setdefault(request_id, []).append((conn, now + self.ask_ttl_s))
        return None

    def withdraw(self, request_id: str) -> None:
        """The request began its push with its target in hand: it will not ask."""
        self._known.pop(request_id, None)

    def _room(self, entries: dict, alive) -> dict:
        """``entries`` with room for one more: when full, what ``alive`` keeps (None: an
        expired entry), then the oldest dropped."""
        if len(entries) < self.limit:
            return entries
        entries = {k: kept for k, v in entries.items() if (kept := alive(v)) is not None}
        while len(entries) >= self.limit:
            entries.pop(next(iter(entries)))
            self.dropped += 1
        return entries

    def forget(self, conn: Connection) -> None:
        """An engine's channel closed: its asks go with it."""
        for rid in list(self._waiting):
            alive = [a for a in self._waiting[rid] if a[0] is not conn]
            if alive:
                self._waiting[rid] = alive
            else:
                del self._waiting[rid]

    def stats(self) -> dict:
        return {"handover_offered": self.offered, "handover_delivered": self.delivered,
                "handover_known": len(self._known), "handover_waiting": len(self._waiting)}

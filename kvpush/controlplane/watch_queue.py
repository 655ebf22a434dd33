"""A watcher's pending events, bounded: one that falls ``limit`` events behind is cut
off (RESOURCE_EXHAUSTED) rather than allowed to grow the replica's memory; it watches
again, with a fresh snapshot. Filled from the view's listeners (never blocking the
loop that applies etcd's changes), drained by the watcher's stream."""

from __future__ import annotations

import asyncio

from kvpush.controlplane import errors

WATCH_QUEUE = 10_000


class WatchQueue:
    def __init__(self, behind: str, limit: int = WATCH_QUEUE) -> None:
        """``behind``: what the cut-off watcher is told to do."""
        self._queue: asyncio.Queue = asyncio.Queue(limit)
        self.limit = limit
        self._behind = behind
        self.overflow = False

    def put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            self.overflow = True

    async def get(self):
        item = await self._queue.get()
        if self.overflow:
            raise errors.exhausted(f"watcher fell too far behind; {self._behind}")
        return item

"""Calls waiting for a replica's view (view.py) to catch up: until it holds a revision, or
until it applied a write of one of some keys newer than the revision a caller knew.

The second is what a Reserve whose transaction failed needs (reserver.py): one of its
compares (an engine's fence, a tenant's usage fence) met a newer write, and the view can
plan again as soon as it has that write. A view following several parts (follow.py) holds
a revision only once etcd's progress answer says every watcher reached it, which may take
up to a progress tick; the write itself arrives on its own watcher at once.
"""

from __future__ import annotations

import asyncio


class ViewWaiters:
    def __init__(self) -> None:
        self._by_revision: list[tuple[int, asyncio.Future]] = []
        self.by_key: dict[bytes, list[tuple[int, asyncio.Future]]] = {}   # key -> (revision known, waiter)

    def reached(self, revision: int) -> None:
        """The view holds everything up to ``revision``."""
        still = []
        for want, fut in self._by_revision:
            if want <= revision:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((want, fut))
        self._by_revision = still

    def written(self, key: bytes, revision: int) -> None:
        """The view applied a write of ``key`` at ``revision`` (called only while ``by_key``)."""
        waiting = self.by_key.get(key)
        if waiting is None:
            return
        for known, fut in waiting:
            if revision > known and not fut.done():
                fut.set_result(None)

    async def wait(self, revision: int, known: dict[bytes, int], timeout: float) -> bool:
        """Until ``reached(revision)`` or a write newer than ``known`` (key -> revision) of one
        of its keys; False after ``timeout`` seconds."""
        fut = asyncio.get_running_loop().create_future()
        self._by_revision.append((revision, fut))
        for key, rev in known.items():
            self.by_key.setdefault(key, []).append((rev, fut))
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            for key in known:
                left = [w for w in self.by_key.get(key, ()) if w[1] is not fut]
                if left:
                    self.by_key[key] = left
                else:
                    self.by_key.pop(key, None)
            self._by_revision = [w for w in self._by_revision if w[1] is not fut]

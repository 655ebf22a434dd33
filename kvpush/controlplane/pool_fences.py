"""Each engine's pool fence as a replica's view holds it: the pool key's mod revision,
which every transaction that takes or gives back the engine's blocks compares and bumps.

A Reserve is safe because its transaction compares the fence the view planned on: etcd
refuses it if anyone wrote the engine's blocks since. That holds only while the view
that holds fence F has applied every reservation written up to F. A view that missed
one transaction on the engine (a watch event never delivered) but applied a later one
holds a current fence over a stale bitmap, and etcd would let it grant the missed
reservation's blocks again. So the pool key's etcd ``version`` (one more at each put)
is followed too: a step of more than one is a transaction the view did not see, and the
view gives up the fence and reads everything again (``WatchGap``) rather than plan on it.
"""

from __future__ import annotations

from kvpush.controlplane import keys


class WatchGap(Exception):
    """The watch skipped a write the view needed: it must be loaded again."""


class PoolFences(dict):
    """engine id -> the pool key's mod revision (a ``dict``, as the planners read it),
    with the key's etcd version where the view saw it (None: not known, e.g. after the
    view applied its own write, which carries no version)."""

    def __init__(self) -> None:
        super().__init__()
        self._versions: dict[str, int | None] = {}

    def put(self, engine_id: str, revision: int, version: int) -> None:
        """The pool key written at ``revision`` (etcd's ``version`` of it; 0: not known)."""
        seen = self._versions.get(engine_id)
        if version and seen and version > seen + 1:
            self.pop(engine_id, None)
            raise WatchGap(f"engine {engine_id}'s pool key went from version {seen} to {version}: "
                           f"{version - seen - 1} transaction(s) on it were not seen")
        self[engine_id] = revision
        self._versions[engine_id] = version or None

    def echo(self, key: bytes, revision: int, version: int) -> None:
        """The watch's copy of a write the view applied already (its own, which carried no
        version): the pool key's version, if ``key`` is one and that write is the last the
        view applied to it (the copy of an older one would not say where it stands)."""
        if not version or not key.startswith(keys.SLOTTED):
            return
        kind, engine_id = keys.split_slotted(key)
        if kind == keys.POOLS and self.get(engine_id) == revision and self._versions.get(engine_id) is None:
            self._versions[engine_id] = version

    def pop(self, engine_id: str, *default):
        self._versions.pop(engine_id, None)
        return super().pop(engine_id, *default)

    def __delitem__(self, engine_id: str) -> None:
        self._versions.pop(engine_id, None)
        super().__delitem__(engine_id)

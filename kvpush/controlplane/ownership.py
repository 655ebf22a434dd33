"""Which decode engines each control-plane replica owns, and this replica's membership.

Every live replica keeps a key under its own lease (``keys.REPLICAS``), so every view
holds the same set of replicas. Engines fall into ``SLOTS`` slots by a hash of their
id, and each slot belongs to the live replica with the highest rendezvous weight for it.
Every replica computes the same map from the same set, and a replica that joins or
leaves moves only the slots it takes or gives up (about 1/N of them): the others keep
theirs.

Ownership is a preference, never what correctness rests on. A Reserve is committed by a
compare-and-swap on its engine's fence whoever makes it, so two replicas that both
believe they own an engine (a view that has not yet seen a join or a leave) collide at
worst: one transaction fails and is planned again, and no block is handed out twice.
What ownership buys is that replicas serving at once reserve on different engines and
do not fail each other's transactions (each replica's choice is deterministic, so two
replicas choosing over the same engines at the same moment pick the same one).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Iterable

import numpy as np

from kvpush import log
from kvpush.controlplane import keys, metrics
from kvpush.controlplane.etcd import EtcdClient, EtcdLeaseNotFound
from kvpush.controlplane.records import ReplicaRecord
from kvpush.controlplane.view import View

_log = log.get("ownership")

SLOTS = keys.SLOTS
slot_of = keys.slot_of
LEASE_TTL_S = 5  # a replica that dies gives up its engines within this
# A replica reserves on an engine it owns while that engine's score (its free fraction, plus
# the share of the prompt it holds) is within this of the best engine's: imbalance between
# engines stays under 5% of an engine's landing blocks, and replicas rarely collide.
OWN_SLACK = 0.05


def weight(replica_id: str, slot: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{slot}/{replica_id}".encode(), digest_size=8).digest(), "big")


def assign(replica_ids: Iterable[str]) -> list[str]:
    """Slot -> the replica that owns it (rendezvous hashing)."""
    ids = sorted(set(replica_ids))
    return [max(ids, key=lambda r: weight(r, slot)) for slot in range(SLOTS)]


class Ownership:
    """This replica's share of the engines, as its view's set of live replicas decides it.
    The replica itself always counts as live: its own key may not be in the view yet."""

    def __init__(self, view: View, replica_id: str) -> None:
        self._view = view
        self.replica_id = replica_id
        self._version = -1
        self._owners: list[str] = []
        self._members: tuple[str, ...] = ()
        self._owned: frozenset[int] = frozenset()
        self._masks: dict[int, tuple[object, np.ndarray]] = {}  # id(candidates) -> (candidates, own mask)
        self._engines_version = -1

    def refresh(self) -> None:
        view = self._view
        if view.engines_version != self._engines_version:
            self._masks.clear()
            self._engines_version = view.engines_version
        if view.replicas_version == self._version:
            return
        self._version = view.replicas_version
        members = set(view.replicas) | {self.replica_id}
        self._owners = assign(members)
        self._members = tuple(sorted(members))
        owned = frozenset(s for s, owner in enumerate(self._owners) if owner == self.replica_id)
        if owned != self._owned:
            _log.info("ownership", replicas=len(members), owned_slots=len(owned))
        self._owned = owned
        self._masks.clear()
        metrics.OWNED_SLOTS.set(len(owned))
        metrics.LIVE_REPLICAS.set(len(members))

    @property
    def members(self) -> tuple[str, ...]:
        """The live replicas, this one included, by id."""
        self.refresh()
        return self._members

    @property
    def owned(self) -> frozenset[int]:
        """The slots this replica owns."""
        self.refresh()
        return self._owned

    def owner_of(self, engine_id: str) -> str:
        self.refresh()
        return self._owners[slot_of(engine_id)]

    def owns(self, engine_id: str) -> bool:
        self.refresh()
        return slot_of(engine_id) in self._owned

    def mask(self, cands) -> np.ndarray:
        """Which of ``cands.engines`` this replica owns (cached with the candidates)."""
        self.refresh()
        cached = self._masks.get(id(cands))
        if cached is None or cached[0] is not cands:
            mask = np.array([slot_of(e.engine_id) in self._owned for e in cands.engines], dtype=bool)
            cached = self._masks[id(cands)] = (cands, mask)
        return cached[1]

    def prefer(self, cands, fits: np.ndarray, score: np.ndarray, only_own: bool = False) -> np.ndarray:
        """The candidates a Reserve should choose among: those that fit and that this replica
        owns, while the best of them scores within OWN_SLACK of the best that fits (the
        score: free fraction plus the share of the prompt held, reserver.py); else every one
        that fits. Without the slack a replica owning few engines would pile its whole share
        of the requests on them; with it, the engines' free fractions stay within OWN_SLACK
        of each other. KV-aware routing goes through the same rule: an engine elsewhere
        holding enough more of the prompt to score OWN_SLACK higher wins. ``only_own``: a
        Reserve forwarded here because another replica's summary of these engines said so
        (elsewhere.py) takes its own engines whatever the slack, else it would go on again."""
        if len(self.members) == 1:
            return fits
        own = fits & self.mask(cands)
        if not own.any() or (not only_own and score[own].max() < score[fits].max() - OWN_SLACK):
            return fits
        return own


class Membership:
    """Keeps this replica's key alive under its own lease, and revokes the lease on a clean
    stop so that the other replicas take its engines at once rather than after the TTL."""

    def __init__(self, etcd: EtcdClient, record: ReplicaRecord, ttl_s: int = LEASE_TTL_S) -> None:
        self._etcd = etcd
        self.record = record
        self.ttl_s = ttl_s
        self.lease = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if not self.lease:
                    lease = await self._etcd.grant_lease(self.ttl_s)
                    await self._etcd.put(keys.replica(self.record.replica_id), self.record.encode(), lease)
                    self.lease = lease
                elif await self._etcd.refresh_lease(self.lease) <= 0:
                    self.lease = 0
                    continue
            except EtcdLeaseNotFound:
                self.lease = 0  # it ran out (etcd unreachable past the TTL): join again
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd unavailable, out of space, refusing: try again
                _log.warning("replica lease not refreshed", reason=str(exc) or type(exc).__name__)
            try:
                await asyncio.wait_for(stop.wait(), self.ttl_s / 3)
            except asyncio.TimeoutError:
                pass

    async def leave(self, timeout_s: float = 1.0) -> None:
        """Revoke the lease (its key goes with it), waiting at most ``timeout_s``: a replica
        stopping while etcd is unreachable must not hang on it; the lease runs out anyway."""
        if self.lease:
            try:
                await asyncio.wait_for(self._etcd.revoke_lease(self.lease), timeout_s)
            except Exception:  # (unavailable, timed out, refused) the lease runs out by itself
                pass
            self.lease = 0

"""The in-memory view of the registry, kept in step with etcd by kvpush/controlplane/follow.py.

Every replica keeps the registry's shared state (tenants, engines) and the
reservations of the slots it follows (keys.py: all of them, or its own and those
its clients need) in memory, so a Reserve decides without reading etcd. The view may lag etcd: that is
safe because every write it informs is fenced in etcd (see reserver.py) and a lag
only hides frees, never allocations of other replicas that the fences would not
catch. Derived state (each engine's allocated-block bitmap; each tenant's usage, from
its part of the request index) is kept incrementally so a Reserve costs O(blocks it takes).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import heapq
from typing import Callable

import numpy as np

from kvpush.controlplane import keys
from kvpush.controlplane.etcd import KV
from kvpush.contract.states import State
from kvpush.contract.engine import EngineRecord
from kvpush.controlplane.block_holds import Overlaps
from kvpush.controlplane.free_counts import FreeCounts
from kvpush.controlplane.free_told import FreeTold
from kvpush.controlplane.pool_fences import PoolFences
from kvpush.controlplane.prefill_copies import PrefillCopies
from kvpush.controlplane.request_index import RequestIndex
from kvpush.controlplane.view_waiters import ViewWaiters
from kvpush.controlplane.prefixes import PrefixIndex
from kvpush.controlplane.records import ReplicaRecord, ReservationRecord, TenantRecord, now_ms
from kvpush import log

_log = log.get("view")

# Blocks of a reservation that ended any way but CONSUMED stay out of use this
# long: a prefill sidecar may still have a write in flight into them (its
# transfer timeout is 2 s), and a late write must never land in someone else's KV.
QUARANTINE_MS = 5_000


@dataclasses.dataclass(slots=True)
class Entry:
    record: object
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class ReservationChange:
    """A reservation appeared, changed state, or vanished (new is None)."""
    old: ReservationRecord | None
    new: ReservationRecord | None
    revision: int
    expired: bool = False  # vanished while live: its deadline lease ran out


@dataclasses.dataclass(frozen=True)
class EngineChange:
    old: EngineRecord | None
    new: EngineRecord | None
    revision: int


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class View:
    def __init__(self, quarantine_ms: int = QUARANTINE_MS) -> None:
        self.quarantine_ms = quarantine_ms
        self.quarantined: list[tuple[int, str, str, str, tuple]] = []  # heap: (release ms, id, engine, incarnation, extents)
        self.revision = 0
        self.engines: dict[str, Entry] = {}
        self.decode_models: dict[str, int] = {}      # model -> registered decode engines serving it
        self.pool_fences = PoolFences()
        # Live reservations only (ended ones are read from etcd), one GC-tracked object
        # each: every full collection walks them all (see records.to_extents).
        self.reservations: dict[str, ReservationRecord] = {}
        self.reservation_revs: dict[str, tuple[int, int]] = {}  # id -> (mod revision, lease)
        self.by_engine: dict[str, set[str]] = {}     # engine -> ids of its live reservations
        self.pushes = PrefillCopies()                 # what prefill sidecars' streams are told from
        self.ended: dict[str, int] = {}              # terminal state name -> count seen by this replica
        self.requests = RequestIndex()                # request ids, tenants' usage and fences (request_index.py)
        self.tenants: dict[str, Entry] = {}
        self.prefixes = PrefixIndex()                 # decode engines' prefix caches (kvpush/controlplane/prefixes.py)
        self.tenant_by_token: dict[str, str] = {}
        self.allocated: dict[str, np.ndarray] = {}   # engine -> bool per block, live reservations
        self.free_count = FreeCounts()               # engine -> blocks not in the bitmap
        self.overlaps = Overlaps()                   # blocks two holders hold (block_holds.py)
        self.engines_version = 0                     # bumped at every engine change (candidate caches)
        self.cursors: dict[str, int] = {}            # engine -> next-fit allocation cursor
        self.replicas: dict[str, ReplicaRecord] = {}  # live control-plane replicas (ownership.py)
        self.replicas_version = 0
        self.free_told = FreeTold()                  # the other replicas' engines' free blocks (free_told.py)
        self.free_moved = asyncio.Event()            # set as blocks are taken or given back (free_summary.py)
        # The parts whose keys are kept (None: all): slots (int) and tenants' request indexes (str).
        self.following: frozenset[int | str] | None = None
        self.request_progress: Callable[[], None] = lambda: None  # set by the follow: a waiter wants the revision
        self._key_revs: dict[bytes, int] = {}         # newest revision applied per key, deletes too
        self._deleted: collections.deque = collections.deque()  # (revision, key) to prune from _key_revs
        self._expired_ids: dict[str, int] = {}        # ids whose EXPIRED we already announced
        self._own_writes: dict[bytes, tuple[bytes, object]] = {}
        self._listeners: list[Callable[[object], None]] = []
        self._engine_listeners: dict[str, list[Callable[[object], None]]] = {}
        self.waiters = ViewWaiters()
        self.ready = asyncio.Event()
        self._loading = False

    # ----- listeners -------------------------------------------------------
    def subscribe(self, fn: Callable[[object], None]) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def subscribe_engine(self, engine_id: str, fn: Callable[[ReservationChange], None]) -> Callable[[], None]:
        """``fn`` hears only the changes of reservations that land on ``engine_id`` or, from
        their copies under its slot, that it pushes into: each sidecar's watch, without every
        change visiting every watcher."""
        fns = self._engine_listeners.setdefault(engine_id, [])
        fns.append(fn)

        def unsubscribe() -> None:
            if fn in fns:
                fns.remove(fn)
            if not fns and self._engine_listeners.get(engine_id) is fns:
                del self._engine_listeners[engine_id]
        return unsubscribe

    def _emit(self, change: object) -> None:
        if self._loading:
            return
        for fn in list(self._listeners):
            fn(change)
        if isinstance(change, ReservationChange) and self._engine_listeners:
            rec = change.new or change.old
            for fn in list(self._engine_listeners.get(rec.engine_id, ())):
                fn(change)


    # ----- queries ---------------------------------------------------------
    def engine(self, engine_id: str) -> EngineRecord | None:
        entry = self.engines.get(engine_id)
        return entry.record if entry else None

    def reservation(self, res_id: str) -> ReservationRecord | None:
        return self.reservations.get(res_id)

    def reservation_at(self, res_id: str) -> tuple[ReservationRecord, int] | None:
        """A live reservation and the mod revision it was read at (for compare-and-swap)."""
        rec = self.reservations.get(res_id)
        return (rec, self.reservation_revs[res_id][0]) if rec is not None else None

    def tenant(self, name: str) -> TenantRecord | None:
        entry = self.tenants.get(name)
        return entry.record if entry else None

    def tenant_for_token(self, token: str) -> TenantRecord | None:
        name = self.tenant_by_token.get(token_hash(token))
        return self.tenant(name) if name else None

    def free_blocks(self, engine_id: str) -> int:
        self.release_quarantine()
        return self.free_count.get(engine_id, 0)

    def live_reservations(self, engine_id: str | None = None, tenant: str | None = None) -> list[ReservationRecord]:
        if engine_id is not None:
            ids = self.by_engine.get(engine_id, ())
            records = [self.reservations[i] for i in ids]
        else:
            records = list(self.reservations.values())
        return [r for r in records if tenant is None or r.tenant == tenant]

    def reservation_lease(self, res_id: str) -> int:
        """The deadline lease of a live reservation (0 when not known)."""
        revs = self.reservation_revs.get(res_id)
        return revs[1] if revs else 0

    def live_by_state(self) -> collections.Counter:
        return collections.Counter(rec.state.name for rec in self.reservations.values())

    def counts(self, rec: ReservationRecord) -> bool:
        """Does ``rec`` hold blocks of a registered engine (live, same incarnation)?"""
        engine = self.engine(rec.engine_id)
        return engine is not None and engine.incarnation == rec.incarnation

    # ----- applying changes ------------------------------------------------
    def expect_own_writes(self, writes: dict[bytes, tuple[bytes, object]]) -> None:
        """Records this replica is about to write (key -> (value, record)). The watch
        often brings a write back before the writer has applied it; with the record
        at hand the view need not decode the JSON it was made from."""
        self._own_writes.update(writes)

    def forget_own_writes(self, keys_: list[bytes]) -> None:
        for key in keys_:
            self._own_writes.pop(key, None)

    def apply(self, kv: KV, deleted: bool, revision: int, record: object = None) -> None:
        """Apply one put or delete at ``revision`` (idempotent; older ones are ignored).
        ``record``: the decoded value, when the caller wrote it and has it at hand."""
        key = kv.key
        if self._key_revs.get(key, 0) >= revision:
            self.pool_fences.echo(key, revision, kv.version)  # (the watch's copy of its own write)
            return
        if self.following is not None and not self._kept(key):
            # A write this replica made into a part it does not follow: not even its revision
            # is kept, or taking the part on later would skip the key as already seen.
            return
        self._key_revs[kv.key] = revision
        if self.waiters.by_key:
            self.waiters.written(key, revision)
        if deleted:
            self._deleted.append((revision, kv.key))
        if key.startswith(keys.SLOTTED):
            kind, name = keys.split_slotted(key)
            if kind == keys.RESERVATIONS:
                if record is None and not deleted:
                    expected = self._own_writes.get(key)
                    if expected is not None and expected[0] == kv.value:
                        record = expected[1]
                self._apply_reservation(name, kv, deleted, revision, record)
            elif kind == keys.POOLS:
                if deleted:
                    self.pool_fences.pop(name, None)
                else:
                    self.pool_fences.put(name, revision, kv.version)
            elif kind == keys.PUSHES:  # heard by the prefill engine's stream only
                prefill_engine_id, _, res_id = name.partition("/")
                told = self.pushes.apply(prefill_engine_id, res_id, None if deleted else kv.value)
                if told is not None and not self._loading:
                    change = ReservationChange(*told, revision, expired=told[1] is None)
                    for fn in list(self._engine_listeners.get(prefill_engine_id, ())):
                        fn(change)
        elif key.startswith(keys.REQUESTS):
            self.requests.apply(*keys.split_request(key), None if deleted else kv.value, revision)
        elif key.startswith(keys.ENGINES):
            self._apply_engine(keys.name_of(key, keys.ENGINES), kv, deleted, revision)
        elif key.startswith(keys.TENANTS):
            self._apply_tenant(keys.name_of(key, keys.TENANTS), kv, deleted, revision)
        elif key.startswith(keys.PREFIXES):
            self.prefixes.apply_value(keys.name_of(key, keys.PREFIXES), None if deleted else kv.value)
        elif key.startswith(keys.FREE):
            self.free_told.apply(keys.name_of(key, keys.FREE), None if deleted else kv.value)
        elif key.startswith(keys.REPLICAS):
            name = keys.name_of(key, keys.REPLICAS)
            if deleted:
                self.replicas.pop(name, None)
            else:
                try:
                    self.replicas[name] = ReplicaRecord.decode(kv.value)
                except (ValueError, KeyError, TypeError):  # only its name counts: never stop a load
                    self.replicas[name] = ReplicaRecord(name, "", 0)
            self.replicas_version += 1

    def _mark(self, engine_id: str, incarnation: str, extents, taken: bool) -> None:
        engine = self.engine(engine_id)
        bitmap = self.allocated.get(engine_id)
        if engine is None or bitmap is None or engine.incarnation != incarnation:
            return
        for start, count in extents:  # (holds counted: block_holds.py says why)
            if taken:
                self.free_count[engine_id] -= self.overlaps.take(engine_id, bitmap, start, count)
            else:
                self.free_count[engine_id] += self.overlaps.give(engine_id, bitmap, start, count)
        self.free_moved.set()

    def _contribute(self, rec: ReservationRecord, sign: int) -> None:
        if self.counts(rec):
            self._mark(rec.engine_id, rec.incarnation, rec.extents, sign > 0)

    def _quarantine(self, rec: ReservationRecord, ended_ms: int, already_marked: bool) -> None:
        """Keep ``rec``'s blocks taken until ``ended_ms`` + quarantine (see QUARANTINE_MS)."""
        release = ended_ms + self.quarantine_ms
        if release <= now_ms() or not self.counts(rec):
            if already_marked:
                self._mark(rec.engine_id, rec.incarnation, rec.extents, False)
            return
        if not already_marked:
            self._mark(rec.engine_id, rec.incarnation, rec.extents, True)
        heapq.heappush(self.quarantined, (release, rec.id, rec.engine_id, rec.incarnation,
                                          rec.extents))

    def release_quarantine(self, now: int | None = None) -> None:
        now = now_ms() if now is None else now
        while self.quarantined and self.quarantined[0][0] <= now:
            _, _, engine_id, incarnation, extents = heapq.heappop(self.quarantined)
            self._mark(engine_id, incarnation, extents, False)

    def _apply_reservation(self, res_id: str, kv: KV, deleted: bool, revision: int, record=None) -> None:
        # Only live reservations are kept: the view (and the heap the garbage
        # collector walks) stays the size of the work in flight, not of history.
        old = self.reservations.pop(res_id, None)
        self.reservation_revs.pop(res_id, None)
        new = None if deleted else (record if record is not None else ReservationRecord.decode(kv.value))
        if old is not None:
            self.by_engine[old.engine_id].discard(res_id)
            if new is None or (new.state.terminal and new.state != State.CONSUMED):
                # Ended without being consumed: the blocks come back only after the quarantine
                # (the tenant's quota at once: its index key went with the record).
                self._quarantine(old, new.ended_ms if new is not None and new.ended_ms else now_ms(), True)
            else:
                self._contribute(old, -1)
        elif new is not None and new.state.terminal and new.state != State.CONSUMED and new.ended_ms:
            self._quarantine(new, new.ended_ms, False)  # e.g. a tombstone loaded after a restart
        if deleted:
            if old is not None:  # a live record vanished: its deadline lease ran out
                self._expired_ids[res_id] = revision
                self._count_ended(State.EXPIRED)
                self._emit(ReservationChange(old, None, revision, expired=True))
            return
        if new.state.live:
            self.reservations[res_id] = new
            self.reservation_revs[res_id] = (revision, kv.lease)
            self.by_engine.setdefault(new.engine_id, set()).add(res_id)
            self._contribute(new, +1)
        # The EXPIRED tombstone written after a lease ran out was announced already.
        elif old is None and new.state == State.EXPIRED and self._expired_ids.pop(res_id, None):
            return
        else:
            self._count_ended(new.state)
        if old is None or old.state != new.state:
            self._emit(ReservationChange(old, new, revision))

    def _count_ended(self, state: State) -> None:
        if not self._loading:
            self.ended[state.name] = self.ended.get(state.name, 0) + 1

    def _apply_engine(self, engine_id: str, kv: KV, deleted: bool, revision: int) -> None:
        # An engine change alters which of its reservations count: take their
        # share out, swap the engine, put back the share of those that still count.
        affected = self.live_reservations(engine_id=engine_id)
        for rec in affected:
            self._contribute(rec, -1)
        old_entry = self.engines.pop(engine_id, None)
        if old_entry is not None and old_entry.record.is_decode:
            self.decode_models[old_entry.record.model] -= 1
        self.allocated.pop(engine_id, None)
        self.overlaps.forget(engine_id)
        self.free_count.pop(engine_id, None)
        self.engines_version += 1
        self.free_moved.set()
        new = None if deleted else EngineRecord.decode(kv.value)
        if new is None or (old_entry is not None and old_entry.record.incarnation != new.incarnation):
            self.prefixes.drop(engine_id)  # a new life's cache is empty until it reports
        if new is not None:
            self.engines[engine_id] = Entry(new, revision, kv.lease)
            if new.is_decode:
                self.decode_models[new.model] = self.decode_models.get(new.model, 0) + 1
            self.allocated[engine_id] = np.zeros(new.num_blocks, dtype=bool)
            self.free_count[engine_id] = new.num_blocks
        for rec in affected:
            self._contribute(rec, +1)
        for _, _, q_engine, incarnation, extents in self.quarantined:
            if q_engine == engine_id:
                self._mark(engine_id, incarnation, extents, True)
        self._emit(EngineChange(old_entry.record if old_entry else None, new, revision))

    def _apply_tenant(self, name: str, kv: KV, deleted: bool, revision: int) -> None:
        old = self.tenants.pop(name, None)
        if old is not None:
            self.tenant_by_token.pop(old.record.token_sha256, None)
        if not deleted:
            rec = TenantRecord.decode(kv.value)
            self.tenants[name] = Entry(rec, revision, kv.lease)
            self.tenant_by_token[rec.token_sha256] = name

    def advance(self, revision: int) -> None:
        """Everything up to ``revision`` has been applied."""
        if revision <= self.revision:
            return
        self.revision = revision
        while self._deleted and self._deleted[0][0] <= revision:
            rev, key = self._deleted.popleft()
            if self._key_revs.get(key) == rev:
                del self._key_revs[key]
        # Both are in revision order: prune from the front, not by scanning them all
        # (this runs on every watch response).
        while self._expired_ids:
            res_id, rev = next(iter(self._expired_ids.items()))
            if rev >= revision - 100_000:
                break
            del self._expired_ids[res_id]
        self.waiters.reached(revision)

    async def wait_for_revision(self, revision: int, timeout: float, known: dict[bytes, int] | None = None) -> bool:
        """Until the view holds ``revision``, or (``known``: key -> the mod revision a
        transaction compared) has a newer write of one of those keys (view_waiters.py)."""
        if self.revision >= revision or (known and any(self._key_revs.get(k, 0) > r for k, r in known.items())):
            return True
        self.request_progress()
        return await self.waiters.wait(revision, known or {}, timeout)

    def _kept(self, key: bytes) -> bool:
        """Is ``key`` in a followed part (shared keys always are)?"""
        if key.startswith(keys.SLOTTED):
            return keys.slot_of_key(key) in self.following
        return not key.startswith(keys.REQUESTS) or keys.split_request(key)[0] in self.following

    def followed(self, slot: int) -> bool:
        return self.following is None or slot in self.following

    def take_slot(self, slot: int, kvs: list[KV]) -> None:
        """Start keeping ``slot``: ``kvs`` is everything under it at some revision; the
        watch from the next revision follows. (Reservations it holds are announced as
        they would be by the watch: a sidecar stream that asked for the slot hears them.)"""
        assert self.following is not None
        self.following = self.following | {slot}
        for kv in kvs:
            self.apply(kv, False, kv.mod_revision)
        self.engines_version += 1  # the slot's engines can be chosen here now

    def drop_slot(self, slot: int) -> None:
        """Stop keeping ``slot``: its keys leave the view without any change announced
        (nothing ended; this replica just no longer follows them)."""
        if self.following is None or slot not in self.following:
            return
        self.following = self.following - {slot}
        prefix = keys.slot_prefix(slot)
        for res_id in [r for r in self.reservations if keys.reservation_slot(r) == slot]:
            rec = self.reservations.pop(res_id)
            self.reservation_revs.pop(res_id, None)
            self.by_engine[rec.engine_id].discard(res_id)
            self._contribute(rec, -1)
        for engine_id in [e for e in self.pool_fences if keys.slot_of(e) == slot]:
            del self.pool_fences[engine_id]
        self.pushes.drop_slot(slot)
        kept = [q for q in self.quarantined if keys.slot_of(q[2]) != slot]
        for _, _, engine_id, incarnation, extents in self.quarantined:
            if keys.slot_of(engine_id) == slot:
                self._mark(engine_id, incarnation, extents, False)
        heapq.heapify(kept)
        self.quarantined = kept
        for key in [k for k in self._key_revs if k.startswith(prefix)]:
            del self._key_revs[key]
        self.engines_version += 1  # the slot's engines are no longer candidates here

    def take_tenant(self, name: str, kvs: list[KV]) -> None:
        """Start keeping ``name``'s part of the request index (its usage counted here):
        ``kvs`` is all of it at some revision; the watch from the next revision follows."""
        assert self.following is not None
        self.following = self.following | {name}
        for kv in kvs:
            self.apply(kv, False, kv.mod_revision)

    def drop_tenant(self, name: str) -> None:
        if self.following is None or name not in self.following:
            return
        self.following = self.following - {name}
        self.requests.drop_tenant(name)
        prefix = keys.tenant_requests(name)
        for key in [k for k in self._key_revs if k.startswith(prefix)]:
            del self._key_revs[key]

    def load(self, kvs: list[KV], revision: int, following: frozenset[int | str] | None = None) -> None:
        """Replace the whole view with a snapshot taken at ``revision`` of the shared state
        and of the parts in ``following`` (None: all)."""
        old_res = dict(self.reservations)
        old_engines = {eid: entry.record for eid, entry in self.engines.items()}
        self.__init_state()
        self.following = following
        self._loading = True
        # Engines first so reservations find their engine when they are counted.
        order = sorted(kvs, key=lambda kv: 0 if kv.key.startswith(keys.ENGINES) else 1)
        for kv in order:
            self.apply(kv, False, kv.mod_revision)
        self._key_revs = {kv.key: kv.mod_revision for kv in kvs}
        self.revision = 0
        self.advance(revision)
        self._loading = False
        # Tell listeners what changed while we were not watching.
        for eid, old_engine in old_engines.items():
            if eid not in self.engines:
                self._emit(EngineChange(old_engine, None, revision))
        for eid, entry in self.engines.items():
            if old_engines.get(eid) != entry.record:
                self._emit(EngineChange(old_engines.get(eid), entry.record, revision))
        for rid, old in old_res.items():
            if rid not in self.reservations and self.followed(keys.reservation_slot(rid)):
                self._emit(ReservationChange(old, None, revision, expired=old.state.live))
        for rid, rec in self.reservations.items():
            old = old_res.get(rid)
            if old is None or old.state != rec.state:
                self._emit(ReservationChange(old, rec, revision))

    def __init_state(self) -> None:
        listeners, waiters, ready = self._listeners, self.waiters, self.ready
        engine_listeners, request_progress = self._engine_listeners, self.request_progress
        expired, cursors, ended = self._expired_ids, self.cursors, self.ended
        version, replicas_version = self.engines_version, self.replicas_version
        free_version = self.free_told.version
        self.__init__(self.quarantine_ms)
        self._listeners, self.waiters, self.ready = listeners, waiters, ready
        self._engine_listeners, self.request_progress = engine_listeners, request_progress
        self._expired_ids, self.cursors, self.ended = expired, cursors, ended
        self.engines_version = version + 1  # a new FreeCounts: every cached slot is stale
        self.replicas_version = replicas_version + 1
        self.free_told = FreeTold(free_version + 1)

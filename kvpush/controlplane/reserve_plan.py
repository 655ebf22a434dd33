"""One batch of Reserves as the reserver (kvpush/controlplane/reserver.py) plans it: the
asks, the blocks the batch has taken so far, and the one etcd transaction that commits
them, fenced on each engine and tenant it touches."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import secrets

import numpy as np

from kvpush.controlplane import keys
from kvpush.controlplane.etcd import cmp_create, cmp_mod, op_put, op_touch
from kvpush.controlplane.leases import LeaseBuckets
from kvpush.controlplane.lifecycle import move_writes, record_puts
from kvpush.controlplane.records import RequestEntry, ReservationRecord, TenantRecord
from kvpush.controlplane.view import View
from kvpush.contract.layout import KvLayout


@dataclasses.dataclass
class ReserveAsk:
    tenant: TenantRecord
    request_id: str
    num_tokens: int
    model: str
    deadline_ms: int                      # lifetime in ms
    preferred_engine_id: str = ""
    prefill_layout: KvLayout | None = None
    prefill_engine_id: str = ""           # named by the scheduler: its sidecar hears the grant by watch
    prefill_incarnation: str = ""
    # Decode failover (Scheduler.Relocate): the reservation this one replaces, as read at
    # ``moving_revision``; it ends FAILED (or, already FAILED, is marked moved) in the
    # same transaction, on another engine of its block size.
    moving: ReservationRecord | None = None
    moving_revision: int = 0
    move_reason: str = ""                 # why its decode engine failed, kept on the old one
    # KV-aware routing: the prompt's full blocks' keys (kvpush/contract/block_hash.py), hashed
    # over blocks of this many tokens; the engine holding the longest prefix is preferred.
    block_keys: tuple[int, ...] = ()
    block_keys_block_size: int = 0
    # Conditional disaggregation: a decode engine that lacks fewer than this many of the
    # prompt's tokens gets the request alone (nothing reserved); 0: always reserve.
    local_prefill_tokens: int = 0
    future: asyncio.Future | None = None
    widened: bool = False                 # planned again once over more slots than the replica's own
    may_forward: bool = False             # may be sent on to another replica (elsewhere.py); once at most
    forwarded: bool = False               # sent here by another replica: never elsewhere again
    share: str = ""                       # the replica whose share of the quota counts it (quota_shares.py)
    in_share: bool = False                # committed within that share, the usage fence left alone

    def same_params(self, rec: ReservationRecord) -> bool:
        return rec.num_tokens == self.num_tokens and rec.model == self.model


# Ids need to be unique across replicas, not secret (every lookup is scoped to the
# tenant): 88 random bits from a generator seeded by the OS, without a getrandom()
# syscall per reservation, after the 8 bits of the engine's slot (keys.reservation).
_ids = random.Random(secrets.randbits(128))


def new_reservation_id(engine_id: str) -> str:
    return f"r-{keys.slot_of(engine_id):02x}{_ids.getrandbits(88):022x}"


@dataclasses.dataclass
class BatchState:
    """What a batch has taken so far, before it is committed."""
    bitmaps: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)   # engine -> working copy
    free: np.ndarray | None = None                      # the view's free counts less what the batch took, by slot
    used: dict[str, int] = dataclasses.field(default_factory=dict)             # tenant -> blocks, fenced
    share_used: dict[str, int] = dataclasses.field(default_factory=dict)       # tenant -> blocks, in this replica's share
    reclaim: set[str] = dataclasses.field(default_factory=set)                 # tenants whose others' shares it takes back


SHARE_SLACK = 8  # other replicas' shares of a quota one transaction may take back (quota_shares.py)


@dataclasses.dataclass
class Plan:
    asks: list[ReserveAsk] = dataclasses.field(default_factory=list)
    records: list[ReservationRecord] = dataclasses.field(default_factory=list)
    deferred: list[ReserveAsk] = dataclasses.field(default_factory=list)
    compares: list = dataclasses.field(default_factory=list)
    ops: list = dataclasses.field(default_factory=list)
    writes: list = dataclasses.field(default_factory=list)   # (key, value, lease, record) for the view
    moved_live: int = 0                                      # live reservations a move ends FAILED
    moves: int = 0                                           # asks that move a reservation
    share_puts: dict = dataclasses.field(default_factory=dict)  # share key -> (its op, its write): quota_shares.py
    _fenced: set = dataclasses.field(default_factory=set)
    # The fences' bumps, written after the records they guard (attach_records): a view part way
    # through applying the transaction (follow.py applies a big one in slices) then holds the
    # records without the new fence, so a Reserve planned there fails its compare instead of
    # trusting a fence whose records it has not yet counted.
    _fences: list = dataclasses.field(default_factory=list)   # (op, write for the view)

    def has_room(self, max_ops: int) -> bool:
        """Whether one more ask surely fits: at most 7 more operations (three puts: record,
        prefill copy, request key; an engine's and a tenant's fence; a move's end and its
        copy) and 6 more compares."""
        # (per fenced quota tenant: its share grown, and up to SHARE_SLACK others' taken back)
        shares = sum(kind == "q" for kind, _ in self._fenced) * (1 + SHARE_SLACK)
        return (len(self.ops) + len(self._fences) + 3 * len(self.records) + 2 * self.moves + shares + 7 <= max_ops
                and len(self.compares) + self.moves + shares + 6 <= max_ops)

    def fenced(self, what: tuple) -> bool:
        """Whether ``what`` (a kind and a name) is compared in this transaction for the first time."""
        if what in self._fenced:
            return False
        self._fenced.add(what)
        return True

    def fence_usage(self, tenant: str, revision: int) -> None:
        """Compare ``tenant``'s usage fence with ``revision`` and bump it, after the records."""
        self.compares.append(cmp_mod(keys.usage(tenant), revision))
        self._fences.append((op_put(keys.usage(tenant), b""), (keys.usage(tenant), b"", 0, None)))

    def add(self, ask: ReserveAsk, rec: ReservationRecord, tenant: TenantRecord, view: View, quota) -> None:
        self.asks.append(ask)
        self.records.append(rec)
        self.moves += ask.moving is not None
        if ask.moving is None or not ask.moving.state.live:
            # (A live reservation being moved holds the request key: the compare on its
            # own mod revision, in attach_records, stands for this one.)
            self.compares.append(cmp_create(keys.request(rec.tenant, rec.request_id), 0))
        if ("e", rec.engine_id) not in self._fenced:
            self._fenced.add(("e", rec.engine_id))
            self.compares.append(cmp_mod(keys.engine(rec.engine_id), view.engines[rec.engine_id].mod_revision))
            self.compares.append(cmp_mod(keys.pool(rec.engine_id), view.pool_fences[rec.engine_id]))
            self._fences.append((op_touch(keys.pool(rec.engine_id)),
                                 (keys.pool(rec.engine_id), b"", view.engines[rec.engine_id].lease, None)))
        if self.fenced(("t", rec.tenant)):
            self.compares.append(cmp_mod(keys.tenant(rec.tenant), view.tenants[rec.tenant].mod_revision))
        # The usage fence (or this replica's share, quota_shares.py: ``quota``) guards a quota
        # only: without one, replicas reserving for the same tenant at once would fail each
        # other's transactions for nothing. (Setting a quota changes the tenant record, which
        # the compare above catches.)
        if tenant.quota_blocks:
            quota.fence(self, ask)

    async def attach_records(self, leases: LeaseBuckets) -> None:
        """Add the reservation and request-index puts, bound to their deadline lease."""
        for ask, rec in zip(self.asks, self.records):
            lease = await leases.for_deadline(rec.deadline_ms)
            value = rec.encode()
            req_key = keys.request(rec.tenant, rec.request_id)
            entry = RequestEntry(rec.id, rec.num_blocks, ask.share).encode()
            self.ops += record_puts(rec, value, lease)
            self.ops.append(op_put(req_key, entry, lease))
            self.writes.append((keys.reservation(rec.id), value, lease, rec))
            self.writes.append((req_key, entry, lease, None))
            if ask.moving is not None:
                # After its successor: watchers (the prefill sidecar) hear the successor
                # first, so a push that begins between the two events goes into it rather
                # than being refused for a reservation that has just ended.
                old = ask.moving
                tombstone = await leases.tombstone() if old.state.live else 0
                compares, ops, write = move_writes(old, ask.moving_revision, rec.id,
                                                   f"moved to another decode engine: {ask.move_reason}", tombstone)
                self.compares += compares
                self.ops += ops
                self.writes.append(write)
                self.moved_live += old.state.live
        for op, write in self._fences:
            self.ops.append(op)
            self.writes.append(write)


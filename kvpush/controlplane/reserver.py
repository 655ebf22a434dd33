"""Reserve with group commit: many concurrent Reserves, one etcd transaction.

Reserves queue up while the previous transaction is in flight; the committer
takes everything queued (up to ``max_batch``), allocates from the in-memory view
and writes all of it in one transaction. The transaction is *fenced*: it
compares the mod revision of every touched engine's pool key and tenant's usage
key with what the view saw, and bumps them. Another replica that allocated on
the same engine (or for the same tenant) in between has bumped a fence, so our
transaction fails as a whole, the view catches up, and the batch is retried:
two replicas can never hand out the same block or overrun a quota.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from kvpush.controlplane import errors, keys, metrics
from kvpush.controlplane.allocator import allocate
from kvpush.controlplane.candidates import CandidateCache
from kvpush.controlplane.elsewhere import Elsewhere
from kvpush.controlplane.etcd import KV, EtcdClient, EtcdLeaseNotFound, EtcdUnavailable, compared
from kvpush.controlplane.leases import LeaseBuckets
from kvpush.controlplane.following import Following
from kvpush.controlplane.ownership import OWN_SLACK, Ownership
from kvpush.controlplane.quota_shares import QuotaShares
from kvpush.controlplane.reserve_plan import BatchState, Plan, ReserveAsk, new_reservation_id
from kvpush.contract.states import State
from kvpush.contract.engine import EngineRecord
from kvpush.controlplane.records import DecodeAlone, RequestEntry, ReservationRecord, TenantRecord, now_ms, to_extents
from kvpush.controlplane.view import View
from kvpush import log

_log = log.get("reserver")
MAX_ATTEMPTS = 20
OVERLAP_WEIGHT = 1.0  # a candidate's score: free fraction + this x the share of the prompt it holds
# Decode alone takes no landing blocks, so the free fraction does not see it: each engine's
# recent decode-alone answers (decaying with this half-life) weigh against it instead, or
# every turn of a prefix many engines hold (a shared system prompt) would go to one.
ALONE_LOAD_WEIGHT = 0.02
ALONE_HALF_LIFE_S = 1.0


class Reserver:
    def __init__(self, etcd: EtcdClient, view: View, leases: LeaseBuckets, max_batch: int = 60,
                 ownership: Ownership | None = None, following: Following | None = None,
                 quota: QuotaShares | None = None) -> None:
        self._etcd = etcd
        self._view = view
        self._leases = leases
        self._ownership = ownership
        self._quota = quota or QuotaShares(view, "", lambda: 0, lambda: 1)  # (alone: no shares)
        self.max_batch = max_batch
        # Operations (and compares) in one transaction: etcd's default --max-txn-ops (128), or
        # what --max-batch asks for (etcd configured to match, as the embedded one is).
        self.max_ops = max(128, 2 * max_batch + 8)
        self._candidates = CandidateCache(view)
        self._alone_load: dict[str, tuple[float, float]] = {}  # engine id -> (decayed count, as of)
        self._queue: asyncio.Queue[ReserveAsk] = asyncio.Queue()
        self._elsewhere = Elsewhere(view, self._queue.put_nowait, ownership, following)
        self._task: asyncio.Task | None = None
        self.batch_all_of_queue = True  # False: one transaction per reservation (the baseline)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="reserver")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._elsewhere.stop()
        while not self._queue.empty():
            ask = self._queue.get_nowait()
            if not ask.future.done():
                ask.future.set_exception(errors.unavailable("control plane is shutting down"))

    def submit(self, ask: ReserveAsk) -> asyncio.Future:
        """Queue ``ask`` for the next group commit; the future gets the record or an ApiError."""
        ask.future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(ask)
        return ask.future

    async def reserve(self, ask: ReserveAsk) -> ReservationRecord:
        return await self.submit(ask)

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # One loop turn first: asks whose messages arrived with the last commit's
            # answer are still in the loop's ready queue; let them join this batch.
            await asyncio.sleep(0)
            limit = self.max_batch if self.batch_all_of_queue else 1
            while len(batch) < limit and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._commit(batch)
            except asyncio.CancelledError:
                for ask in batch:
                    if not ask.future.done():
                        ask.future.set_exception(errors.unavailable("control plane is shutting down"))
                raise
            except Exception as exc:  # never leave a caller hanging
                _log.exception("reserve batch failed")
                for ask in batch:
                    if not ask.future.done():
                        ask.future.set_exception(errors.unavailable(f"reserve failed: {exc}"))

    async def _commit(self, batch: list[ReserveAsk]) -> None:
        pending = [a for a in batch if not a.future.cancelled()]
        for attempt in range(MAX_ATTEMPTS):
            plan = self._plan(pending)
            if not plan.records:
                pending = [a for a in plan.deferred if not a.future.done()]
                if not pending:
                    return
                continue
            try:
                await plan.attach_records(self._leases)
                own = {key: (value, rec) for key, value, _, rec in plan.writes if rec is not None}
                self._view.expect_own_writes(own)
                try:
                    result = await self._etcd.txn(plan.compares, plan.ops)
                finally:
                    self._view.forget_own_writes(list(own))
            except EtcdUnavailable as exc:
                # Every ask of the batch, those put off to its next transaction too (they
                # would wait for their callers' deadlines): the outcome is unknown to all.
                for ask in pending:
                    if not ask.future.done():
                        ask.future.set_exception(errors.unavailable(
                            f"etcd unavailable ({exc}); the outcome is unknown: retry with the same request_id"))
                return
            except EtcdLeaseNotFound:
                self._leases.forget()
                if plan.share_puts:  # (or the membership lease a share was put on)
                    self._quota.lease_failed()
                continue
            if result.succeeded:
                metrics.BATCH_SIZE.observe(len(plan.records))
                if in_share := sum(ask.in_share for ask in plan.asks):
                    metrics.RESERVE_IN_SHARE.inc(in_share)
                if plan.moved_live:
                    metrics.TRANSITIONS.labels(to=State.FAILED.name).inc(plan.moved_live)
                self._apply_own_writes(plan, result.revision)
                for ask, rec in zip(plan.asks, plan.records):
                    if not ask.future.done():
                        ask.future.set_result(rec)
                # Duplicates inside the batch resolve against what was just written.
                pending = [a for a in plan.deferred if not a.future.done()]
                if not pending:
                    return
                continue
            metrics.BATCH_CONFLICTS.inc()
            # Someone else moved a fence: let the watch bring the view up to date (that write
            # is enough; a view following several parts may hold the whole revision later).
            if not await self._view.wait_for_revision(result.revision, timeout=2.0, known=compared(plan.compares)):
                _log.warning("view lagging after conflict", want=result.revision, have=self._view.revision)
            await self._read_request_keys(pending)
            for ask in pending:
                if ask.moving is not None and not ask.future.done():
                    await self._refresh_move(ask)  # the reservation moved may be what changed
            pending = [a for a in pending if not a.future.done()]
            if attempt >= 3:
                await asyncio.sleep(0.001 * (attempt - 2))
        for ask in pending:
            if not ask.future.done():
                ask.future.set_exception(errors.unavailable("too much contention between replicas; retry"))

    async def _refresh_move(self, ask: ReserveAsk) -> None:
        """A move's transaction failed: read the reservation it replaces again (its engine's
        death may just have ended it FAILED), or end the ask when it cannot move any more."""
        old = ask.moving
        current = self._view.reservation_at(old.id)
        if current is None:
            try:
                kv = await self._etcd.get(keys.reservation(old.id))
            except EtcdUnavailable:
                return  # the next attempt's transaction says more
            if kv is None:
                ask.future.set_exception(errors.not_found(f"reservation_id {old.id!r} not found"))
                return
            current = (ReservationRecord.decode(kv.value), kv.mod_revision)
        rec, revision = current
        if rec.moved_to or (rec.state.terminal and rec.state != State.FAILED):
            ask.future.set_exception(errors.failed_precondition(
                f"reservation_id {old.id!r} became {rec.state.name}" + (f", moved to {rec.moved_to}," if rec.moved_to
                                                                        else "") + " while it was being moved"))
            return
        ask.moving, ask.moving_revision = rec, revision

    def _plan(self, asks: list[ReserveAsk]) -> "Plan":
        view = self._view
        view.release_quarantine()
        plan = Plan()
        batch = BatchState()
        seen_requests: set[tuple[str, str]] = set()
        quota_tenants: dict[str, TenantRecord] = {}
        for ask in asks:
            if ask.future.done():
                continue
            req = (ask.tenant.name, ask.request_id)
            if req in seen_requests:
                plan.deferred.append(ask)
                continue
            existing_id = view.requests.reservation_id(*req)
            existing = view.reservation(existing_id) if existing_id else None
            if self._answer_existing(ask, existing):
                continue
            if not plan.has_room(self.max_ops):  # etcd's limit on one transaction: the next one
                plan.deferred.append(ask)
                continue
            tenant = view.tenant(ask.tenant.name)
            if tenant is None:
                ask.future.set_exception(errors.ApiError(grpc.StatusCode.UNAUTHENTICATED,
                                                         "tenant no longer exists"))
                continue
            try:
                chosen = self._choose(ask, tenant, batch)
            except errors.ApiError as exc:
                ask.future.set_exception(exc)
                continue
            if chosen is None:  # planned again once the view follows more slots
                continue
            if isinstance(chosen, DecodeAlone):  # nothing to write
                ask.future.set_result(chosen)
                continue
            engine, blocks, cached = chosen
            seen_requests.add(req)
            plan.add(ask, self._record(ask, engine, blocks, cached), tenant, view, self._quota)
            if tenant.quota_blocks:
                quota_tenants[tenant.name] = tenant
        self._quota.grow(plan, batch, quota_tenants)
        return plan

    @staticmethod
    def _answer_existing(ask: ReserveAsk, existing: ReservationRecord | None) -> bool:
        """Answer ``ask`` from the live reservation its request id already has, if any."""
        moving = ask.moving
        if existing is None or not existing.state.live or (moving and existing.id == moving.id):
            return False
        if moving is not None:
            if existing.moved_from == moving.id:  # moved already: the same successor again
                ask.future.set_result(existing)
            else:
                ask.future.set_exception(errors.failed_precondition(
                    f"request_id {ask.request_id!r} has another live reservation, {existing.id}"))
        elif ask.same_params(existing):
            ask.future.set_result(existing)
        else:
            ask.future.set_exception(errors.ApiError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {ask.request_id!r} already has live reservation {existing.id} "
                "with other parameters"))
        return True

    async def _read_request_keys(self, asks: list[ReserveAsk]) -> None:
        """After a failed transaction, in a view that does not follow the request index
        (keys.REQUESTS): the index keys of ``asks``, read from etcd. A Reserve asked again
        (its answer was lost) is answered with what it got the first time, as in a view
        that follows the index."""
        view = self._view
        for ask in asks:
            if ask.future.done() or view.following is None:
                continue
            key = keys.request(ask.tenant.name, ask.request_id)
            try:
                kv = await self._etcd.get(key)
                found = None if kv is None else await self._etcd.get(
                    keys.reservation(RequestEntry.decode(kv.value).reservation_id))
            except EtcdUnavailable:
                return  # the next attempt's transaction says more
            if found is not None and not ask.future.done():
                self._answer_existing(ask, ReservationRecord.decode(found.value))

    def _choose(self, ask: ReserveAsk, tenant: TenantRecord, batch: "BatchState"
                ) -> tuple[EngineRecord, list[int], int] | DecodeAlone | None:
        """The engine and blocks for ``ask``; None when it was sent elsewhere (elsewhere.py:
        forwarded, or planned again over more slots) or waits for its tenant's usage."""
        view = self._view
        if tenant.quota_blocks and self._elsewhere.usage_unknown(ask, tenant):
            return None
        cands = self._candidates.get(ask.model, tenant, ask.prefill_layout)
        preferred = ask.preferred_engine_id
        if preferred and preferred not in cands.index and preferred in view.engines and \
                self._elsewhere.send(ask, tenant, preferred, {keys.slot_of(preferred)}):
            return None
        if not cands.engines and self._elsewhere.send(ask, tenant, self._elsewhere.room(ask, tenant)[1]):
            return None
        if not cands.engines:
            if cands.unmappable:  # no room will ever make it fit: not worth a retry
                raise errors.failed_precondition(cands.unmappable)
            raise errors.exhausted(f"no decode engine for model {ask.model!r} is available to tenant "
                                   f"{tenant.name!r}")
        if batch.free is None:  # (the view does not change while a batch is planned)
            batch.free = view.free_count.array.copy()
        free = batch.free[cands.slots]
        # Leading prompt tokens each candidate holds (KV-aware routing): decode then needs
        # landing blocks only for the rest, one block less for each block it holds.
        cached = self._cached_tokens(ask, cands) if ask.block_keys and ask.moving is None else None
        if ask.local_prefill_tokens and ask.moving is None:
            alone = self._alone(ask, cands, free, cached)
            if alone is not None:
                return alone
        need = cands.need(ask.num_tokens)
        if cached is not None:
            need = need - cached // cands.block_size
        fits = free >= need
        credit = 0
        if ask.moving is not None:
            # Staging holds the KV in the old engine's block geometry: another engine of
            # that block size (moves are rare: a Python pass over the candidates is fine).
            old = ask.moving
            fits &= np.array([e.engine_id != old.engine_id and e.layout.block_size == old.block_size
                              and e.layout.tp_size == old.decode_tp for e in cands.engines])
            # Given back in the same transaction (its index key is the successor's now); counted
            # while live whatever its engine's state, as the tenant's usage counts it.
            credit = old.num_blocks if old.state.live else 0
        ask.in_share, ask.share = False, ""
        if tenant.quota_blocks:  # (quota_shares.py: within this replica's share, or fenced)
            fits = self._quota.room(ask, tenant, fits, need, batch, credit)
        if not fits.any() and self._elsewhere.send(ask, tenant, self._elsewhere.room(ask, tenant)[1]):
            return None
        if not fits.any():
            if ask.moving is not None:
                raise errors.exhausted(f"no other decode engine of block size {ask.moving.block_size} and "
                                       f"tp {ask.moving.decode_tp} has room "
                                       f"for num_tokens={ask.num_tokens}")
            most = int(np.argmax(free))
            raise errors.exhausted(f"no decode engine has room for num_tokens={ask.num_tokens} "
                                   f"({cands.need_on(need, most)} blocks; most free: {free[most]} on "
                                   f"{cands.engines[most].engine_id})")
        # This replica's own engines first (ownership.py: replicas serving at once then do not
        # collide on the same engine's fence); a move takes any engine of its geometry.
        score = self._score(ask, cands, free, cached)
        if self._elsewhere.partitioned and ask.moving is None and not ask.widened and not ask.preferred_engine_id:
            # Another replica's engine with clearly more room (its owner's summary) beats ours.
            there, engine_id = self._elsewhere.room(ask, tenant)
            if there > float(score[fits].max()) + OWN_SLACK and \
                    self._elsewhere.send(ask, tenant, engine_id, {keys.slot_of(engine_id)}):
                return None
        eligible = (self._ownership.prefer(cands, fits, score, only_own=ask.forwarded)
                    if self._ownership is not None and ask.moving is None else fits)
        chosen = cands.index.get(ask.preferred_engine_id) if ask.preferred_engine_id else None
        while True:
            if chosen is None or not fits[chosen]:
                chosen = self._best(score, eligible if eligible.any() else fits)
            engine = cands.engines[chosen]
            eid = engine.engine_id
            # Its lease is running out this very moment (the view applies a revision's
            # deletions a slice at a time): its fence may be gone before its record.
            if eid in view.pool_fences and eid in view.allocated:
                break
            fits[chosen] = eligible[chosen] = False
            if not fits.any():
                raise errors.exhausted(f"no decode engine for model {ask.model!r} is available to tenant "
                                       f"{tenant.name!r}")
        if eid not in batch.bitmaps:
            batch.bitmaps[eid] = view.allocated[eid].copy()
        blocks, view.cursors[eid] = allocate(batch.bitmaps[eid], cands.need_on(need, chosen),
                                             view.cursors.get(eid, 0))
        batch.free[cands.slots[chosen]] -= len(blocks)
        taken = batch.share_used if ask.in_share else batch.used
        taken[tenant.name] = taken.get(tenant.name, 0) + len(blocks)
        if tenant.quota_blocks:
            self._quota.taken(tenant.name, len(blocks))
        if self._ownership is not None:
            (metrics.RESERVED_ON_OWN if self._ownership.owns(eid) else metrics.RESERVED_ON_OTHER).inc()
        return engine, blocks, int(cached[chosen]) if cached is not None else 0

    @staticmethod
    def _score(ask: ReserveAsk, cands, free: np.ndarray, cached: np.ndarray | None) -> np.ndarray:
        """Each candidate's free fraction, plus, with the prompt's block keys, the share of the
        prompt it already holds (OVERLAP_WEIGHT: a whole prompt held outweighs an idle engine)."""
        score = free / cands.divisor
        if cached is not None:
            score = score + OVERLAP_WEIGHT * cached / ask.num_tokens
        return score

    @staticmethod
    def _best(score: np.ndarray, eligible, penalty: np.ndarray | None = None) -> int:
        """The eligible candidate with the best ``score`` (``_score``) less ``penalty``; ties to
        the largest id, for determinism."""
        if penalty is not None:
            score = score - penalty
        score = np.where(eligible, score, -1.0)
        return len(score) - 1 - int(score[::-1].argmax())

    def _alone(self, ask: ReserveAsk, cands, free: np.ndarray, cached: np.ndarray | None) -> DecodeAlone | None:
        """Conditional disaggregation: the best candidate that lacks fewer than
        ``local_prefill_tokens`` of the prompt computes it itself; None when none does. Its
        landing room and the tenant's quota do not matter: nothing lands and nothing is held."""
        short = (ask.num_tokens - (cached if cached is not None else 0)) < ask.local_prefill_tokens
        if not np.any(short):
            return None
        preferred = cands.index.get(ask.preferred_engine_id) if ask.preferred_engine_id else None
        eligible = np.broadcast_to(short, free.shape)
        now = asyncio.get_running_loop().time()
        if preferred is not None and eligible[preferred]:
            i = preferred
        else:
            load = np.zeros(len(free))
            for j in np.flatnonzero(eligible):
                load[j] = self._recent_alone(cands.engines[j].engine_id, now)
            i = self._best(self._score(ask, cands, free, cached), eligible, ALONE_LOAD_WEIGHT * load)
        engine = cands.engines[i]
        self._alone_load[engine.engine_id] = (self._recent_alone(engine.engine_id, now) + 1.0, now)
        metrics.DECODE_ALONE.labels(reason="cached_prefix" if cached is not None and cached[i] else
                                    "short_prompt").inc()
        return DecodeAlone(ask.tenant.name, ask.request_id, engine.engine_id, engine.incarnation,
                           engine.layout.block_size, ask.num_tokens, ask.model,
                           int(cached[i]) if cached is not None else 0)

    def _recent_alone(self, engine_id: str, now: float) -> float:
        count, since = self._alone_load.get(engine_id, (0.0, now))
        return count * 0.5 ** ((now - since) / ALONE_HALF_LIFE_S)

    def _cached_tokens(self, ask: ReserveAsk, cands) -> np.ndarray:
        """Leading prompt tokens each candidate holds in its prefix cache (block-aligned, and
        short of the whole prompt: decode computes at least its last token). Only the engines
        holding the prompt's first block are looked at."""
        bs = ask.block_keys_block_size
        cap = (ask.num_tokens - 1) // bs
        out = np.zeros(len(cands.engines), dtype=np.int64)
        for (eid, incarnation), blocks in self._view.prefixes.overlaps(ask.block_keys, bs).items():
            i = cands.index.get(eid)
            if i is not None and cands.engines[i].incarnation == incarnation:
                out[i] = min(cap, blocks) * bs
        return out

    def _record(self, ask: ReserveAsk, engine: EngineRecord, blocks: list[int], cached: int = 0) -> ReservationRecord:
        created = now_ms()
        return ReservationRecord(
            id=new_reservation_id(engine.engine_id), tenant=ask.tenant.name, request_id=ask.request_id,
            engine_id=engine.engine_id, incarnation=engine.incarnation, nixl_agent=engine.nixl_agent,
            extents=to_extents(blocks), block_size=engine.layout.block_size, num_tokens=ask.num_tokens,
            model=ask.model, state=State.RESERVED, deadline_ms=created + ask.deadline_ms, created_ms=created,
            prefill_engine_id=ask.prefill_engine_id, prefill_incarnation=ask.prefill_incarnation,
            moved_from=ask.moving.id if ask.moving is not None else "", decode_tp=engine.layout.tp_size,
            cached_tokens=cached)

    def _apply_own_writes(self, plan: "Plan", revision: int) -> None:
        # The watch will bring the same writes; applying them now lets the next
        # batch allocate without waiting for it (the view ignores the echo).
        for key, value, lease, record in plan.writes:
            self._view.apply(KV(key, value, revision, revision, lease), False, revision, record)

"""The one place that changes a reservation's state in etcd.

Every transition is a compare-and-swap on the reservation key's mod revision,
checked against ``lifecycle_states.LEGAL`` first. Ending a reservation (any
terminal state) rewrites its record under a short tombstone lease, so ended
reservations can still be read for a while, and drops the request index, so the
blocks count as free from that revision on in every replica's view.
"""

from __future__ import annotations

import dataclasses

import grpc

from kvpush.controlplane import errors, keys, metrics
from kvpush.controlplane.etcd import KV, EtcdClient, EtcdLeaseNotFound, EtcdUnavailable, chunks, cmp_create, \
    cmp_mod, op_delete, op_key, op_put, op_txn
from kvpush.controlplane.group_commit import BATCH, GroupCommit
from kvpush.controlplane.leases import LeaseBuckets
from kvpush.controlplane.lifecycle_states import LEGAL, IllegalTransition, Move, decide
from kvpush.contract.states import UNLANDED, State
from kvpush.controlplane.records import ReservationRecord, now_ms
from kvpush.controlplane.view import View
from kvpush import log

_log = log.get("lifecycle")
MAX_ATTEMPTS = 10


def ending(rec: ReservationRecord, target: State, reason: str) -> ReservationRecord:
    return dataclasses.replace(rec, state=target, reason=reason or rec.reason, ended_ms=now_ms())


def record_puts(rec: ReservationRecord, value: bytes, lease: int, keep_lease: bool = False) -> list:
    """The puts that store ``rec`` (encoded as ``value``): its key and, when it names a
    prefill engine, its copy under that engine's slot (keys.push), under ``lease``. The
    copy never keeps its lease: it may not exist yet (the prefill engine named at PUSHING),
    and etcd refuses to keep the lease of a key that does not exist."""
    ops = [op_put(keys.reservation(rec.id), value, lease, keep_lease=keep_lease)]
    if rec.prefill_engine_id and lease:
        ops.append(op_put(keys.push(rec.prefill_engine_id, rec.id), value, lease))
    return ops


def move_writes(current: ReservationRecord, revision: int, new_id: str, reason: str,
                tombstone_lease: int) -> tuple[list, list, tuple]:
    """The replaced half of a decode failover (``Scheduler.Relocate``), for the
    transaction that also creates its successor ``new_id``: a live reservation ends
    FAILED under ``tombstone_lease``, one already FAILED keeps its tombstone; either way
    it names ``new_id``, and the compare on its mod revision makes the move happen once.
    Its request-index key is not deleted: the successor's put takes it over in the same
    transaction (etcd refuses two operations on one key in a transaction).
    (compares, ops, (key, value, lease, record) for the view)."""
    key = keys.reservation(current.id)
    if current.state.live:
        decide(current.state, State.FAILED)  # raises IllegalTransition if the table forbids it
        moved = dataclasses.replace(ending(current, State.FAILED, reason), moved_to=new_id)
        value = moved.encode()
        return [cmp_mod(key, revision)], record_puts(moved, value, tombstone_lease), (key, value, tombstone_lease, moved)
    moved = dataclasses.replace(current, moved_to=new_id)
    value = moved.encode()
    return [cmp_mod(key, revision)], [op_put(key, value, keep_lease=True)], (key, value, 0, moved)


class Lifecycle:
    def __init__(self, etcd: EtcdClient, view: View, leases: LeaseBuckets, group_commit: bool = True) -> None:
        self._etcd = etcd
        self._view = view
        self._leases = leases
        self._commits = GroupCommit(etcd, BATCH if group_commit else 1)

    async def transition(self, res_id: str, target: State, reason: str = "",
                         tenant: str | None = None, prefill_engine_id: str = "",
                         via: State | None = None, prefill_incarnation: str = "") -> ReservationRecord:
        """Move ``res_id`` to ``target``. ``tenant`` scopes who may do it (a
        mismatch looks exactly like a missing id: NOT_FOUND); ``prefill_engine_id``
        records which engine pushes into it (with PUSHING; ``prefill_incarnation``: which
        of its lives); ``via``: a state the reservation may pass through on the way
        (two legal moves, one write).

        Raises ApiError NOT_FOUND (unknown, foreign, or gone), FAILED_PRECONDITION
        (illegal move), UNAVAILABLE (etcd down)."""
        key = keys.reservation(res_id)
        current = self._view.reservation_at(res_id)
        held = self._view.reservation_lease(res_id)  # its lease now (the prefill copy is put under it)
        try:
            if current is None:
                kv = await self._etcd.get(key)
                current = (ReservationRecord.decode(kv.value), kv.mod_revision) if kv else None
                held = kv.lease if kv else 0
            for _ in range(MAX_ATTEMPTS):
                if current is None:
                    raise errors.not_found(f"reservation_id {res_id!r} not found")
                rec, revision = current
                if tenant is not None and rec.tenant != tenant:
                    raise errors.not_found(f"reservation_id {res_id!r} not found")
                try:
                    move = decide(rec.state, target)
                except IllegalTransition as exc:
                    if not (via is not None and via in LEGAL[rec.state] and target in LEGAL[via]):
                        raise errors.StateConflict(f"reservation_id {res_id!r}: {exc}", exc.current,
                                                   exc.target) from None
                    move = Move.APPLY
                if move is Move.STALE:
                    return rec
                new = ending(rec, target, reason) if target.terminal else dataclasses.replace(
                    rec, state=target, reason=reason or rec.reason,
                    prefill_engine_id=prefill_engine_id or rec.prefill_engine_id,
                    prefill_incarnation=prefill_incarnation if prefill_engine_id else rec.prefill_incarnation)
                value = new.encode()
                if target.terminal:
                    lease = await self._leases.tombstone()
                    req_key = keys.request(rec.tenant, rec.request_id)
                    ops = record_puts(new, value, lease) + [op_delete(req_key)]
                else:
                    lease = None
                    ops = [op_put(key, value, keep_lease=True)]
                    if new.prefill_engine_id and held:
                        ops.append(op_put(keys.push(new.prefill_engine_id, res_id), value, held))
                if rec.prefill_engine_id and rec.prefill_engine_id != new.prefill_engine_id:
                    ops.append(op_delete(keys.push(rec.prefill_engine_id, res_id)))
                written = tuple(op_key(op) for op in ops)
                # The watch often brings the write back before the commit's answer: with
                # the record at hand the view need not decode the JSON.
                self._view.expect_own_writes({key: (value, new)})
                try:
                    succeeded, applied = await self._commits.commit([cmp_mod(key, revision)], ops, written)
                finally:
                    self._view.forget_own_writes([key])
                if succeeded:
                    metrics.TRANSITIONS.labels(to=target.name).inc()
                    self._view.apply(KV(key, value, applied, applied,
                                        lease if lease is not None else self._view.reservation_lease(res_id)),
                                     False, applied)
                    if target.terminal:
                        self._view.apply(KV(keys.request(rec.tenant, rec.request_id), b"", applied, 0, 0), True,
                                         applied)
                    _log.info("transition", reservation_id=res_id, tenant=rec.tenant,
                              request_id=rec.request_id, frm=rec.state.name, to=target.name, reason=reason)
                    return new
                # Lost a race (another report, the reaper, another replica): read what won.
                kv = await self._etcd.get(key)
                current = (ReservationRecord.decode(kv.value), kv.mod_revision) if kv else None
                held = kv.lease if kv else 0
            raise errors.unavailable(f"reservation {res_id} changed too often; retry")
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None
        except EtcdLeaseNotFound:
            self._leases.forget()
            raise errors.unavailable("lease vanished; retry") from None

    async def read(self, res_id: str) -> tuple[ReservationRecord, int] | None:
        """The reservation and its mod revision: live in the view, or from etcd (ended, or in
        a slot this replica does not follow)."""
        current = self._view.reservation_at(res_id)
        if current is not None:
            return current
        try:
            kv = await self._etcd.get(keys.reservation(res_id))
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None
        return (ReservationRecord.decode(kv.value), kv.mod_revision) if kv else None

    async def find(self, res_id: str) -> ReservationRecord | None:
        """The reservation from the view, or from etcd when the view has not seen it yet."""
        found = await self.read(res_id)
        return found[0] if found is not None else None

    async def record_expiries(self, records: list[ReservationRecord]) -> int:
        """Deadline leases deleted these live reservations: write their EXPIRED
        tombstones (once each, whichever replica gets there first), many per
        round trip since a whole second's worth of reservations expires at once."""
        written = 0
        for chunk in chunks(records, BATCH):
            try:
                lease = await self._leases.tombstone(len(chunk))
                nested, values = [], []
                for rec in chunk:
                    key = keys.reservation(rec.id)
                    # It ended when the lease ran out, at or after the deadline: the
                    # deadline is the earliest end any replica can have quarantined from.
                    value = dataclasses.replace(rec, state=State.EXPIRED, reason="deadline passed",
                                                ended_ms=rec.deadline_ms).encode()
                    values.append((key, value))
                    nested.append(op_txn([cmp_create(key, 0)], [op_put(key, value, lease)]))
                result = await self._etcd.txn([], nested)
            except (EtcdUnavailable, EtcdLeaseNotFound) as exc:
                _log.warning("could not record expiries", count=len(chunk), error=str(exc))
                continue
            for (key, value), ok in zip(values, result.nested):
                if ok:
                    written += 1
                    self._view.apply(KV(key, value, result.revision, result.revision, lease), False,
                                     result.revision)
        metrics.TRANSITIONS.labels(to=State.EXPIRED.name).inc(written)
        if written:
            _log.info("reservations expired", count=written)
        return written

    async def end_many(self, records: list[ReservationRecord], target: State, reason: str) -> int:
        """End many live reservations at once (engine death, tenant deletion): one
        nested compare-and-swap per reservation, up to BATCH per round trip; any
        the view had stale go through ``transition`` one by one."""
        assert target.terminal
        ended, retry = 0, []
        for chunk in chunks(records, BATCH):
            entries = [(rec, self._view.reservation_at(rec.id)) for rec in chunk]
            entries = [(rec, e) for rec, e in entries if e is not None and e[0].state.live]
            if not entries:
                continue
            try:
                lease = await self._leases.tombstone(len(entries))
                nested, writes = [], []
                for rec, (current, mod_revision) in entries:
                    key = keys.reservation(rec.id)
                    ended_rec = ending(current, target, reason)
                    value = ended_rec.encode()
                    req_key = keys.request(rec.tenant, rec.request_id)
                    nested.append(op_txn([cmp_mod(key, mod_revision)],
                                         record_puts(ended_rec, value, lease) + [op_delete(req_key)]))
                    writes.append((rec, key, value, req_key))
                result = await self._etcd.txn([], nested)
            except EtcdUnavailable as exc:
                raise errors.unavailable(f"etcd unavailable: {exc}") from None
            except EtcdLeaseNotFound:
                self._leases.forget()
                retry += [rec for rec, _ in entries]
                continue
            for (rec, key, value, req_key), ok in zip(writes, result.nested):
                if not ok:
                    retry.append(rec)
                    continue
                ended += 1
                self._view.apply(KV(key, value, result.revision, result.revision, lease), False, result.revision)
                self._view.apply(KV(req_key, b"", result.revision, 0, 0), True, result.revision)
        metrics.TRANSITIONS.labels(to=target.name).inc(ended)
        for rec in retry:
            try:
                await self.transition(rec.id, target, reason)
                ended += 1
            except errors.ApiError as exc:
                if exc.code == grpc.StatusCode.UNAVAILABLE:
                    raise
        if ended:
            _log.info("reservations ended", count=ended, to=target.name, reason=reason)
        return ended

    async def fail_engine(self, engine_id: str, reason: str, keep_incarnation: str | None = None) -> int:
        """End FAILED every live reservation on ``engine_id`` (except those of
        ``keep_incarnation``, the engine's current life), and every reservation
        ``engine_id`` was to push or was pushing into, not yet landed: its writes died with
        it, and the decode engine waiting for them must hear so now, not at the deadline.
        (A push that had not reported PUSHING yet is as dead as one that had; its sidecar's
        next life refuses to begin it: ``PushTarget.prefill_incarnation``.) Returns how many
        ended."""
        doomed = [rec for rec in self._view.live_reservations(engine_id=engine_id)
                  if keep_incarnation is None or rec.incarnation != keep_incarnation]
        pushed = [rec for rec in self._view.live_reservations()
                  if rec.prefill_engine_id == engine_id and rec.state in UNLANDED and rec not in doomed
                  and not (keep_incarnation and rec.prefill_incarnation == keep_incarnation)]
        count = await self.end_many(doomed, State.FAILED, reason)
        if pushed:
            count += await self.end_many(pushed, State.FAILED, "prefill engine died or restarted before its push landed")
        return count

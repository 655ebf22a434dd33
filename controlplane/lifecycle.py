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

from controlplane import errors, keys, metrics
from controlplane.etcd import KV, EtcdClient, EtcdLeaseNotFound, EtcdUnavailable, cmp_create, cmp_mod, \
    op_delete, op_get, op_put
from controlplane.leases import LeaseBuckets
from controlplane.lifecycle_states import IllegalTransition, Move, State, decide
from controlplane.records import ReservationRecord
from controlplane.view import View
from kvpush import log

_log = log.get("lifecycle")
MAX_ATTEMPTS = 10


class Lifecycle:
    def __init__(self, etcd: EtcdClient, view: View, leases: LeaseBuckets) -> None:
        self._etcd = etcd
        self._view = view
        self._leases = leases

    async def transition(self, res_id: str, target: State, reason: str = "",
                         tenant: str | None = None, engine_id: str | None = None) -> ReservationRecord:
        """Move ``res_id`` to ``target``. ``tenant``/``engine_id`` scope who may do it
        (a mismatch looks exactly like a missing id: NOT_FOUND).

        Raises ApiError NOT_FOUND (unknown, foreign, or gone), FAILED_PRECONDITION
        (illegal move), UNAVAILABLE (etcd down)."""
        key = keys.reservation(res_id)
        entry = self._view.reservations.get(res_id)
        current = (entry.record, entry.mod_revision) if entry else None
        try:
            if current is None:
                kv = await self._etcd.get(key)
                current = (ReservationRecord.decode(kv.value), kv.mod_revision) if kv else None
            for _ in range(MAX_ATTEMPTS):
                if current is None:
                    raise errors.not_found(f"reservation_id {res_id!r} not found")
                rec, revision = current
                if (tenant is not None and rec.tenant != tenant) or \
                        (engine_id is not None and engine_id not in (rec.engine_id, "")):
                    raise errors.not_found(f"reservation_id {res_id!r} not found")
                try:
                    move = decide(rec.state, target)
                except IllegalTransition as exc:
                    raise errors.StateConflict(f"reservation_id {res_id!r}: {exc}", exc.current, exc.target) from None
                if move is Move.STALE:
                    return rec
                new = dataclasses.replace(rec, state=target, reason=reason or rec.reason)
                value = new.encode()
                if target.terminal:
                    lease = await self._leases.tombstone()
                    ops = [op_put(key, value, lease), op_delete(keys.request(rec.tenant, rec.request_id))]
                else:
                    lease = None
                    ops = [op_put(key, value, keep_lease=True)]
                result = await self._etcd.txn([cmp_mod(key, revision)], ops, [op_get(key)])
                if result.succeeded:
                    metrics.TRANSITIONS.labels(to=target.name).inc()
                    self._view.apply(KV(key, value, result.revision, result.revision,
                                        lease if lease is not None else (entry.lease if entry else 0)),
                                     False, result.revision)
                    if target.terminal:
                        self._view.apply(KV(keys.request(rec.tenant, rec.request_id), b"", result.revision,
                                            0, 0), True, result.revision)
                    _log.info("transition", reservation_id=res_id, tenant=rec.tenant,
                              request_id=rec.request_id, frm=rec.state.name, to=target.name, reason=reason)
                    return new
                kvs = result.ranges[0] if result.ranges else []
                current = (ReservationRecord.decode(kvs[0].value), kvs[0].mod_revision) if kvs else None
                entry = None
            raise errors.unavailable(f"reservation {res_id} changed too often; retry")
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None
        except EtcdLeaseNotFound:
            self._leases.forget()
            raise errors.unavailable("lease vanished; retry") from None

    async def find(self, res_id: str) -> ReservationRecord | None:
        """The reservation from the view, or from etcd when the view has not seen it yet."""
        rec = self._view.reservation(res_id)
        if rec is not None:
            return rec
        try:
            kv = await self._etcd.get(keys.reservation(res_id))
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None
        return ReservationRecord.decode(kv.value) if kv else None

    async def record_expiry(self, rec: ReservationRecord) -> None:
        """The deadline lease deleted a live reservation: write its EXPIRED tombstone
        (once, whichever replica gets there first)."""
        key = keys.reservation(rec.id)
        expired = dataclasses.replace(rec, state=State.EXPIRED, reason="deadline passed")
        try:
            lease = await self._leases.tombstone()
            result = await self._etcd.txn([cmp_create(key, 0)], [op_put(key, expired.encode(), lease)])
            if result.succeeded:
                metrics.TRANSITIONS.labels(to=State.EXPIRED.name).inc()
                _log.info("transition", reservation_id=rec.id, tenant=rec.tenant, request_id=rec.request_id,
                          frm=rec.state.name, to="EXPIRED", reason="deadline passed")
        except (EtcdUnavailable, EtcdLeaseNotFound) as exc:
            _log.warning("could not record expiry", reservation_id=rec.id, error=str(exc))

    async def fail_engine(self, engine_id: str, reason: str, keep_incarnation: str | None = None) -> int:
        """End FAILED every live reservation on ``engine_id`` (except those of
        ``keep_incarnation``, the engine's current life). Returns how many ended."""
        ended = 0
        for rec in self._view.live_reservations(engine_id=engine_id):
            if keep_incarnation is not None and rec.incarnation == keep_incarnation:
                continue
            try:
                await self.transition(rec.id, State.FAILED, reason)
                ended += 1
            except errors.ApiError as exc:
                if exc.code == grpc.StatusCode.UNAVAILABLE:
                    raise
        return ended

"""kvpush.v1.Admin: tenants (quota, allowed pools, token) and a status snapshot."""

from __future__ import annotations

import dataclasses

import grpc

from kvpush.controlplane import errors, keys, validation as v
from kvpush.controlplane.api import unary
from kvpush.controlplane.auth import Auth, new_token
from kvpush.controlplane.etcd import (KV, EtcdClient, EtcdUnavailable, cmp_create, cmp_mod, op_delete,
                                     op_delete_prefix, op_put)
from kvpush.controlplane.lifecycle import Lifecycle
from kvpush.contract.states import State
from kvpush.controlplane.following import ALL, Following
from kvpush.controlplane.ownership import Ownership
from kvpush.controlplane.records import TenantRecord
from kvpush.controlplane.request_index import RequestIndex
from kvpush.controlplane.engine_events import engine_proto
from kvpush.controlplane.view import View, token_hash
from kvpush.contract.v1 import admin_pb2, admin_pb2_grpc, types_pb2


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, view: View, auth: Auth, etcd: EtcdClient, lifecycle: Lifecycle, ownership: Ownership,
                 following: Following) -> None:
        self.view = view
        self._following = following
        self._auth = auth
        self._etcd = etcd
        self._lifecycle = lifecycle
        self._ownership = ownership

    def _pools(self, pools) -> list[str]:
        if len(pools) > 64:
            raise errors.invalid("allowed_pools has more than 64 entries")
        for i, pool in enumerate(pools):
            v.text(pool, f"allowed_pools[{i}]", 128, v.POOL_NAME)
        return sorted(set(pools))

    async def _txn(self, compares, ops):
        try:
            return await self._etcd.txn(compares, ops)
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None

    async def _used(self, name: str | None = None) -> dict[str, int]:
        """Blocks each tenant's live reservations hold (``name``'s only, if given): from the
        view where it follows that part of the request index, else read from etcd."""
        following = self.view.following
        if following is None or (name is not None and name in following):
            return self.view.requests.used
        prefix = keys.tenant_requests(name) if name is not None else keys.REQUESTS
        try:
            kvs, _ = await self._etcd.get_prefix(prefix)
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None
        index = RequestIndex()
        for kv in kvs:
            index.apply(*keys.split_request(kv.key), kv.value, kv.mod_revision)
        return index.used

    def _existing(self, name: str):
        v.text(name, "name", 63, v.TENANT_NAME)
        entry = self.view.tenants.get(name)
        if entry is None:
            raise errors.not_found(f"tenant {name!r} not found")
        return entry

    @unary
    async def CreateTenant(self, request, context) -> types_pb2.Tenant:
        self._auth.admin(context)
        v.text(request.name, "name", 63, v.TENANT_NAME)
        v.in_range(request.quota_blocks, "quota_blocks", 0, v.MAX_QUOTA)
        token = request.token or new_token()
        if len(token) < 16 or len(token) > 256 or not v.PRINTABLE.match(token):
            raise errors.invalid("token must be 16..256 printable characters")
        if token_hash(token) in self.view.tenant_by_token:
            raise errors.invalid("token is already in use")
        rec = TenantRecord(request.name, request.quota_blocks, self._pools(request.allowed_pools), token_hash(token))
        result = await self._txn([cmp_create(keys.tenant(rec.name), 0)], self._tenant_writes(rec))
        if not result.succeeded:
            raise errors.ApiError(grpc.StatusCode.ALREADY_EXISTS, f"tenant {rec.name!r} already exists")
        self._applied(rec, result.revision, created=result.revision)
        await self.view.wait_for_revision(result.revision, 2.0)
        return rec.to_proto(token=token)

    @staticmethod
    def _tenant_writes(rec: TenantRecord) -> list:
        """The record, and a bump of the tenant's usage fence. Reserves for a tenant without
        a quota leave that fence alone (reserver.py), so a view that has this record but not
        yet every reservation made before it (``_applied`` puts it in at once) would check a
        new quota against a short count, and its compares would all pass; the bump, which
        ``_applied`` does not apply, makes that view's first batch fail until it caught up."""
        return [op_put(keys.tenant(rec.name), rec.encode()), op_put(keys.usage(rec.name), b"")]

    def _applied(self, rec: TenantRecord, revision: int, created: int) -> None:
        """This replica's own write, in its view at once: the token it answers works on it
        for the next call even while its watch lags (under load, past the 2 s it waits)."""
        key = keys.tenant(rec.name)
        self.view.apply(KV(key, rec.encode(), revision, created, 0), False, revision)

    async def _replace(self, entry, rec: TenantRecord, more_ops: tuple = ()) -> None:
        result = await self._txn([cmp_mod(keys.tenant(rec.name), entry.mod_revision)],
                                 self._tenant_writes(rec) + list(more_ops))
        if not result.succeeded:
            raise errors.ApiError(grpc.StatusCode.ABORTED, f"tenant {rec.name!r} changed concurrently; retry")
        self._applied(rec, result.revision, created=0)
        await self.view.wait_for_revision(result.revision, 2.0)

    @unary
    async def UpdateTenant(self, request, context) -> types_pb2.Tenant:
        self._auth.admin(context)
        entry = self._existing(request.name)
        v.in_range(request.quota_blocks, "quota_blocks", 0, v.MAX_QUOTA)
        rec = dataclasses.replace(entry.record, quota_blocks=request.quota_blocks,
                                  allowed_pools=self._pools(request.allowed_pools))
        # The replicas' shares of the old quota go (quota_shares.py): none may outlive it.
        await self._replace(entry, rec, (op_delete_prefix(keys.shares(rec.name)),))
        return rec.to_proto((await self._used(rec.name)).get(rec.name, 0))

    @unary
    async def RotateTenantToken(self, request, context) -> types_pb2.Tenant:
        self._auth.admin(context)
        entry = self._existing(request.name)
        token = new_token()
        rec = dataclasses.replace(entry.record, token_sha256=token_hash(token))
        await self._replace(entry, rec)
        return rec.to_proto((await self._used(rec.name)).get(rec.name, 0), token=token)

    @unary
    async def DeleteTenant(self, request, context) -> admin_pb2.DeleteTenantResponse:
        self._auth.admin(context)
        entry = self._existing(request.name)
        # Delete first so no new reservation can be made, then end the live ones.
        result = await self._txn([cmp_mod(keys.tenant(request.name), entry.mod_revision)],
                                 [op_delete(keys.tenant(request.name)), op_delete_prefix(keys.shares(request.name))])
        if not result.succeeded:
            raise errors.ApiError(grpc.StatusCode.ABORTED, f"tenant {request.name!r} changed concurrently; retry")
        await self.view.wait_for_revision(result.revision, 2.0)
        async with self._following.needing([ALL]):  # its reservations are on every slot
            released = await self._lifecycle.end_many(self.view.live_reservations(tenant=request.name),
                                                      State.RELEASED, "tenant deleted")
        return admin_pb2.DeleteTenantResponse(reservations_released=released)

    @unary
    async def ListTenants(self, request, context) -> admin_pb2.ListTenantsResponse:
        self._auth.admin(context)
        used = await self._used()
        tenants = [e.record.to_proto(used.get(name, 0)) for name, e in sorted(self.view.tenants.items())]
        return admin_pb2.ListTenantsResponse(tenants=tenants)

    @unary
    async def GetStatus(self, request, context) -> admin_pb2.StatusResponse:
        self._auth.admin(context)
        by_state = self.view.live_by_state()
        by_state.update(self.view.ended)  # ended reservations this replica has seen
        live = sorted((r for r in self.view.live_reservations()), key=lambda r: r.created_ms)
        owner = self._ownership
        return admin_pb2.StatusResponse(
            engines=sorted((engine_proto(self.view, e.record) for e in self.view.engines.values()),
                           key=lambda e: e.engine_id),
            reservations_by_state=dict(by_state), live_reservations=[r.to_proto() for r in live[:1000]],
            revision=self.view.revision, replica_id=owner.replica_id, live_replicas=len(owner.members),
            owned_slots=len(owner.owned))

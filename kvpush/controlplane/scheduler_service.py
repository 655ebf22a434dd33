"""kvpush.v1.Scheduler: what routers call. Every call is scoped to the caller's tenant."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from kvpush.controlplane import errors, metrics, validation as v
from kvpush.controlplane.api import streaming, unary
from kvpush.controlplane.auth import Auth, bearer
from kvpush.controlplane.engine_events import engine_events, engine_proto, engine_summary_proto
from kvpush.controlplane.lifecycle import Lifecycle
from kvpush.contract.states import State
from kvpush.controlplane.records import ReservationRecord, now_ms
from kvpush.controlplane.reserve_plan import ReserveAsk
from kvpush.controlplane.reserver import Reserver
from kvpush.controlplane.tagged_stream import outcome, serve_tagged
from kvpush.controlplane.following import ALL, Following
from kvpush.controlplane.forwarding import Forwarded, Forwarder
from kvpush.controlplane.ownership import Ownership
from kvpush.controlplane.view import ReservationChange, View
from kvpush.controlplane.watch_gather import gather, peer_events
from kvpush.controlplane.watch_queue import WatchQueue
from kvpush.contract.layout import KvLayout, LayoutError
from kvpush.contract.v1 import scheduler_pb2, scheduler_pb2_grpc, types_pb2

DEFAULT_DEADLINE_MS = 30_000


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, view: View, auth: Auth, reserver: Reserver, lifecycle: Lifecycle, etcd,
                 following: Following, forwarder: Forwarder, ownership: Ownership,
                 default_deadline_ms: int = DEFAULT_DEADLINE_MS) -> None:
        self.view = view
        self._following = following
        self._ownership = ownership
        self._auth = auth
        self._reserver = reserver
        self._forwarder = forwarder
        self._lifecycle = lifecycle
        self._etcd = etcd
        self._default_deadline_ms = default_deadline_ms

    @unary
    async def Reserve(self, request: scheduler_pb2.ReserveRequest, context) -> types_pb2.Reservation:
        started = time.perf_counter()
        code = "OK"
        try:
            tenant = self._auth.tenant(context)
            structlog.contextvars.bind_contextvars(tenant=tenant.name, request_id=request.request_id[:256])
            ask = self._validate_reserve(request, tenant)
            self._forwarder.mark(ask, self._forwarder.arrived_forwarded(context))
            rec = await self._forwarder.reserve(ask, request, bearer(context))
            if isinstance(rec, (ReservationRecord, Forwarded)):  # (a DecodeAlone answer reserved nothing)
                structlog.contextvars.bind_contextvars(reservation_id=rec.id)
            return rec.to_proto()
        except errors.ApiError as exc:
            code = exc.code.name
            raise
        finally:
            metrics.reserve_answered(time.perf_counter() - started, code)

    @streaming
    async def ReserveStream(self, request_iterator, context):
        tenant = self._auth.tenant(context)
        structlog.contextvars.bind_contextvars(tenant=tenant.name)
        forwarded, token = self._forwarder.arrived_forwarded(context), bearer(context)

        def start(ask_msg, _i: int) -> asyncio.Future:
            ask = self._validate_reserve(ask_msg.reserve, tenant)
            self._forwarder.mark(ask, forwarded)
            return self._forwarder.reserve(ask, ask_msg.reserve, token)

        def answer(ask_msg, fut: asyncio.Future, started: float):
            rec, api = outcome(fut)
            metrics.reserve_answered(time.perf_counter() - started, "OK" if api is None else api.code.name)
            if api is None:
                return scheduler_pb2.ReserveAnswer(tag=ask_msg.tag, reservation=rec.to_proto())
            return scheduler_pb2.ReserveAnswer(tag=ask_msg.tag, code=api.code.value[0], message=api.message)

        async for response in serve_tagged(request_iterator, lambda m: m.asks, "asks", start, answer,
                                           lambda answers: scheduler_pb2.ReserveStreamResponse(answers=answers)):
            yield response

    def _validate_reserve(self, request, tenant) -> ReserveAsk:
        v.request_id(request.request_id)
        v.in_range(request.num_tokens, "num_tokens", 1, v.MAX_TOKENS)
        v.text(request.model, "model", v.MAX_MODEL, v.PRINTABLE)
        deadline = request.deadline_ms or self._default_deadline_ms
        v.in_range(deadline, "deadline_ms", v.MIN_DEADLINE_MS, v.MAX_DEADLINE_MS)
        if not self.view.decode_models.get(request.model):
            raise errors.invalid(f"model {request.model!r} is not served by any registered decode engine")
        if request.preferred_engine_id:
            v.text(request.preferred_engine_id, "preferred_engine_id", 128, v.ENGINE_ID)
            if self.view.engine(request.preferred_engine_id) is None:
                raise errors.invalid(f"preferred_engine_id {request.preferred_engine_id!r} is not registered")
        layout = None
        if request.HasField("prefill_layout"):
            try:
                layout = KvLayout.from_proto(request.prefill_layout, "prefill_layout")
            except LayoutError as exc:
                raise errors.invalid(str(exc)) from None
        prefill = None
        if request.prefill_engine_id:
            v.text(request.prefill_engine_id, "prefill_engine_id", 128, v.ENGINE_ID)
            prefill = self.view.engine(request.prefill_engine_id)
            if prefill is None or prefill.is_decode:
                raise errors.invalid(f"prefill_engine_id {request.prefill_engine_id!r} is not a registered "
                                     "prefill engine")
            if prefill.unavailable:
                raise errors.failed_precondition(f"prefill_engine_id {request.prefill_engine_id!r} is unavailable: "
                                                 f"{prefill.unavailable}")
            layout = layout or prefill.layout
        if request.block_keys:
            v.in_range(request.block_keys_block_size, "block_keys_block_size", 1, v.MAX_TOKENS)
            most = request.num_tokens // request.block_keys_block_size
            if len(request.block_keys) > most:
                raise errors.invalid(f"block_keys has {len(request.block_keys)} keys; num_tokens={request.num_tokens} "
                                     f"holds at most {most} full blocks of block_keys_block_size="
                                     f"{request.block_keys_block_size}")
        return ReserveAsk(tenant=tenant, request_id=request.request_id, num_tokens=request.num_tokens,
                          model=request.model, deadline_ms=deadline,
                          preferred_engine_id=request.preferred_engine_id, prefill_layout=layout,
                          prefill_engine_id=prefill.engine_id if prefill else "",
                          prefill_incarnation=prefill.incarnation if prefill else "",
                          block_keys=tuple(request.block_keys), block_keys_block_size=request.block_keys_block_size,
                          local_prefill_tokens=request.local_prefill_tokens)

    def _tenant_ending(self, request, context):
        """The caller's tenant, with ``request``'s reservation_id and reason checked (Release, Relocate)."""
        tenant = self._auth.tenant(context)
        v.reservation_id(request.reservation_id)
        v.text(request.reason, "reason", 1024, required=False)
        structlog.contextvars.bind_contextvars(tenant=tenant.name, reservation_id=request.reservation_id)
        return tenant

    @unary
    async def Release(self, request: scheduler_pb2.ReleaseRequest, context) -> types_pb2.Reservation:
        tenant = self._tenant_ending(request, context)
        target = State.CONSUMED if request.consumed else State.RELEASED
        try:
            rec = await self._lifecycle.transition(request.reservation_id, target,
                                                   request.reason or ("consumed" if request.consumed
                                                                      else "released by scheduler"),
                                                   tenant=tenant.name)
        except errors.StateConflict as exc:
            if exc.current.terminal:
                raise errors.not_found(f"reservation_id {request.reservation_id!r} has already ended "
                                       f"({exc.current.name})") from None
            raise
        return rec.to_proto()

    @unary
    async def Relocate(self, request: scheduler_pb2.RelocateRequest, context) -> types_pb2.Reservation:
        tenant = self._tenant_ending(request, context)
        try:
            move = await self._relocation(request, tenant)
            rec = move if isinstance(move, ReservationRecord) else await self._reserver.reserve(move)
        except errors.ApiError as exc:
            metrics.RELOCATIONS.labels(outcome=exc.code.name).inc()
            raise
        metrics.RELOCATIONS.labels(outcome="OK").inc()
        structlog.contextvars.bind_contextvars(moved_to=rec.id, engine_id=rec.engine_id)
        return rec.to_proto()

    async def _relocation(self, request, tenant) -> "ReserveAsk | ReservationRecord":
        """The Reserve that replaces ``request.reservation_id`` (its live successor when it
        was moved already), or an ApiError saying why it cannot be moved."""
        name = request.reservation_id
        found = await self._lifecycle.read(name)
        if found is None or found[0].tenant != tenant.name:
            raise errors.not_found(f"reservation_id {name!r} not found")
        old, revision = found
        if old.moved_to:
            successor = await self._lifecycle.find(old.moved_to)  # (it may be in a slot this replica does not follow)
            if successor is not None and successor.state.live:  # asked again: the same answer while it lives
                return successor
            raise errors.failed_precondition(f"reservation_id {name!r} was moved to {old.moved_to}, "
                                             "which has ended")
        if old.state.terminal and old.state != State.FAILED:
            raise errors.failed_precondition(f"reservation_id {name!r} has ended {old.state.name}: "
                                             + ("its KV was loaded by its decode engine" if old.state == State.CONSUMED
                                                else "there is nothing to move"))
        if not old.prefill_engine_id:
            raise errors.failed_precondition(f"reservation_id {name!r} names no prefill engine: none holds its KV")
        if old.cached_tokens:
            raise errors.failed_precondition(f"reservation_id {name!r} counts on its decode engine's prefix cache "
                                             f"for its first {old.cached_tokens} tokens: no other engine has them")
        prefill = self.view.engine(old.prefill_engine_id)
        if prefill is None or (old.prefill_incarnation and prefill.incarnation != old.prefill_incarnation):
            raise errors.failed_precondition(f"prefill engine {old.prefill_engine_id!r} of reservation_id {name!r} "
                                             "is gone or restarted: its staged KV went with it")
        if old.deadline_ms - now_ms() < v.MIN_DEADLINE_MS:
            raise errors.failed_precondition(f"reservation_id {name!r} is within {v.MIN_DEADLINE_MS} ms of its "
                                             "deadline: too late to move")
        return ReserveAsk(tenant=tenant, request_id=old.request_id, num_tokens=old.num_tokens, model=old.model,
                          deadline_ms=old.deadline_ms - now_ms(), prefill_layout=prefill.layout,
                          prefill_engine_id=old.prefill_engine_id, prefill_incarnation=old.prefill_incarnation,
                          moving=old, moving_revision=revision, move_reason=request.reason or "decode engine failed")

    @unary
    async def GetReservation(self, request, context) -> types_pb2.Reservation:
        tenant = self._auth.tenant(context)
        v.reservation_id(request.reservation_id)
        rec = await self._lifecycle.find(request.reservation_id)
        if rec is None or rec.tenant != tenant.name:
            raise errors.not_found(f"reservation_id {request.reservation_id!r} not found")
        return rec.to_proto()

    @streaming
    async def WatchReservations(self, request, context):
        tenant = self._auth.tenant(context)
        peers = self._peers()
        if request.owned_only or peers is not None:  # (watch_gather.py)
            view, ownership, started = self.view, self._ownership, self.view.replicas_version
            if not await self._following.until_covered(ownership.owned):
                raise errors.unavailable("this control-plane replica could not follow its own engines in time; retry")
            sources = [watch_events(view, lambda rec: rec.tenant == tenant.name and ownership.owns(rec.engine_id),
                                    request.include_snapshot)]
            if not request.owned_only:
                token = bearer(context)
                sources += [peer_events(self._forwarder.client(address, token), address, request.include_snapshot)
                            for address in peers]
            async for event in gather(sources, request.include_snapshot, lambda: view.replicas_version != started):
                yield event
            return
        async with self._following.needing([ALL]):  # a tenant's reservations are on every slot
            async for event in watch_events(self.view, lambda rec: rec.tenant == tenant.name,
                                            request.include_snapshot):
                yield event

    def _peers(self) -> list[str] | None:
        """The other live replicas' addresses, to gather a tenant's watch from; None when this
        replica follows every slot anyway, or cannot reach them all (then it follows every slot)."""
        if self.view.following is None or not self._forwarder.enabled:
            return None
        others = [self.view.replicas.get(r) for r in self._ownership.members if r != self._ownership.replica_id]
        if not others or not all(rec is not None and rec.reachable for rec in others):
            return None
        return [rec.reachable for rec in others]

    @unary
    async def ListEngines(self, request, context) -> scheduler_pb2.ListEnginesResponse:
        tenant = self._auth.tenant(context)
        v.text(request.model, "model", v.MAX_MODEL, v.PRINTABLE, required=False)
        def listed(as_proto) -> list:
            return sorted((as_proto(self.view, e.record) for e in self.view.engines.values()
                           if e.record.is_decode and tenant.allows(e.record.pool)
                           and (not request.model or e.record.model == request.model)),
                          key=lambda e: e.engine_id)
        if not request.exact:  # (the others' engines as their owners last told)
            return scheduler_pb2.ListEnginesResponse(engines=listed(engine_summary_proto))
        async with self._following.needing([ALL]):  # exact counts for every engine listed
            return scheduler_pb2.ListEnginesResponse(engines=listed(engine_proto))

    @streaming
    async def WatchEngines(self, request, context):
        tenant = self._auth.tenant(context)
        v.text(request.model, "model", v.MAX_MODEL, v.PRINTABLE, required=False)

        def concerns(rec) -> bool:
            return tenant.allows(rec.pool) and (not request.model or rec.model == request.model)
        async for event in engine_events(self.view, concerns):
            yield event


async def watch_events(view: View, concerns, include_snapshot: bool, engine_id: str = "", live=None):
    """ReservationEvents for the reservations ``concerns(record)`` selects: the live
    ones first (if asked; from ``live()`` when given, else every live one), then every
    change as the view applies it (only ``engine_id``'s, when given). A watcher
    that falls WATCH_QUEUE events behind is cut off (RESOURCE_EXHAUSTED) rather
    than allowed to grow the replica's memory; it reconnects with a snapshot."""
    queue = WatchQueue("reconnect with include_snapshot")

    def on_change(change: object) -> None:
        if not isinstance(change, ReservationChange):
            return
        rec = change.new
        if rec is None:
            if not change.expired:
                return
            rec = dataclasses.replace(change.old, state=State.EXPIRED, reason="deadline passed",
                                      ended_ms=change.old.deadline_ms)
        if not concerns(rec):
            return
        queue.put((rec, change.revision))

    # An engine's watch hears only its engine's changes (view.subscribe_engine): with a
    # sidecar's stream per engine, every change visiting every stream cost O(engines).
    unsubscribe = view.subscribe_engine(engine_id, on_change) if engine_id else view.subscribe(on_change)
    try:
        if include_snapshot:
            for rec in (live() if live is not None else view.live_reservations()):
                if concerns(rec):
                    yield scheduler_pb2.ReservationEvent(kind=scheduler_pb2.ReservationEvent.SNAPSHOT,
                                                         reservation=rec.to_proto(), revision=view.revision)
            yield scheduler_pb2.ReservationEvent(kind=scheduler_pb2.ReservationEvent.SNAPSHOT_END,
                                                 revision=view.revision)
        while True:
            rec, revision = await queue.get()
            yield scheduler_pb2.ReservationEvent(kind=scheduler_pb2.ReservationEvent.CHANGED,
                                                 reservation=rec.to_proto(), revision=revision)
    finally:
        unsubscribe()

"""kvpush.v1.Registry: sidecars register engines, keep them alive, find peers and
report transfer progress. An engine lives exactly as long as its etcd lease."""

from __future__ import annotations

import dataclasses

import asyncio

import structlog

from kvpush.controlplane import errors, keys, validation as v
from kvpush.controlplane.api import check_parsed, streaming, unary
from kvpush.controlplane.auth import Auth
from kvpush.controlplane.etcd import KV, EtcdClient, EtcdUnavailable, cmp_mod, op_put
from kvpush.controlplane.lifecycle import Lifecycle
from kvpush.contract.states import State
from kvpush.controlplane.records import now_ms
from kvpush.contract.engine import MEMORY_KINDS, EngineRecord
from kvpush.controlplane.engine_events import engine_proto
from kvpush.controlplane.scheduler_service import watch_events
from kvpush.controlplane.tagged_stream import outcome, serve_tagged
from kvpush.controlplane.following import Following
from kvpush.controlplane.view import View
from kvpush import log
from kvpush.contract.layout import LayoutError
from kvpush.contract.prefixes import PrefixReport, PrefixReportError
from kvpush.contract.v1 import registry_pb2, registry_pb2_grpc, types_pb2

_log = log.get("registry")
DEFAULT_LEASE_TTL_S = 10
REPORTABLE = {State.PUSHING, State.LANDED, State.CONSUMED, State.FAILED}


class RegistryService(registry_pb2_grpc.RegistryServicer):
    def __init__(self, view: View, auth: Auth, etcd: EtcdClient, lifecycle: Lifecycle, following: Following) -> None:
        self.view = view
        self._following = following
        self._auth = auth
        self._etcd = etcd
        self._lifecycle = lifecycle
        self._background: set[asyncio.Task] = set()
        self.shutting_down = False

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _engine_record(self, msg: types_pb2.Engine) -> EngineRecord:
        v.text(msg.engine_id, "engine.engine_id", 128, v.ENGINE_ID)
        if msg.role not in (types_pb2.PREFILL, types_pb2.DECODE):
            raise errors.invalid("engine.role must be PREFILL or DECODE")
        v.text(msg.model, "engine.model", v.MAX_MODEL, v.PRINTABLE)
        v.text(msg.nixl_agent, "engine.nixl_agent", 256, v.PRINTABLE)
        if len(msg.nixl_metadata) > v.MAX_NIXL_METADATA:
            raise errors.invalid(f"engine.nixl_metadata is larger than {v.MAX_NIXL_METADATA} bytes")
        low = 1 if msg.role == types_pb2.DECODE else 0
        v.in_range(msg.num_blocks, "engine.num_blocks", low, v.MAX_BLOCKS_PER_ENGINE)
        v.text(msg.incarnation, "engine.incarnation", 128, v.PRINTABLE)
        v.text(msg.sidecar_address, "engine.sidecar_address", 256, v.PRINTABLE, required=False)
        v.text(msg.pool, "engine.pool", 128, v.POOL_NAME, required=False)
        v.text(msg.serving_url, "engine.serving_url", 256, v.SERVING_URL, required=False)
        v.text(msg.unavailable, "engine.unavailable", 512, v.REASON, required=False)
        if msg.memory_kind not in ("", *MEMORY_KINDS):
            raise errors.invalid(f"engine.memory_kind must be one of {MEMORY_KINDS}")
        try:
            record = EngineRecord.from_proto(msg)
        except LayoutError as exc:
            raise errors.invalid(str(exc)) from None
        if len(record.rank_pools) != record.expected_rank_pools:
            raise errors.invalid(f"engine.rank_pools: an engine of kv_layout.tp_size={record.layout.tp_size} "
                                 f"lists {record.expected_rank_pools} rank pools, got {len(record.rank_pools)}")
        return dataclasses.replace(record, pool=msg.pool or "default", registered_ms=now_ms())

    @unary
    async def RegisterEngine(self, request, context) -> registry_pb2.RegisterEngineResponse:
        self._auth.engine(context)
        rec = self._engine_record(request.engine)
        ttl = request.lease_ttl_seconds or DEFAULT_LEASE_TTL_S
        v.in_range(ttl, "lease_ttl_seconds", 2, 300)
        structlog.contextvars.bind_contextvars(engine_id=rec.engine_id, incarnation=rec.incarnation)
        old = self.view.engines.get(rec.engine_id)
        try:
            lease = await self._etcd.grant_lease(ttl)
            # Engine record and pool fence share the engine's lease: both vanish with it.
            result = await self._etcd.txn([], [op_put(keys.engine(rec.engine_id), rec.encode(), lease),
                                               op_put(keys.pool(rec.engine_id), b"", lease)])
            if old is not None and old.lease != lease:
                await self._etcd.revoke_lease(old.lease)
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None
        self.view.apply(KV(keys.engine(rec.engine_id), rec.encode(), result.revision, result.revision, lease),
                        False, result.revision)
        self.view.apply(KV(keys.pool(rec.engine_id), b"", result.revision, result.revision, lease),
                        False, result.revision)
        _log.info("engine registered", role=types_pb2.EngineRole.Name(rec.role), model=rec.model,
                  num_blocks=rec.num_blocks, lease_id=lease, replaced=old is not None)
        return registry_pb2.RegisterEngineResponse(lease_id=lease, lease_ttl_seconds=ttl,
                                                   engine=engine_proto(self.view, rec))

    @streaming
    async def Heartbeat(self, request_iterator, context):
        self._auth.engine(context)
        engine_id, lease_id = None, None
        try:
            async for ping in request_iterator:
                check_parsed(ping)
                v.text(ping.engine_id, "engine_id", 128, v.ENGINE_ID)
                if engine_id is None:
                    engine_id, lease_id = ping.engine_id, ping.lease_id
                    structlog.contextvars.bind_contextvars(engine_id=engine_id)
                elif (ping.engine_id, ping.lease_id) != (engine_id, lease_id):
                    raise errors.invalid("engine_id and lease_id must not change within one heartbeat stream")
                try:
                    remaining = await self._etcd.refresh_lease(lease_id)
                except EtcdUnavailable as exc:
                    # The stream ends because etcd failed here (a leader election, a member
                    # gone), not because the engine did: its lease is left to its TTL and to
                    # the engine's next stream, and its reservations live on.
                    engine_id = None
                    raise errors.unavailable(f"etcd unavailable: {exc}") from None
                if remaining <= 0:
                    engine_id = None  # nothing left to revoke
                    raise errors.not_found("engine lease expired; register again")
                yield registry_pb2.HeartbeatPong(ttl_seconds=remaining)
        finally:
            # The stream is the engine's liveness: when it ends, so does the engine,
            # unless the engine has registered again on a newer lease meanwhile, or
            # the stream ended because this replica is shutting down: then the
            # sidecar moves to another replica and the lease's TTL decides.
            entry = self.view.engines.get(engine_id) if engine_id else None
            if entry is not None and entry.lease == lease_id and not self.shutting_down:
                _log.info("heartbeat stream ended; deregistering", engine_id=engine_id)
                self._spawn(self._etcd.revoke_lease(lease_id))

    @unary
    async def DeregisterEngine(self, request, context) -> registry_pb2.DeregisterEngineResponse:
        self._auth.engine(context)
        v.text(request.engine_id, "engine_id", 128, v.ENGINE_ID)
        entry = self.view.engines.get(request.engine_id)
        if entry is None or (request.incarnation and entry.record.incarnation != request.incarnation):
            raise errors.not_found(f"engine_id {request.engine_id!r} is not registered")
        # End its reservations first so the count is ours; the lease revoke then
        # removes the engine, and the reaper ends anything reserved in between.
        failed = await self._lifecycle.fail_engine(request.engine_id, "decode engine deregistered")
        try:
            await self._etcd.revoke_lease(entry.lease)
        except EtcdUnavailable as exc:
            raise errors.unavailable(f"etcd unavailable: {exc}") from None
        return registry_pb2.DeregisterEngineResponse(reservations_failed=failed)

    @unary
    async def GetEngine(self, request, context) -> types_pb2.Engine:
        self._auth.engine(context)
        v.text(request.engine_id, "engine_id", 128, v.ENGINE_ID)
        if self.view.engine(request.engine_id) is None:
            raise errors.not_found(f"engine_id {request.engine_id!r} is not registered")
        async with self._following.needing([keys.slot_of(request.engine_id)]):  # its exact counts
            rec = self.view.engine(request.engine_id)
            if rec is None:
                raise errors.not_found(f"engine_id {request.engine_id!r} is not registered")
            return engine_proto(self.view, rec)

    @unary
    async def ReportState(self, request, context) -> types_pb2.Reservation:
        self._auth.engine(context)
        return await self._report(request)

    @streaming
    async def ReportStates(self, request_iterator, context):
        self._auth.engine(context)

        def start(tagged, _i: int) -> asyncio.Future:
            # Concurrent reports' transitions meet in the lifecycle's group commit.
            return asyncio.ensure_future(self._report(tagged.report))

        def answer(tagged, fut: asyncio.Future, _started: float):
            res, api = outcome(fut)
            if api is None:
                return registry_pb2.ReportAnswer(tag=tagged.tag, reservation=res)
            return registry_pb2.ReportAnswer(tag=tagged.tag, code=api.code.value[0], message=api.message)

        async for response in serve_tagged(request_iterator, lambda m: m.reports, "reports", start, answer,
                                           lambda answers: registry_pb2.ReportStatesResponse(answers=answers)):
            yield response

    async def _report(self, request) -> types_pb2.Reservation:
        v.reservation_id(request.reservation_id)
        v.text(request.reason, "reason", 1024, required=False)
        v.text(request.engine_id, "engine_id", 128, v.ENGINE_ID, required=False)
        v.text(request.incarnation, "incarnation", 128, v.PRINTABLE, required=False)
        try:
            target = State(request.state)
        except ValueError:
            raise errors.invalid(f"state {request.state} is not a reservation state") from None
        if target not in REPORTABLE:
            raise errors.invalid(f"state {target.name} cannot be reported; use one of "
                                 f"{sorted(s.name for s in REPORTABLE)}")
        if request.landed and target != State.CONSUMED:
            raise errors.invalid(f"landed is only meaningful with CONSUMED, not {target.name}")
        if target == State.PUSHING:
            if not request.engine_id:
                raise errors.invalid("engine_id is required with PUSHING: it names the engine pushing")
            pusher = self.view.engine(request.engine_id)
            if pusher is None:
                raise errors.not_found(f"engine_id {request.engine_id!r} is not registered")
            if request.incarnation and request.incarnation != pusher.incarnation:
                raise errors.failed_precondition(
                    f"incarnation {request.incarnation!r} of engine_id {request.engine_id!r} is not its current one")
        structlog.contextvars.bind_contextvars(reservation_id=request.reservation_id, engine_id=request.engine_id)
        rec = await self._lifecycle.transition(
            request.reservation_id, target, request.reason,
            prefill_engine_id=request.engine_id if target == State.PUSHING else "",
            via=State.LANDED if request.landed else None,
            prefill_incarnation=request.incarnation if target == State.PUSHING else "")
        return rec.to_proto()

    @streaming
    async def WatchEngineReservations(self, request, context):
        self._auth.engine(context)
        v.text(request.engine_id, "engine_id", 128, v.ENGINE_ID)
        engine = self.view.engine(request.engine_id)
        if engine is None:
            raise errors.not_found(f"engine_id {request.engine_id!r} is not registered")
        engine_id = request.engine_id
        # Decode engines hear about reservations landing on them; prefill engines
        # about the ones they push into.
        # A prefill engine's are told from their copies under its own slot (keys.push): either
        # way the stream needs that one slot.
        if engine.is_decode:
            def concerns(rec) -> bool:
                return rec.engine_id == engine_id

            def live():
                return self.view.live_reservations(engine_id=engine_id)
        else:
            def concerns(rec) -> bool:
                return rec.prefill_engine_id == engine_id

            def live():
                return self.view.pushes.live(engine_id)
        async with self._following.needing([keys.slot_of(engine_id)]):
            async for event in watch_events(self.view, concerns, request.include_snapshot, engine_id, live):
                yield event

    @unary
    async def SetEngineAvailability(self, request, context) -> registry_pb2.SetEngineAvailabilityResponse:
        self._auth.engine(context)
        v.text(request.engine_id, "engine_id", 128, v.ENGINE_ID)
        v.text(request.incarnation, "incarnation", 128, v.PRINTABLE)
        v.text(request.unavailable, "unavailable", 512, v.REASON, required=False)
        structlog.contextvars.bind_contextvars(engine_id=request.engine_id, incarnation=request.incarnation)
        # Compare-and-swap on the record: a Reserve planned on the old record fails its
        # fence on the engine key, so none lands on an engine once it is unavailable.
        for _ in range(8):
            entry = self.view.engines.get(request.engine_id)
            if entry is None:
                raise errors.not_found(f"engine_id {request.engine_id!r} is not registered")
            if entry.record.incarnation != request.incarnation:
                raise errors.failed_precondition(f"incarnation {request.incarnation!r} of engine_id "
                                                 f"{request.engine_id!r} is not its current one")
            rec = dataclasses.replace(entry.record, unavailable=request.unavailable)
            if rec == entry.record:
                break
            key = keys.engine(rec.engine_id)
            try:
                result = await self._etcd.txn([cmp_mod(key, entry.mod_revision)], [op_put(key, rec.encode(), entry.lease)])
            except EtcdUnavailable as exc:
                raise errors.unavailable(f"etcd unavailable: {exc}") from None
            if result.succeeded:
                self.view.apply(KV(key, rec.encode(), result.revision, result.revision, entry.lease), False,
                                result.revision)
                _log.info("engine availability changed", available=not rec.unavailable, reason=rec.unavailable)
                break
            await self.view.wait_for_revision(result.revision, 2.0)
        else:
            raise errors.unavailable("engine record kept changing; retry")
        failed = 0
        if rec.unavailable:
            failed = await self._lifecycle.fail_engine(rec.engine_id, f"engine unavailable: {rec.unavailable}")
        return registry_pb2.SetEngineAvailabilityResponse(engine=engine_proto(self.view, rec),
                                                          reservations_failed=failed)

    @unary
    async def LookupReservation(self, request, context) -> types_pb2.Reservation:
        self._auth.engine(context)
        v.reservation_id(request.reservation_id)
        rec = await self._lifecycle.find(request.reservation_id)
        if rec is None:
            raise errors.not_found(f"reservation_id {request.reservation_id!r} not found")
        return rec.to_proto()

    @unary
    async def ReportPrefixes(self, request, context) -> registry_pb2.ReportPrefixesResponse:
        self._auth.engine(context)
        v.text(request.engine_id, "engine_id", 128, v.ENGINE_ID)
        v.text(request.incarnation, "incarnation", 128, v.PRINTABLE)
        report = PrefixReport.from_proto(request)
        try:
            report.check()
        except PrefixReportError as exc:
            raise errors.invalid(str(exc)) from None
        key = keys.prefixes(report.engine_id)
        value = report.encode()
        for _ in range(4):  # fenced on the engine's record: a report never outlives its engine's life
            entry = self.view.engines.get(report.engine_id)
            if entry is None:
                raise errors.not_found(f"engine_id {report.engine_id!r} is not registered")
            rec = entry.record
            if rec.incarnation != report.incarnation:
                raise errors.failed_precondition(f"incarnation {report.incarnation!r} of engine_id "
                                                 f"{report.engine_id!r} is not its current one")
            if not rec.is_decode:
                raise errors.failed_precondition(f"engine_id {report.engine_id!r} is a prefill engine: prefix "
                                                 "reports are a decode engine's")
            if report.block_size != rec.layout.block_size:
                raise errors.invalid(f"block_size {report.block_size} is not engine {report.engine_id!r}'s "
                                     f"{rec.layout.block_size}")
            engine_key = keys.engine(report.engine_id)
            try:
                result = await self._etcd.txn([cmp_mod(engine_key, entry.mod_revision)],
                                              [op_put(key, value, entry.lease)])
            except EtcdUnavailable as exc:
                raise errors.unavailable(f"etcd unavailable: {exc}") from None
            if result.succeeded:
                self.view.apply(KV(key, value, result.revision, result.revision, entry.lease), False, result.revision)
                return registry_pb2.ReportPrefixesResponse(
                    held_blocks=self.view.prefixes.held_blocks(report.engine_id))
            await self.view.wait_for_revision(result.revision, 2.0)
        raise errors.unavailable("engine record kept changing; retry")

"""Hypothesis throws random fields, sizes and ids at every RPC. The server must
answer each with a status (never crash or hang), stay up, and leave the registry
satisfying every invariant."""

from __future__ import annotations

import asyncio

import grpc
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpush.controlplane.invariants import check
from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import admin_pb2, registry_pb2, scheduler_pb2, types_pb2
from tests.controlplane.helpers import make_tenant

# Codes an API may legitimately answer with; INTERNAL/UNKNOWN would mean a crash.
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ABORTED}

texts = st.one_of(st.text(max_size=300), st.sampled_from(["", "sim-model", "decode-0", "acme", "r-" + "0" * 24]))
u32 = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 5000))
layouts = st.builds(types_pb2.KvLayout, num_layers=u32, block_size=u32, num_kv_heads=u32, head_dim=u32,
                    dtype=st.sampled_from(["", "float32", "bfloat16", "x"]), kv_parts=st.integers(0, 3))
engines = st.builds(types_pb2.Engine, engine_id=texts, role=st.integers(0, 2), model=texts,
                    kv_layout=layouts, nixl_agent=texts, nixl_metadata=st.binary(max_size=64), num_blocks=u32,
                    incarnation=texts, pool=texts, memory_kind=st.sampled_from(["", "DRAM", "VRAM", "?"]),
                    serving_url=st.one_of(texts, st.just("http://127.0.0.1:8200")), unavailable=texts)

# Rotating or deleting the fuzzing tenant itself would leave every later call UNAUTHENTICATED.
others = texts.filter(lambda name: name != "acme")

u64s = st.lists(st.integers(0, 2**64 - 1), max_size=40)
reserves = st.builds(scheduler_pb2.ReserveRequest, request_id=texts, num_tokens=u32, model=texts,
                     preferred_engine_id=texts, deadline_ms=u32, prefill_layout=st.one_of(st.none(), layouts),
                     block_keys=u64s, block_keys_block_size=st.one_of(u32, st.just(16)),
                     local_prefill_tokens=st.one_of(u32, st.just(0), st.just(64)))
stream_messages = st.lists(st.builds(scheduler_pb2.ReserveStreamRequest, asks=st.lists(st.builds(
    scheduler_pb2.ReserveAsk, tag=st.integers(0, 2**64 - 1), reserve=reserves), max_size=5)), max_size=3)
reports = st.builds(registry_pb2.ReportStateRequest, reservation_id=texts, state=st.integers(0, 9), reason=texts,
                    engine_id=texts, landed=st.booleans())
report_messages = st.lists(st.builds(registry_pb2.ReportStatesRequest, reports=st.lists(st.builds(
    registry_pb2.TaggedReport, tag=st.integers(0, 2**64 - 1), report=reports), max_size=5)), max_size=3)

COVERED: set[tuple[str, str]] = set()


def _call(spec: tuple[str, str, str], requests):
    COVERED.add(spec[:2])
    return st.tuples(st.just(spec), requests)


CALLS = st.one_of(
    _call(("scheduler", "Reserve", "tenant"), reserves),
    _call(("scheduler", "ReserveStream", "tenant"), stream_messages),
    _call(("registry", "ReportStates", "engine"), report_messages),
    _call(("scheduler", "WatchReservations", "tenant"),
              st.builds(scheduler_pb2.WatchReservationsRequest, include_snapshot=st.booleans())),
    _call(("registry", "WatchEngineReservations", "engine"), st.builds(
        registry_pb2.WatchEngineReservationsRequest, engine_id=texts, include_snapshot=st.booleans())),
    _call(("registry", "Heartbeat", "engine"), st.lists(st.builds(
        registry_pb2.HeartbeatPing, engine_id=texts, lease_id=st.integers(-2**63, 2**63 - 1)), max_size=3)),
    _call(("scheduler", "Release", "tenant"), st.builds(
        scheduler_pb2.ReleaseRequest, reservation_id=texts, consumed=st.booleans(), reason=texts)),
    _call(("scheduler", "Relocate", "tenant"), st.builds(
        scheduler_pb2.RelocateRequest, reservation_id=texts, reason=texts)),
    _call(("scheduler", "GetReservation", "tenant"),
              st.builds(scheduler_pb2.GetReservationRequest, reservation_id=texts)),
    _call(("scheduler", "ListEngines", "tenant"),
              st.builds(scheduler_pb2.ListEnginesRequest, model=texts)),
    _call(("scheduler", "WatchEngines", "tenant"),
              st.builds(scheduler_pb2.WatchEnginesRequest, model=texts)),
    _call(("registry", "SetEngineAvailability", "engine"), st.builds(
        registry_pb2.SetEngineAvailabilityRequest, engine_id=texts, incarnation=texts, unavailable=texts)),
    _call(("registry", "RegisterEngine", "engine"), st.builds(
        registry_pb2.RegisterEngineRequest, engine=engines, lease_ttl_seconds=u32)),
    _call(("registry", "GetEngine", "engine"),
              st.builds(registry_pb2.GetEngineRequest, engine_id=texts)),
    _call(("registry", "ReportState", "engine"), st.builds(
        registry_pb2.ReportStateRequest, reservation_id=texts, state=st.integers(0, 9), reason=texts,
        engine_id=texts)),
    _call(("registry", "LookupReservation", "engine"),
              st.builds(registry_pb2.LookupReservationRequest, reservation_id=texts)),
    _call(("registry", "ReportPrefixes", "engine"), st.builds(
        registry_pb2.ReportPrefixesRequest, engine_id=texts, incarnation=texts, epoch=st.integers(0, 2**64 - 1),
        seq=st.integers(0, 2**64 - 1), stored=u64s, removed=u64s, block_size=st.one_of(u32, st.just(16)))),
    _call(("registry", "DeregisterEngine", "engine"),
              st.builds(registry_pb2.DeregisterEngineRequest, engine_id=texts, incarnation=texts)),
    _call(("admin", "CreateTenant", "admin"), st.builds(
        admin_pb2.CreateTenantRequest, name=texts, quota_blocks=u32, allowed_pools=st.lists(texts, max_size=70),
        token=texts)),
    _call(("admin", "UpdateTenant", "admin"), st.builds(
        admin_pb2.UpdateTenantRequest, name=others, quota_blocks=u32, allowed_pools=st.lists(texts, max_size=3))),
    _call(("admin", "DeleteTenant", "admin"), st.builds(admin_pb2.DeleteTenantRequest, name=others)),
    _call(("admin", "RotateTenantToken", "admin"),
              st.builds(admin_pb2.RotateTenantTokenRequest, name=others)),
    _call(("admin", "GetStatus", "admin"), st.just(admin_pb2.GetStatusRequest())),
    _call(("admin", "ListTenants", "admin"), st.just(admin_pb2.ListTenantsRequest())),
)


def test_the_fuzzer_calls_every_rpc():
    """A method added to a service is fuzzed too, or this fails naming it."""
    services = {"scheduler": scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"],
                "registry": registry_pb2.DESCRIPTOR.services_by_name["Registry"],
                "admin": admin_pb2.DESCRIPTOR.services_by_name["Admin"]}
    every = {(name, m.name) for name, service in services.items() for m in service.methods}
    assert every - COVERED == set()


STREAMS_THAT_STAY_OPEN = {"WatchReservations", "WatchEngineReservations", "WatchEngines", "Heartbeat"}


async def drain(stub, method: str, request, client) -> None:
    if method == "Heartbeat":
        # Ping, then wait for the pong before the next ping, as a sidecar does. (Writing
        # after the server has refused a ping and ended the call makes grpc's client
        # record its own failed send, INTERNAL, as the call's status.)
        call = stub.Heartbeat(metadata=client.metadata, timeout=0.3)
        for ping in request:
            await call.write(ping)
            if await call.read() is grpc.aio.EOF:
                break
        else:
            await call.done_writing()
    else:
        call = getattr(stub, method)(request, metadata=client.metadata, timeout=0.3)
    async for _ in call:
        pass


async def stream_answers(stub, method: str, messages, client) -> list:
    async def requests():
        for msg in messages:
            yield msg
    return [a async for msg in getattr(stub, method)(requests(), metadata=client.metadata, timeout=10)
            for a in msg.answers]


async def test_fuzz_every_rpc(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=256)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme", quota_blocks=200)
    clients = {"tenant": tenant, "engine": engine_client, "admin": admin}
    loop = asyncio.get_running_loop()
    seen: dict[str, int] = {}

    async def call(spec, request):
        service, method, who = spec
        client = clients[who]
        stub = getattr(client, service)
        try:
            if method in STREAMS_THAT_STAY_OPEN:
                # A well-formed watch or heartbeat is answered by a stream that stays
                # open: the client's deadline ends it, which is not an error.
                try:
                    await drain(stub, method, request, client)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise
            elif method in ("ReserveStream", "ReportStates"):
                answers = await stream_answers(stub, method, request, client)
                for ans in answers:
                    code = next(c for c in grpc.StatusCode if c.value[0] == ans.code)
                    assert code == grpc.StatusCode.OK or code in ALLOWED, f"{method}: {code.name}: {ans.message}"
                assert len(answers) == sum(len(m.asks if method == "ReserveStream" else m.reports) for m in request)
            else:
                await getattr(stub, method)(request, metadata=client.metadata, timeout=10)
            seen["OK"] = seen.get("OK", 0) + 1
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in ALLOWED, f"{method}: {exc.code().name}: {exc.details()}"
            seen[exc.code().name] = seen.get(exc.code().name, 0) + 1

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(CALLS, min_size=1, max_size=4))
    def run(calls):
        # Hypothesis drives synchronously; run each example on the test's own loop.
        async def batch():
            await asyncio.gather(*(call(s, r) for s, r in calls))
        fut = asyncio.run_coroutine_threadsafe(batch(), loop)
        fut.result(60)

    await asyncio.to_thread(run)
    print("fuzz outcomes:", seen)
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen
    assert sum(seen.values()) >= 400
    # The server is still up and the registry is consistent (orphans of fuzzed
    # engines that were registered without heartbeats may still await the reaper).
    report = await check(etcd.endpoint, allow_orphans=True)
    assert report.ok, report.summary()
    status = await admin.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=admin.metadata, timeout=5)
    assert status.revision > 0
    await tenant.close()
    await engine.stop()

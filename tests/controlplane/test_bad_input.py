"""Bad input gets a clear status naming the field; the server stays up and
nothing is reserved or leaked."""

from __future__ import annotations

import grpc
import pytest

from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.layout import KvLayout
from kvpush.contract.v1 import registry_pb2, scheduler_pb2, types_pb2
from tests.controlplane.helpers import expect_code, make_tenant, reserve, settle

INVALID = grpc.StatusCode.INVALID_ARGUMENT

RESERVE_CASES = [
    (dict(request_id="", num_tokens=16), INVALID, "request_id"),
    (dict(request_id="x" * 257, num_tokens=16), INVALID, "request_id"),
    (dict(request_id="has space", num_tokens=16), INVALID, "request_id"),
    (dict(request_id="nul\x00byte", num_tokens=16), INVALID, "request_id"),
    (dict(request_id="r", num_tokens=0), INVALID, "num_tokens"),
    (dict(request_id="r", num_tokens=2**32 - 1), INVALID, "num_tokens"),
    (dict(request_id="r", num_tokens=16, model=""), INVALID, "model"),
    (dict(request_id="r", num_tokens=16, model="no-such-model"), INVALID, "model"),
    (dict(request_id="r", num_tokens=16, deadline_ms=5), INVALID, "deadline_ms"),
    (dict(request_id="r", num_tokens=16, deadline_ms=10**9), INVALID, "deadline_ms"),
    (dict(request_id="r", num_tokens=16, preferred_engine_id="nope"), INVALID, "preferred_engine_id"),
    (dict(request_id="r", num_tokens=16, preferred_engine_id="../etc"), INVALID, "preferred_engine_id"),
    (dict(request_id="r", num_tokens=16, prefill_layout=types_pb2.KvLayout(num_layers=0)), INVALID,
     "prefill_layout.num_layers"),
    (dict(request_id="r", num_tokens=16, prefill_layout=types_pb2.KvLayout(
        num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype="float64")), INVALID,
     "prefill_layout.dtype"),
    # More tokens than any engine has blocks for: capacity, not a bad argument.
    (dict(request_id="r", num_tokens=64 * 16 + 1), grpc.StatusCode.RESOURCE_EXHAUSTED, "num_tokens"),
    # A prefill layout no decode engine can take: refused before any prefill, naming both
    # layouts; no amount of free blocks would change it, so not RESOURCE_EXHAUSTED.
    (dict(request_id="r", num_tokens=16, prefill_layout=
        KvLayout(num_layers=8, block_size=16, num_kv_heads=2, head_dim=64).to_proto()),
     grpc.StatusCode.FAILED_PRECONDITION,
     "prefill layout layers=8,block=16,heads=2,dim=64,dtype=float32 cannot feed decode layout "
     "layers=4,block=16,heads=2,dim=64,dtype=float32: kv_layout.num_layers differs"),
    (dict(request_id="r", num_tokens=16, prefill_layout=
        KvLayout(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, tp_size=2).to_proto()),
     grpc.StatusCode.FAILED_PRECONDITION, "heads=4,dim=64,dtype=float32,tp=2 cannot feed"),
    (dict(request_id="r", num_tokens=16, prefill_layout=types_pb2.KvLayout(
        num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, tp_size=3)), INVALID,
     "prefill_layout.tp_size=3 cannot split num_kv_heads=2"),
]


@pytest.mark.parametrize("fields,code,mention", RESERVE_CASES, ids=[c[2] + str(i) for i, c in enumerate(RESERVE_CASES)])
async def test_reserve_bad_input(cp, admin, engine_client, etcd, fields, code, mention):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    fields = {"model": "sim-model", **fields}
    details = await expect_code(code, tenant.scheduler.Reserve(scheduler_pb2.ReserveRequest(**fields),
                                                               metadata=tenant.metadata, timeout=5))
    assert mention in details, details
    await settle(etcd.endpoint, quiet=True)
    assert (await reserve(tenant, "still-works", 16)).state == types_pb2.RESERVED
    await tenant.close()
    await engine.stop()


async def test_a_prefill_of_another_tp_and_block_size_is_granted(cp, admin, engine_client, etcd):
    # Tensor parallelism and block size may differ between prefill and decode: the head
    # plan and the re-blocking staging map them; only the heads' bytes must agree.
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    prefill = KvLayout(num_layers=4, block_size=32, num_kv_heads=2, head_dim=64, tp_size=2)
    res = await tenant.scheduler.Reserve(scheduler_pb2.ReserveRequest(
        request_id="tp2", num_tokens=40, model="sim-model", prefill_layout=prefill.to_proto()),
        metadata=tenant.metadata, timeout=5)
    assert res.state == types_pb2.RESERVED and res.engine_id == "decode-0" and len(res.block_ids) == 3
    assert res.decode_tp_size == 1
    # A decode engine of TP 2: its reservations say so (the prefill plans its heads by it).
    tp2 = SimulatedEngine(engine_client, "decode-tp2", num_blocks=64, model="tp2-model",
                          layout=KvLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, tp_size=2))
    await tp2.register()
    res = await tenant.scheduler.Reserve(scheduler_pb2.ReserveRequest(
        request_id="to-tp2", num_tokens=40, model="tp2-model", prefill_layout=prefill.to_proto()),
        metadata=tenant.metadata, timeout=5)
    assert res.engine_id == "decode-tp2" and res.decode_tp_size == 2
    await tenant.close()
    await engine.stop(), await tp2.stop()


async def test_unknown_fields_are_refused(cp, admin, engine_client):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=8)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    raw = scheduler_pb2.ReserveRequest(request_id="r", num_tokens=16, model="sim-model").SerializeToString()
    raw += bytes([0xF8, 0x01, 0x05])  # field 31, varint 5: from some future API version
    call = tenant.channel.unary_unary("/kvpush.v1.Scheduler/Reserve", request_serializer=None,
                                      response_deserializer=None)
    details = await expect_code(INVALID, call(raw, metadata=tenant.metadata, timeout=5))
    assert "unknown field number 31" in details
    await tenant.close()
    await engine.stop()


async def test_garbage_bytes_and_oversized_messages(cp, admin, engine_client):
    tenant = await make_tenant(admin, cp.address, "acme")
    call = tenant.channel.unary_unary("/kvpush.v1.Scheduler/Reserve", request_serializer=None,
                                      response_deserializer=None)
    details = await expect_code(INVALID, call(b"\xff\xff\xff\xff", metadata=tenant.metadata, timeout=5))
    assert "ReserveRequest" in details
    await expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, call(b"\x0a" + b"\x80" * 3 + b"\x01" + b"x" * (5 << 20),
                                                               metadata=tenant.metadata, timeout=5))
    await tenant.close()


async def test_release_and_get_bad_ids(cp, admin):
    tenant = await make_tenant(admin, cp.address, "acme")
    for bad in ("", "x", "r-" + "g" * 24, "r-" + "0" * 25):
        await expect_code(INVALID, tenant.scheduler.Release(scheduler_pb2.ReleaseRequest(reservation_id=bad),
                                                             metadata=tenant.metadata))
    await expect_code(grpc.StatusCode.NOT_FOUND, tenant.scheduler.Release(
        scheduler_pb2.ReleaseRequest(reservation_id="r-" + "0" * 24), metadata=tenant.metadata))
    await expect_code(grpc.StatusCode.NOT_FOUND, tenant.scheduler.GetReservation(
        scheduler_pb2.GetReservationRequest(reservation_id="r-" + "0" * 24), metadata=tenant.metadata))
    await tenant.close()


def engine_msg(**over) -> types_pb2.Engine:
    base = dict(engine_id="decode-x", role=types_pb2.DECODE, model="m", nixl_agent="agent", num_blocks=8,
                incarnation="i1", kv_layout=KvLayout(num_layers=2, block_size=16, num_kv_heads=1,
                                                                   head_dim=32).to_proto())
    base.update(over)
    return types_pb2.Engine(**base)


REGISTER_CASES = [
    (dict(engine_id=""), "engine.engine_id"),
    (dict(engine_id="a/b"), "engine.engine_id"),
    (dict(role=types_pb2.ENGINE_ROLE_UNSPECIFIED), "engine.role"),
    (dict(model=""), "engine.model"),
    (dict(nixl_agent=""), "engine.nixl_agent"),
    (dict(num_blocks=0), "engine.num_blocks"),
    (dict(num_blocks=2**31), "engine.num_blocks"),
    (dict(incarnation=""), "engine.incarnation"),
    (dict(nixl_metadata=b"x" * (2 << 20)), "engine.nixl_metadata"),
    (dict(kv_layout=types_pb2.KvLayout()), "engine.kv_layout.num_layers"),
    (dict(kv_layout=types_pb2.KvLayout(num_layers=1, block_size=16, num_kv_heads=1, head_dim=10**6)),
     "engine.kv_layout.head_dim"),
    (dict(memory_kind="HBM"), "engine.memory_kind"),
    (dict(pool="bad pool"), "engine.pool"),
    (dict(kv_layout=types_pb2.KvLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, tp_size=2)),
     "engine.rank_pools: an engine of kv_layout.tp_size=2 lists 2 rank pools, got 0"),
    (dict(kv_layout=types_pb2.KvLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, tp_size=3)),
     "engine.kv_layout.tp_size=3 cannot split num_kv_heads=2"),
]


@pytest.mark.parametrize("over,mention", REGISTER_CASES, ids=[c[1] + str(i) for i, c in enumerate(REGISTER_CASES)])
async def test_register_bad_input(cp, engine_client, over, mention):
    details = await expect_code(INVALID, engine_client.registry.RegisterEngine(
        registry_pb2.RegisterEngineRequest(engine=engine_msg(**over)), metadata=engine_client.metadata, timeout=5))
    assert mention in details
    assert not cp.view.engines


async def test_register_bad_lease_ttl(cp, engine_client):
    details = await expect_code(INVALID, engine_client.registry.RegisterEngine(
        registry_pb2.RegisterEngineRequest(engine=engine_msg(), lease_ttl_seconds=1),
        metadata=engine_client.metadata))
    assert "lease_ttl_seconds" in details

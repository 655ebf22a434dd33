"""Reserve/Release round trips against a real etcd and an in-process control plane."""

from __future__ import annotations

import grpc

from controlplane.invariants import check
from kvpush.simulated import SimulatedEngine
from kvpush.v1 import types_pb2
from tests.controlplane.helpers import expect_code, make_tenant, release, reserve, settle


async def test_reserve_release_round_trip(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    res = await reserve(tenant, "req-1", num_tokens=100)
    assert res.engine_id == "decode-0"
    assert res.state == types_pb2.RESERVED
    assert len(res.block_ids) == 7  # ceil(100 / 16)
    assert res.block_size == 16
    report = await check(etcd.endpoint)
    assert report.ok, report.summary()
    assert report.engines["decode-0"].reserved == set(res.block_ids)
    assert len(report.engines["decode-0"].free) == 64 - 7

    got = await release(tenant, res.id)
    assert got.state == types_pb2.RELEASED
    report = await settle(etcd.endpoint, quiet=True)
    assert len(report.engines["decode-0"].free) == 64
    await tenant.close()
    await engine.stop()


async def test_idempotent_reserve_and_conflicting_duplicate(cp, admin, engine_client):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    first = await reserve(tenant, "req-1", num_tokens=40)
    again = await reserve(tenant, "req-1", num_tokens=40)
    assert again.id == first.id and list(again.block_ids) == list(first.block_ids)
    await expect_code(grpc.StatusCode.ALREADY_EXISTS, reserve(tenant, "req-1", num_tokens=41))
    await release(tenant, first.id)
    fresh = await reserve(tenant, "req-1", num_tokens=41)
    assert fresh.id != first.id
    await tenant.close()
    await engine.stop()


async def test_reserve_stream_answers_every_tag(cp, admin, engine_client, etcd):
    from kvpush.v1 import scheduler_pb2
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=100)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")

    async def requests():
        for i in range(120):
            # Every 10th is malformed; 120 one-block asks for 100 blocks: 12 bad, 8 exhausted.
            yield scheduler_pb2.ReserveStreamRequest(tag=i, reserve=scheduler_pb2.ReserveRequest(
                request_id=f"s{i}" if i % 10 else "", num_tokens=16, model="sim-model"))

    answers = {}
    async for msg in tenant.scheduler.ReserveStream(requests(), metadata=tenant.metadata, timeout=30):
        answers[msg.tag] = msg
    assert sorted(answers) == list(range(120))
    codes = [grpc.StatusCode.INVALID_ARGUMENT.value[0] if i % 10 == 0 else None for i in range(120)]
    for i, msg in answers.items():
        if codes[i] is not None:
            assert msg.code == codes[i] and "request_id" in msg.message
    ok = [m for m in answers.values() if m.code == 0]
    exhausted = [m for m in answers.values() if m.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert len(ok) == 100 and len(exhausted) == 8
    report = await check(etcd.endpoint)
    assert report.ok and len(report.engines["decode-0"].free) == 0
    await tenant.close()
    await engine.stop()

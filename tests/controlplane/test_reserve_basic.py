"""Reserve/Release round trips against a real etcd and an in-process control plane."""

from __future__ import annotations

import grpc

from kvpush.controlplane.invariants import check
from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.v1 import types_pb2
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
    from kvpush.contract.v1 import scheduler_pb2
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=100)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")

    async def requests():
        # 120 asks in 3 messages. Every 10th is malformed; 120 one-block asks for
        # 100 blocks: 12 bad, 8 exhausted.
        for first in range(0, 120, 40):
            yield scheduler_pb2.ReserveStreamRequest(asks=[scheduler_pb2.ReserveAsk(
                tag=i, reserve=scheduler_pb2.ReserveRequest(request_id=f"s{i}" if i % 10 else "", num_tokens=16,
                                                           model="sim-model"))
                for i in range(first, first + 40)])

    answers, messages = {}, 0
    async for msg in tenant.scheduler.ReserveStream(requests(), metadata=tenant.metadata, timeout=30):
        messages += 1
        for ans in msg.answers:
            answers[ans.tag] = ans
    assert sorted(answers) == list(range(120))
    assert messages < 120  # answers of one group commit share a message
    for i, ans in answers.items():
        if i % 10 == 0:
            assert ans.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "request_id" in ans.message
    ok = [a for a in answers.values() if a.code == 0]
    exhausted = [a for a in answers.values() if a.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert len(ok) == 100 and len(exhausted) == 8
    assert len({a.reservation.id for a in ok}) == 100
    report = await check(etcd.endpoint)
    assert report.ok and len(report.engines["decode-0"].free) == 0
    await tenant.close()
    await engine.stop()


async def test_reserve_stream_refuses_oversized_messages_and_unknown_fields(cp, admin, engine_client, etcd):
    """Too many asks in one message ends the stream (INVALID_ARGUMENT naming asks); an
    ask with a field this server does not know is refused alone, by its tag."""
    from kvpush.contract.v1 import scheduler_pb2
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=64)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")

    def ask(tag: int) -> scheduler_pb2.ReserveAsk:
        return scheduler_pb2.ReserveAsk(tag=tag, reserve=scheduler_pb2.ReserveRequest(
            request_id=f"u{tag}", num_tokens=16, model="sim-model"))

    async def too_many():
        yield scheduler_pb2.ReserveStreamRequest(asks=[ask(i) for i in range(1025)])

    async def drain(it):
        async for _ in tenant.scheduler.ReserveStream(it, metadata=tenant.metadata, timeout=10):
            pass
    details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, drain(too_many()))
    assert "asks" in details and "1024" in details

    raw = ask(2).SerializeToString() + b"\xf8\x3f\x01"  # field 1023, varint 1: unknown to the server
    strange = scheduler_pb2.ReserveAsk.FromString(raw)

    async def mixed():
        yield scheduler_pb2.ReserveStreamRequest(asks=[ask(1), strange])
    answers = {}
    async for msg in tenant.scheduler.ReserveStream(mixed(), metadata=tenant.metadata, timeout=10):
        answers.update({a.tag: a for a in msg.answers})
    assert answers[1].code == 0
    assert answers[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "asks[1]" in answers[2].message
    report = await check(etcd.endpoint)
    assert report.ok and len(report.live) == 1
    await tenant.close()
    await engine.stop()
"""Reports over the ReportStates stream: each answered by tag with the status the unary
ReportState would have ended with (through ``StreamReporter`` as a sidecar sends them),
many committed together, bad items refused alone, a bad stream refused whole."""

from __future__ import annotations

import asyncio

import grpc

from kvpush.app.simulated import SimulatedEngine
from kvpush.client.report_stream import StreamReporter
from kvpush.contract.limits import MAX_ASKS_PER_MESSAGE
from kvpush.contract.v1 import registry_pb2, types_pb2
from tests.controlplane.helpers import expect_code, make_tenant, reserve, settle


def consumed(res_id: str) -> registry_pb2.ReportStateRequest:
    return registry_pb2.ReportStateRequest(reservation_id=res_id, state=types_pb2.CONSUMED, landed=True)


async def test_reports_over_the_stream_answer_as_the_unary_call(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=512)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    reporter = StreamReporter(engine_client)
    try:
        grants = await asyncio.gather(*(reserve(tenant, f"r{i}", 16) for i in range(200)))
        # 200 CONSUMED reports at once: all applied, in far fewer etcd transactions.
        answers = await asyncio.gather(*(reporter.report(consumed(g.id), timeout=10) for g in grants))
        assert all(a.state == types_pb2.CONSUMED for a in answers)
        assert reporter.streams_opened == 1
        # Each bad report is refused alone, with the unary call's code and message.
        details = await expect_code(grpc.StatusCode.NOT_FOUND, reporter.report(consumed("r-" + "0" * 24), 5))
        assert "not found" in details
        await expect_code(grpc.StatusCode.INVALID_ARGUMENT, reporter.report(consumed("nope"), 5))
        await expect_code(grpc.StatusCode.INVALID_ARGUMENT, reporter.report(
            registry_pb2.ReportStateRequest(reservation_id=grants[0].id, state=types_pb2.RESERVED), 5))
        await expect_code(grpc.StatusCode.FAILED_PRECONDITION, reporter.report(
            registry_pb2.ReportStateRequest(reservation_id=grants[0].id, state=types_pb2.PUSHING,
                                            engine_id="decode-0"), 5))
        # Sent again after it applied (a stream that broke before its answer): refused as
        # the unary call refuses it; the sidecar then looks the reservation up.
        assert "CONSUMED" in await expect_code(grpc.StatusCode.FAILED_PRECONDITION,
                                               reporter.report(consumed(grants[1].id), 5))
        assert reporter.streams_opened == 1  # refusals of items do not break the stream
    finally:
        await reporter.close()
    # A message over the limit, or a tenant's token, is refused as a whole stream.
    call = engine_client.registry.ReportStates(metadata=engine_client.metadata)
    await call.write(registry_pb2.ReportStatesRequest(reports=[
        registry_pb2.TaggedReport(tag=i, report=consumed("r-" + "1" * 24)) for i in range(MAX_ASKS_PER_MESSAGE + 1)]))
    assert "at most" in await expect_code(grpc.StatusCode.INVALID_ARGUMENT, call.read())
    foreign = StreamReporter(tenant)
    await expect_code(grpc.StatusCode.UNAUTHENTICATED, foreign.report(consumed(grants[2].id), 5))
    await foreign.close()
    report = await settle(etcd.endpoint, quiet=True)
    assert not report.live
    await tenant.close()
    await engine.stop()

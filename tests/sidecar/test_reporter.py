"""The sidecar's report queue, against a fake registry (fast): held reports are
replaced by the next report of the same reservation, withdrawn when moot, and
flushed on shutdown. The same folding against a real control plane is in
test_landed_folded_into_consumed_over_the_api (tests/controlplane)."""

from __future__ import annotations

import asyncio
import types

import pytest
import pytest_asyncio

from kvpush.contract.v1 import registry_pb2 as R
from kvpush.contract.v1 import types_pb2 as S
from kvpush.sidecar.membership import ServiceConfig
from kvpush.sidecar.reporter import Reporter

pytestmark = pytest.mark.timeout(30)


class FakeRegistry:
    """Answers each report on the ReportStates stream as the control plane would."""

    def __init__(self):
        self.sent = []
        self.streams = 0

    def ReportStates(self, metadata=None):
        self.streams += 1
        return _FakeStream(self)


class _FakeStream:
    def __init__(self, registry: FakeRegistry):
        self.registry = registry
        self.answers: asyncio.Queue = asyncio.Queue()

    async def write(self, msg) -> None:
        answers = []
        for tagged in msg.reports:
            r = tagged.report
            self.registry.sent.append((r.reservation_id, S.ReservationState.Name(r.state), r.landed))
            answers.append(R.ReportAnswer(tag=tagged.tag, reservation=S.Reservation(id=r.reservation_id,
                                                                                   state=r.state)))
        await self.answers.put(R.ReportStatesResponse(answers=answers))

    async def read(self):
        return await self.answers.get()

    def cancel(self) -> None:
        pass


@pytest_asyncio.fixture
async def reporting():
    """A started Reporter on a fake registry, closed after the test."""
    registry = FakeRegistry()
    link = types.SimpleNamespace(client=types.SimpleNamespace(registry=registry, metadata=()))
    rep = Reporter(link, ServiceConfig(controlplane="x", token="t", model="m"), "E1", lambda *_: None)
    rep.start()
    try:
        yield rep, registry
    finally:
        await rep.close()


async def test_a_consumed_within_the_hold_replaces_its_landed(reporting):
    rep, registry = reporting
    rep.report("a", S.LANDED, hold_s=0.2)
    await asyncio.sleep(0.02)
    rep.report("a", S.CONSUMED, hold_s=0.2)
    assert registry.sent == []  # both held so far
    assert await rep.flush(2.0)  # a flush sends what is held at once
    assert registry.sent == [("a", "CONSUMED", True)]
    assert rep.counters["folded"] == 1


async def test_a_held_report_goes_out_when_its_hold_ends(reporting):
    rep, registry = reporting
    rep.report("b", S.LANDED, hold_s=0.05)
    await asyncio.sleep(0.01)
    assert registry.sent == []
    await asyncio.sleep(0.2)
    assert registry.sent == [("b", "LANDED", False)]
    rep.report("b", S.CONSUMED)  # nothing held any more: an ordinary CONSUMED
    assert await rep.flush(2.0)
    assert registry.sent[-1] == ("b", "CONSUMED", False)


async def test_pushing_is_withdrawn_when_the_push_ends_first_and_replaced_by_a_failure(reporting):
    rep, registry = reporting
    rep.report("c", S.PUSHING, hold_s=0.2)
    assert rep.withdraw("c", S.PUSHING) and not rep.withdraw("c", S.PUSHING)
    rep.report("d", S.PUSHING, hold_s=0.2)
    rep.report("d", S.FAILED, "prefill died")  # not held: sent at once, PUSHING dropped
    assert await rep.flush(2.0)
    assert registry.sent == [("d", "FAILED", False)]
    assert (rep.counters["withdrawn"], rep.counters["folded"]) == (1, 1)


async def test_other_reservations_are_not_held_up_and_order_is_kept(reporting):
    rep, registry = reporting
    rep.report("e", S.FAILED, "x")
    rep.report("f", S.LANDED, hold_s=0.1)
    await asyncio.sleep(0.05)
    assert registry.sent == [("e", "FAILED", False)]
    rep.report("f", S.FAILED, "y")
    assert await rep.flush(2.0)
    assert registry.sent == [("e", "FAILED", False), ("f", "FAILED", False)]  # never landed=True on FAILED

"""The client SDK over several registries (``kvpush.client.registries``), with stand-in
reservers: the order registries are asked in, moving on for a refusal another registry
may answer otherwise (never for a request id live in the one asked), the shared time budget,
and which registry holds a grant. The router's test over two real registries is tests/router/test_router_registries.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvpush.client import registries as regs
from kvpush.client.registries import Registries, Registry
from kvpush.client.reserve_stream import ReserveRefused
from kvpush.contract.v1 import scheduler_pb2, types_pb2


class Reserver:
    """Answers each ask with the next of ``answers``: a code (refused), a delay in seconds
    (then granted), (delay, code) (then refused), or None (granted at once); no answer
    within the ask's timeout is DEADLINE_EXCEEDED at its end."""

    def __init__(self, name: str, *answers) -> None:
        self.name, self.answers, self.asked = name, list(answers), []
        self.last_heard = 0.0   # (as TaggedStream's: when the registry last sent anything)
        self.chatty = False     # answers others meanwhile: heard from while an ask times out

    async def reserve(self, request, timeout=None):
        self.asked.append((request, timeout))
        answer = self.answers.pop(0) if self.answers else None
        if isinstance(answer, grpc.StatusCode):
            raise ReserveRefused(answer, f"{self.name} says {answer.name}")
        delay, code = answer if isinstance(answer, tuple) else (answer, None)
        if isinstance(delay, float):
            if delay > timeout:
                await asyncio.sleep(timeout / 2)
                if self.chatty:
                    self.last_heard = time.monotonic()
                await asyncio.sleep(timeout / 2)
                raise ReserveRefused(grpc.StatusCode.DEADLINE_EXCEEDED, "timed out")
            await asyncio.sleep(delay)
        if code is not None:
            raise ReserveRefused(code, f"{self.name} says {code.name}")
        return types_pb2.Reservation(id=f"r-{self.name}-{len(self.asked)}", engine_id=f"decode-{self.name}")


def fleet(*reservers: Reserver) -> Registries:
    return Registries([Registry(r.name, cp=None, reserver=r) for r in reservers])


def ask(reg: Registry) -> scheduler_pb2.ReserveRequest:
    return scheduler_pb2.ReserveRequest(request_id="q", num_tokens=10, model="m", prefill_engine_id=f"p-{reg.name}")


async def test_a_registry_without_room_or_answer_is_passed_for_the_next_and_asked_last_a_while():
    a, b, c = Reserver("a", grpc.StatusCode.RESOURCE_EXHAUSTED), Reserver("b", grpc.StatusCode.UNAVAILABLE), \
        Reserver("c")
    f = fleet(a, b, c)
    seen = []
    reg, res = await f.reserve(ask, 1.0, f.order(), keep_s=30, observe=lambda r, o: seen.append((r.name, o)))
    assert reg.name == "c" and res.id == "r-c-1"
    assert seen == [("a", "resource_exhausted"), ("b", "unavailable"), ("c", "granted")]
    assert [r.asked[0][0].prefill_engine_id for r in (a, b, c)] == ["p-a", "p-b", "p-c"]  # each its own ask
    assert f.of("r-c-1") is reg and f.of("r-a-1") is None
    # Both set aside (b, not answering, the longer): asked last, in their order, while they are.
    assert [r.name for r in f.order()] == ["c", "a", "b"]
    assert [r.name for r in f.order(first=f.all[0])] == ["c", "a", "b"]
    f.all[0].aside_until = time.monotonic() - 1  # a's moment passed: b is still aside
    assert [r.name for r in f.order()] == ["a", "c", "b"]
    assert f.all[1].aside_until - time.monotonic() > regs.FULL_S
    # ... and once its spell is over, a grant ends its being aside.
    f.all[1].aside_until = time.monotonic() - 1
    b.answers = [None]
    await f.reserve(ask, 1.0, [f.all[1]], keep_s=30)
    assert not f.all[1].aside() and not f.all[1].resting()


async def test_a_silent_registry_rests_then_one_probe_at_a_time_sees_it_back():
    """An ask that timed out (after a fair share) with nothing at all heard from the
    registry meanwhile: hung. It is not asked while it is aside, so a request with no
    other registry is refused at once (NotAsked) instead of waiting out its timeout there;
    then one ask at a time goes to it (the others meanwhile are not asked), and an answer,
    any answer, ends its rest."""
    for _ in range(2):
        a = Reserver("a", 0.5)
        f = fleet(a)
        with pytest.raises(ReserveRefused):
            await f.reserve(ask, 0.2, f.order(), keep_s=30)
        reg = f.all[0]
        assert reg.resting() and reg.aside_until - time.monotonic() > regs.DOWN_S - 0.5
        started = time.monotonic()
        with pytest.raises(regs.NotAsked) as refused:
            await f.reserve(ask, 0.2, f.order(), keep_s=30)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "a went silent lately" in refused.value.details
        assert len(a.asked) == 1 and time.monotonic() - started < 0.1
        reg.aside_until = time.monotonic() - 1  # its spell is over: the next ask probes it
        a.answers = [0.3]                       # (it answers, slowly)
        probe = asyncio.ensure_future(f.reserve(ask, 1.0, f.order(), keep_s=30))
        await asyncio.sleep(0.05)
        assert reg.probing and reg.resting()
        with pytest.raises(regs.NotAsked):       # one probe at a time: this one is not asked
            await f.reserve(ask, 1.0, f.order(), keep_s=30)
        granted_in, _ = await probe
        assert granted_in is reg and not reg.resting() and not reg.aside() and len(a.asked) == 2
    # Not resting, only aside (asked last, so asked with one registry): one that answers
    # "no room"; one whose stream broke or connection was refused (UNAVAILABLE: at once, and
    # the next ask opens a new stream, maybe to another replica); one slow for an ask that
    # timed out while it answered others.
    for answer in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, 0.5):
        a = Reserver("a", answer, None)
        a.chatty = True
        f = fleet(a)
        with pytest.raises(ReserveRefused):
            await f.reserve(ask, 0.2, f.order(), keep_s=30)
        assert f.all[0].aside() and not f.all[0].resting(), answer
        await f.reserve(ask, 0.2, f.order(), keep_s=30)
    # With another registry, a resting one is passed over and the other asked.
    a, b = Reserver("a", 5.0), Reserver("b", None, None)
    f = fleet(a, b)
    reg, _ = await f.reserve(ask, 1.0, [f.all[0], f.all[1]], keep_s=30)
    assert reg.name == "b" and f.all[0].resting()
    reg, _ = await f.reserve(ask, 1.0, [f.all[0], f.all[1]], keep_s=30)
    assert reg.name == "b" and len(a.asked) == 1


async def test_an_invalid_argument_is_asked_elsewhere_and_a_live_request_id_is_not():
    # INVALID_ARGUMENT may name what one registry lacks (its prefill engine gone, a model it
    # does not serve): the next is asked, and the first is not set aside for it.
    a, b = Reserver("a", grpc.StatusCode.INVALID_ARGUMENT), Reserver("b")
    f = fleet(a, b)
    reg, _ = await f.reserve(ask, 1.0, f.order(), keep_s=30)
    assert reg.name == "b" and not f.all[0].aside()
    # Refused everywhere (a malformed ask): the last refusal, one ask per registry.
    a, b = Reserver("a", grpc.StatusCode.INVALID_ARGUMENT), Reserver("b", grpc.StatusCode.INVALID_ARGUMENT)
    f = fleet(a, b)
    with pytest.raises(ReserveRefused) as refused:
        await f.reserve(ask, 1.0, f.order(), keep_s=30)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(a.asked) == len(b.asked) == 1
    assert not any(r.aside() for r in f.all)
    # ALREADY_EXISTS: that registry holds the request id's live reservation; another must
    # not make a second.
    a, b = Reserver("a", grpc.StatusCode.ALREADY_EXISTS), Reserver("b")
    f = fleet(a, b)
    with pytest.raises(ReserveRefused) as refused:
        await f.reserve(ask, 1.0, f.order(), keep_s=30)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS and b.asked == []


async def test_a_registry_that_does_not_know_this_client_or_cannot_take_the_ask_is_passed_over():
    # Registries keep their own tenants and engines: a token unknown in one, or its prefill
    # engine unavailable there, says nothing of the next.
    a = Reserver("a", grpc.StatusCode.UNAUTHENTICATED)
    b = Reserver("b", grpc.StatusCode.FAILED_PRECONDITION)
    c = Reserver("c")
    f = fleet(a, b, c)
    reg, _ = await f.reserve(ask, 1.0, f.order(), keep_s=30)
    assert reg.name == "c"
    ra, rb = f.all[0], f.all[1]
    # The one that refused this client is asked last far longer than one whose state refused.
    assert ra.aside_until - time.monotonic() > regs.DOWN_S and 0 < rb.aside_until - time.monotonic() <= regs.FULL_S
    assert [r.name for r in f.order()] == ["c", "a", "b"]
    rb.aside_until = 0.0   # (b's moment over: a, refusing this client, stays last)
    assert [r.name for r in f.order()] == ["b", "c", "a"]


async def test_the_timeout_is_shared_a_hung_registry_leaving_time_for_the_next():
    # Each registry but the last is given half of what is left: a hung one does not eat
    # the whole timeout, and the next grants within it.
    a, b = Reserver("a", 5.0), Reserver("b")
    f = fleet(a, b)
    started = time.monotonic()
    reg, _ = await f.reserve(ask, 0.4, f.order(), keep_s=30)
    assert reg.name == "b" and time.monotonic() - started < 0.35
    assert a.asked[0][1] == pytest.approx(0.2, abs=0.02) and b.asked[0][1] == pytest.approx(0.2, abs=0.03)
    assert f.all[0].aside() and not f.all[1].aside()
    # Every one hung: the last refusal is raised at the end of the timeout, not later.
    c, d = Reserver("c", 5.0), Reserver("d", 5.0)
    f = fleet(c, d)
    started = time.monotonic()
    with pytest.raises(ReserveRefused) as refused:
        await f.reserve(ask, 0.3, f.order(), keep_s=30)
    assert time.monotonic() - started < 0.45 and refused.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert all(r.aside() for r in f.all)
    # ... and both resting now: the next request is not asked of either (said so, at once).
    with pytest.raises(regs.NotAsked, match="c, d went silent lately"):
        await f.reserve(ask, 0.3, f.order(), keep_s=30)
    # No registry could take the ask at all: said so.
    f = fleet(Reserver("e"))
    with pytest.raises(ReserveRefused, match="no registry was asked"):
        await f.reserve(lambda reg: None, 1.0, f.order(), keep_s=30)


async def test_no_answer_within_a_short_leftover_slice_does_not_set_a_registry_aside():
    # a and b use most of the 2 s refusing for room; c and d are then given 0.3 s each,
    # less than a fair share, so their silence says little: they stay in the order.
    a = Reserver("a", (0.95, grpc.StatusCode.RESOURCE_EXHAUSTED))
    b = Reserver("b", (0.45, grpc.StatusCode.RESOURCE_EXHAUSTED))
    c, d = Reserver("c", 5.0), Reserver("d", 5.0)
    f = fleet(a, b, c, d)
    with pytest.raises(ReserveRefused) as refused:
        await f.reserve(ask, 2.0, f.order(), keep_s=30)
    assert refused.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert c.asked[0][1] < 0.5 and d.asked and d.asked[0][1] < 0.5
    assert [r.name for r in f.all if r.aside_until] == ["a", "b"]  # (a and b for room: 0.5 s, passed by now)


async def test_load_orders_the_others_and_grants_are_forgotten_after_their_time():
    a, b, c = Reserver("a"), Reserver("b"), Reserver("c")
    f = fleet(a, b, c)
    load = {"a": 3.0, "b": 2.0, "c": 1.0}
    assert [r.name for r in f.order(load=lambda r: load[r.name])] == ["c", "b", "a"]
    assert [r.name for r in f.order(first=f.all[0], load=lambda r: load[r.name])] == ["a", "c", "b"]
    reg, res = await f.reserve(ask, 1.0, f.order(first=f.all[1]), keep_s=0.05)
    assert f.of(res.id) is reg
    await asyncio.sleep(0.1)
    f.granted("r-later", f.all[2], keep_s=30)  # (each grant prunes the expired)
    assert f.of(res.id) is None and f.of("r-later") is f.all[2]
    # One registry: it holds every reservation, nothing is recorded.
    one = fleet(Reserver("only"))
    assert one.of("anything") is one.all[0]
    with pytest.raises(ValueError):
        Registries([])

"""Decode engines' prefix reports: the rules of the index (snapshots, deltas in order,
anything else forgets), the etcd value's form, and ``Registry.ReportPrefixes`` on a real
control plane over a real etcd: stored on the engine's lease, seen by a second replica's
view through its watch, gone with the engine; bad reports refused naming the field."""

from __future__ import annotations

import grpc
import pytest

from kvpush.app.simulated import SimulatedEngine
from kvpush.controlplane.prefixes import PrefixIndex
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.contract.prefixes import MAX_KEYS, PrefixReport, PrefixReportError
from kvpush.contract.v1 import registry_pb2, types_pb2
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import expect_code
from tests.polling import until


def rep(seq, stored=(), removed=(), epoch=1, incarnation="i1", engine="d0", bs=16):
    return PrefixReport(engine, incarnation, epoch, seq, tuple(stored), tuple(removed), bs)


def test_a_snapshot_then_deltas_in_order_and_the_first_missing_block_ends_the_overlap():
    idx = PrefixIndex()
    idx.apply(rep(0, [1, 2, 3]))
    assert idx.overlap("d0", "i1", [1, 2, 3, 4], 16) == 3
    idx.apply(rep(1, [4], [2]))
    assert idx.overlap("d0", "i1", [1, 2, 3, 4], 16) == 1 and idx.held_blocks("d0") == 3
    assert idx.overlap("d0", "other-life", [1], 16) == 0 and idx.overlap("d0", "i1", [1], 32) == 0


@pytest.mark.parametrize("late", [rep(3, [9]), rep(2, [9], epoch=2), rep(2, [9], incarnation="i2")])
def test_a_gap_another_epoch_or_life_forgets_until_the_next_snapshot(late):
    idx = PrefixIndex()
    idx.apply(rep(0, [1, 2]))
    idx.apply(rep(1, [3]))
    idx.apply(late)
    assert idx.overlap("d0", "i1", [1], 16) == 0 and idx.held_blocks("d0") == 0
    idx.apply(rep(2, [1]))  # a delta on top of nothing known: still nothing
    assert idx.held_blocks("d0") == 0
    idx.apply(rep(0, [1], epoch=3))
    assert idx.overlap("d0", "i1", [1], 16) == 1


def test_the_stored_form_round_trips_and_bad_reports_name_the_field():
    r = rep(4, [1, 2**64 - 1], [7])
    assert PrefixReport.decode(r.encode()) == r
    with pytest.raises(PrefixReportError):
        PrefixReport.decode(r.encode()[:-3])
    for bad, field in [(rep(0, removed=[1]), "snapshot"), (rep(1, bs=0), "block_size"),
                       (rep(-1), "negative"), (rep(1, stored=range(MAX_KEYS + 1)), "at most")]:
        with pytest.raises(PrefixReportError, match=field):
            bad.check()


async def report(client, **fields):
    return await client.registry.ReportPrefixes(registry_pb2.ReportPrefixesRequest(**fields),
                                                metadata=client.metadata, timeout=5)




async def test_reports_live_in_etcd_with_the_engine_and_reach_every_replica(cp, engine_client, etcd):
    other = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            engine_token=ENGINE_TOKEN, sweep_interval_s=0.5))
    await other.start()
    decode = SimulatedEngine(engine_client, "decode-0", num_blocks=16)
    await decode.register()
    try:
        base = dict(engine_id="decode-0", incarnation=decode.incarnation, block_size=16)
        answer = await report(engine_client, epoch=1, seq=0, stored=[11, 12, 13], **base)
        assert answer.held_blocks == 3
        await report(engine_client, epoch=1, seq=1, stored=[14], removed=[12], **base)
        keys = [11, 12, 13, 14]
        assert cp.view.prefixes.overlap("decode-0", decode.incarnation, keys, 16) == 1
        await until(lambda: other.view.prefixes.held_blocks("decode-0") == 3, 10)  # by its watch: 11, 13, 14
        assert other.view.prefixes.overlap("decode-0", decode.incarnation, [11, 13, 14], 16) == 3
        await decode.stop()  # the stream closed: deregistered, its lease revoked and the report with it
        await until(lambda: other.view.prefixes.held_blocks("decode-0") == 0 and
                    cp.view.prefixes.held_blocks("decode-0") == 0, 10)
    finally:
        await other.stop(grace=0.1)


async def test_bad_reports_are_refused_with_the_field_named(cp, engine_client):
    decode = SimulatedEngine(engine_client, "decode-1", num_blocks=16)
    prefill = SimulatedEngine(engine_client, "prefill-1", num_blocks=16, role=types_pb2.PREFILL)
    await decode.register()
    await prefill.register()
    base = dict(engine_id="decode-1", incarnation=decode.incarnation, block_size=16)
    cases = [
        (grpc.StatusCode.INVALID_ARGUMENT, dict(base, engine_id=""), "engine_id"),
        (grpc.StatusCode.INVALID_ARGUMENT, dict(base, block_size=32), "block_size"),
        (grpc.StatusCode.INVALID_ARGUMENT, dict(base, seq=0, removed=[1]), "snapshot"),
        (grpc.StatusCode.NOT_FOUND, dict(base, engine_id="ghost"), "ghost"),
        (grpc.StatusCode.FAILED_PRECONDITION, dict(base, incarnation="old"), "incarnation"),
        (grpc.StatusCode.FAILED_PRECONDITION, dict(base, engine_id="prefill-1", incarnation=prefill.incarnation),
         "prefill"),
    ]
    for code, fields, needle in cases:
        details = await expect_code(code, report(engine_client, epoch=1, **fields))
        assert needle in details, (fields, details)
    assert cp.view.prefixes.held_blocks("decode-1") == 0
    await decode.stop()
    await prefill.stop()


async def test_reserve_prefers_the_engine_holding_the_prompts_prefix(cp, admin, engine_client):
    from tests.controlplane.helpers import make_tenant, reserve
    busy = SimulatedEngine(engine_client, "decode-a", num_blocks=64)  # will hold the prefix, and be busier
    idle = SimulatedEngine(engine_client, "decode-b", num_blocks=64)
    await busy.register()
    await idle.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    try:
        keys = [101, 102, 103, 104, 105, 106]  # a 100-token prompt: 6 full blocks of 16
        await report(engine_client, engine_id="decode-a", incarnation=busy.incarnation, epoch=1, seq=0,
                     stored=keys[:5], block_size=16)
        await reserve(tenant, "filler", 16 * 20, preferred_engine_id="decode-a")  # decode-a: 20 of 64 blocks used
        plain = await reserve(tenant, "plain", 100)
        assert plain.engine_id == "decode-b" and plain.cached_tokens == 0  # no keys: the freer engine
        res = await reserve(tenant, "turn-2", 100, block_keys=keys, block_keys_block_size=16)
        assert res.engine_id == "decode-a" and res.cached_tokens == 5 * 16  # 5 leading blocks held
        assert len(res.block_ids) == 2  # landing blocks for the 20 tokens it lacks only
        other = await reserve(tenant, "other-prompt", 100, block_keys=[1, 2, 3], block_keys_block_size=16)
        assert other.engine_id == "decode-b" and other.cached_tokens == 0
        short = await reserve(tenant, "short", 80, block_keys=keys[:5], block_keys_block_size=16)
        assert short.cached_tokens == 4 * 16  # never the whole prompt: decode computes its last token
        wrong_size = await reserve(tenant, "32s", 100, block_keys=keys[:3], block_keys_block_size=32)
        assert wrong_size.cached_tokens == 0  # hashed over other blocks: nothing matches
        details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT, reserve(tenant, "no-size", 100, block_keys=keys))
        assert "block_keys_block_size" in details
        details = await expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                                    reserve(tenant, "too-many", 40, block_keys=keys, block_keys_block_size=16))
        assert "block_keys" in details
    finally:
        await tenant.close()
        await busy.stop()
        await idle.stop()


async def test_reserve_answers_decode_alone_when_decode_lacks_only_a_short_rest(cp, admin, engine_client):
    """Conditional disaggregation: nothing is reserved or stored, the answer names the
    engine holding the prefix (even one with no landing room left: nothing lands), and a
    longer rest, or a Reserve without the setting, gets landing blocks for the rest only."""
    from kvpush.controlplane import metrics
    from tests.controlplane.helpers import make_tenant, reserve
    from kvpush.client.reserve_stream import StreamReserver
    from kvpush.contract.v1 import scheduler_pb2
    holder = SimulatedEngine(engine_client, "decode-h", num_blocks=64)
    other = SimulatedEngine(engine_client, "decode-o", num_blocks=64)
    await holder.register()
    await other.register()
    tenant = await make_tenant(admin, cp.address, "alone")
    alone = metrics.DECODE_ALONE.labels(reason="cached_prefix")
    short_prompt = metrics.DECODE_ALONE.labels(reason="short_prompt")
    try:
        keys = [201, 202, 203, 204, 205, 206]  # a 100-token prompt: 6 full blocks of 16
        await report(engine_client, engine_id="decode-h", incarnation=holder.incarnation, epoch=1, seq=0,
                     stored=keys, block_size=16)
        filler = await reserve(tenant, "filler", 16 * 63, preferred_engine_id="decode-h")  # one block left
        before = (alone._value.get(), len(cp.view.reservations))
        got = await reserve(tenant, "turn-3", 100, block_keys=keys, block_keys_block_size=16, local_prefill_tokens=32)
        assert got.decode_alone and got.engine_id == "decode-h" and got.engine_incarnation == holder.incarnation
        assert got.cached_tokens == 96 and got.id == "" and not got.block_ids  # 4 tokens left for decode
        assert (alone._value.get(), len(cp.view.reservations)) == (before[0] + 1, before[1])  # nothing stored
        # The same over the stream the router uses (no release is attempted for it).
        reserver = StreamReserver(tenant)
        try:
            streamed = await reserver.reserve(scheduler_pb2.ReserveRequest(
                request_id="turn-3s", num_tokens=100, model="sim-model", block_keys=keys, block_keys_block_size=16,
                local_prefill_tokens=32), timeout=5)
            assert streamed.decode_alone and streamed.engine_id == "decode-h"
        finally:
            await reserver.close()
        assert reserver.abandoned_released == 0
        # The rest is 36 tokens: above the threshold, a reservation, on the engine with room
        # for those 36 tokens' 3 blocks (decode-h has one block left).
        longer = await reserve(tenant, "turn-3b", 132, block_keys=keys, block_keys_block_size=16,
                               local_prefill_tokens=32)
        assert not longer.decode_alone and longer.id and longer.engine_id == "decode-o"
        assert longer.cached_tokens == 0
        # Fit is counted against the rest only: 1 landing block is room enough for a 4-token rest.
        rest = await reserve(tenant, "turn-3c", 100, block_keys=keys, block_keys_block_size=16)
        assert rest.engine_id == "decode-h" and rest.cached_tokens == 96 and len(rest.block_ids) == 1
        # No keys: a prompt shorter than the threshold goes to a decode engine alone.
        n = short_prompt._value.get()
        short = await reserve(tenant, "short", 20, local_prefill_tokens=32)
        assert short.decode_alone and short.cached_tokens == 0 and short_prompt._value.get() == n + 1
        for res in (filler, longer, rest):
            await tenant.scheduler.Release(scheduler_pb2.ReleaseRequest(reservation_id=res.id),
                                           metadata=tenant.metadata, timeout=5)
    finally:
        await tenant.close()
        await holder.stop()
        await other.stop()


async def test_decode_alone_turns_of_a_prefix_many_engines_hold_are_spread_over_them(cp, admin, engine_client):
    """Decode alone takes no landing blocks, so free blocks cannot spread it: without its
    own load term every turn on a shared system prompt would go to one engine (the tie)."""
    from tests.controlplane.helpers import make_tenant, reserve
    engines = [SimulatedEngine(engine_client, f"decode-s{i}", num_blocks=64) for i in range(3)]
    for e in engines:
        await e.register()
    tenant = await make_tenant(admin, cp.address, "spread")
    try:
        keys = [301, 302, 303, 304]  # a shared 64-token system prompt, held by every engine
        for e in engines:
            await report(engine_client, engine_id=e.engine_id, incarnation=e.incarnation, epoch=1, seq=0,
                         stored=keys, block_size=16)
        chosen = []
        for i in range(9):
            got = await reserve(tenant, f"turn-{i}", 72, block_keys=keys, block_keys_block_size=16,
                                local_prefill_tokens=32)
            assert got.decode_alone and got.cached_tokens == 64
            chosen.append(got.engine_id)
        assert sorted(chosen.count(e.engine_id) for e in engines) == [3, 3, 3], chosen
    finally:
        await tenant.close()
        for e in engines:
            await e.stop()

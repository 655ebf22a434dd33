"""Scheduler-side logic of the connector, driven with stand-in request objects (fast:
no vLLM engine, no sidecar)."""

from __future__ import annotations

import dataclasses

import pytest

from connector.metadata import Target
from connector.scheduler import KVPushScheduler
from connector.sidecar_link import SidecarInfo
from kvpush.layout import KvLayout
from kvpush.transfer_params import PushParams
from worker.pools import PoolInfo

BS = 32
LAYOUT = KvLayout(num_layers=4, block_size=BS, num_kv_heads=2, head_dim=64)


def info(role: str, engine_id: str = "D1", incarnation: str = "inc1") -> SidecarInfo:
    pool = PoolInfo("landing" if role == "decode" else "staging", "kvpush-x-1-ab", 1 << 20, 16,
                    LAYOUT.block_layer_bytes, LAYOUT)
    return SidecarInfo(role, engine_id, incarnation, f"{engine_id}.{incarnation}", pool)


@dataclasses.dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0
    status: str = "RUNNING"


@dataclasses.dataclass
class Blocks:
    ids: list[int]

    def get_block_ids(self):
        return (self.ids,)


@dataclasses.dataclass
class Out:
    num_scheduled_tokens: dict

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


def params(role: str, num_tokens: int, res: str = "res-1", engine_id: str = "D1", incarnation: str = "inc1",
           deadline: int = 0) -> dict:
    blocks = tuple(range(100, 100 + -(-num_tokens // BS)))
    return PushParams(role, res, engine_id, incarnation, f"{engine_id}.{incarnation}", blocks, BS, num_tokens,
                      deadline).as_kv_transfer_params()


class BlockTable:
    """The scheduler's view of each request's vLLM blocks (kv_cache_manager.get_block_ids)."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def __call__(self, rid: str) -> list[int]:
        return self.tables[rid]


def prefill_sched():
    table = BlockTable()
    return KVPushScheduler(info("prefill", "P1"), BS, produce=True, consume=False, block_ids_of=table), table


def decode_sched():
    table = BlockTable()
    return KVPushScheduler(info("decode"), BS, produce=False, consume=True, block_ids_of=table), table


def step(sched, reqs_and_tokens):
    """One scheduler step: build the metadata, then advance num_computed_tokens like vLLM."""
    meta = sched.build_connector_meta(Out({r.request_id: n for r, n in reqs_and_tokens}))
    for r, n in reqs_and_tokens:
        r.num_computed_tokens += n
    return meta


# -- prefill ------------------------------------------------------------------------------------
def test_plain_requests_are_left_alone():
    sched, table = prefill_sched()
    r = Req("a", 50)
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    table.tables["a"] = [1, 2]
    meta = step(sched, [(r, 50)])
    assert not meta.pushes and not meta.loads and meta.counts == {"requests_plain": 1}
    assert sched.request_finished(r) == (False, None)
    assert sched.tracked == 0


def test_prefill_whole_prompt_in_one_step_is_one_final_piece_with_begin():
    sched, table = prefill_sched()
    r = Req("a", 70, params("prefill", 70))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)  # prefill never loads
    table.tables["a"] = [7, 3, 9]
    meta = step(sched, [(r, 70)])
    (spec,) = meta.pushes
    assert (spec.req_id, spec.block_ids, spec.start, spec.end, spec.final) == ("a", (7, 3, 9), 0, 70, True)
    assert spec.begin == Target("res-1", "D1", "inc1", (100, 101, 102), BS, 70)
    # The next step (its one output token) pushes nothing; the request ends without holding blocks.
    assert not step(sched, [(r, 1)]).pushes
    assert sched.request_finished(r) == (False, None)
    assert not sched.build_connector_meta(Out({})).push_aborts


def test_chunked_prefill_pushes_each_chunk_as_computed():
    sched, table = prefill_sched()
    r = Req("a", 150, params("prefill", 150))
    sched.on_new_request(r)
    table.tables["a"] = [1, 2]
    m1 = step(sched, [(r, 64)])
    table.tables["a"] = [1, 2, 5, 6, 8]
    m2 = step(sched, [(r, 64)])
    m3 = step(sched, [(r, 22)])
    pieces = [(p.start, p.end, p.final, p.begin is not None) for m in (m1, m2, m3) for p in m.pushes]
    assert pieces == [(0, 64, False, True), (64, 128, False, False), (128, 150, True, False)]
    assert m3.pushes[0].block_ids == (1, 2, 5, 6, 8)


def test_preempted_prefill_does_not_push_twice_and_resumes_where_it_stopped():
    sched, table = prefill_sched()
    r = Req("a", 150, params("prefill", 150))
    sched.on_new_request(r)
    table.tables["a"] = [1, 2, 3]
    assert [(p.start, p.end) for p in step(sched, [(r, 96)]).pushes] == [(0, 96)]
    r.num_computed_tokens = 0  # preempted: recomputed from the start in new blocks
    table.tables["a"] = [10, 11]
    assert not step(sched, [(r, 64)]).pushes  # tokens already pushed (the staging copy has them)
    table.tables["a"] = [10, 11, 12, 13, 14]
    (spec,) = step(sched, [(r, 86)]).pushes
    assert (spec.start, spec.end, spec.final, spec.begin, spec.block_ids) == (96, 150, True, None,
                                                                              (10, 11, 12, 13, 14))


def test_prefill_pushes_only_the_reserved_tokens_of_a_longer_prompt():
    sched, table = prefill_sched()
    r = Req("a", 100, params("prefill", 64))
    sched.on_new_request(r)
    table.tables["a"] = [1, 2, 3, 4]
    (spec,) = step(sched, [(r, 100)]).pushes
    assert (spec.start, spec.end, spec.final) == (0, 64, True)


def test_prefill_with_prompt_shorter_than_reservation_is_refused():
    sched, table = prefill_sched()
    r = Req("a", 40, params("prefill", 64))
    sched.on_new_request(r)
    table.tables["a"] = [1, 2]
    meta = step(sched, [(r, 40)])
    assert not meta.pushes and meta.counts == {"refused_short_prompt": 1}


def test_prefill_ending_early_aborts_its_push_only_when_begun():
    sched, table = prefill_sched()
    a, b = Req("a", 150, params("prefill", 150, "ra")), Req("b", 50, params("prefill", 50, "rb"))
    for r in (a, b):
        sched.on_new_request(r)
    table.tables["a"] = [1, 2]
    step(sched, [(a, 64)])
    a.status = b.status = "FINISHED_ABORTED"
    sched.request_finished(a)
    sched.request_finished(b)  # never scheduled: nothing was begun, nothing to abort
    meta = sched.build_connector_meta(Out({}))
    assert [rid for rid, _ in meta.push_aborts] == ["a"] and "64 of 150" in meta.push_aborts[0][1]
    assert sched.tracked == 0


def test_role_and_param_mismatches_are_counted_and_served_normally():
    sched, _ = prefill_sched()
    sched.on_new_request(Req("a", 50, params("decode", 50)))  # a decode request sent to a prefill engine
    sched.on_new_request(Req("b", 50, {"kvpush": {"role": "prefill"}}))  # malformed
    sched.on_new_request(Req("c", 50, {"other_connector": {}}))
    assert sched.build_connector_meta(Out({})).counts == {"role_ignored": 1, "bad_params": 1,
                                                          "requests_plain": 1}
    assert sched.tracked == 0
    # A decode sidecar does not push even if the engine is configured as a producer too.
    both = KVPushScheduler(info("decode"), BS, produce=True, consume=True, block_ids_of=BlockTable())
    both.on_new_request(Req("p", 50, params("prefill", 50)))
    assert both.build_connector_meta(Out({"p": 50})).counts == {"role_ignored": 1}


# -- decode -------------------------------------------------------------------------------------
def test_decode_is_an_async_load_of_the_prompt_beyond_the_local_hit():
    sched, _ = decode_sched()
    r = Req("d", 70, params("decode", 70, deadline=123))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (70, True)
    assert sched.get_num_new_matched_tokens(r, 32) == (38, True)  # asked again: no side effects
    sched.update_state_after_alloc(r, Blocks([4, 5, 6]), 38)
    sched.update_state_after_alloc(r, Blocks([4, 5, 6, 7]), 0)  # the second call (after the load): ignored
    meta = sched.build_connector_meta(Out({}))
    assert meta.idle  # nothing else runs in this step: the worker may wait for the landing
    assert not sched.build_connector_meta(Out({"other": 1})).idle
    (load,) = meta.loads
    assert (load.req_id, load.reservation_id, load.block_ids, load.start, load.end) == ("d", "res-1", (4, 5, 6),
                                                                                      32, 70)
    assert (load.landing_block_ids, load.landing_block_size, load.num_tokens, load.deadline_unix_ms) == \
        ((100, 101, 102), BS, 70, 123)
    assert not sched.build_connector_meta(Out({})).loads  # planned once
    # Preempted later: num_computed_tokens back to 0, the prompt is recomputed locally.
    sched.update_connector_output({"d"})
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.request_finished(r) == (False, None)
    assert not sched.build_connector_meta(Out({})).load_aborts


def test_decode_loads_at_most_the_reserved_tokens():
    sched, _ = decode_sched()
    r = Req("d", 100, params("decode", 64))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (64, True)
    assert sched.get_num_new_matched_tokens(r, 64) == (0, False)


@pytest.mark.parametrize("kw,prompt,why", [({"engine_id": "D2"}, 70, "wrong_engine"),
                                           ({"incarnation": "old"}, 70, "wrong_engine"),
                                           ({}, 60, "short_prompt")])
def test_decode_refuses_what_cannot_land_here(kw, prompt, why):
    sched, _ = decode_sched()
    r = Req("d", prompt, params("decode", 70, **kw))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.build_connector_meta(Out({})).counts == {f"refused_{why}": 1}


def test_decode_with_nothing_to_load_releases_the_reservation():
    sched, _ = decode_sched()
    r = Req("d", 64, params("decode", 64))
    sched.on_new_request(r)
    sched.update_state_after_alloc(r, Blocks([1, 2]), 0)  # e.g. a full local prefix-cache hit
    meta = sched.build_connector_meta(Out({}))
    assert not meta.loads and [x.reservation_id for x in meta.releases] == ["res-1"]
    assert meta.counts == {"load_skipped_local_hit": 1}


def test_decode_request_ending_while_loading_stops_the_load():
    sched, _ = decode_sched()
    a, b = Req("a", 64, params("decode", 64, "ra")), Req("b", 64, params("decode", 64, "rb"))
    for r in (a, b):
        sched.on_new_request(r)
    sched.get_num_new_matched_tokens(a, 0)
    sched.update_state_after_alloc(a, Blocks([1, 2]), 64)
    sched.build_connector_meta(Out({}))
    a.status = b.status = "FINISHED_ABORTED"
    sched.request_finished(a)  # waiting for its KV: the worker must report it and load nothing
    sched.request_finished(b)  # never scheduled: its reservation is released if it lands
    meta = sched.build_connector_meta(Out({}))
    assert meta.load_aborts == ["a"] and [x.reservation_id for x in meta.releases] == ["rb"]
    assert sched.tracked == 0


def test_counts_are_shipped_once():
    sched, _ = decode_sched()
    sched.on_new_request(Req("x", 5))
    assert sched.build_connector_meta(Out({})).counts == {"requests_plain": 1}
    assert sched.build_connector_meta(Out({})).empty()


def test_decode_asks_its_sidecar_again_when_a_reservation_names_a_newer_incarnation():
    calls = []

    def refresh():
        calls.append(1)
        return info("decode", incarnation="inc2")

    sched = KVPushScheduler(info("decode"), BS, produce=False, consume=True, block_ids_of=BlockTable(),
                            refresh=refresh)
    sched.on_new_request(Req("other", 64, params("decode", 64, engine_id="D9", incarnation="inc2")))
    assert not calls  # another engine's reservation: no reason to ask
    r = Req("new", 64, params("decode", 64, incarnation="inc2"))
    sched.on_new_request(r)  # the sidecar restarted: asked once, then accepted
    assert calls == [1] and sched.get_num_new_matched_tokens(r, 0) == (64, True)
    for i in range(3):  # reservations of the old incarnation: refused, without asking each time
        sched.on_new_request(Req(f"old{i}", 64, params("decode", 64, incarnation="inc1")))
    assert calls == [1]  # at most one HELLO a second
    assert sched.build_connector_meta(Out({})).counts == {"refused_wrong_engine": 4}

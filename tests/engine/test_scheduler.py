"""Scheduler-side logic of the connector, driven with stand-in request objects and a
stand-in channel client under the real LandingWatch (fast: no vLLM engine, no sidecar)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from kvpush.connector.sidecar_client import ChannelError
from kvpush.connector.landing_watch import LandingWatch
from kvpush.contract.target import PushTarget
from kvpush.connector.scheduler import DecodeTiming, KVPushScheduler
from kvpush.connector.sidecar_link import SidecarInfo
from kvpush.contract.layout import KvLayout
from kvpush.contract.transfer_params import AloneParams, AwaitParams, PushParams
from kvpush.channel.frames import StateEvent
from kvpush.channel.pool import PoolDescription
from tests.polling import wait_for

BS = 32
LAYOUT = KvLayout(num_layers=4, block_size=BS, num_kv_heads=2, head_dim=64)


def info(role: str, engine_id: str = "D1", incarnation: str = "inc1") -> SidecarInfo:
    pool = PoolDescription("landing" if role == "decode" else "staging", "DRAM", "kvpush-x-1-ab", 1 << 20, 16,
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
           deadline: int = 0, first_token: int = 0) -> dict:
    """A reservation of prompt tokens [first_token, first_token + num_tokens)."""
    blocks = tuple(range(100, 100 + -(-num_tokens // BS)))
    return PushParams(role, PushTarget(res, engine_id, incarnation, blocks, BS, num_tokens,
                                       f"{engine_id}.{incarnation}", deadline,
                                       first_token=first_token)).as_kv_transfer_params()


class BlockTable:
    """The scheduler's view of each request's vLLM blocks (kv_cache_manager.get_block_ids)."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def __call__(self, rid: str) -> list[int]:
        return self.tables[rid]


def prefill_sched():
    table = BlockTable()
    return KVPushScheduler(info("prefill", "P1"), BS, produce=True, consume=False, block_ids_of=table), table


class FakeClient:
    """The decode sidecar's channel as the scheduler's LandingWatch uses it."""

    def __init__(self, states: dict | None = None):
        self.states = states or {}  # reservation -> (state, tokens) answered to SUBSCRIBE
        self.subscribed: list[str] = []
        self.consumed: list[str] = []
        self.recomputed: list[tuple[str, str]] = []
        self.on_event = None
        self.broken = False

    def subscribe(self, res):
        if self.broken:
            from kvpush.connector.sidecar_client import ChannelError
            raise ChannelError("channel closed")
        self.subscribed.append(res)
        state, tokens = self.states.get(res, ("EXPECTED", 0))
        return StateEvent(res, state, num_tokens=tokens)

    def consumed_nowait(self, res):
        self.consumed.append(res)

    def recomputed_nowait(self, res, reason):
        self.recomputed.append((res, reason))

    def events(self):
        return []

    def close(self):
        pass

    def event(self, res, state, tokens=0):  # the sidecar sends an event (reader thread)
        self.on_event(StateEvent(res, state, num_tokens=tokens))


def decode_sched(client: FakeClient | None = None, timing: DecodeTiming = DecodeTiming(idle_wait_s=0),
                 sidecar=None):
    client = client or FakeClient()
    watch = LandingWatch(lambda: (client, sidecar or info("decode")))
    watch.connect()
    table = BlockTable()
    sched = KVPushScheduler(info("decode"), BS, produce=False, consume=True, block_ids_of=table, watch=watch,
                            timing=timing)
    sched.client = client
    return sched, table


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
    assert spec.begin == PushTarget("res-1", "D1", "inc1", (100, 101, 102), BS, 70, "D1.inc1")
    # The next step (its one output token) pushes nothing; the request ends without holding blocks.
    assert not step(sched, [(r, 1)]).pushes
    # Its answer tells the router the whole reservation was pushed.
    assert sched.request_finished(r) == (False, {"kvpush": {"reservation_id": "res-1", "pushed": True}})
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
    both = KVPushScheduler(info("decode"), BS, produce=True, consume=True, block_ids_of=BlockTable(),
                           watch=LandingWatch(lambda: (FakeClient(), info("decode"))))
    both.on_new_request(Req("p", 50, params("prefill", 50)))
    assert both.build_connector_meta(Out({"p": 50})).counts == {"role_ignored": 1}


# -- decode -------------------------------------------------------------------------------------
def test_decode_waits_unscheduled_until_landed_then_loads_synchronously_beyond_the_local_hit():
    sched, _ = decode_sched()
    r = Req("d", 70, params("decode", 70, deadline=0))
    sched.on_new_request(r)
    assert sched.client.subscribed == ["res-1"]
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)  # not landed: ask again later
    sched.client.event("res-1", "LANDED", 70)
    # vLLM computes the last prompt token itself: 69 at most, beyond the local hit.
    assert sched.get_num_new_matched_tokens(r, 0) == (69, False)
    assert sched.get_num_new_matched_tokens(r, 32) == (37, False)  # asked again: no side effects
    sched.update_state_after_alloc(r, Blocks([4, 5, 6]), 37)
    sched.update_state_after_alloc(r, Blocks([4, 5, 6, 7]), 0)  # a later call: ignored
    meta = sched.build_connector_meta(Out({"d": 1}))
    (load,) = meta.loads
    assert (load.req_id, load.target.reservation_id, load.block_ids, load.start, load.end) == ("d", "res-1", (4, 5, 6),
                                                                                      32, 69)
    assert (load.target.block_ids, load.target.block_size, load.target.num_tokens) == ((100, 101, 102), BS, 70)
    assert meta.counts["loads_started"] == 1 and "load_wait_ms_max" in meta.maxima
    assert not sched.build_connector_meta(Out({})).loads  # planned once
    # Preempted later: num_computed_tokens back to 0, the prompt is recomputed locally.
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.request_finished(r) == (False, None)
    assert sched.tracked == 0 and not sched.client.consumed  # the worker consumes what it loaded


def test_decode_loads_at_most_the_reserved_and_landed_tokens():
    sched, _ = decode_sched(FakeClient({"res-1": ("LANDED", 64)}))  # landed before the request came
    r = Req("d", 100, params("decode", 64))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (64, False)
    assert sched.get_num_new_matched_tokens(r, 64) == (0, False)


def test_prefill_pushes_only_what_decode_lacks_from_its_first_token():
    sched, table = prefill_sched()
    r = Req("a", 150, params("prefill", 86, first_token=64))  # decode holds tokens [0, 64)
    sched.on_new_request(r)
    table.tables["a"] = [1, 2, 5, 6, 8]
    m1 = step(sched, [(r, 64)])  # (chunked prefill) the tokens decode holds: computed, not pushed
    m2 = step(sched, [(r, 64)])
    m3 = step(sched, [(r, 22)])
    pieces = [(p.start, p.end, p.final, p.begin is not None) for m in (m1, m2, m3) for p in m.pushes]
    assert pieces == [(64, 128, False, True), (128, 150, True, False)]  # prompt tokens, as vLLM holds them
    assert m2.pushes[0].begin.first_token == 64 and m2.pushes[0].begin.num_tokens == 86
    assert sched.request_finished(r)[1] == {"kvpush": {"reservation_id": "res-1", "pushed": True}}


def test_decode_loads_the_landed_rest_beyond_the_prefix_it_holds():
    sched, _ = decode_sched(FakeClient({"res-1": ("LANDED", 86)}))
    r = Req("d", 150, params("decode", 86, first_token=64))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 64) == (85, False)  # [64, 149): all but the last token
    assert sched.get_num_new_matched_tokens(r, 96) == (53, False)  # a longer local hit: the rest of it
    sched.update_state_after_alloc(r, Blocks([4, 5, 6, 7, 8]), 53)
    (load,) = sched.build_connector_meta(Out({"d": 1})).loads
    assert (load.start, load.end, load.target.first_token) == (96, 149, 64)  # the worker reads landing [32, 85)


def test_decode_whose_prefix_was_evicted_computes_the_prompt_and_gives_the_reservation_back():
    sched, _ = decode_sched(FakeClient({"res-1": ("LANDED", 86)}))
    r = Req("d", 150, params("decode", 86, first_token=64))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 32) == (0, False)  # holds 32 of the 64 the reservation counted on
    meta = sched.build_connector_meta(Out({"d": 150}))
    assert not meta.loads and meta.counts["load_error_prefix_evicted"] == 1
    assert sched.client.recomputed == [("res-1", "prefix_evicted")]
    assert sched.client.consumed == ["res-1"]  # landed: its blocks go back at once


@pytest.mark.parametrize("state", ["FAILED", "CANCELLED"])
def test_decode_reservation_that_ends_unlanded_is_recomputed(state):
    sched, _ = decode_sched()
    r = Req("d", 64, params("decode", 64))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
    sched.client.event("res-1", state)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, Blocks([1, 2]), 0)
    meta = sched.build_connector_meta(Out({"d": 64}))
    assert not meta.loads and meta.counts["load_errors"] == 1 and meta.counts[f"load_error_{state.lower()}"] == 1
    assert sched.client.recomputed == [("res-1", state.lower())]  # the sidecar counts it for Prometheus
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)  # decided: never loaded later


def test_decode_gives_up_at_the_deadline_and_consumes_a_late_landing():
    sched, _ = decode_sched(timing=DecodeTiming(load_timeout_s=0.05, idle_wait_s=0))
    r = Req("d", 64, params("decode", 64))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
    time.sleep(0.06)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.build_connector_meta(Out({"d": 64})).counts["load_error_timeout"] == 1
    assert sched.client.recomputed == [("res-1", "timeout")]
    sched.client.event("res-1", "LANDED", 64)  # too late: its blocks go back at once
    assert sched.client.consumed == ["res-1"]
    assert sched.build_connector_meta(Out({})).counts == {"releases_consumed": 1}


@pytest.mark.parametrize("kw,prompt,why", [({"engine_id": "D2"}, 70, "wrong_engine"),
                                           ({"incarnation": "old"}, 70, "wrong_engine"),
                                           ({}, 60, "short_prompt")])
def test_decode_refuses_what_cannot_land_here(kw, prompt, why):
    sched, _ = decode_sched()
    r = Req("d", prompt, params("decode", 70, **kw))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert sched.build_connector_meta(Out({})).counts == {f"refused_{why}": 1}
    assert not sched.client.subscribed


def test_decode_with_nothing_to_load_releases_the_reservation():
    sched, _ = decode_sched(FakeClient({"res-1": ("LANDED", 64)}))
    r = Req("d", 64, params("decode", 64))
    sched.on_new_request(r)
    sched.update_state_after_alloc(r, Blocks([1, 2]), 0)  # e.g. a full local prefix-cache hit
    meta = sched.build_connector_meta(Out({}))
    assert not meta.loads and sched.client.consumed == ["res-1"]  # landed already: consumed at once
    assert meta.counts == {"loads_started": 1, "load_skipped_local_hit": 1, "releases_consumed": 1}


def test_decode_request_ending_before_its_landing_releases_it():
    sched, _ = decode_sched()
    a, b = Req("a", 64, params("decode", 64, "ra")), Req("b", 64, params("decode", 64, "rb"))
    for r in (a, b):
        sched.on_new_request(r)
    a.status = b.status = "FINISHED_ABORTED"
    sched.request_finished(a)
    sched.client.event("rb", "LANDED", 64)
    sched.request_finished(b)  # landed but never loaded: consumed now
    assert sched.client.consumed == ["rb"]
    sched.client.event("ra", "LANDED", 64)  # lands after its request ended: consumed then
    assert sched.client.consumed == ["rb", "ra"]
    meta = sched.build_connector_meta(Out({}))
    assert meta.counts["loads_abandoned"] == 2 and meta.counts["releases_consumed"] == 2
    assert sched.tracked == 0 and sched.watch.released == 0


def test_idle_decode_sleeps_for_the_landing_instead_of_spinning():
    sched, _ = decode_sched(timing=DecodeTiming(idle_wait_s=5.0))
    r = Req("d", 64, params("decode", 64))
    sched.on_new_request(r)
    threading.Timer(0.05, sched.client.event, ("res-1", "LANDED", 64)).start()
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(r, 0) == (63, False)  # woke by the landing, not the timeout
    assert time.monotonic() - t0 < 2.0
    sched.update_state_after_alloc(r, Blocks([1, 2]), 63)
    assert sched.build_connector_meta(Out({"d": 1})).counts["idle_waits"] == 1
    # A busy engine (its last step ran tokens) never sleeps for a landing.
    r2 = Req("e", 64, params("decode", 64, "res-2"))
    sched.on_new_request(r2)
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(r2, 0) == (None, False)
    assert time.monotonic() - t0 < 1.0


def test_decode_without_its_sidecar_computes_locally():
    client = FakeClient()
    dials = []

    def connect():
        dials.append(time.monotonic())
        if len(dials) > 1:
            raise ChannelError("no sidecar at the socket")
        return client, info("decode")

    watch = LandingWatch(connect)
    watch.connect()
    sched = KVPushScheduler(info("decode"), BS, produce=False, consume=True, block_ids_of=BlockTable(), watch=watch,
                            timing=DecodeTiming(idle_wait_s=0))
    try:
        client.broken = True
        client.on_closed()  # the sidecar went away (the reader thread saw the channel close)
        r = Req("d", 64, params("decode", 64))
        sched.on_new_request(r)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        assert sched.build_connector_meta(Out({})).counts == {"refused_channel": 1}
        # Nobody asks for the channel any more, yet it is dialed again, spaced out, not spun.
        time.sleep(1.5)
        tries = dials[1:]
        assert 3 <= len(tries) <= 10, tries
        assert all(b - a >= 0.05 for a, b in zip(tries[1:], tries[2:])), tries
    finally:
        watch.close()


def test_a_closed_channel_is_dialed_again_with_no_request_needing_it():
    """The sidecar restarted while the engine had nothing to do: the watch is back on the
    new sidecar by itself (its HELLO is what makes the engine available again, and no
    reservation, so no request, comes before that), and the first request of the new
    incarnation is accepted without another HELLO."""
    clients = [FakeClient(), FakeClient()]
    down = threading.Event()

    def connect():
        if hellos and not down.is_set():
            raise ChannelError("no sidecar at the socket yet")
        hellos.append(1)
        return clients[len(hellos) - 1], info("decode", incarnation=f"inc{len(hellos)}")

    hellos = []
    watch = LandingWatch(connect)
    watch.connect()
    sched = KVPushScheduler(info("decode"), BS, produce=False, consume=True, block_ids_of=BlockTable(),
                            watch=watch, timing=DecodeTiming(idle_wait_s=0))
    try:
        clients[0].broken = True
        clients[0].on_closed()
        time.sleep(0.3)  # the sidecar is still starting: dialed in vain meanwhile
        assert hellos == [1] and watch.broken
        down.set()  # it serves again
        wait_for(lambda: watch.epoch == 2, 5, "the watch dialing the restarted sidecar")
        assert hellos == [1, 1] and not watch.broken
        r = Req("r", 64, params("decode", 64, "res-9", incarnation="inc2"))
        sched.on_new_request(r)
        assert sched.sidecar.incarnation == "inc2" and clients[1].subscribed == ["res-9"]
        assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
        assert hellos == [1, 1]
    finally:
        watch.close()


def test_counts_are_shipped_once():
    sched, _ = decode_sched()
    sched.on_new_request(Req("x", 5))
    assert sched.build_connector_meta(Out({})).counts == {"requests_plain": 1}
    assert sched.build_connector_meta(Out({})).empty()


def test_decode_learns_a_newer_incarnation_from_its_redialed_channel():
    hellos = []
    clients = [FakeClient(), FakeClient()]

    def connect():
        hellos.append(1)
        return clients[len(hellos) - 1], info("decode", incarnation=f"inc{len(hellos)}")

    watch = LandingWatch(connect)
    watch.connect()
    sched = KVPushScheduler(info("decode"), BS, produce=False, consume=True, block_ids_of=BlockTable(),
                            watch=watch, timing=DecodeTiming(idle_wait_s=0))
    try:
        waiting = Req("waiting", 64, params("decode", 64, "res-0"))
        sched.on_new_request(waiting)
        new = Req("new", 64, params("decode", 64, incarnation="inc2"))
        sched.on_new_request(new)  # the channel is up: no reason to ask (refused)
        assert hellos == [1]
        clients[0].broken = True  # the sidecar went away (the reader thread saw the channel close)
        clients[0].on_closed()
        wait_for(lambda: watch.epoch == 2, 5, "the watch dialing the restarted sidecar")
        sched.on_new_request(Req("other", 64, params("decode", 64, engine_id="D9", incarnation="inc2")))
        new = Req("new2", 64, params("decode", 64, "res-2", incarnation="inc2"))
        sched.on_new_request(new)  # the sidecar restarted: learnt from the new channel, accepted
        assert hellos == [1, 1] and sched.get_num_new_matched_tokens(new, 0) == (None, False)
        assert clients[1].subscribed == ["res-2"]
        for i in range(3):  # reservations of the old incarnation: refused, without asking each time
            sched.on_new_request(Req(f"old{i}", 64, params("decode", 64, incarnation="inc1")))
        assert hellos == [1, 1]
        # The request that waited on the old incarnation is computed locally at once.
        assert sched.get_num_new_matched_tokens(waiting, 0) == (0, False)
        counts = sched.build_connector_meta(Out({})).counts
        assert counts["refused_wrong_engine"] == 5 and counts["load_error_restarted"] == 1
    finally:
        watch.close()


# -- prefill: a request sent before its Reserve answered -----------------------------------------
class FakeHandover:
    """The prefill sidecar's AWAIT as HandoverWatch sees it: known now, later, or never."""

    def __init__(self):
        self.known: dict[str, dict] = {}
        self.asked: list[str] = []
        self.forgotten: list[str] = []
        self.generation = 0
        self.waits = 0
        self.broken = False  # the handover channel (the prefill sidecar's): up
        self.epoch = 1

    def expect(self, key):
        self.asked.append(key)

    def get(self, key):
        return self.known.get(key)

    def forget(self, key):
        self.forgotten.append(key)

    def wait_change(self, generation, timeout_s):
        self.waits += 1


def awaiting(key: str, wait_ms: int = 500) -> dict:
    return AwaitParams(key, wait_ms).as_kv_transfer_params()


def handover_sched():
    table = BlockTable()
    ho = FakeHandover()
    sched = KVPushScheduler(info("prefill", "P1"), BS, produce=True, consume=False, block_ids_of=table, handover=ho,
                            timing=DecodeTiming(idle_wait_s=0.001))
    return sched, table, ho


def test_request_waits_for_its_reservation_then_pushes():
    sched, table, ho = handover_sched()
    r = Req("a", 70, awaiting("rt-1"))
    sched.on_new_request(r)
    assert ho.asked == ["rt-1"]
    # Not here yet: vLLM is told "not yet" and computes nothing for it (an idle engine waits a little).
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False) and ho.waits == 1
    ho.known["rt-1"] = params("prefill", 70)["kvpush"]
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert ho.forgotten == ["rt-1"]
    table.tables["a"] = [7, 3, 9]
    meta = step(sched, [(r, 70)])
    (spec,) = meta.pushes
    assert spec.begin == PushTarget("res-1", "D1", "inc1", (100, 101, 102), BS, 70, "D1.inc1") and spec.final
    assert meta.counts["handover_awaited"] == 1 and meta.counts["handover_received"] == 1
    assert sched.request_finished(r) == (False, {"kvpush": {"reservation_id": "res-1", "pushed": True}})
    assert sched.tracked == 0


@pytest.mark.parametrize("after", ["closed", "redialed"])
def test_a_push_whose_sidecar_went_away_is_reported_not_pushed(after):
    """The scheduler handed every layer to the worker, but the prefill sidecar's channel
    closed (or came back: a new sidecar) before the request ended: the push went with the
    old sidecar, so the router is told not to send decode a load."""
    sched, table, ho = handover_sched()
    r = Req("a", 70, awaiting("rt-9"))
    sched.on_new_request(r)
    ho.known["rt-9"] = params("prefill", 70)["kvpush"]
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    table.tables["a"] = [7, 3, 9]
    assert step(sched, [(r, 70)]).pushes[0].final
    if after == "closed":
        ho.broken = True
    else:
        ho.epoch += 1
    assert sched.request_finished(r) == (False, {"kvpush": {"reservation_id": "res-1", "pushed": False}})
    assert sched.build_connector_meta(Out({})).counts["push_reported_lost"] == 1


def test_no_reservation_in_time_is_computed_without_a_push():
    sched, table, ho = handover_sched()
    r = Req("a", 40, awaiting("rt-2", wait_ms=1))
    sched.on_new_request(r)
    time.sleep(0.005)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    table.tables["a"] = [1, 2]
    meta = step(sched, [(r, 40)])
    assert not meta.pushes and meta.counts["handover_timeout"] == 1
    # The router reads "not pushed" and has decode compute the prompt itself.
    assert sched.request_finished(r) == (False, {"kvpush": {"reservation_id": "", "pushed": False}})
    assert sched.tracked == 0


def test_request_gone_while_waiting_leaves_nothing():
    sched, table, ho = handover_sched()
    r = Req("a", 40, awaiting("rt-3"))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)
    assert sched.request_finished(r) == (False, {"kvpush": {"reservation_id": "", "pushed": False}})
    assert ho.forgotten == ["rt-3"] and sched.tracked == 0


def test_malformed_await_params_are_ignored():
    sched, table, ho = handover_sched()
    for bad in ({"kvpush": {"role": "prefill", "await": {"request_id": "", "wait_ms": 5}}},
                {"kvpush": {"role": "decode", "await": {"request_id": "x", "wait_ms": 5}}},
                {"kvpush": {"role": "prefill", "await": {"request_id": "x"}}}):
        r = Req("a", 40, bad)
        sched.on_new_request(r)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        assert sched.request_finished(r) == (False, None)
    assert ho.asked == [] and sched.tracked == 0


# -- decode alone, guessed by the router (AloneParams) ---------------------------------------
def alone(min_cached: int, hold_ms: int = 500) -> dict:
    return AloneParams(min_cached, hold_ms).as_kv_transfer_params()


def test_a_guessed_decode_alone_request_holding_enough_is_computed_at_once():
    sched, _ = decode_sched()
    r = Req("a", 200, alone(150))
    sched.on_new_request(r)
    # vLLM's block-aligned local hit: 160 of 200 tokens, at least the 150 guessed
    assert sched.get_num_new_matched_tokens(r, 160) == (0, False)
    assert sched.tracked == 0  # decided: nothing left to answer for
    meta = step(sched, [(r, 40)])
    assert not meta.loads and meta.counts["alone_guessed"] == 1 and meta.counts["alone_held_prefix"] == 1
    assert sched.request_finished(r) == (False, None)
    assert "alone_taken_back" not in sched._meta.counts


def test_a_guessed_decode_alone_request_holding_too_little_waits_to_be_taken_back():
    sched, _ = decode_sched(timing=DecodeTiming(idle_wait_s=0.002))
    r = Req("a", 200, alone(150))
    sched.on_new_request(r)
    step(sched, [])  # an idle engine: it may sleep a little per pass rather than spin
    t0 = time.monotonic()
    assert sched.get_num_new_matched_tokens(r, 96) == (None, False)  # not yet: nothing computed
    assert 0.001 < time.monotonic() - t0 < 0.1
    assert sched.get_num_new_matched_tokens(r, 96) == (None, False)  # (once a pass: no second sleep)
    # The Reserve answered P/D: the router took it back (vLLM aborts it).
    assert sched.request_finished(r) == (False, None)
    meta = step(sched, [])
    assert meta.counts["alone_short"] == 1 and meta.counts["alone_taken_back"] == 1
    assert 1_000 < meta.counts["alone_held_us_total"] < 1_000_000  # held until taken back
    assert sched.tracked == 0


def test_a_guessed_decode_alone_request_not_taken_back_is_computed_after_its_hold():
    sched, _ = decode_sched()
    r = Req("a", 200, alone(150, hold_ms=1))
    sched.on_new_request(r)
    time.sleep(0.005)
    assert sched.get_num_new_matched_tokens(r, 64) == (0, False)  # the whole rest, here
    meta = step(sched, [(r, 136)])
    assert meta.counts["alone_short"] == 1 and meta.counts["alone_hold_expired"] == 1
    assert meta.counts["alone_held_us_total"] >= 5_000  # from its arrival, the hold (1 ms) and past it
    assert sched.request_finished(r) == (False, None) and sched.tracked == 0


def test_malformed_or_misplaced_alone_params_are_served_normally():
    for bad in ({"kvpush": {"role": "prefill", "alone": {"min_cached_tokens": 5, "hold_ms": 5}}},
                {"kvpush": {"role": "decode", "alone": {"min_cached_tokens": 0, "hold_ms": 5}}},
                {"kvpush": {"role": "decode", "alone": {"min_cached_tokens": 5, "hold_ms": 0}}},
                {"kvpush": {"role": "decode", "alone": {"min_cached_tokens": "5", "hold_ms": 5}}},
                {"kvpush": {"role": "decode", "alone": {"min_cached_tokens": 5}}},
                {"kvpush": {"role": "decode", "alone": {"min_cached_tokens": 5, "hold_ms": 5}, "x": 1}}):
        sched, _ = decode_sched()
        r = Req("a", 40, bad)
        sched.on_new_request(r)
        assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
        assert step(sched, []).counts["bad_params"] == 1
        assert sched.request_finished(r) == (False, None) and sched.tracked == 0
    # On a prefill engine (it never loads): served normally, counted.
    sched, _ = prefill_sched()
    r = Req("a", 40, alone(8))
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert step(sched, []).counts["role_ignored"] == 1 and sched.tracked == 0

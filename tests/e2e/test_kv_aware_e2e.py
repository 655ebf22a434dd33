"""KV-aware routing through the whole system, real parts only: etcd, a control plane,
`kvpush sidecar` processes (the decode ones following their engines' KV events), a
prefill and two decode vLLM engines with prefix caching, the router hashing each prompt's
blocks, and an aggregated engine for the reference answers.

A conversation's first turn is steered to decode-0 (a reservation held on decode-1 makes
it the freer one); once that hold is gone both engines are equally free, and without the
prefix the second turn would go to decode-1 (ties go to the largest id). It goes to
decode-0, which holds the first turn's prompt and answer in its prefix cache: the
reservation says how much, the prefill engine pushes only the rest, decode loads it
beyond its prefix hit, and the answer equals the aggregated engine's. The registry is
clean after.

The reservation covers only the tokens decode lacks and the prefill engine pushes only
those (its staged bytes per token are turn 1's). The stack's router always disaggregates
(--local-prefill-tokens 0); a second one, with a threshold, serves a short follow-up on the
decode engine holding the conversation alone (conditional disaggregation)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
import urllib.request

import pytest

from kvpush.app import engines
from kvpush.app.stack import Stack, StackSpec, complete
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.connector.sidecar_client import SidecarClient
from kvpush.contract.v1 import scheduler_pb2
from tests.e2e.test_router_e2e import counters, settled, with_aggregated
from tests.engine.conftest import prompt

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("kv-aware-logs"))
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    # (dev endpoints on the decode engines: /reset_prefix_cache plays an eviction)
    yield from with_aggregated(logs, StackSpec(model_dir=model, log_dir=logs, decode_engines=2, kv_aware=True,
                                               decode_env={"VLLM_SERVER_DEV_MODE": "1"},
                                               router_args=("--local-prefill-tokens", "0"),
                                               deadline_ms=20_000, quarantine_ms=2_000))


def overlap(stack: Stack, engine_id: str, ids: list[int], cache_salt: str = "") -> int:
    with SidecarClient(os.path.join(stack.run_dir, f"{engine_id}.sock"), timeout_s=10) as c:
        return c.admin("prefix_overlap", token_ids=ids, cache_salt=cache_salt)["tokens"]


def served_by(stack: Stack, before: dict) -> list[str]:
    return [e for e in ("decode-0", "decode-1")
            if counters(stack, e).get("loads_started", 0) > before[e].get("loads_started", 0)]


async def hold(stack: Stack, engine_id: str, blocks: int) -> str:
    async with ControlPlaneClient(stack.controlplane, stack.tenant_token) as cp:
        res = await cp.scheduler.Reserve(scheduler_pb2.ReserveRequest(
            request_id=f"hold-{time.monotonic_ns()}", num_tokens=blocks * engines.BLOCK_SIZE, model="tiny",
            preferred_engine_id=engine_id, deadline_ms=60_000), metadata=cp.metadata, timeout=10)
        return res.id


async def release(stack: Stack, res_id: str) -> None:
    async with ControlPlaneClient(stack.controlplane, stack.tenant_token) as cp:
        await cp.scheduler.Release(scheduler_pb2.ReleaseRequest(reservation_id=res_id), metadata=cp.metadata,
                                   timeout=10)


def first_turn_on_decode_0(stack: Stack, turn1: list[int], max_tokens: int, router: str = "",
                           **extra) -> tuple[list[int], int]:
    """Turn 1 through the router (``router``, else the stack's) onto decode-0 (a reservation
    held on decode-1 makes it the freer), then the hold let go and its quarantine waited
    out: both engines equally free, so without the prefix the next turn's tie would go to
    decode-1. The answer's token ids and the bytes the prefill engine staged for it."""
    held = asyncio.run(hold(stack, "decode-1", 64))
    try:
        before = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
        first = complete(router or stack.router_url, turn1, max_tokens, return_token_ids=True, **extra)
        assert served_by(stack, before) == ["decode-0"]
        staged = counters(stack, "prefill-0").get("bytes_staged", 0) - before["prefill-0"].get("bytes_staged", 0)
    finally:
        asyncio.run(release(stack, held))
    time.sleep(2.5)  # its blocks stay out of use for the quarantine (2 s here)
    return first["choices"][0]["token_ids"], staged


def wait_until_held(stack: Stack, ids: list[int], tokens: int, cache_salt: str = "") -> None:
    """Until decode-0's sidecar holds ``tokens`` of ``ids`` and has reported it."""
    deadline = time.monotonic() + 10  # the engine's events, the sidecar's next report
    while overlap(stack, "decode-0", ids, cache_salt) < tokens:
        assert time.monotonic() < deadline, overlap(stack, "decode-0", ids, cache_salt)
        time.sleep(0.1)
    time.sleep(1.0)  # the report reaches the control plane within its 0.25 s interval


def test_the_next_turn_goes_to_the_decode_engine_that_holds_the_conversation(system):
    stack, agg = system
    turn1 = prompt(150, seed=71)
    answer, first_staged = first_turn_on_decode_0(stack, turn1, 24)
    assert answer == complete(agg, turn1, 24, return_token_ids=True)["choices"][0]["token_ids"]

    turn2 = turn1 + answer + prompt(30, seed=72)
    held_tokens = (len(turn1) + len(answer) - 1) // engines.BLOCK_SIZE * engines.BLOCK_SIZE
    wait_until_held(stack, turn2, held_tokens)
    before = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
    cached_before = router_prefix_tokens(stack)["cached"]
    second = complete(stack.router_url, turn2, 16, return_token_ids=True)
    assert second["choices"][0]["token_ids"] == complete(agg, turn2, 16, return_token_ids=True)[
        "choices"][0]["token_ids"]
    assert served_by(stack, before) == ["decode-0"]
    after = counters(stack, "decode-0")
    loaded = after.get("tokens_loaded", 0) - before["decode-0"].get("tokens_loaded", 0)
    # decode's own prefix hit covered the conversation so far: it loaded only the rest
    assert 0 < loaded <= len(turn2) - held_tokens, (loaded, len(turn2), held_tokens)
    assert after.get("load_errors", 0) == before["decode-0"].get("load_errors", 0)
    cached = router_prefix_tokens(stack)["cached"] - cached_before
    assert cached == held_tokens  # the reservation said what decode-0 held ...
    # ... and the prefill engine pushed only the rest: its staged bytes per token as in turn 1
    staged1 = first_staged
    staged2 = counters(stack, "prefill-0").get("bytes_staged", 0) - before["prefill-0"].get("bytes_staged", 0)
    assert staged2 * len(turn1) == staged1 * (len(turn2) - held_tokens), (staged1, staged2)
    settled(stack)


def router_samples(url: str):
    """A router's /metrics, sample by sample."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [(fam.name, s) for fam in text_string_to_metric_families(text) for s in fam.samples]


def router_counter(url: str, name: str, *labels: str) -> dict:
    """A router's counter ``name`` (without _total), by the value of ``labels`` (by a
    tuple of their values when there are several)."""
    return {(s.labels[labels[0]] if len(labels) == 1 else tuple(s.labels[x] for x in labels)): s.value
            for fam, s in router_samples(url) if fam == name and s.name.endswith("_total")}


def router_prefix_tokens(stack: Stack) -> dict[str, float]:
    return router_counter(stack.router_url, "kvpush_router_prefix_tokens", "kind")


def test_a_prefix_evicted_between_the_reserve_and_the_load_is_computed_and_correct(system):
    stack, agg = system
    turn1 = prompt(120, seed=81)
    answer, _ = first_turn_on_decode_0(stack, turn1, 20)
    turn2 = turn1 + answer + prompt(20, seed=82)
    wait_until_held(stack, turn2, 96)
    # The engine drops its cache; the event goes out with its next step (the next request),
    # so the control plane still counts on the prefix when it reserves.
    req = urllib.request.Request(f"{stack.urls['decode-0']}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and b"false" not in resp.read()  # {"success": true}: nothing was running
    before = counters(stack, "decode-0")
    cached_before = router_prefix_tokens(stack)["cached"]
    got = complete(stack.router_url, turn2, 12, return_token_ids=True)["choices"][0]["token_ids"]
    assert got == complete(agg, turn2, 12, return_token_ids=True)["choices"][0]["token_ids"]
    assert router_prefix_tokens(stack)["cached"] > cached_before  # reserved counting on the prefix ...
    after = counters(stack, "decode-0")
    evicted = after.get("load_error_prefix_evicted", 0) - before.get("load_error_prefix_evicted", 0)
    assert evicted == 1, after  # ... which was gone: computed locally, counted
    settled(stack)


def test_without_a_held_prefix_the_freer_engine_is_chosen(system):
    stack, _ = system
    held = asyncio.run(hold(stack, "decode-0", 64))
    try:
        before = {e: counters(stack, e) for e in ("decode-0", "decode-1")}
        complete(stack.router_url, prompt(100, seed=73), 4)
        assert served_by(stack, before) == ["decode-1"]
    finally:
        asyncio.run(release(stack, held))
    time.sleep(2.5)  # (its quarantine)
    settled(stack)


@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_a_short_follow_up_is_served_by_the_decode_engine_holding_the_conversation_alone(system, salt):
    """Turn 1 and its follow-up through the same router: the follow-up extends the turn it
    sent by a short rest, so it goes beside its Reserve to decode-0, which served turn 1,
    finds it holds the prefix and computes the rest at once; the prefill engine gets
    nothing, not even a request to take back. (A conversation with a cache_salt too: its
    blocks are held under the salt, the router's keys are salted as the engines salt them.)"""
    stack, agg = system
    local = stack.add_router(f"router-local{salt}", extra=("--local-prefill-tokens", "64"))
    salted = {"cache_salt": salt} if salt else {}
    turn1 = prompt(150, seed=91 + 10 * bool(salt))
    answer, _ = first_turn_on_decode_0(stack, turn1, 24, router=local, **salted)
    turn2 = turn1 + answer + prompt(20, seed=92)  # 194 tokens, of which decode-0 holds 160: 34 to compute
    held = (len(turn1) + len(answer) - 1) // engines.BLOCK_SIZE * engines.BLOCK_SIZE
    wait_until_held(stack, turn2, held, salt)
    if salt:
        assert overlap(stack, "decode-0", turn2, "tenant-b") == overlap(stack, "decode-0", turn2) == 0
    before = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
    alone_before = router_counter(local, "kvpush_router_local_prefill", "reason").get("cached_prefix", 0)
    guesses = ("decode_alone", "decode_alone")
    guessed_before = router_counter(local, "kvpush_router_turn_guesses", "guess", "answer").get(guesses, 0)
    got = complete(local, turn2, 16, return_token_ids=True, **salted)["choices"][0]["token_ids"]
    assert got == complete(agg, turn2, 16, return_token_ids=True, **salted)["choices"][0]["token_ids"]
    assert router_counter(local, "kvpush_router_local_prefill", "reason")["cached_prefix"] == alone_before + 1
    assert router_counter(local, "kvpush_router_turn_guesses", "guess", "answer")[guesses] == guessed_before + 1
    after = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
    # the prefill engine's connector never held a request for its reservation
    assert after["prefill-0"].get("handover_awaited", 0) == before["prefill-0"].get("handover_awaited", 0)
    # decode-0 computed the rest itself, as it was sent it (its connector found the prefix
    # held): nothing reserved, loaded or pushed, no prefill computed, nothing taken back
    for name, moved in (("alone_guessed", 1), ("alone_held_prefix", 1), ("alone_short", 0),
                        ("alone_taken_back", 0), ("alone_hold_expired", 0)):
        assert after["decode-0"].get(name, 0) - before["decode-0"].get(name, 0) == moved, (name, after["decode-0"])
    for e in ("decode-0", "decode-1"):
        assert after[e].get("loads_started", 0) == before[e].get("loads_started", 0)
    assert after["decode-1"].get("requests_plain", 0) == before["decode-1"].get("requests_plain", 0)
    assert after["prefill-0"].get("bytes_staged", 0) == before["prefill-0"].get("bytes_staged", 0)
    settled(stack)


def test_a_follow_up_guessed_alone_whose_prefix_decode_evicted_is_taken_back_and_served_by_pd(system):
    """The router guesses the follow-up decode alone and sends it to decode-0, which served
    turn 1; but decode-0 dropped its prefix cache meanwhile (an eviction) and the control
    plane has heard so. Its connector holds the request unstarted; the Reserve reserves
    (P/D); the router takes the request on decode-0 back and the turn is served by P/D,
    its answer the aggregated engine's. Nothing stays reserved."""
    stack, agg = system
    local = stack.add_router("router-local-evicted", extra=("--local-prefill-tokens", "64"))
    turn1 = prompt(150, seed=95)
    answer, _ = first_turn_on_decode_0(stack, turn1, 24, router=local)
    turn2 = turn1 + answer + prompt(20, seed=96)
    wait_until_held(stack, turn2, (len(turn1) + len(answer) - 1) // engines.BLOCK_SIZE * engines.BLOCK_SIZE)
    req = urllib.request.Request(f"{stack.urls['decode-0']}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and b"false" not in resp.read()
    # The reset's event goes out with the engine's next step: a request straight to it.
    complete(stack.urls["decode-0"], prompt(8, seed=97), 1)
    deadline = time.monotonic() + 10
    while overlap(stack, "decode-0", turn2) > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)  # the report reaches the control plane within its 0.25 s interval
    before = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
    guesses = ("decode_alone", "pd")
    guessed_before = router_counter(local, "kvpush_router_turn_guesses", "guess", "answer").get(guesses, 0)
    got = complete(local, turn2, 16, return_token_ids=True)["choices"][0]["token_ids"]
    assert got == complete(agg, turn2, 16, return_token_ids=True)["choices"][0]["token_ids"]
    assert router_counter(local, "kvpush_router_turn_guesses", "guess", "answer")[guesses] == guessed_before + 1
    complete(stack.urls["decode-0"], prompt(8, seed=98), 1)  # (counts ride an engine's next step)
    after = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
    for name, moved in (("alone_guessed", 1), ("alone_held_prefix", 0), ("alone_short", 1),
                        ("alone_taken_back", 1), ("alone_hold_expired", 0)):
        assert after["decode-0"].get(name, 0) - before["decode-0"].get(name, 0) == moved, (name, after["decode-0"])
    # P/D served it: the prefill engine staged the prompt, a decode engine loaded it
    assert after["prefill-0"].get("bytes_staged", 0) > before["prefill-0"].get("bytes_staged", 0)
    assert sum(after[e].get("loads_started", 0) - before[e].get("loads_started", 0) for e in ("decode-0", "decode-1")) == 1
    settled(stack)


def router_gauge(url: str, name: str) -> float:
    return next(s.value for _, s in router_samples(url) if s.name == name)


def reserve_buckets(url: str) -> dict:
    return {s.labels.get("le"): s.value for _, s in router_samples(url)
            if s.name == "kvpush_router_reserve_seconds_bucket"}


def test_a_follow_up_answered_alone_from_a_stale_view_waits_only_the_learned_hold(system):
    """The control plane answers decode alone from a view that has not yet heard of decode-0's
    eviction (its report goes out after the engine's next step, which is the turn itself):
    nobody takes the guessed turn back, decode-0 holds it for the router's hold, then
    computes the whole rest itself, and the answer is the aggregated engine's. The hold is
    the one the router learned from its Reserves (twice their p99), not the Reserve's
    timeout: a stale view costs a turn tens of milliseconds, not 750."""
    stack, agg = system
    local = stack.add_router("router-local-stale", extra=("--local-prefill-tokens", "64"))
    ceiling = router_gauge(local, "kvpush_router_guess_hold_seconds")
    # Its Reserves teach the router the round trip (short prompts: decode alone, each a Reserve;
    # two tokens: one would be prefill-only, no Reserve).
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: complete(local, prompt(8, seed=1000 + i), 2), range(100)))
    for attempt in range(3):  # (the view may catch up first: the report timer fired in the turn's few ms)
        turn1 = prompt(150, seed=200 + attempt)
        answer, _ = first_turn_on_decode_0(stack, turn1, 24, router=local)
        turn2 = turn1 + answer + prompt(20, seed=210 + attempt)
        wait_until_held(stack, turn2, (len(turn1) + len(answer) - 1) // engines.BLOCK_SIZE * engines.BLOCK_SIZE)
        req = urllib.request.Request(f"{stack.urls['decode-0']}/reset_prefix_cache", method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200 and b"false" not in resp.read()
        hold_s = router_gauge(local, "kvpush_router_guess_hold_seconds")
        assert 0.02 <= hold_s <= 0.5 < ceiling, (hold_s, ceiling, reserve_buckets(local))  # learned, well under
        before = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
        guessed = router_counter(local, "kvpush_router_turn_guesses", "guess", "answer")
        got = complete(local, turn2, 16, return_token_ids=True)["choices"][0]["token_ids"]
        assert got == complete(agg, turn2, 16, return_token_ids=True)["choices"][0]["token_ids"]
        answered = router_counter(local, "kvpush_router_turn_guesses", "guess", "answer")
        if answered.get(("decode_alone", "decode_alone"), 0) > guessed.get(("decode_alone", "decode_alone"), 0):
            break
        assert answered[("decode_alone", "pd")] == guessed.get(("decode_alone", "pd"), 0) + 1
        settled(stack)
    else:
        pytest.fail("the control plane heard of the eviction before every Reserve (3 tries): no stale view")
    complete(stack.urls["decode-0"], prompt(8, seed=220), 1)  # (counts ride an engine's next step)
    after = {e: counters(stack, e) for e in ("decode-0", "decode-1", "prefill-0")}
    moved = {name: after["decode-0"].get(name, 0) - before["decode-0"].get(name, 0)
             for name in ("alone_guessed", "alone_held_prefix", "alone_short", "alone_taken_back",
                          "alone_hold_expired", "alone_held_us_total")}
    assert {k: v for k, v in moved.items() if k != "alone_held_us_total"} == {
        "alone_guessed": 1, "alone_held_prefix": 0, "alone_short": 1, "alone_taken_back": 0,
        "alone_hold_expired": 1}, after["decode-0"]
    # held for the hold the router sent, from its arrival, and then computed at once
    assert 0.9 * hold_s * 1e6 <= moved["alone_held_us_total"] <= (hold_s + 0.25) * 1e6, (moved, hold_s)
    for e in ("decode-0", "decode-1"):
        assert after[e].get("loads_started", 0) == before[e].get("loads_started", 0)
    assert after["prefill-0"].get("bytes_staged", 0) == before["prefill-0"].get("bytes_staged", 0)
    settled(stack)

"""Conditional disaggregation at the router (stand-in engines, a real control plane and
etcd): with the prompt's block keys, the Reserve finds the decode engine holding all but a
short rest of the prompt and answers decode_alone; the router takes back the prefill
request it sent ahead of the answer and that engine serves the request alone. A prompt
shorter than the threshold never reaches the prefill engine. Nothing stays reserved."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from aiohttp.test_utils import TestServer

from kvpush.app.simulated import SimulatedEngine
from kvpush.contract.block_hash import BlockHasher
from kvpush.contract.transfer_params import AloneParams
from kvpush.contract.v1 import registry_pb2, types_pb2
from kvpush.router import metrics
from kvpush.router.app import DISPATCHER, build_app
from kvpush.router.config import DecodeEngine, RouterConfig
from kvpush.router.kv_aware import GuessHold
from tests.controlplane.helpers import settle
from tests.router.fakes import FakeEngine, WordTokenizer


def local_prefills(reason: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvpush_router_local_prefill_total", {"reason": reason}) or 0.0


@pytest.mark.parametrize("salt", [None, "tenant-a"])
async def test_a_short_rest_is_served_by_the_decode_engine_holding_the_prefix_alone(stack, engine_client, salt):
    """(With a cache_salt, decode-0 holds the salted prompt's blocks: the router's keys are
    salted as vLLM salts them, and decode gets the salt.)"""
    s = stack
    prefill_sim = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, model="tiny", role=types_pb2.PREFILL)
    other_sim = SimulatedEngine(engine_client, "decode-1", num_blocks=8, model="tiny")
    await prefill_sim.register()
    await other_sim.register()  # as free as decode-0: without the prefix the tie goes to decode-1
    other = FakeEngine("D1")
    other_server = TestServer(other.app(), handler_cancellation=True)
    await other_server.start_server()
    for fake in (s["prefill"], s["decode"], other):
        fake.mode = "token_ids"
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       prefill_ids=("prefill-0",), max_model_len=1000, prefix_block_size=16, local_prefill_tokens=20,
                       decode=(DecodeEngine("decode-0", s["decode_url"]),
                               DecodeEngine("decode-1", str(other_server.make_url("")).rstrip("/"))))
    router = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
    await router.start_server()
    url = str(router.make_url("")).rstrip("/") + "/v1/completions"
    prompt = list(range(100, 164))  # 64 tokens: 4 blocks of 16 (the simulated engines')
    hasher = BlockHasher(16, cfg.prefix_hash, cfg.prefix_hash_seed)
    decode0 = s["cp"].view.engine("decode-0")
    await engine_client.registry.ReportPrefixes(registry_pb2.ReportPrefixesRequest(
        engine_id="decode-0", incarnation=decode0.incarnation, epoch=1, seq=0, block_size=16,
        stored=hasher.keys(prompt, salt)[:3]), metadata=engine_client.metadata, timeout=5)
    cached, short = local_prefills("cached_prefix"), local_prefills("short_prompt")
    try:
        # Decode-0 holds 48 of the 64 tokens: the 16 left are under the threshold of 20. The
        # prefill request left before the Reserve's answer; it is taken back unanswered.
        s["prefill"].stall.clear()
        salted = {"cache_salt": salt} if salt else {}
        async with s["session"].post(url, json={"model": "tiny", "prompt": prompt, "max_tokens": 3, **salted},
                                     timeout=aiohttp.ClientTimeout(total=30)) as resp:  # (P/D: the prefill stalls)
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["id"] == "cmpl-D"
        assert len(s["decode"].bodies) == 1 and not other.bodies
        body = s["decode"].bodies[0]
        assert "kv_transfer_params" not in body and body["prompt"] == prompt and body["max_tokens"] == 3
        assert body.get("cache_salt") == salt
        for _ in range(100):
            if s["prefill"].cancelled:
                break
            await asyncio.sleep(0.02)
        assert s["prefill"].cancelled == 1 and len(s["prefill"].bodies) == 1
        assert local_prefills("cached_prefix") == cached + 1
        s["prefill"].stall.set()

        # A prompt shorter than the threshold never goes to the prefill engine.
        async with s["session"].post(url, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}) as resp:
            assert resp.status == 200, await resp.text()
        assert len(s["prefill"].bodies) == 1 and local_prefills("short_prompt") == short + 1
        assert "kv_transfer_params" not in (s["decode"].bodies + other.bodies)[-1]
        report = await settle(s["etcd"].endpoint)
        assert not report.live, report.summary()  # nothing was reserved
    finally:
        s["prefill"].stall.set()
        await router.close()
        await other_server.close()
        await prefill_sim.stop()
        await other_sim.stop()


def turn_guesses(guess: str, answer: str) -> float:
    return metrics.REGISTRY.get_sample_value("kvpush_router_turn_guesses_total",
                                             {"guess": guess, "answer": answer}) or 0.0


async def test_a_turn_extending_one_it_sent_by_a_short_rest_goes_to_its_decode_engine_beside_the_reserve(
        stack, engine_client):
    """The router remembers the prompts it sent and where they were served: a turn that
    extends one by fewer new tokens than the threshold, beyond what its answer may have
    added, goes at once to the decode engine that served it (guarded: computed there only
    if that engine holds all but the short rest) and sends no prefill request ahead of the
    Reserve; decode alone serves it, nothing to take back. A longer rest still sends the
    prefill request early. A wrong guess (decode evicted the prefix, so its engine holds
    the request) costs only the overlap: the Reserve reserves, the request on decode is
    taken back, the prefill request goes with the reservation, and P/D serves the turn."""
    s = stack
    prefill_sim = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, model="tiny", role=types_pb2.PREFILL)
    await prefill_sim.register()
    for fake in (s["prefill"], s["decode"]):
        fake.mode = "token_ids"
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       prefill_ids=("prefill-0",), max_model_len=1000, prefix_block_size=16, local_prefill_tokens=20,
                       decode=(DecodeEngine("decode-0", s["decode_url"]),))
    router = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
    await router.start_server()
    url = str(router.make_url("")).rstrip("/") + "/v1/completions"
    hasher = BlockHasher(16, cfg.prefix_hash, cfg.prefix_hash_seed)
    decode0 = s["cp"].view.engine("decode-0")
    epoch = iter(range(1, 100))

    async def holds(prompt):  # decode-0's prefix cache holds the prompt's full blocks (a snapshot)
        await engine_client.registry.ReportPrefixes(registry_pb2.ReportPrefixesRequest(
            engine_id="decode-0", incarnation=decode0.incarnation, epoch=next(epoch), seq=0, block_size=16,
            stored=hasher.keys(prompt)), metadata=engine_client.metadata, timeout=5)
        await asyncio.sleep(0.2)  # (the view's watch applies it)

    async def turn(prompt) -> list[int]:
        async with s["session"].post(url, json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                "return_token_ids": True},
                                     timeout=aiohttp.ClientTimeout(total=30)) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        return answer["choices"][0]["token_ids"]

    before = {(g, a): turn_guesses(g, a) for g in ("decode_alone", "prefill") for a in ("decode_alone", "pd")}

    def guessed(g: str, a: str) -> float:
        return turn_guesses(g, a) - before[(g, a)]
    try:
        # Turn 1: nothing remembered, nothing held: the prefill request leaves with the Reserve.
        # (Decode-0 has 8 blocks of 16 tokens, and each P/D turn's stay quarantined: short turns.)
        p1 = list(range(100, 132))
        a1 = await turn(p1)
        assert len(s["prefill"].bodies) == 1 and guessed("prefill", "pd") == 1
        # Turn 2 adds the answer (3 tokens, at most max_tokens) and 5 new: 5 beyond turn 1
        # and its answer, under the threshold. Decode-0 served turn 1 and holds its blocks:
        # the turn goes there at once, guarded (it must hold 40 - 20 + 1 tokens), and the
        # Reserve's decode_alone on decode-0 keeps it; the prefill engine never hears of it.
        p2 = p1 + a1 + [5, 6, 7, 8, 9]
        await holds(p1)
        decode_bodies = len(s["decode"].bodies)
        await turn(p2)
        assert len(s["prefill"].bodies) == 1 and s["prefill"].cancelled == 0
        assert len(s["decode"].bodies) == decode_bodies + 1 and s["decode"].cancelled == 0
        assert s["decode"].bodies[-1]["prompt"] == p2
        router_await_ms = int(cfg.reserve_timeout_s * 1000) + 250
        assert s["decode"].bodies[-1]["kv_transfer_params"] == AloneParams(len(p2) - 20 + 1,
                                                                           router_await_ms).as_kv_transfer_params()
        assert guessed("decode_alone", "decode_alone") == 1
        # Turn 3 adds 24 new tokens: a P/D turn, its prefill request sent early again.
        await holds(p2)
        await turn(p2 + [7, 8, 9] + list(range(300, 324)))
        assert len(s["prefill"].bodies) == 2 and guessed("prefill", "pd") == 2
        # A guess gone wrong: turn 2 again with other new tokens, but decode-0 evicted
        # everything. Decode alone was guessed: the turn went to decode-0, which holds it
        # (it lacks the prefix); the Reserve reserves (P/D): the request on decode-0 is taken
        # back, and the prefill request goes after the answer, with the reservation it names.
        await holds([])
        s["prefill"].pushes = False  # (no sidecars here: its reservation is released, not left to a load)
        s["decode"].holds_alone.clear()
        decode_bodies = len(s["decode"].bodies)
        # By now the router has seen enough Reserve round trips (fed here: 15 ms each) to hold
        # a guessed turn twice their p99, not the Reserve's whole timeout.
        hold = router.app[DISPATCHER].kv_aware.hold
        for _ in range(GuessHold.MIN_SEEN):
            hold.observe(0.015)
        await turn(p1 + a1 + [50, 51, 52])
        assert len(s["prefill"].bodies) == 3 and guessed("decode_alone", "pd") == 1
        assert "await" not in s["prefill"].bodies[-1]["kv_transfer_params"]["kvpush"]
        assert s["decode"].bodies[decode_bodies]["kv_transfer_params"]["kvpush"]["alone"]["hold_ms"] == hold.ms
        assert 30 <= hold.ms < router_await_ms  # (with the two real Reserves among them)
        for _ in range(100):
            if s["decode"].cancelled:
                break
            await asyncio.sleep(0.02)
        assert s["decode"].cancelled == 1  # taken back
        # (the prefill engine did not push: decode computes the prompt, without kvpush params)
        assert len(s["decode"].bodies) == decode_bodies + 2 and "kv_transfer_params" not in s["decode"].bodies[-1]
        report = await settle(s["etcd"].endpoint)
        assert not report.live, report.summary()
    finally:
        await router.close()
        await prefill_sim.stop()


async def test_a_next_turn_reaching_another_worker_is_guessed_as_by_the_first(stack, engine_client, tmp_path):
    """With several router workers (``--workers``) a conversation's next turn may reach
    another worker than its last: the worker that sent a turn tells its siblings
    (``kvpush.router.siblings``), so the other guesses the next turn decode alone and
    sends it at once to the decode engine that served the first, as the first would."""
    from kvpush.router.siblings import Siblings
    s = stack
    prefill_sim = SimulatedEngine(engine_client, "prefill-0", num_blocks=8, model="tiny", role=types_pb2.PREFILL)
    await prefill_sim.register()
    for fake in (s["prefill"], s["decode"]):
        fake.mode = "token_ids"
    cfg = RouterConfig(controlplane=s["cp"].address, token=s["token"], model="tiny", prefill_urls=(s["prefill_url"],),
                       prefill_ids=("prefill-0",), max_model_len=1000, prefix_block_size=16, local_prefill_tokens=20,
                       decode=(DecodeEngine("decode-0", s["decode_url"]),))
    routers, urls, siblings = [], [], []
    for i in range(2):
        router = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
        await router.start_server()
        kv = router.app[DISPATCHER].kv_aware
        kv.siblings = Siblings(str(tmp_path), i, 2)
        await kv.siblings.start(kv.heard)
        routers.append(router)
        siblings.append(kv.siblings)
        urls.append(str(router.make_url("")).rstrip("/") + "/v1/completions")
    hasher = BlockHasher(16, cfg.prefix_hash, cfg.prefix_hash_seed)
    decode0 = s["cp"].view.engine("decode-0")

    async def turn(url, prompt) -> list[int]:
        async with s["session"].post(url, json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                "return_token_ids": True},
                                     timeout=aiohttp.ClientTimeout(total=30)) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]["token_ids"]
    try:
        p1 = list(range(100, 132))
        a1 = await turn(urls[0], p1)                         # turn 1 on worker 0: P/D
        assert len(s["prefill"].bodies) == 1
        await engine_client.registry.ReportPrefixes(registry_pb2.ReportPrefixesRequest(
            engine_id="decode-0", incarnation=decode0.incarnation, epoch=1, seq=0, block_size=16,
            stored=hasher.keys(p1)), metadata=engine_client.metadata, timeout=5)
        await asyncio.sleep(0.2)
        b_turns = routers[1].app[DISPATCHER].kv_aware.turns
        assert b_turns.extends(hasher.keys(p1 + a1), len(p1) + 3) == (0, "decode-0")  # worker 1 heard it
        decode_bodies = len(s["decode"].bodies)
        await turn(urls[1], p1 + a1 + [5, 6, 7, 8, 9])        # turn 2 on worker 1: guessed decode alone
        assert len(s["prefill"].bodies) == 1 and s["prefill"].cancelled == 0
        assert len(s["decode"].bodies) == decode_bodies + 1
        assert "alone" in s["decode"].bodies[-1]["kv_transfer_params"]["kvpush"]
    finally:
        for sib in siblings:
            sib.close()
        for router in routers:
            await router.close()
        await prefill_sim.stop()

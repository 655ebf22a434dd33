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

from app.simulated import SimulatedEngine
from kvpush.contract.block_hash import BlockHasher
from kvpush.contract.v1 import registry_pb2, types_pb2
from router import metrics
from router.app import build_app
from router.config import DecodeEngine, RouterConfig
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

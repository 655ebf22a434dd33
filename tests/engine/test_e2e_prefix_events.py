"""A decode sidecar following its real vLLM engine's prefix-cache events: the blocks it
holds are the ones a router computes from the token ids (kvpush/contract/block_hash.py),
including blocks the engine filled with its own answer (the next turn of a conversation);
a reset of the engine's prefix cache empties it; a restarted sidecar joins the stream
with nothing and learns what is stored from then on.

Processes (started once for the module): a decode sidecar (``--kv-events``) and a decode
vLLM engine on the tiny model with prefix caching and ``--kv-events-config`` (ZMQ
publisher on an ipc socket), the kvpush connector loaded, dev endpoints on (for
``/reset_prefix_cache``).
"""

from __future__ import annotations

import itertools
import os
import pathlib
import tempfile
import time
import urllib.request

import pytest

from kvpush.app.engines import kv_events_args
from kvpush.contract.block_hash import BlockHasher
from tests.engine.conftest import SidecarProc, VllmEngine, kvpush_transfer_config, prompt, serve_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 32
LAYOUT = f"layers=4,block={BS},heads=2,dim=64,dtype=float32"


class EventsStack:
    def __init__(self, model: str, workdir: pathlib.Path):
        self.model, self.workdir = model, workdir
        self.endpoint = f"ipc://{workdir}/D.kvevents"
        self.sidecar: SidecarProc | None = None
        self.engine: VllmEngine | None = None

    def start(self) -> "EventsStack":
        self.sidecar = SidecarProc("D", "decode", self.workdir, LAYOUT, 64, "--kv-events", self.endpoint,
                                   "--kv-events-topic", "kvpush").ready()
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        try:
            self.engine = VllmEngine("D", self.model, self.workdir,
                                     kvpush_transfer_config("kv_consumer", self.sidecar.socket, str(self.workdir), "D"),
                                     kv_events_args(self.endpoint))
        finally:
            del os.environ["VLLM_SERVER_DEV_MODE"]
        self.engine.wait_ready(timeout_s=300)
        return self

    def stop(self) -> None:
        for proc in (self.engine, self.sidecar):
            if proc is not None:
                proc.stop()

    def overlap(self, ids: list[int], cache_salt: str = "") -> dict:
        return self.sidecar.admin("prefix_overlap", token_ids=ids, cache_salt=cache_salt)

    def wait_overlap(self, ids: list[int], blocks: int, timeout_s: float = 10.0, cache_salt: str = "") -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.overlap(ids, cache_salt)
            if got["blocks"] == blocks or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tiny_model):
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvpe-", dir="/tmp"))
    st = EventsStack(tiny_model, workdir)
    yield from serve_module(st, workdir, lambda: f"--- engine\n{st.engine.log() if st.engine else ''}\n"
                                                 f"--- sidecar\n{st.sidecar.log() if st.sidecar else ''}")


def test_the_sidecar_holds_the_blocks_a_router_computes_including_the_answers(stack):
    ids = prompt(100, seed=1)
    answer = stack.engine.complete(ids, 40)["choices"][0]["token_ids"]
    assert stack.wait_overlap(ids, 3)["blocks"] == 3  # the prompt's 3 full blocks (100 // 32)
    turn2 = ids + answer + prompt(20, seed=2)  # the next turn: the conversation so far and a new message
    got = stack.wait_overlap(turn2, (len(ids) + len(answer) - 1) // BS)
    # vLLM caches the blocks its answer filled too (all but the last sampled token's KV)
    assert got["blocks"] == (len(ids) + len(answer) - 1) // BS == 4, got
    assert BlockHasher(BS).keys(turn2)[:4] == BlockHasher(BS).keys(ids + answer)[:4]
    other = ids[:64] + prompt(36, seed=3)
    assert stack.overlap(other)["blocks"] == 2  # a shared first two blocks, then a different prefix
    stats = stack.sidecar.admin("stats")
    assert stats["prefix_events"]["verified"] > 0 and not stats["prefix_unusable"], stats  # our hashes are vLLM's
    assert stats["prefix_events"]["gaps"] == 0, stats


def test_a_salted_request_is_held_under_its_salt_and_leaves_routing_on(stack):
    """A client's cache_salt (a tenant's prefixes kept from the others') salts the engine's
    block hashes: the sidecar checks them with the salt and holds them as such, and its
    view of the engine stays usable for everyone."""
    verified = stack.sidecar.admin("stats")["prefix_events"]["verified"]
    ids = prompt(100, seed=6)
    stack.engine.complete(ids, 2, cache_salt="tenant-a")
    assert stack.wait_overlap(ids, 3, cache_salt="tenant-a")["blocks"] == 3
    assert stack.overlap(ids)["blocks"] == 0 and stack.overlap(ids, "tenant-b")["blocks"] == 0
    stats = stack.sidecar.admin("stats")
    assert not stats["prefix_unusable"] and stats["prefix_events"]["verified"] > verified, stats
    plain = prompt(70, seed=7)  # and the engine's unsalted blocks are still followed
    stack.engine.complete(plain, 2)
    assert stack.wait_overlap(plain, 2)["blocks"] == 2


def test_a_reset_of_the_engines_prefix_cache_empties_the_sidecars_view(stack):
    ids = prompt(70, seed=4)
    stack.engine.complete(ids, 2)
    assert stack.wait_overlap(ids, 2)["blocks"] == 2
    req = urllib.request.Request(f"{stack.engine.url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200, resp.read()
    # vLLM publishes a step's KV events with the step: one more (a prompt shorter than a
    # block: nothing stored) sends the reset's AllBlocksCleared.
    stack.engine.complete(prompt(5, seed=9), 1)
    assert stack.wait_overlap(ids, 0)["blocks"] == 0
    assert stack.sidecar.admin("stats")["prefix_blocks_held"] == 0
    stack.engine.complete(ids, 2)  # computed again, stored again
    assert stack.wait_overlap(ids, 2)["blocks"] == 2


def test_a_restarted_sidecar_starts_knowing_nothing_and_follows_from_there(stack):
    ids = prompt(70, seed=5)
    stack.engine.complete(ids, 2)
    assert stack.wait_overlap(ids, 2)["blocks"] == 2
    stack.sidecar.restart()
    assert stack.overlap(ids)["blocks"] == 0  # what was stored before it came back is not claimed
    deadline = time.monotonic() + 30  # the new SUB socket joins the engine's publisher; stores from then on arrive
    for i in itertools.count():
        fresh = prompt(70, seed=100 + i)
        stack.engine.complete(fresh, 2)
        if stack.wait_overlap(fresh, 2, timeout_s=2)["blocks"] == 2:
            break
        assert time.monotonic() < deadline, stack.sidecar.admin("stats")
    assert stack.sidecar.admin("stats")["prefix_events"]["gaps"] == 0  # joined late: not a gap

"""Decode failover without a second prefill, real parts only: etcd, a control plane,
`kvpush sidecar` processes, one prefill and two decode vLLM engines with the connector,
and a router.

A long prompt is prefilled in small chunks, so its KV is pushed over many engine steps.
While the push is under way (the reservation is PUSHING in etcd), the decode engine the
reservation names is killed with -9, its vLLM and its sidecar together, as a pod dies.
The prefill sidecar keeps the staged KV; the router, finding that engine gone, moves the
reservation to the other decode engine (Scheduler.Relocate), the prefill sidecar pushes
the KV again from staging, and the other engine loads it. The client's answer is the same
greedy text as before the kill; the prefill engine prefilled the prompt once; the new
decode engine loaded the prompt by push and computed none of it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from app import engines
from app.stack import Stack, StackSpec
from app.tiny_model import DEFAULT_DIR, ensure_model
from kvpush.contract.states import State
from tests.e2e.test_router_e2e import counters, settled, streamed

pytestmark = pytest.mark.timeout(900)

LONG = " ".join(f"word{i} of a long prompt pushed in many chunks" for i in range(60))
MAX_TOKENS = 12
NO_CACHE = "--no-enable-prefix-caching"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("decode-failover-logs"))
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    # Small prefill chunks: the push of the long prompt spans many engine steps. No prefix
    # caching: the same prompt is computed (and pushed) whole each time, and a decode
    # engine's answer is a load, never a local cache hit.
    stack = Stack(StackSpec(model_dir=model, log_dir=logs, deadline_ms=30_000, quarantine_ms=2_000,
                            decode_engines=2, prefill_args=("--max-num-batched-tokens", "8", NO_CACHE),
                            decode_args=(NO_CACHE,)), progress=print)
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def ask(url: str, prompt: str) -> tuple[int, str, list[tuple[float, dict]]]:
    """(status, the streamed text, each event with the time it arrived)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            events = [(time.monotonic(), json.loads(line[6:])) for line in (raw.strip() for raw in resp)
                      if line.startswith(b"data: {")]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), []
    return 200, streamed([e for _, e in events])["text"], events


def watch_for_reservation(stack: Stack, found: dict, stop: threading.Event) -> None:
    """Follow the tenant's reservations; record the first one granted."""
    from client.control_plane import ControlPlaneClient
    from kvpush.contract.v1 import scheduler_pb2

    async def follow():
        async with ControlPlaneClient(stack.controlplane, stack.tenant_token) as cp:
            call = cp.scheduler.WatchReservations(scheduler_pb2.WatchReservationsRequest(), metadata=cp.metadata)
            found["subscribed"] = True
            async for event in call:
                res = event.reservation
                if res.id and not res.moved_from:
                    found["reservation"] = res
                    return
                if stop.is_set():
                    return
    asyncio.run(follow())


def test_a_decode_engine_killed_mid_push_costs_no_second_prefill(system):
    stack = system
    url = stack.router_url
    want = ask(url, LONG)  # the reference: the whole P/D path, nothing killed
    assert want[0] == 200, want
    settled(stack)
    before = {name: dict(counters(stack, name)) for name in ("prefill-0", "decode-0", "decode-1")}

    found: dict = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_for_reservation, args=(stack, found, stop), daemon=True)
    watcher.start()
    deadline = time.monotonic() + 10
    while "subscribed" not in found:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    answer: dict = {}
    client = threading.Thread(target=lambda: answer.update(result=ask(url, LONG), sent=time.monotonic()))
    client.start()
    deadline = time.monotonic() + 60
    while "reservation" not in found:
        assert time.monotonic() < deadline, "no reservation was granted"
        time.sleep(0.002)
    res = found["reservation"]
    named = res.engine_id
    proc_name = "decode" if named == "decode-0" else named
    # Mid-push: the prefill engine's connector has pushed some chunks' layers (its counters
    # file is written every engine step) and not yet the whole prompt.
    while counters(stack, "prefill-0").get("layers_pushed", 0) == before["prefill-0"].get("layers_pushed", 0):
        assert time.monotonic() < deadline, "the push did not begin"
        time.sleep(0.002)
    # The tiny model prefills the prompt in well under a second: the prefill engine is
    # frozen (SIGSTOP, its sidecar runs on) so that the kill lands before its last chunk,
    # then thawed. Its counters, read while it is frozen, show the push under way.
    prefill_group = os.getpgid(stack.process("vllm-prefill").proc.pid)
    os.killpg(prefill_group, signal.SIGSTOP)
    now = counters(stack, "prefill-0")
    stack.process(f"vllm-{proc_name}").kill_group()
    stack.process(f"sidecar-{proc_name}").kill()
    killed = time.monotonic()
    os.killpg(prefill_group, signal.SIGCONT)
    assert now.get("requests_pushed", 0) == before["prefill-0"].get("requests_pushed", 0), "not mid-push"
    client.join(300)
    stop.set()
    status, text, events = answer["result"]
    assert (status, text) == (200, want[1])
    after = {name: dict(counters(stack, name)) for name in ("prefill-0", "decode-0", "decode-1")}
    delta = {name: {k: after[name].get(k, 0) - before[name].get(k, 0) for k in after[name]} for name in after}
    survivor = "decode-1" if named == "decode-0" else "decode-0"
    # One prefill: the prefill engine staged the prompt once, and the sidecar pushed it twice.
    assert delta["prefill-0"].get("requests_begun") == 1, delta["prefill-0"]
    # The new decode engine loaded the whole prompt by push, and computed none of it.
    assert delta[survivor].get("loads_landed") == 1, delta[survivor]
    assert delta[survivor].get("tokens_loaded", 0) >= res.num_tokens, delta[survivor]
    assert not delta[survivor].get("load_errors"), delta[survivor]
    # The first token from the new decode engine (the stream's second), after the kill.
    decode_first = next(t for t, e in events[1:] if e.get("choices") and e["choices"][0].get("text"))
    print(f"reservation {res.id} ({res.num_tokens} tokens) on {named}, killed mid-push; "
          f"first token from {survivor} {1000 * (decode_first - killed):.0f} ms after the kill")

    from tests.e2e.test_decode_death_e2e import router_metric
    assert router_metric(url, "kvpush_router_relocations_total", outcome="moved") == 1
    assert router_metric(url, "kvpush_router_fallbacks_total", reason="decode_failed") == 0
    # The registry: the old reservation FAILED naming its successor, which was consumed;
    # nothing is left live once the dead engine's lease has gone.
    moved = asyncio.run(_reservation(stack, res.id))
    assert moved.state == State.FAILED and moved.moved_to
    successor = asyncio.run(_reservation(stack, moved.moved_to))
    assert successor.state == State.CONSUMED and successor.engine_id == survivor
    settled(stack, timeout=60)


async def _reservation(stack: Stack, res_id: str):
    from tests.sidecar.service_helpers import Etcd
    etcd = Etcd(stack.etcd.endpoint)
    try:
        return await etcd.reservation(res_id)
    finally:
        await etcd.close()

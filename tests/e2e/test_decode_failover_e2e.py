"""Decode failover without a second prefill, real parts only: etcd, a control plane,
`kvpush sidecar` processes, one prefill and two decode vLLM engines with the connector,
and a router.

A long prompt is prefilled in small chunks (first on the first-token path, then on the push
path, a whole answer with an output penalty), so its KV is pushed over many engine steps.
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

from kvpush.app import engines
from kvpush.app.stack import Stack, StackSpec
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
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


def ask(url: str, prompt: str, stream: bool = True, **extra) -> tuple[int, str, list[tuple[float, dict]]]:
    """(status, the text, each streamed event with the time it arrived)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream,
            **extra}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as resp:
            if not stream:
                return 200, json.load(resp)["choices"][0]["text"], []
            events = [(time.monotonic(), json.loads(line[6:])) for line in (raw.strip() for raw in resp)
                      if line.startswith(b"data: {")]
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), []
    return 200, streamed([e for _, e in events])["text"], events


def watch_for_reservation(stack: Stack, found: dict, stop: threading.Event) -> None:
    """Follow the tenant's reservations; record the first one granted."""
    from kvpush.client.control_plane import ControlPlaneClient
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


def kill_the_named_engine_mid_push(stack: Stack, request) -> tuple:
    """Send ``request`` (a callable: the client) and, once its push is under way, kill -9 the
    decode engine its reservation names (vLLM and sidecar, as a pod dies). (the reservation,
    its engine's process name, when it was killed, the client's answer, the counters before)."""
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
    client = threading.Thread(target=lambda: answer.update(result=request()))
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
    stack.live(f"vllm-{proc_name}").kill_group()
    stack.live(f"sidecar-{proc_name}").kill()
    killed = time.monotonic()
    os.killpg(prefill_group, signal.SIGCONT)
    assert now.get("requests_pushed", 0) == before["prefill-0"].get("requests_pushed", 0), "not mid-push"
    client.join(300)
    stop.set()
    return res, proc_name, killed, answer["result"], before


def test_a_decode_engine_killed_mid_push_costs_no_second_prefill(system):
    stack = system
    url = stack.router_url
    want = ask(url, LONG)  # the reference: the whole P/D path, nothing killed
    assert want[0] == 200, want
    settled(stack)
    res, proc_name, killed, (status, text, events), before = kill_the_named_engine_mid_push(
        stack, lambda: ask(url, LONG))
    named = res.engine_id
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
    # (The survivor's sidecar reports CONSUMED on its own stream, group-committed: it may
    # land a moment after the client has its last token.)
    successor = asyncio.run(_reservation(stack, moved.moved_to, until=_consumed))
    assert successor.state == State.CONSUMED and successor.engine_id == survivor, \
        (successor.state, successor.reason, successor.engine_id)  # (who ended it, if not consumed)
    settled(stack, timeout=60)


def _consumed(rec) -> bool:
    return rec is not None and rec.state == State.CONSUMED


async def _reservation(stack: Stack, res_id: str, until=None, timeout: float = 10.0):
    """The reservation's record in etcd; with ``until``, once it holds (or as it is at ``timeout``)."""
    from tests.sidecar.service_helpers import Etcd
    etcd = Etcd(stack.etcd.endpoint)
    deadline = time.monotonic() + timeout
    try:
        while True:
            rec = await etcd.reservation(res_id)
            if until is None or until(rec) or time.monotonic() > deadline:
                return rec
            await asyncio.sleep(0.05)
    finally:
        await etcd.close()


def both_decode_engines(stack: Stack) -> None:
    """Start again whatever decode engine an earlier test killed, and wait until the control
    plane has both available."""
    for engine_id in ("decode-0", "decode-1"):
        name = "decode" if engine_id == "decode-0" else engine_id
        try:
            stack.live(f"sidecar-{name}")
        except StopIteration:
            stack.restart(f"sidecar-{name}")
        try:
            stack.live(f"vllm-{name}")
        except StopIteration:
            stack.restart_engine("decode", engine_id)
    from kvpush.client.control_plane import ControlPlaneClient
    from kvpush.contract.v1 import scheduler_pb2

    async def available() -> list[str]:
        async with ControlPlaneClient(stack.controlplane, stack.tenant_token) as cp:
            listed = await cp.scheduler.ListEngines(scheduler_pb2.ListEnginesRequest(), metadata=cp.metadata,
                                                    timeout=10)
        return [e.engine_id for e in listed.engines if not e.unavailable]
    deadline = time.monotonic() + 60
    while len(ready := asyncio.run(available())) < 2:  # available once vLLM's connector connects
        assert time.monotonic() < deadline, ready
        time.sleep(0.5)


def test_on_the_push_path_a_decode_engine_killed_mid_push_costs_no_second_prefill(system):
    """The push path (an output penalty: decode computes every token, asked at once beside
    the prefill), a whole answer: the reservation names the prefill engine there too, so it
    is moved the same way when its decode engine dies before anything reached the client."""
    stack = system
    both_decode_engines(stack)
    url = stack.router_url
    penalty = {"presence_penalty": 0.5}
    want = ask(url, LONG, stream=False, **penalty)
    assert want[0] == 200, want
    settled(stack, timeout=60)
    from tests.e2e.test_decode_death_e2e import router_metric
    moved_before = router_metric(url, "kvpush_router_relocations_total", outcome="moved")
    fallbacks_before = router_metric(url, "kvpush_router_fallbacks_total", reason="decode_failed")
    res, _, _, (status, text, _), before = kill_the_named_engine_mid_push(
        stack, lambda: ask(url, LONG, stream=False, **penalty))
    assert (status, text) == (200, want[1])
    assert res.prefill_engine_id == "prefill-0"  # named on the push path too
    after = {name: dict(counters(stack, name)) for name in ("prefill-0", "decode-0", "decode-1")}
    delta = {name: {k: after[name].get(k, 0) - before[name].get(k, 0) for k in after[name]} for name in after}
    survivor = "decode-1" if res.engine_id == "decode-0" else "decode-0"
    assert delta["prefill-0"].get("requests_begun") == 1, delta["prefill-0"]
    assert delta[survivor].get("loads_landed") == 1, delta[survivor]
    # All but the prompt's last token, which decode computes for its first output's logits.
    assert delta[survivor].get("tokens_loaded", 0) >= res.num_tokens - 1, delta[survivor]
    assert not delta[survivor].get("load_errors"), delta[survivor]
    assert router_metric(url, "kvpush_router_relocations_total", outcome="moved") == moved_before + 1
    assert router_metric(url, "kvpush_router_fallbacks_total", reason="decode_failed") == fallbacks_before
    moved = asyncio.run(_reservation(stack, res.id))
    assert moved.state == State.FAILED and moved.moved_to
    # (The survivor's sidecar reports CONSUMED on its own stream, group-committed: it may
    # land a moment after the client has its last token.)
    successor = asyncio.run(_reservation(stack, moved.moved_to, until=_consumed))
    assert successor.state == State.CONSUMED and successor.engine_id == survivor, \
        (successor.state, successor.reason, successor.engine_id)  # (who ended it, if not consumed)
    settled(stack, timeout=60)

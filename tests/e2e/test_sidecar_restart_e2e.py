"""A sidecar killed (and started again) under running vLLM engines, real parts only: etcd,
a control plane, `kvpush sidecar` processes, a prefill and a decode vLLM engine with the
connector, the router, and clients.

Restarts: the engine's connector dials its sidecar again by itself
(kvpush/connector/sidecar_link.py, ``Redialer``): the restarted sidecar hears the engine's
HELLO, reports it available, and requests arrive by push again within seconds, nothing
restarted but the sidecar. Clients see no error meanwhile (the router serves the prompt
on one engine while push is off), and the registry's invariants hold in etcd afterwards.

The prefill sidecar killed mid-push: the control plane fails the reservations that
sidecar's life was named for as soon as its heartbeat stream is cut, pushing or not yet,
so a decode engine waiting for the bytes recomputes at once instead of at the deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from kvpush.app import engines
from kvpush.app.stack import Stack, StackSpec, complete
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
from tests.e2e.test_router_e2e import counters, settled
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(900)

NO_CACHE = "--no-enable-prefix-caching"
# Push resumes within this of the restarted sidecar being ready: the connector dials every
# second at most, then the availability report and the router's engine watch follow.
RESUME_BOUND_S = 10.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("sidecar-restart-logs"))
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    # Small prefill chunks: a long prompt's push spans many engine steps, so a kill lands
    # mid-push. No prefix caching: every answer is a push or a whole recompute.
    s = Stack(StackSpec(model_dir=model, log_dir=logs, deadline_ms=30_000, quarantine_ms=2_000,
                        prefill_args=("--max-num-batched-tokens", "8", NO_CACHE), decode_args=(NO_CACHE,)),
              progress=print)
    try:
        s.start()
        yield s
    finally:
        s.stop()


class Load:
    """One client sending short greedy completions one after another through the router,
    each a fresh prompt (no prefix-cache hit), until stopped: every answer's status kept."""

    def __init__(self, url: str):
        self.url = url
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            prompt = f"Request {i} at {time.monotonic():.6f}: " + " ".join(["the load goes on"] * 12)
            try:
                complete(self.url, prompt, 4, timeout=120)
                self.statuses.append(200)
            except Exception as exc:  # urllib's HTTPError carries the status
                self.statuses.append(getattr(exc, "code", 0))
            time.sleep(0.05)


def available(stack: Stack) -> dict[str, str]:
    """Each engine's availability as the control plane holds it ("" = available), as
    `kvpush status` reads it."""
    from kvpush.client.control_plane import ControlPlaneClient
    from kvpush.contract.v1 import admin_pb2

    async def listed():
        async with ControlPlaneClient(stack.controlplane, stack.admin_token) as cp:
            resp = await cp.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=cp.metadata, timeout=10)
        return {e.engine_id: e.unavailable for e in resp.engines}
    return asyncio.run(listed())


def pushed(stack: Stack) -> int:
    """Requests the decode engine loaded by push so far."""
    return counters(stack, "decode-0").get("loads_landed", 0)


def restart_under_load(stack: Stack, sidecar: str) -> None:
    engines_before = {name: stack.live(name).pid for name in ("vllm-prefill", "vllm-decode")}
    with Load(stack.router_url) as load:
        wait_for(lambda: len(load.statuses) >= 3, 120, "the load running")
        before = pushed(stack)
        wait_for(lambda: pushed(stack) > before, 60, "a request by push before the kill")
        stack.live(sidecar).kill()  # SIGKILL: no goodbye to the engine or the control plane
        killed = time.monotonic()
        stack.restart(sidecar)  # the same command line; returns once it has registered
        ready = time.monotonic()
        at_ready = pushed(stack)
        wait_for(lambda: pushed(stack) > at_ready, 60, "push resuming after the restart")
        resumed = time.monotonic()
        wait_for(lambda: len(load.statuses) >= 3 + 2, 60, "the load still running")
    print(f"\n{sidecar} killed and restarted: ready {ready - killed:.2f} s after the kill, push resumed "
          f"{resumed - ready:.2f} s after it was ready ({resumed - killed:.2f} s after the kill); "
          f"{len(load.statuses)} requests, statuses {sorted(set(load.statuses))}")
    assert resumed - ready <= RESUME_BOUND_S
    assert set(load.statuses) == {200}
    assert all(available(stack).get(e) == "" for e in ("prefill-0", "decode-0")), available(stack)
    # Nothing of vLLM was touched: the same engine processes serve.
    assert {name: stack.live(name).pid for name in engines_before} == engines_before
    reconnects = counters(stack, "decode-0" if "decode" in sidecar else "prefill-0").get("sidecar_reconnects", 0)
    assert reconnects >= 1
    settled(stack, timeout=60)


def test_a_decode_sidecar_killed_and_restarted_gets_its_engine_back(stack):
    restart_under_load(stack, "sidecar-decode")


def test_a_prefill_sidecar_killed_and_restarted_gets_its_engine_back(stack):
    restart_under_load(stack, "sidecar-prefill")


def test_a_prefill_sidecar_killed_mid_push_leaves_decode_waiting_no_longer_than_its_recompute(stack):
    """On the push path (an output penalty: decode is asked at once, beside the prefill, and
    waits for the landing) two requests are in flight when the prefill sidecar dies
    (kill -9; the prefill engine frozen meanwhile so the kill lands before its last chunk).
    Their reservations end FAILED at once; decode recomputes each prompt. Each answer equals
    the one the whole path gave before, and arrives no later than decode's own recompute of
    the prompt plus about a second after the kill, not at the 30 s deadline."""
    from tests.e2e.test_decode_failover_e2e import LONG, ask
    from tests.e2e.test_router_e2e import post
    url, penalty = stack.router_url, {"presence_penalty": 0.5}
    prompts = [f"Request {i}: {LONG}" for i in range(2)]
    want = [ask(url, p, stream=False, **penalty) for p in prompts]
    assert all(w[0] == 200 for w in want), want
    # What decode alone needs for such a prompt: its recompute, the floor of what a kill costs.
    t0 = time.monotonic()
    status, _ = post(stack.decode_url, "/v1/completions", {"model": "tiny", "prompt": prompts[0], "max_tokens": 12,
                                                           "temperature": 0.0, **penalty})
    recompute = time.monotonic() - t0
    assert status == 200
    settled(stack, timeout=60)
    before = dict(counters(stack, "decode-0"))
    pushed_before = counters(stack, "prefill-0").get("layers_pushed", 0)
    answers: dict[int, tuple] = {}
    clients = [threading.Thread(target=lambda i=i: answers.update({i: (ask(url, prompts[i], stream=False, **penalty),
                                                                       time.monotonic())}))
               for i in range(2)]
    for c in clients:
        c.start()
    wait_for(lambda: counters(stack, "prefill-0").get("layers_pushed", 0) > pushed_before, 60, "the push beginning",
             interval_s=0.002)
    prefill_group = os.getpgid(stack.live("vllm-prefill").pid)
    os.killpg(prefill_group, signal.SIGSTOP)
    try:
        stack.live("sidecar-prefill").kill()
        killed = time.monotonic()
    finally:
        os.killpg(prefill_group, signal.SIGCONT)
    for c in clients:
        c.join(120)
    waits = [answers[i][1] - killed for i in range(2)]
    print(f"\nprefill sidecar killed mid-push: answers {', '.join(f'{w:.2f}' for w in waits)} s after the kill; "
          f"decode's own recompute {recompute:.2f} s")
    assert [answers[i][0][:2] for i in range(2)] == [w[:2] for w in want]
    assert max(waits) <= 2 * recompute + 1.5, (waits, recompute)  # two recomputes share decode's core
    after = counters(stack, "decode-0")
    recomputed = sum(after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("load_error_"))
    assert recomputed >= 1, (before, after)
    stack.restart("sidecar-prefill")
    settled(stack, timeout=60)  # the registry in etcd: invariants hold, nothing left live

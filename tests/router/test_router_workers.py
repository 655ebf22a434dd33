"""``kvpush router --workers 2``, real processes: one port served by two workers, their
metrics added up on any of them, a killed worker started again, and SIGTERM stopping all."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import aiohttp
import psutil

from kvpush.app import engines
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model


async def requests_total(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(v) for v in re.findall(r'kvpush_router_requests_total\{[^}]*outcome="ok"[^}]*\} (\S+)', text))


def worker_procs(pid: int) -> list[psutil.Process]:
    """The supervisor's workers (not multiprocessing's resource tracker), alive."""
    return [c for c in psutil.Process(pid).children()
            if "resource_tracker" not in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE]


async def wait_for(path: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.1)


async def test_two_workers_on_one_port(stack, tmp_path):
    s = stack
    model = ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR))
    ready = tmp_path / "router.ready"
    proc = subprocess.Popen([sys.executable, "-m", "kvpush.app.cli", "router", "--controlplane", s["cp"].address,
                             "--token", s["token"], "--model", "tiny", "--model-dir", model, "--prefill",
                             s["prefill_url"], "--decode", f"decode-0={s['decode_url']}", "--max-model-len", "1000",
                             "--port", "0", "--workers", "2", "--ready-file", str(ready)],
                            stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
    try:
        await wait_for(str(ready))
        url = f"http://127.0.0.1:{ready.read_text().strip()}"
        workers = worker_procs(proc.pid)
        assert len(workers) == 2
        n = 24
        for i in range(n):  # a connection each: the kernel spreads them over the workers
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/completions",
                                        json={"model": "tiny", "prompt": f"one two {i}", "max_tokens": 4}) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
        counts = [await requests_total(url) for _ in range(6)]
        assert counts == [n] * 6   # whichever worker answers /metrics, it counts both
        # A worker killed is started again; the port keeps serving meanwhile.
        workers[0].kill()
        workers[0].wait(10)
        deadline = time.monotonic() + 60
        while len(worker_procs(proc.pid)) < 2:
            assert time.monotonic() < deadline, "the killed worker was not started again"
            await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions",
                                    json={"model": "tiny", "prompt": "after", "max_tokens": 4}) as r:
                assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers[1:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""The pull baseline of ``bench/push.py``: a decode-side READ after prefill, with a handshake.

Not used by kvpush. It reproduces, over the very same sidecar agents, what a
pull connector does once prefill has finished: learn the prefill side's agent
(metadata load and connection set-up, the "handshake"), then READ the
request's KV from the prefill's registered memory into the landing blocks and
wait until it is DONE. Reached through the channel's ADMIN op ``bench_pull`` of the
benchmark's own decode sidecar (``bench/pull_sidecar.py``).
"""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np

from kvpush.sidecar.transport.nixl import NixlConfig, NixlTransport
from kvpush.sidecar.progress import ProgressDriver


class ReadingNixlTransport(NixlTransport):
    """The sidecar's NIXL transport plus the READ that only this baseline does."""

    def post_read(self, local: np.ndarray, remote: np.ndarray, remote_agent: str):
        return self._post("READ", local, remote, remote_agent, "DRAM", "DRAM", b"")


def reading_transport(config) -> ReadingNixlTransport:
    return ReadingNixlTransport(NixlConfig(config.agent_name, config.backends))


async def pull(agent: ReadingNixlTransport, driver: ProgressDriver, request: dict, timeout_s: float = 10.0) -> dict:
    """``request``: ``metadata`` (base64 agent metadata of the prefill side), ``agent``
    (its name), ``local``/``remote``: lists of ``[address, length]`` pairs (same order)."""
    name = request["agent"]
    t0 = time.perf_counter()
    if request.get("handshake", True):
        agent.remove_remote(name)  # as a fresh pair would: nothing cached
        agent.add_remote(base64.b64decode(request["metadata"]))
        agent.connect(name)
    t1 = time.perf_counter()
    loc = np.array([(a, n, 0) for a, n in request["local"]], dtype=np.uint64)
    rem = np.array([(a, n, 0) for a, n in request["remote"]], dtype=np.uint64)
    done: asyncio.Future = asyncio.get_running_loop().create_future()
    handle, finished = agent.post_read(loc, rem, name)
    if finished:
        agent.release(handle)
        done.set_result((True, ""))
    else:
        driver.track(handle, timeout_s, lambda ok, err: done.done() or done.set_result((ok, err)), "bench-pull")
    ok, error = await done
    t2 = time.perf_counter()
    if not ok:
        raise RuntimeError(f"READ failed: {error}")
    return {"handshake_s": t1 - t0, "read_s": t2 - t1, "bytes": int(loc[:, 1].sum())}

"""Running a service's event loop: uvloop when installed (about 15% more Reserves
per core in bench/reserve.py), the standard loop otherwise."""

from __future__ import annotations

import asyncio
import gc
import os
import signal


def run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def freeze_heap() -> None:
    """Call once a service is set up: everything alive now (modules, descriptors,
    loaded state) lives for good, so keep it out of every later collection. Without
    it a full collection walks all of it and pauses the event loop for 10-20 ms
    (measured in bench/reserve.py's load generator), right on a request's path."""
    gc.collect()
    gc.freeze()


def write_ready_file(path: str | None, content: str) -> None:
    """Atomically tell a supervisor we are serving (it polls for the file)."""
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        f.write(content)
    os.replace(path + ".tmp", path)


async def until_signalled() -> None:
    """Return on SIGTERM or SIGINT: the services' shutdown trigger."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()

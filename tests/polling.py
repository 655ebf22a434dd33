"""Bounded polling for tests: wait until a condition holds, and fail naming it if it never does."""

from __future__ import annotations

import asyncio
import time


async def until(predicate, timeout_s: float = 20.0, what: str = "condition", interval_s: float = 0.05):
    """``predicate()``'s first truthy value, polled every ``interval_s`` without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(interval_s)
    return value


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition", interval_s: float = 0.05):
    """The same, for tests outside an event loop."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(interval_s)
    return value

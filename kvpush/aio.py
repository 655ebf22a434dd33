"""Running a service's event loop: uvloop when installed (about 15% more Reserves
per core in bench/reserve.py), the standard loop otherwise."""

from __future__ import annotations

import asyncio


def run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)

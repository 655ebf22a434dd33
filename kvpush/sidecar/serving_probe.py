"""Whether the engine's OpenAI server answers, from its ``/health``.

The channel connections (``engine_presence.py``) say whether the engine's scheduler and
workers live; they say nothing of vLLM's API server, a process of its own. One that dies
alone leaves the engine's connections open, the engine reported available, and every
request a router sends it refused. With ``--probe-serving`` the sidecar asks the serving
URL's ``/health`` that often: after ``failures`` probes in a row that fail (no answer
within ``timeout_s``, or not 200) the engine is unavailable, and the first one that
succeeds makes it available again (when its connections allow).

Called on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

log = logging.getLogger("kvpush.sidecar")


class ServingProbe:
    def __init__(self, url: str, interval_s: float, timeout_s: float = 2.0, failures: int = 3,
                 on_change: Callable[[str], None] | None = None):
        self.url = url.rstrip("/") + "/health"
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self.on_change = on_change
        self.unavailable = ""  # "" = it answers, or has not failed enough yet
        self.probes = 0
        self._failed = 0

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.sleep(self.interval_s)
                self._record(await self._probe(session))

    async def _probe(self, session: aiohttp.ClientSession) -> str:
        """"" when it answered 200, else what went wrong."""
        self.probes += 1
        try:
            async with session.get(self.url) as resp:
                return "" if resp.status == 200 else f"answered {resp.status}"
        except asyncio.TimeoutError:
            return f"no answer within {self.timeout_s:g} s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    def _record(self, error: str) -> None:
        self._failed = self._failed + 1 if error else 0
        if error and self._failed >= self.failures:
            why = f"engine's OpenAI server {self.url} not answering ({self._failed} probes: {error})"
            self._set(" ".join(why.encode("ascii", "replace").decode().split())[:500])  # the API's reason: ASCII
        elif not error:
            self._set("")

    def _set(self, unavailable: str) -> None:
        # The reason names the latest error; only a change between serving and not is news.
        changed = bool(unavailable) != bool(self.unavailable)
        self.unavailable = unavailable
        if changed:
            log.warning("engine's OpenAI server %s", "not answering: " + unavailable if unavailable else "answers again")
            if self.on_change is not None:
                self.on_change(unavailable)

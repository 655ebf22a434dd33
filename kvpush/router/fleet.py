"""The engines a router serves, over one registry or several (``kvpush.client.registries``).

Each registry's engines are followed by their own ``EngineDirectory``; the dispatcher sees
them merged (the same questions a directory answers) and asks ``choose`` which registry a
new request goes to: the one holding the decode engine its conversation's previous turn
went to (its prefix is cached there), else the one where this router has the fewest
requests per decode engine, passing over a registry that did not answer or had no room lately. The
prefill engine is then one of that registry's: a reservation names engines of its own
registry only.

Engine ids must be unique across the registries: an id registered in two of them is
served in neither (said in the log and in ``kvpush_router_engine_id_conflicts``), since a
reservation's engine would be ambiguous.
"""

from __future__ import annotations

import asyncio
from typing import Mapping

from kvpush import log
from kvpush.client.registries import Registries, Registry
from kvpush.router import metrics
from kvpush.router.config import RouterConfig
from kvpush.router.engines import EngineDirectory

_log = log.get("router")


class Fleet:
    def __init__(self, cfg: RouterConfig, registries: Registries, outstanding: Mapping[str, int] | None = None) -> None:
        self.registries = registries
        self.directories = {reg: EngineDirectory(cfg, reg.cp) for reg in registries.all}
        self.discovering = next(iter(self.directories.values())).discovering
        self.outstanding = outstanding if outstanding is not None else {}  # decode URL -> this router's requests
        self.ready = asyncio.Event()
        self._seen: tuple = ()   # the directories' engine sets last merged (held, compared by identity)
        self._decode: dict[str, tuple[str, Registry]] = {}   # engine id -> (url, registry)
        self._prefill: dict[str, tuple[str, Registry]] = {}  # url -> (engine id, registry)
        self._conflicts: set[str] = set()
        self._ready_task: asyncio.Task | None = None
        self._turn = 0
        self._merge()
        if all(d.ready.is_set() for d in self.directories.values()):
            self.ready.set()

    # -- life -----------------------------------------------------------------------------------
    def start(self) -> None:
        for d in self.directories.values():
            d.start()
        if not self.ready.is_set() and self._ready_task is None:
            self._ready_task = asyncio.create_task(self._any_ready(), name="fleet-ready")

    async def _any_ready(self) -> None:
        """Ready once any registry has answered: one that is down must not hold the others up."""
        waits = [asyncio.ensure_future(d.ready.wait()) for d in self.directories.values()]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            self.ready.set()
        finally:
            for w in waits:
                w.cancel()

    async def close(self) -> None:
        if self._ready_task is not None:
            self._ready_task.cancel()
            await asyncio.gather(self._ready_task, return_exceptions=True)
        for d in self.directories.values():
            await d.close()

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- what the dispatcher asks (EngineDirectory's questions, merged) --------------------------
    def prefill_urls(self, reg: Registry | None = None) -> list[str]:
        self._merge()
        return [url for url, (_, r) in self._prefill.items() if reg is None or r is reg]

    def prefill_id(self, url: str) -> str:
        self._merge()
        found = self._prefill.get(url)
        return found[0] if found else ""

    def decode_urls(self) -> list[str]:
        self._merge()
        return [url for url, _ in self._decode.values()]

    def decode_url(self, engine_id: str) -> str | None:
        self._merge()
        found = self._decode.get(engine_id)
        return found[0] if found else None

    def registry_of_engine(self, engine_id: str) -> Registry | None:
        self._merge()
        found = self._decode.get(engine_id)
        return found[1] if found else None

    def describe(self) -> dict:
        self._merge()
        out = {"source": "registry" if self.discovering else "flags",
               "prefill": {u: e for u, (e, _) in self._prefill.items()},
               "decode": {e: u for e, (u, _) in self._decode.items()}}
        if len(self.directories) > 1:
            out["registries"] = {reg.name: {"ready": d.ready.is_set(), "aside": reg.aside(),
                                            "prefill": len(d.engines.prefill), "decode": len(d.engines.decode)}
                                 for reg, d in self.directories.items()}
            out["engine_id_conflicts"] = sorted(self._conflicts)
        return out

    def choose(self, engine_id: str = "") -> Registry:
        """The registry a new request is reserved in: ``engine_id``'s (the decode engine its
        conversation's previous turn went to) when it answers, else the least loaded of
        those with a prefill and a decode engine. One with a prefill engine whenever any has."""
        regs = self.registries.all
        if len(regs) == 1:
            return regs[0]
        self._merge()
        home = self.registry_of_engine(engine_id) if engine_id else None
        if home is not None and not home.aside() and self.prefill_urls(home):
            return home
        self._turn += 1
        n = len(regs)

        def rank(item: tuple[int, Registry]) -> tuple:
            i, reg = item
            load = self.load(reg)
            prefill = bool(self.prefill_urls(reg))
            return not prefill, not (load != float("inf") and not reg.aside()), load, (i - self._turn) % n
        return min(enumerate(regs), key=rank)[1]

    def load(self, reg: Registry) -> float:
        """This router's requests per decode engine of ``reg`` (inf: none)."""
        self._merge()
        decodes = [url for url, r in self._decode.values() if r is reg]
        if not decodes:
            return float("inf")
        return sum(self.outstanding.get(u, 0) for u in decodes) / len(decodes)

    # -- merging --------------------------------------------------------------------------------
    def _merge(self) -> None:
        """Rebuild the merged maps when a directory published a new set (each is a new object).

        The sets themselves are held and compared by identity: an ``id()`` can be reused once
        the old set is freed, which would leave a stale merge in place."""
        seen = tuple(d.engines for d in self.directories.values())
        if len(seen) == len(self._seen) and all(a is b for a, b in zip(seen, self._seen)):
            return
        self._seen = seen
        decode: dict[str, tuple[str, Registry]] = {}
        prefill: dict[str, tuple[str, Registry]] = {}
        clash: set[str] = set()
        prefill_ids: dict[str, Registry] = {}
        # A clash is an id in two registries; one registry repeating an id (flags naming an
        # engine twice) is that registry's own business, as it was with a single registry.
        for reg, d in self.directories.items():
            for e in d.engines.decode:
                if e.engine_id in decode and decode[e.engine_id][1] is not reg:
                    clash.add(e.engine_id)
                decode.setdefault(e.engine_id, (e.url, reg))
            for url, eid in d.engines.prefill:
                if eid and prefill_ids.setdefault(eid, reg) is not reg:
                    clash.add(eid)
                prefill.setdefault(url, (eid, reg))
        for eid in clash - self._conflicts:
            _log.error("an engine id is registered in more than one of this router's registries; it is not served "
                       "until only one holds it (engine ids must be unique across registries)", engine_id=eid,
                       registries=[r.name for r, d in self.directories.items()
                                   if any(e.engine_id == eid for e in d.engines.decode)
                                   or any(i == eid for _, i in d.engines.prefill)])
        self._conflicts = clash
        metrics.ENGINE_ID_CONFLICTS.set(len(clash))
        self._decode = {eid: v for eid, v in decode.items() if eid not in clash}
        self._prefill = {url: v for url, v in prefill.items() if v[0] not in clash}

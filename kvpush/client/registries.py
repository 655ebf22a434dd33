"""Several registries behind one client: a fleet split over control planes, each with its
own etcd.

One etcd cluster carries about 10,000 of kvpush's requests/s (docs/SCALING.md, "Where the
limits are now"), so a fleet past that is split into registries, typically by engine pool:
each registry is its own etcd and control-plane replicas, and each engine's sidecar
registers in one of them. A client that serves a model over several (the router with
``--controlplane`` given more than once, or a program using this SDK) asks one registry per
request, chosen by the caller (where the conversation's previous turn went, where it has
the least load), and moves on to the next when that one has no room, does not answer, or
refuses for a reason of its own (``MOVE_ON``).

A reservation lives in the registry that granted it: its release and its relocation go
there (``of``). Registries share nothing, so engine ids must be unique across them.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import grpc

from kvpush import log
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.reserve_stream import ReserveRefused, StreamReserver
from kvpush.contract.v1 import scheduler_pb2, types_pb2

# A registry that did not answer (UNAVAILABLE, DEADLINE_EXCEEDED) is asked last for this
# long: requests go to the others meanwhile instead of each waiting out its timeout there.
DOWN_S = 2.0
# ... and one that had no room (or quota) for this long: the next requests try the others
# first, and it is asked again soon, as its engines free blocks all the time.
FULL_S = 0.5
# ... and one that does not know this client (a token or tenant missing there, a pool not
# allowed: registries keep their own tenants) for this long: a setup error, said in the log
# each time, while the others serve.
REFUSED_S = 10.0
# Refusals another registry may answer otherwise: no room (or quota) there; no answer; its
# own state (FAILED_PRECONDITION: its prefill engine unavailable, its engines' layouts unable
# to take the prefill's); this client unknown there. Each with how long the registry is then
# asked last.
ASIDE_S = {grpc.StatusCode.RESOURCE_EXHAUSTED: FULL_S, grpc.StatusCode.FAILED_PRECONDITION: FULL_S,
           grpc.StatusCode.UNAVAILABLE: DOWN_S, grpc.StatusCode.DEADLINE_EXCEEDED: DOWN_S,
           grpc.StatusCode.UNAUTHENTICATED: REFUSED_S, grpc.StatusCode.PERMISSION_DENIED: REFUSED_S}
# INVALID_ARGUMENT moves on too, the registry not set aside: it names what that registry
# lacks as often as a malformed ask (each registry is asked about its own prefill engine; a
# preferred engine, a model may be registered in one only), and a malformed ask costs one
# refusal per registry before the last is raised. Never ALREADY_EXISTS: that registry holds
# the request id's live reservation, and another must not make a second.
MOVE_ON = frozenset(ASIDE_S) | {grpc.StatusCode.INVALID_ARGUMENT}
_NOT_KNOWN = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
_log = log.get("registries")


class NotAsked(ReserveRefused):
    """No registry was asked: each one the caller could ask went silent lately (it is
    resting, ``Registry.resting``), so the request is served without push at once."""


@dataclasses.dataclass(eq=False)
class Registry:
    """One registry as a client sees it: its control plane and one Reserve stream to it."""
    name: str                   # its control-plane address, for logs
    cp: ControlPlaneClient
    reserver: StreamReserver
    aside_until: float = 0.0    # (monotonic) did not answer, or had no room: asked last until then
    silent: bool = False        # its last ask timed out with nothing heard from it meanwhile
    probing: bool = False       # ... and one ask is out to it now, to see whether it is back

    def aside(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.aside_until

    def resting(self, now: float | None = None) -> bool:
        """Not to be asked: it went silent (an ask timed out and nothing at all came from
        it meanwhile: hung, not merely slow for one ask). Each request would otherwise wait
        out its Reserve timeout there (all of it, with one registry) before serving without
        push, for as long as a control plane or its etcd hangs; instead the requests meanwhile
        are served without push at once, and once its spell aside is over one ask at a time
        (a probe) sees whether it answers again. (A broken stream or a refused connection,
        UNAVAILABLE, answers at once and the next ask opens a new stream: no rest.)"""
        return self.silent and (self.probing or self.aside(now))


class Registries:
    def __init__(self, registries: Sequence[Registry]) -> None:
        if not registries:
            raise ValueError("at least one registry (a control-plane address) is needed")
        self.all = tuple(registries)
        # Which registry granted each reservation, kept past its deadline (nothing is asked
        # of it after); one registry needs no record.
        self._granted: dict[str, Registry] = {}
        self._expiry: collections.deque[tuple[float, str]] = collections.deque()

    @classmethod
    def connect(cls, targets: Sequence[tuple[str, str]], tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                server_name: str = "") -> "Registries":
        """``targets``: (control-plane address, tenant token) of each registry, in order."""
        out = []
        for address, token in targets:
            cp = ControlPlaneClient(address, token, tls_ca, tls_cert, tls_key, server_name)
            out.append(Registry(address, cp, StreamReserver(cp)))
        return cls(out)

    async def close(self) -> None:
        for reg in self.all:
            await reg.reserver.close()
            await reg.cp.close()

    def order(self, first: Registry | None = None, load: Callable[[Registry], float] | None = None
              ) -> list[Registry]:
        """Every registry, in the order to ask them: ``first``, then the others by ``load``
        (lowest first; ties in their given order); those that did not answer or had no room
        lately last."""
        now = time.monotonic()
        rest = [r for r in self.all if r is not first]
        if load is not None:
            rest.sort(key=load)
        ordered = ([first] if first is not None else []) + rest
        return [r for r in ordered if not r.aside(now)] + [r for r in ordered if r.aside(now)]

    async def reserve(self, ask: Callable[[Registry], scheduler_pb2.ReserveRequest | None], timeout: float,
                      order: Sequence[Registry], keep_s: float,
                      observe: Callable[[Registry, str], None] | None = None) -> tuple[Registry, types_pb2.Reservation]:
        """The first grant of ``order``'s registries, asked in turn within ``timeout`` in all
        (each but the last given at most half of what is left);
        ``ask(registry)`` is the request for that registry (None: skip it). Raises the last
        refusal (``ReserveRefused``) when none granted. ``keep_s``: how long the grant's
        registry is remembered (``of``): the reservation's deadline and a margin. ``observe(registry,
        outcome)``: each answer ("granted", or the refusal's code in lower case), for metrics.

        A registry that did not answer may still have reserved (the stream broke after the
        ask left): that reservation ends at its deadline, as a lost answer's does with one
        registry; one answered after its caller moved on is released (``StreamReserver``)."""
        deadline = time.monotonic() + timeout
        refused: ReserveRefused | None = None
        resting = []
        for i, reg in enumerate(order):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if reg.resting():
                resting.append(reg.name)
                continue
            request = ask(reg)
            if request is None:
                continue
            # Each but the last is given half of what is left: one that does not answer
            # leaves time for the next.
            given = left if i == len(order) - 1 else left / 2
            probe = reg.probing = reg.silent
            asked_at = time.monotonic()
            try:
                res = await reg.reserver.reserve(request, timeout=given)
            except ReserveRefused as exc:
                refused = exc
                if observe is not None:
                    observe(reg, exc.code.name.lower())
                # (No answer within a short slice, the end of a timeout others used up,
                # says little about a registry: it is set aside only after a fair share.)
                short = exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and given < timeout / 4
                if not short:
                    reg.silent = exc.code == grpc.StatusCode.DEADLINE_EXCEEDED and \
                        reg.reserver.last_heard <= asked_at
                if exc.code not in MOVE_ON:
                    raise
                if exc.code in ASIDE_S and not short:
                    reg.aside_until = time.monotonic() + ASIDE_S[exc.code]
                if exc.code in _NOT_KNOWN and len(self.all) > 1:
                    _log.error("a registry refuses this client: its requests go to the others meanwhile "
                               "(is the tenant and its token created there?)", registry=reg.name,
                               code=exc.code.name, details=exc.details, asked_last_for_s=ASIDE_S[exc.code])
                continue
            finally:
                if probe:
                    reg.probing = False
            reg.aside_until, reg.silent = 0.0, False
            if observe is not None:
                observe(reg, "granted")
            self.granted(res.id, reg, keep_s)
            return reg, res
        if refused is None and resting:
            raise NotAsked(grpc.StatusCode.UNAVAILABLE,
                           f"not asked: {', '.join(resting)} went silent lately (asked again in turn)")
        raise refused or ReserveRefused(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        "no registry was asked: none could take the request in time")

    def granted(self, reservation_id: str, reg: Registry, keep_s: float) -> None:
        """Remember that ``reg`` holds ``reservation_id`` (a grant, or a relocation's new one)."""
        if len(self.all) == 1:
            return
        now = time.monotonic()
        while self._expiry and self._expiry[0][0] < now:
            _, old = self._expiry.popleft()
            self._granted.pop(old, None)
        self._granted[reservation_id] = reg
        self._expiry.append((now + keep_s, reservation_id))

    def of(self, reservation_id: str) -> Registry | None:
        """The registry holding ``reservation_id`` (None: not granted through this client, or
        long past its deadline)."""
        if len(self.all) == 1:
            return self.all[0]
        return self._granted.get(reservation_id)

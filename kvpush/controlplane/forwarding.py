"""A Reserve sent on to the replica that owns the engine it should go to (elsewhere.py
decides when), so that the owner commits it on its exact view.

The forwarded call carries the caller's own bearer token (the owner authenticates the
tenant as any replica does: tenants are shared by the whole registry) and a header that
stops it being forwarded again. Every outcome but a grant and ALREADY_EXISTS (the request
id's live reservation has other parameters, which any replica would answer) sends the
ask back to this replica, which then commits it itself (elsewhere.py widens): an owner
that is gone, slow, or whose room another Reserve just took costs one bounded detour,
never the request.

Forwards to one owner for one tenant share one ReserveStream (kvpush/client/reserve_stream.py),
as a router's Reserves do: a unary call per forward cost both replicas about three times a
streamed ask. A forward that times out is committed here; if the owner commits it too,
whichever transaction is second finds the first by the request id (the request index's
compare) and answers it, so the caller gets one reservation. That is why a late answer is
left alone here, not released as a router's stream releases what nobody waits for: the
caller may hold that very reservation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from kvpush import log
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.client.reserve_stream import ReserveRefused, StreamReserver
from kvpush.controlplane import errors, metrics
from kvpush.controlplane.elsewhere import Forward
from kvpush.controlplane.reserve_plan import ReserveAsk
from kvpush.controlplane.reserver import Reserver
from kvpush.controlplane.view import View
from kvpush.contract.v1 import scheduler_pb2, types_pb2

_log = log.get("forwarding")

FORWARDED_BY = "kvpush-forwarded-by"  # metadata: the replica that forwarded this call
TIMEOUT_S = 2.0                        # then the ask is committed here instead
# An owner that did not answer (gone, partitioned, overloaded) is not asked again for this
# long: until its lease runs out and its engines move, every Reserve would wait on it.
ASIDE_S = 2.0


class Forwarded:
    """An owner's answer to a forwarded Reserve, as the service answers it."""

    def __init__(self, msg: types_pb2.Reservation) -> None:
        self.msg = msg
        self.id = msg.id
        self.engine_id = msg.engine_id

    def to_proto(self) -> types_pb2.Reservation:
        return self.msg


class _ForwardStream(StreamReserver):
    """A stream of forwards to one owner for one tenant: an answer nobody waits for (its
    forward timed out) is not released (above)."""

    def _unclaimed(self, answer) -> None:
        pass

    def _dropped(self, reservation) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class PeerTls:
    """How a replica dials its peers over TLS (ControlPlaneClient's arguments)."""
    tls_ca: str
    tls_cert: str
    tls_key: str
    server_name: str = ""  # every replica's certificate names the service, not its own address


class Forwarder:
    def __init__(self, view: View, replica_id: str, reserver: Reserver, tls: PeerTls | None = None,
                 enabled: bool = True) -> None:
        self._view = view
        self.replica_id = replica_id
        self.enabled = enabled
        self._reserver = reserver
        self._tls = tls
        self._clients: dict[tuple[str, str], ControlPlaneClient] = {}         # (address, token) ->
        self._reserve_streams: dict[tuple[str, str], _ForwardStream] = {}     # (address, token) ->
        self._tasks: set[asyncio.Task] = set()
        self._aside: dict[str, float] = {}  # replica -> monotonic time it may be asked again

    def mark(self, ask: ReserveAsk, forwarded: bool) -> None:
        """Whether ``ask`` may go to another replica (``forwarded``: another sent it here)."""
        ask.forwarded = forwarded
        ask.may_forward = self.enabled and not forwarded

    @staticmethod
    def arrived_forwarded(context) -> bool:
        """Whether the call on ``context`` was forwarded here by another replica."""
        return any(key == FORWARDED_BY for key, _ in context.invocation_metadata() or ())

    def reserve(self, ask: ReserveAsk, request: scheduler_pb2.ReserveRequest, token: str) -> asyncio.Future:
        """Submit ``ask`` (``request`` as it arrived, with the caller's ``token``); the future
        gets what the caller is answered, wherever it was committed."""
        inner = self._reserver.submit(ask)
        if not ask.may_forward:
            return inner
        outer = asyncio.get_running_loop().create_future()
        self._into(inner, outer, ask, request, token)
        return outer

    def _into(self, fut: asyncio.Future, outer: asyncio.Future, ask: ReserveAsk, request, token: str) -> None:
        """``fut``'s outcome (an ask's) goes to ``outer`` once done, a Forward by way of the
        owner; ``outer`` cancelled (the caller went) cancels what is still pending."""
        def settled(f: asyncio.Future) -> None:
            if outer.done():
                return
            if f.cancelled():
                outer.cancel()
            elif isinstance(f.exception(), Forward):
                task = self._spawn(self._forward(f.exception(), ask, request, token, outer))
                outer.add_done_callback(lambda o: task.cancel() if o.cancelled() else None)
            elif f.exception() is not None:
                outer.set_exception(f.exception())
            else:
                outer.set_result(f.result())
        fut.add_done_callback(settled)
        outer.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)

    async def _forward(self, fwd: Forward, ask: ReserveAsk, request, token: str, outer: asyncio.Future) -> None:
        try:
            answer = await self._ask_owner(fwd, request, token)
        except errors.ApiError as exc:
            answer = exc
        except asyncio.CancelledError:
            if not outer.done():
                outer.set_exception(errors.unavailable("control plane is shutting down"))
            raise
        except Exception:  # a bug here must not cost the request: it is committed here
            _log.exception("forwarding failed")
            answer = None
        if outer.done():
            return
        if isinstance(answer, errors.ApiError):
            outer.set_exception(answer)
        elif answer is not None:
            outer.set_result(answer)
        else:
            ask.may_forward = False  # committed here now (elsewhere.py widens)
            self._into(self._reserver.submit(ask), outer, ask, request, token)

    async def _ask_owner(self, fwd: Forward, request, token: str) -> Forwarded | None:
        """The owner's grant; None when it could not give one (the ask is then committed
        here); ALREADY_EXISTS raised as the owner said it."""
        if self._aside.get(fwd.replica, 0.0) > time.monotonic():
            metrics.forwarded("SET_ASIDE")
            return None
        # As it came: the owner chooses among its own engines on its exact view (the summary
        # that sent it there is up to EVERY_S old), keeping the caller's own preference.
        try:
            msg = await self._stream(fwd.address, token).reserve(request, timeout=TIMEOUT_S)
        except ReserveRefused as exc:
            code = exc.code
            metrics.forwarded(code.name)
            if code == grpc.StatusCode.ALREADY_EXISTS:
                raise errors.ApiError(code, exc.details or "request_id already reserved") from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._aside[fwd.replica] = time.monotonic() + ASIDE_S
                _log.warning("replica did not answer a forwarded reserve; committing here for a while",
                             owner=fwd.replica, address=fwd.address, code=code.name)
            _log.debug("forwarded reserve not granted; committing it here", owner=fwd.replica,
                       code=code.name, reason=exc.details)
            return None
        metrics.forwarded("OK")
        self._view.free_told.count_spent(msg.engine_id, len(msg.block_ids))
        return Forwarded(msg)

    def _stream(self, address: str, token: str) -> _ForwardStream:
        stream = self._reserve_streams.get((address, token))
        if stream is None:
            stream = self._reserve_streams[(address, token)] = _ForwardStream(self.client(address, token))
        return stream

    def client(self, address: str, token: str) -> ControlPlaneClient:
        """A client of the replica at ``address`` with a caller's ``token``, kept while both live."""
        client = self._clients.get((address, token))
        if client is None:
            self._forget()
            tls = dataclasses.asdict(self._tls) if self._tls is not None else {}
            client = self._clients[(address, token)] = ControlPlaneClient(address, token, **tls)
            client.metadata += ((FORWARDED_BY, self.replica_id),)
        return client

    def _forget(self) -> None:
        """Close the clients of replicas no longer live (restarted on another port, gone) and
        those of tokens no longer valid (rotated, the tenant deleted)."""
        live = {r.address for r in self._view.replicas.values()}
        for key in [k for k in self._clients if k[0] not in live or self._view.tenant_for_token(k[1]) is None]:
            self._spawn(self._close(self._clients.pop(key), self._reserve_streams.pop(key, None)))

    @staticmethod
    async def _close(client: ControlPlaneClient, stream: _ForwardStream | None) -> None:
        if stream is not None:
            await stream.close()
        await client.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for key, client in self._clients.items():
            await self._close(client, self._reserve_streams.get(key))
        self._clients.clear()
        self._reserve_streams.clear()

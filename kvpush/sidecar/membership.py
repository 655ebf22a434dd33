"""The sidecar's membership in the system: its gRPC link to the control plane,
registration and heartbeat (``Membership``), and the shared retry vocabulary.

``Membership`` registers the engine (``Registry.RegisterEngine``: NIXL metadata
and pool address published once), keeps a ``Heartbeat`` stream beating every
TTL/3 and registers again, with the same incarnation so its reservations
survive, whenever the stream breaks (control-plane restart, network, a replica
that stopped answering). Retries back off exponentially with jitter and always
sleep: never a busy loop. ``ControlPlaneLink`` owns the gRPC channel; after a
failure it makes a new one, so a restarted control plane is reached at once
instead of after gRPC's own reconnect backoff (which grows to minutes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import Callable

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import registry_pb2, types_pb2

log = logging.getLogger("kvpush.sidecar")


RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ABORTED}
FATAL_AT_START = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}


class FatalError(Exception):
    """The control plane refused this sidecar for good (bad token, bad record)."""


class ChannelReplaced(Exception):
    """A call ended because its channel was closed under it (a reconnect elsewhere)."""


async def guarded(call):
    """Await a gRPC call or stream read. grpc.aio raises ``CancelledError`` from every
    call on a channel that is closed, which a long-lived loop must not mistake for
    its own cancellation: that would end the loop silently (a watch that never
    subscribes again). Only a cancel of this task itself propagates as one."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        raise ChannelReplaced("the call's channel was closed (reconnected)") from None


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    controlplane: str
    token: str
    model: str
    pool: str = "default"
    lease_ttl_s: int = 10
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    rpc_timeout_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    report_workers: int = 32  # reservations reported at once (one stream carries them all)
    report_queue_max: int = 100_000
    report_give_up_s: float = 30.0  # a report still failing after this is dropped
    # LANDED and CONSUMED wait this long before they are sent, so a CONSUMED that
    # follows a LANDED within it replaces it (one write, and none on the critical path).
    report_hold_s: float = 0.05
    # A push that ends sooner never reports PUSHING. PUSHING is what lets the control
    # plane fail a reservation when its prefill engine dies mid-push; a router sees
    # that death itself (the prefill request fails) and releases the reservation.
    pushing_report_after_s: float = 0.25
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0: no metrics endpoint
    drain_s: float = 2.0  # on shutdown: running pushes may finish this long
    ready_file: str = ""  # written (engine record + lease, JSON) once registered and beating
    serving_url: str = ""  # the engine's OpenAI server, published for routers to find it
    probe_serving_s: float = 0.0  # ask serving_url's /health this often (0: never; serving_probe.py)


class Backoff:
    """Exponential backoff with jitter; ``next()`` is never below ``initial``."""

    def __init__(self, initial: float, maximum: float):
        self.initial, self.maximum = initial, maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._next = self.initial


def printable(text: str, limit: int = 1000) -> str:
    return "".join(c if c.isprintable() else " " for c in text)[:limit]


def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status of a failed call; anything that is not an RPC error (a call on a
    channel just closed by a reconnect raises ``UsageError``) counts as UNAVAILABLE."""
    return exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE


def error_details(exc: BaseException) -> str:
    return (exc.details() or "") if isinstance(exc, grpc.aio.AioRpcError) else f"{type(exc).__name__}: {exc}"


def rpc_error_text(exc: BaseException) -> str:
    return f"{status_code(exc).name}: {error_details(exc)}"


# -- the channel ----------------------------------------------------------------------------------
class ControlPlaneLink:
    """The current control-plane client; ``reconnect`` swaps in a fresh channel."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.client = self._new()
        self.epoch = 0
        self.reconnects = 0
        self._closing: set[asyncio.Task] = set()

    def _new(self) -> ControlPlaneClient:
        c = self.config
        return ControlPlaneClient(c.controlplane, c.token, c.tls_ca, c.tls_cert, c.tls_key, c.tls_server_name)

    def reconnect(self, epoch: int) -> None:
        """A new channel, unless someone already replaced the one of ``epoch``."""
        if epoch != self.epoch:
            return
        old, self.client = self.client, self._new()
        self.epoch += 1
        self.reconnects += 1
        task = asyncio.get_running_loop().create_task(old.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await self.client.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


# -- registration and heartbeat -----------------------------------------------------------------
class Membership:
    def __init__(self, link: ControlPlaneLink, config: ServiceConfig, engine: Callable[[], types_pb2.Engine],
                 on_ready: Callable[[registry_pb2.RegisterEngineResponse], None] | None = None):
        self.link = link
        self.config = config
        self.engine = engine
        self.on_ready = on_ready
        self.connected = asyncio.Event()  # registered and the heartbeat stream answers
        self.lease_id = 0
        self.ttl_s = 0
        self.registrations = 0
        self.beats = 0
        self.last_break = ""
        self._stopping = False
        self._end_stream: asyncio.Event | None = None
        self._wake = asyncio.Event()
        self._stale_call = None  # a heartbeat stream that stopped answering, ended only once replaced

    async def run(self) -> None:
        # Retry often enough to be back before a lease that outlived its replica runs out.
        backoff = Backoff(self.config.backoff_initial_s,
                          max(self.config.backoff_initial_s,
                              min(self.config.backoff_max_s, self.config.lease_ttl_s / 4)))
        while not self._stopping:
            client, epoch = self.link.client, self.link.epoch
            request = registry_pb2.RegisterEngineRequest(engine=self.engine(),
                                                          lease_ttl_seconds=self.config.lease_ttl_s)
            try:
                resp = await guarded(client.registry.RegisterEngine(request, metadata=client.metadata,
                                                                    timeout=self.config.rpc_timeout_s))
            except Exception as exc:
                self._drop_stale_call()
                if not self.registrations and status_code(exc) in FATAL_AT_START:
                    raise FatalError(f"control plane at {self.config.controlplane} refused the registration: "
                                     f"{rpc_error_text(exc)}") from None
                self.last_break = f"RegisterEngine: {rpc_error_text(exc)}"
                log.warning("registration failed (%s); retrying", self.last_break)
                self.link.reconnect(epoch)
                await self._pause(backoff.next())
                continue
            # Registered on a new lease (the control plane revoked the old one itself), so the
            # stream that stopped answering can go now without taking the engine with it.
            self._drop_stale_call()
            self.registrations += 1
            self.lease_id, self.ttl_s = resp.lease_id, resp.lease_ttl_seconds
            log.info("engine %s registered (lease %x, ttl %d s, registration %d)", resp.engine.engine_id,
                     resp.lease_id, resp.lease_ttl_seconds, self.registrations)
            reason, healthy = await self._beat(client, resp)
            self.connected.clear()
            if self._stopping:
                break
            self.last_break = reason
            if healthy:
                backoff.reset()
            log.warning("heartbeat stream broke (%s); registering again", reason)
            if self._stale_call is not None:
                continue  # make before break: register again at once, on the same channel
            self.link.reconnect(epoch)
            await self._pause(backoff.next())

    def _drop_stale_call(self) -> None:
        if self._stale_call is not None:
            self._stale_call.cancel()
            self._stale_call = None

    async def _beat(self, client: ControlPlaneClient, resp) -> tuple[str, bool]:
        """Beat until the stream breaks or we end it; (why it ended, whether it ever answered)."""
        interval = max(resp.lease_ttl_seconds / 3, 0.5)
        patience = interval + max(resp.lease_ttl_seconds / 3, 1.0)  # no answer this long: hung
        end = self._end_stream = asyncio.Event()
        ping = registry_pb2.HeartbeatPing(engine_id=resp.engine.engine_id, lease_id=resp.lease_id)

        async def pings():
            while True:
                yield ping
                try:
                    await asyncio.wait_for(end.wait(), interval)
                    return  # half-close: the control plane ends the engine's lease
                except asyncio.TimeoutError:
                    pass

        call = None
        answered = False
        try:
            call = client.registry.Heartbeat(pings(), metadata=client.metadata)
            while True:
                read = asyncio.ensure_future(guarded(call.read()))
                # Outlives us when the stream is left open (hung) or we are cancelled:
                # its outcome is retrieved here so it is never logged as lost.
                read.add_done_callback(lambda f: f.cancelled() or f.exception())
                try:
                    pong = await asyncio.wait_for(asyncio.shield(read), patience)
                except asyncio.TimeoutError:
                    # Hung, not closed: cancelling (the call, or even its read) would make a
                    # replica that is merely slow revoke our lease. Keep the stream open
                    # until we are registered again.
                    self._stale_call, call = call, None
                    return f"no heartbeat answer within {patience:.1f} s", answered
                if pong is grpc.aio.EOF:
                    return "stream closed by the control plane", answered
                self.beats += 1
                if not answered:
                    answered = True
                    self.connected.set()
                    if self.on_ready is not None:
                        self.on_ready(resp)
        except Exception as exc:
            return rpc_error_text(exc), answered
        finally:
            self._end_stream = None
            if call is not None:
                call.cancel()

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def stop(self) -> None:
        """End the heartbeat stream cleanly (half-close) and stop registering."""
        self._stopping = True
        self._wake.set()
        if self._end_stream is not None:
            self._end_stream.set()

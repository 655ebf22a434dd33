"""The sidecar's end of the local channel: a Unix-domain socket to its engine's connector.

``ChannelServer`` parses frames straight from an asyncio ``Protocol`` buffer and
calls the ``ChannelHandler`` (the sidecar: ``kvpush/sidecar/base.py`` and its role's
class) synchronously, on the loop, in arrival order; replies and events are
written without awaiting (the engine reads them on its own thread). The engine's
end is ``kvpush/connector/sidecar_client.py`` (``SidecarClient``); the frames are ``kvpush/channel/frames.py``.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import logging
import os
from typing import Awaitable

from kvpush.channel import frames as F
from kvpush.channel.pool import StagingAllocation

log = logging.getLogger(__name__)

MAX_UNSENT = 8 << 20  # a client that stops reading events is dropped past this


class Connection:
    """One connected engine process, as the handler sees it."""

    _ids = itertools.count(1)

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.owner = f"conn-{next(self._ids)}"
        self.info: dict = {}
        self.rank = 0  # the engine's tensor-parallel rank this connection speaks for (HELLO)
        self.whole_engine = True  # HELLO named no rank: the engine's scheduler, which maps no pool
        self.closed = False

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        if self.transport.get_write_buffer_size() > MAX_UNSENT:
            log.warning("%s is not reading its events; closing it", self.owner)
            self.transport.close()
            return
        self.transport.write(data)

    def send_event(self, event: F.StateEvent) -> None:
        self.send(F.frame(F.EVENT, 0, F.encode_state(event)))


class ChannelHandler(abc.ABC):
    """What a sidecar answers on its channel. Every method runs on the sidecar's loop,
    called by ``ChannelServer`` as the frame arrives, and must not block: what the engine
    waits for comes back as the reply, what it must hear later as an EVENT frame on
    ``conn``. An exception becomes an error reply (or a log line, for frames without one).

    Callers (all in the engine process, ``kvpush/connector/``): the *worker side* runs in
    vLLM's worker process around each forward pass; the *scheduler side* in its
    scheduler (EngineCore) process, once per engine step.
    """

    @abc.abstractmethod
    def on_hello(self, conn: Connection, info: dict) -> dict:
        """HELLO, first on every connection (both sides, at start and after a reconnect):
        this sidecar's role, engine id, incarnation and pool description."""

    @abc.abstractmethod
    def on_begin(self, conn: Connection, req: F.BeginRequest) -> tuple[StagingAllocation, ...]:
        """BEGIN, prefill worker side (each rank), before the forward pass of a request's
        first pushed step: check the target, allocate staging; the reply says where the
        connection's rank stages which of its heads (one allocation per head share)."""

    @abc.abstractmethod
    def on_push(self, conn: Connection, piece: F.PushPiece) -> None:
        """PUSH (no reply), prefill worker side, inside the forward pass right after a
        layer's piece was staged: write it out."""

    @abc.abstractmethod
    def on_end(self, conn: Connection, end: F.EndRequest) -> None:
        """END (no reply), prefill worker side, after the forward pass that staged a
        request's last piece, or when it stops early (aborted)."""

    @abc.abstractmethod
    def on_await(self, conn: Connection, request_id: str) -> dict | None:
        """AWAIT, prefill scheduler side, when a request arrives before its reservation:
        its push params if the handover has them, else None and a RESERVATION event later."""

    @abc.abstractmethod
    def on_query(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        """QUERY, decode, from tests and tools (the connector subscribes instead): a
        reservation's landing state now (and poll hot for it)."""

    @abc.abstractmethod
    def on_subscribe(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        """SUBSCRIBE, decode scheduler side, when a request of the reservation arrives:
        its state now, and one EVENT when it ends (LANDED, FAILED, CANCELLED)."""

    @abc.abstractmethod
    def on_consumed(self, conn: Connection, reservation_id: str) -> F.StateEvent:
        """CONSUMED, decode worker side after its load copied the reservation out (or the
        scheduler side for one it gave up on): the landing blocks are free again."""

    @abc.abstractmethod
    def on_recomputed(self, conn: Connection, reservation_id: str, reason: str) -> None:
        """RECOMPUTED, decode scheduler side, fire-and-forget: it gave up loading the
        reservation (it ended, timed out, its sidecar restarted) and computes the prompt."""

    @abc.abstractmethod
    def on_admin(self, conn: Connection, request: dict) -> dict | Awaitable[dict]:
        """ADMIN, from operators, tests and benchmarks (stats, record, add_peer, cancel, ...)."""

    @abc.abstractmethod
    def on_disconnect(self, conn: Connection) -> None:
        """The connection closed (the engine exited or reconnected): drop what it owned."""


class _ServerProtocol(asyncio.Protocol):
    def __init__(self, handler: ChannelHandler, connections: set):
        self.handler = handler
        self.connections = connections
        self.buf = bytearray()
        self.conn: Connection | None = None
        self.paused_for: asyncio.Task | None = None

    def connection_made(self, transport) -> None:
        self.conn = Connection(transport)
        self.connections.add(self.conn)

    def connection_lost(self, exc) -> None:
        conn = self.conn
        conn.closed = True
        self.connections.discard(conn)
        try:
            self.handler.on_disconnect(conn)
        except Exception:
            log.exception("disconnect handler failed for %s", conn.owner)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._drain()

    def _drain(self) -> None:
        buf = self.buf
        while len(buf) >= F.HEADER.size and self.paused_for is None:
            length, kind, seq = F.HEADER.unpack_from(buf)
            if length > F.MAX_BODY:
                log.error("%s sent a %d-byte frame; closing", self.conn.owner, length)
                self.conn.transport.close()
                return
            end = F.HEADER.size + length
            if len(buf) < end:
                return
            body = bytes(buf[F.HEADER.size:end])
            del buf[:end]
            self._dispatch(kind, seq, body)

    def _dispatch(self, kind: int, seq: int, body: bytes) -> None:
        conn, h = self.conn, self.handler
        try:
            if kind == F.PUSH:
                return h.on_push(conn, F.decode_push(body))
            if kind == F.END:
                return h.on_end(conn, F.decode_end(body))
            if kind == F.RECOMPUTED:
                note = F.decode_json(body)
                return h.on_recomputed(conn, str(note["reservation_id"]), str(note.get("reason", ""))[:64])
            if kind == F.PING:
                answer = b""
            elif kind == F.BEGIN:
                answer = F.encode_allocs(h.on_begin(conn, F.decode_begin(body)))
            elif kind == F.QUERY:
                answer = F.encode_state(h.on_query(conn, F.decode_id(body)))
            elif kind == F.SUBSCRIBE:
                answer = F.encode_state(h.on_subscribe(conn, F.decode_id(body)))
            elif kind == F.CONSUMED:
                answer = F.encode_state(h.on_consumed(conn, F.decode_id(body)))
            elif kind == F.AWAIT:
                answer = F.encode_json({"params": h.on_await(conn, F.decode_id(body))})
            elif kind == F.HELLO:
                conn.info = F.decode_json(body)
                answer = F.encode_json(h.on_hello(conn, conn.info))
            elif kind == F.ADMIN:
                result = h.on_admin(conn, F.decode_json(body))
                if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                    return self._await_admin(seq, result)
                answer = F.encode_json(result)
            else:
                raise F.FrameError(f"unknown frame type {kind}")
        except Exception as exc:
            if seq:
                conn.send(F.reply(seq, error=f"{type(exc).__name__}: {exc}"))
            else:
                log.warning("%s: frame type %d failed: %s", conn.owner, kind, exc)
            return
        if seq:
            conn.send(F.reply(seq, answer))

    def _await_admin(self, seq: int, awaitable) -> None:
        # Stop reading until the answer is in, so frames after it keep their order.
        self.conn.transport.pause_reading()

        async def finish() -> None:
            try:
                self.conn.send(F.reply(seq, F.encode_json(await awaitable)))
            except Exception as exc:
                self.conn.send(F.reply(seq, error=f"{type(exc).__name__}: {exc}"))
            finally:
                self.paused_for = None
                if not self.conn.closed:
                    self.conn.transport.resume_reading()
                    self._drain()

        self.paused_for = asyncio.get_running_loop().create_task(finish())


class ChannelServer:
    def __init__(self, path: str, handler: ChannelHandler):
        self.path = path
        self.handler = handler
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)  # a stale socket of a previous sidecar
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _ServerProtocol(self.handler, self.connections), self.path)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                conn.transport.close()
            await self._server.wait_closed()
            self._server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

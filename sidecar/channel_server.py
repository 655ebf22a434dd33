"""The local channel: a Unix-domain socket between vLLM's connector and its sidecar.

Server side (in the sidecar): ``ChannelServer`` parses frames straight from
an asyncio ``Protocol`` buffer and calls a ``ChannelHandler`` synchronously,
in arrival order; replies and events are written without awaiting (the
connector reads them on its own thread).

Client side (in the engine process): ``SidecarClient`` is plain synchronous
code for vLLM's worker thread. ``push``/``end_request`` are fire-and-forget:
one non-blocking ``send`` of a small frame into the socket buffer (a few
microseconds), no reply awaited; if the buffer is full (the sidecar is busy or
stopped) the frame joins a backlog that a writer thread flushes, so the forward
pass never waits on the sidecar. Order is kept: one stream carries every frame
and nothing overtakes the backlog. Calls that need an answer (``begin_push``, ``query``, ...)
block for their reply with a timeout. A reader thread, asleep in ``recv`` when
nothing comes, matches replies to callers and queues events (push outcomes on
the prefill side, LANDED/FAILED on the decode side).

Frame format: ``engine/frames.py``. Round-trip time: ``measure_rtt``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Awaitable, Protocol

from engine import frames as F
from engine.pool import StagingAllocation

log = logging.getLogger(__name__)

MAX_UNSENT = 8 << 20  # a client that stops reading events is dropped past this



class Connection:
    """One connected engine process, as the handler sees it."""

    _ids = itertools.count(1)

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.owner = f"conn-{next(self._ids)}"
        self.info: dict = {}
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


class ChannelHandler(Protocol):
    def on_hello(self, conn: Connection, info: dict) -> dict: ...
    def on_begin(self, conn: Connection, req: F.BeginRequest) -> StagingAllocation: ...
    def on_push(self, conn: Connection, piece: F.PushPiece) -> None: ...
    def on_end(self, conn: Connection, end: F.EndRequest) -> None: ...
    def on_query(self, conn: Connection, reservation_id: str) -> F.StateEvent: ...
    def on_subscribe(self, conn: Connection, reservation_id: str) -> F.StateEvent: ...
    def on_consumed(self, conn: Connection, reservation_id: str) -> F.StateEvent: ...
    def on_await(self, conn: Connection, request_id: str) -> dict | None: ...
    def on_admin(self, conn: Connection, request: dict) -> dict | Awaitable[dict]: ...
    def on_disconnect(self, conn: Connection) -> None: ...


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
            if kind == F.PING:
                answer = b""
            elif kind == F.BEGIN:
                answer = F.encode_alloc(h.on_begin(conn, F.decode_begin(body)))
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

"""The engine's end of the local channel: ``SidecarClient``, for the connector.

Plain synchronous code for vLLM's threads. ``push``/``end_request`` are fire-and-forget:
one non-blocking ``send`` of a small frame into the socket buffer (a few
microseconds), no reply awaited; if the buffer is full (the sidecar is busy or
stopped) the frame joins a backlog that a writer thread flushes, so the forward
pass never waits on the sidecar. Order is kept: one stream carries every frame
and nothing overtakes the backlog. Calls that need an answer (``begin_push``,
``query``, ...) block for their reply with a timeout. A reader thread, asleep in
``recv`` when nothing comes, matches replies to callers and queues events (push
outcomes on the prefill side, LANDED/FAILED on the decode side).

The sidecar's end is ``kvpush/sidecar/channel_server.py`` (what each frame does there:
``ChannelHandler``); the frames are ``kvpush/channel/frames.py``; round-trip time: ``measure_rtt``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import socket
import threading
import time
from typing import Callable

from kvpush.channel import frames as F
from kvpush.channel.pool import StagingAllocation

log = logging.getLogger(__name__)

MAX_BACKLOG = 64 << 20  # frames a client queues for a sidecar that stopped reading


class ChannelError(Exception):
    """The sidecar refused a call, or the channel broke or timed out."""


class SidecarClient:
    """Synchronous client of a sidecar's local channel (thread-safe)."""

    def __init__(self, path: str, timeout_s: float = 5.0,
                 on_event: Callable[[F.StateEvent], None] | None = None):
        self.path = path
        self.timeout_s = timeout_s
        self.on_event = on_event
        # (request id, PushParams dict), on the reader thread: a reservation AWAIT asked for
        self.on_reservation: Callable[[str, dict], None] | None = None
        # On the reader thread, once, when the sidecar closed the channel (not after ``close``):
        # whoever holds the client dials again without waiting for a request to need it.
        self.on_closed: Callable[[], None] | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        self._sock.connect(path)
        self._sock.settimeout(None)  # blocking for the reader; sends use MSG_DONTWAIT
        self._send_lock = threading.Condition(threading.Lock())
        self._backlog = bytearray()  # bytes the kernel buffer could not take yet, in order
        self._writer_busy = False
        self._closing = False
        self._writer = threading.Thread(target=self._write_loop, name="kvpush-channel-writer", daemon=True)
        self._writer.start()
        self._seq = itertools.count(1)
        self._pending: dict[int, list] = {}  # seq -> [threading.Event, ok, body]
        self._events: collections.deque[F.StateEvent] = collections.deque(maxlen=65536)
        self._event_cv = threading.Condition()
        self._broken: str = ""
        self._reader = threading.Thread(target=self._read_loop, name="kvpush-channel-reader", daemon=True)
        self._reader.start()

    # -- calls ------------------------------------------------------------------------------
    def hello(self, **info) -> dict:
        return F.decode_json(self._call(F.HELLO, F.encode_json(info)))

    def begin_push(self, request: F.BeginRequest) -> StagingAllocation:
        """The staging of an engine without tensor parallelism: one allocation, every head."""
        allocs = self.begin_shares(request)
        if len(allocs) != 1:
            raise ChannelError(f"BEGIN answered {len(allocs)} head shares: a tensor-parallel engine stages "
                               "with begin_shares")
        return allocs[0]

    def begin_shares(self, request: F.BeginRequest) -> tuple[StagingAllocation, ...]:
        """This rank's staging: one allocation per head share it sends (none: it sends nothing)."""
        return F.decode_allocs(self._call(F.BEGIN, F.encode_begin(request)))

    def push(self, request_id: str, layer: int, start: int = 0, end: int = 0) -> None:
        """Fire-and-forget: push tokens [start, end) of ``layer`` (end 0: to the end)."""
        self._send(F.frame(F.PUSH, 0, F.encode_push(F.PushPiece(request_id, layer, start, end))))

    def end_request(self, request_id: str, aborted: bool = False, reason: str = "") -> None:
        self._send(F.frame(F.END, 0, F.encode_end(F.EndRequest(request_id, aborted, reason))))

    def query(self, reservation_id: str) -> F.StateEvent:
        return F.decode_state(self._call(F.QUERY, F.encode_id(reservation_id)))

    def subscribe(self, reservation_id: str) -> F.StateEvent:
        return F.decode_state(self._call(F.SUBSCRIBE, F.encode_id(reservation_id)))

    def consumed(self, reservation_id: str) -> F.StateEvent:
        return F.decode_state(self._call(F.CONSUMED, F.encode_id(reservation_id)))

    def await_reservation(self, request_id: str) -> dict | None:
        """Prefill: the reservation the router made under ``request_id`` (PushParams as a
        dict), or None; then ``on_reservation`` is called once it arrives."""
        return F.decode_json(self._call(F.AWAIT, F.encode_id(request_id)))["params"]

    def consumed_nowait(self, reservation_id: str) -> None:
        """Fire-and-forget CONSUMED: the engine copied the landing out and moves on
        (the sidecar logs a refusal; the blocks are the control plane's concern)."""
        self._send(F.frame(F.CONSUMED, 0, F.encode_id(reservation_id)))

    def recomputed_nowait(self, reservation_id: str, reason: str) -> None:
        """Fire-and-forget RECOMPUTED: the engine gave up loading this reservation and
        computes the prompt itself (a silent cost the sidecar's metrics make visible)."""
        self._send(F.frame(F.RECOMPUTED, 0, F.encode_json({"reservation_id": reservation_id, "reason": reason})))

    def ping(self) -> None:
        self._call(F.PING, b"")

    def admin(self, op: str, **fields) -> dict:
        return F.decode_json(self._call(F.ADMIN, F.encode_json({"op": op, **fields})))

    def wait_event(self, predicate: Callable[[F.StateEvent], bool], timeout_s: float) -> F.StateEvent:
        """The first queued event matching ``predicate`` (removed from the queue), waiting
        up to ``timeout_s``; ``ChannelError`` on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._event_cv:
            while True:
                for event in self._events:
                    if predicate(event):
                        self._events.remove(event)
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or self._broken:
                    raise ChannelError(self._broken or f"no matching event within {timeout_s} s")
                self._event_cv.wait(left)

    @property
    def broken(self) -> bool:
        """The channel is known closed (the sidecar went away): a new client is needed."""
        return bool(self._broken)

    def events(self) -> list[F.StateEvent]:
        with self._event_cv:
            out = list(self._events)
            self._events.clear()
            return out

    def close(self) -> None:
        with self._send_lock:
            self._closing = True
            self._send_lock.notify()
        self._broken = self._broken or f"channel to {self.path} closed by this side"
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=2)
        self._writer.join(timeout=2)
        self._sock.close()

    def __enter__(self) -> "SidecarClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        """Never blocks: straight into the socket buffer when it has room (the usual
        case, one syscall), else onto a backlog the writer thread flushes in order."""
        if self._broken:
            raise ChannelError(self._broken)
        with self._send_lock:
            if not self._backlog and not self._writer_busy:
                try:
                    sent = self._sock.send(data, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    raise ChannelError(f"channel to {self.path} broken: {exc}") from exc
                if sent == len(data):
                    return
                data = data[sent:]
            if len(self._backlog) + len(data) > MAX_BACKLOG:
                raise ChannelError(f"sidecar at {self.path} is not reading: {len(self._backlog)} bytes queued")
            self._backlog += data
            self._send_lock.notify()

    def _write_loop(self) -> None:
        while True:
            with self._send_lock:
                while not self._backlog and not self._closing:
                    self._send_lock.wait()
                if self._closing:
                    return
                data, self._backlog = bytes(self._backlog), bytearray()
                self._writer_busy = True
            try:
                self._sock.sendall(data)  # blocking, off the caller's thread
            except OSError as exc:
                self._broken = self._broken or f"channel to {self.path} broken: {exc}"
                return
            finally:
                with self._send_lock:
                    self._writer_busy = False

    def _call(self, kind: int, body: bytes) -> bytes:
        seq = next(self._seq)
        slot = [threading.Event(), False, b""]
        self._pending[seq] = slot
        try:
            self._send(F.frame(kind, seq, body))
            if not slot[0].wait(self.timeout_s):
                raise ChannelError(self._broken or f"no reply from the sidecar within {self.timeout_s} s")
        finally:
            self._pending.pop(seq, None)
        if slot[1] is None:
            raise ChannelError(self._broken)
        if not slot[1]:
            raise ChannelError(slot[2].decode(errors="replace"))
        return slot[2]

    def _recv_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self._sock.recv(min(n - got, 1 << 20))
            if not chunk:
                raise ConnectionError("sidecar closed the channel")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read_loop(self) -> None:
        try:
            while True:
                length, kind, seq = F.HEADER.unpack(self._recv_exact(F.HEADER.size))
                body = self._recv_exact(length) if length else b""
                if kind == F.REPLY:
                    slot = self._pending.get(seq)
                    if slot is not None:
                        slot[1], slot[2] = body[:1] == bytes([F.OK]), body[1:]
                        slot[0].set()
                elif kind == F.RESERVATION:
                    data = F.decode_json(body)
                    if self.on_reservation is not None:
                        try:
                            self.on_reservation(data["request_id"], data["params"])
                        except Exception:
                            log.exception("reservation callback failed")
                elif kind == F.EVENT:
                    event = F.decode_state(body)
                    with self._event_cv:
                        self._events.append(event)
                        self._event_cv.notify_all()
                    if self.on_event is not None:
                        try:
                            self.on_event(event)
                        except Exception:
                            log.exception("event callback failed")
        except (OSError, ConnectionError, F.FrameError) as exc:
            self._broken = self._broken or f"channel to {self.path} closed: {exc}"
        finally:
            for slot in list(self._pending.values()):
                slot[1] = None
                slot[0].set()
            with self._event_cv:
                self._event_cv.notify_all()
            if not self._closing and self.on_closed is not None:
                try:
                    self.on_closed()
                except Exception:
                    log.exception("channel-closed callback failed")


@dataclasses.dataclass(frozen=True)
class RttStats:
    samples: int
    p50_us: float
    p99_us: float
    max_us: float
    send_only_us: float  # cost to the caller of one fire-and-forget frame


def measure_rtt(client: SidecarClient, samples: int = 2000, warmup: int = 100) -> RttStats:
    """Round trip of a PING (frame out, reply in, through the reader thread)."""
    for _ in range(warmup):
        client.ping()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        client.ping()
        times.append(time.perf_counter() - t0)
    times.sort()
    # Fire-and-forget cost: an END for a request the sidecar does not know is ignored.
    t0 = time.perf_counter()
    for _ in range(samples):
        client.end_request("rtt-probe")
    send_only = (time.perf_counter() - t0) / samples
    client.ping()  # let the sidecar work through them before the caller goes on
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))] * 1e6  # noqa: E731
    return RttStats(samples, pick(0.5), pick(0.99), times[-1] * 1e6, send_only * 1e6)

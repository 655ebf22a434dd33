"""Connecting to the local sidecar: retry until it serves, then HELLO; and again
whenever the channel closes.

The engine and its sidecar start side by side; the engine waits up to
``connect_timeout_s`` for the sidecar's socket (and fails to start after
that: a P/D engine without its sidecar is misconfigured, better said at once).
Later, a sidecar that goes away (killed, restarted, upgraded) is dialed again in
the background by a ``Redialer`` until it is back: a sidecar restart costs the
push path seconds, never an engine restart.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from kvpush.contract.layout import KvLayout
from kvpush.connector.sidecar_client import ChannelError, SidecarClient
from kvpush.channel.pool import PoolDescription

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers


@dataclasses.dataclass(frozen=True)
class SidecarInfo:
    """What HELLO says about the sidecar: the engine's identity in kvpush."""

    role: str  # "prefill" (staging pool) or "decode" (landing pool)
    engine_id: str
    incarnation: str
    agent: str
    pool: PoolDescription
    rank: int = 0  # the tensor-parallel rank this channel speaks for (its pool is that rank's)

    @property
    def layout(self) -> KvLayout:
        return self.pool.layout

    @classmethod
    def from_hello(cls, hello: dict) -> SidecarInfo:
        return cls(hello["role"], hello["engine_id"], hello["incarnation"], hello.get("agent", ""),
                   PoolDescription.from_dict(hello["pool"]), hello.get("rank", 0))


def connect(path: str, connect_timeout_s: float, channel_timeout_s: float,
            name: str = "vllm", cuda_device: int | None = -1, rank: int | None = None
            ) -> tuple[SidecarClient, SidecarInfo]:
    """HELLO the sidecar at ``path``, retrying until it serves. ``cuda_device``: the worker's
    GPU index (None: none), which a sidecar with a VRAM pool checks against its own; -1
    (the scheduler's processes, which map no pool) says nothing. ``rank``: the worker's
    tensor-parallel rank (its pool is that rank's; None, the scheduler's: it speaks for the
    whole engine). A refusal of the device or the rank is final: it raises at once instead
    of retrying."""
    deadline = time.monotonic() + connect_timeout_s
    last_error: Exception | None = None
    while True:
        try:
            client = SidecarClient(path, timeout_s=channel_timeout_s)
        except OSError as exc:
            last_error = exc
        else:
            try:
                extra = {} if cuda_device == -1 else {"cuda_device": cuda_device}
                if rank is not None:
                    extra["rank"] = rank
                # engine=True: the sidecar counts this connection as its engine being there.
                info = SidecarInfo.from_hello(client.hello(name=name, pid=os.getpid(), engine=True, **extra))
                return client, info
            except (ChannelError, KeyError) as exc:
                client.close()
                if "PoolMapError" in str(exc) or "serves an engine of tp_size" in str(exc):
                    raise ChannelError(f"the kvpush sidecar at {path} refused this engine: {exc}") from None
                last_error = exc
        if time.monotonic() >= deadline:
            raise ChannelError(f"no kvpush sidecar at {path} within {connect_timeout_s:g} s: {last_error}")
        time.sleep(0.2)


def hello_once(path: str, connect_timeout_s: float, channel_timeout_s: float, name: str) -> SidecarInfo:
    client, info = connect(path, connect_timeout_s, channel_timeout_s, name)
    client.close()
    return info


class Redialer:
    """Keeps a channel to the local sidecar up whatever requests arrive.

    When the channel in use closes (the sidecar was killed, restarted, upgraded), a
    thread of its own dials again, first at once, then with backoff (``initial_s``
    doubling to ``max_s``), until a sidecar answers HELLO; ``on_connected(client, info)``
    then takes the new channel. Waiting for a request to need the channel is not enough:
    a restarted sidecar reports its engine unavailable until the engine says HELLO, and
    no reservation (so no request that would reconnect) is granted before that.

    ``dial_now`` is the same attempt made at once on the caller's thread, for a request
    that needs the channel before the next attempt would come (or the attempt under way,
    waited for). Attempts never overlap."""

    def __init__(self, dial: Callable[[], tuple[SidecarClient, SidecarInfo]],
                 on_connected: Callable[[SidecarClient, SidecarInfo], None], what: str,
                 initial_s: float = 0.1, max_s: float = 1.0, refused_s: float = 10.0):
        self._dial = dial
        self._on_connected = on_connected
        self.what = what
        self.initial_s, self.max_s = initial_s, max_s
        # After a sidecar that answered but could not be used: its HELLO counts as the engine
        # being there, so dialing it every second would keep a wrong sidecar looking healthy.
        self.refused_s = refused_s
        self._not_before = 0.0  # monotonic: no attempt before (after a refusal)
        self._client: SidecarClient | None = None  # the newest channel dialed
        self._lock = threading.Lock()  # one attempt at a time
        self._wake = threading.Event()
        self._stopping = False
        self._down_since = 0.0  # monotonic: when the channel was found closed (0: it is up)
        self._thread = threading.Thread(target=self._run, name=f"kvpush-redial-{what}", daemon=True)
        self._thread.start()

    def follow(self, client: SidecarClient) -> None:
        """``client`` is the channel now in use: dial again when it closes."""
        self._client = client
        client.on_closed = self.wake
        if client.broken:  # closed before the callback was in place
            self.wake()

    def wake(self) -> None:
        """Dial again now (the channel closed, or the one dialed could not be used)."""
        self._wake.set()

    @property
    def down(self) -> bool:
        return self._client is None or self._client.broken

    def dial_now(self, wait_s: float = 0.5) -> bool:
        """One attempt on the caller's thread; where the redialer's own is under way, its
        outcome, waited for up to ``wait_s`` (a restarted sidecar's first HELLO can take a
        while: giving up at once refused the push that asked, the channel up a moment
        later). True when a channel is up afterwards."""
        if not self._lock.acquire(timeout=wait_s):
            return False
        try:
            return self._attempt()
        finally:
            self._lock.release()

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            delay = self.initial_s
            while not self._stopping:
                with self._lock:
                    if self._attempt():
                        break
                self._wake.wait(max(delay, self._not_before - time.monotonic()))  # wake(): at once
                self._wake.clear()
                delay = min(delay * 2, self.max_s)
            if self._stopping:
                return

    def _attempt(self) -> bool:
        """Under the lock: dial if the channel is down; True when it is up."""
        if self._stopping or not self.down:
            return not self._stopping
        if time.monotonic() < self._not_before:
            return False
        if not self._down_since:
            self._down_since = time.monotonic()
            log.warning("kvpush sidecar channel (%s) closed; dialing again", self.what)
        try:
            client, info = self._dial()
        except (ChannelError, OSError, KeyError) as exc:
            log.debug("kvpush sidecar (%s) not back yet: %s", self.what, exc)
            return False
        try:
            self._on_connected(client, info)
        except Exception as exc:  # e.g. a sidecar that came back with another role or layout
            log.error("kvpush sidecar at %s (%s) answered but cannot be used: %s; trying again in %g s",
                      client.path, self.what, exc, self.refused_s)
            client.close()
            self._not_before = time.monotonic() + self.refused_s
            return False
        self.follow(client)
        if self.down:  # closed again at once (follow() woke the thread for another try)
            return False
        log.warning("kvpush sidecar channel (%s) up again after %.2f s: %s incarnation %s", self.what,
                    time.monotonic() - self._down_since, info.engine_id, info.incarnation)
        self._down_since = 0.0
        return True


class SchedulerChannel:
    """One channel client held by the scheduler's process (the decode scheduler's
    landing watch, the prefill scheduler's handover), dialed again by a ``Redialer``
    as soon as it closes. Subclasses wire the client's callbacks in ``_attach``; they
    run on its reader thread. ``epoch`` counts the channels so far: the scheduler
    compares it with the one it last saw to learn that the sidecar may have restarted."""

    def __init__(self, connect: Callable[[], tuple[SidecarClient, SidecarInfo]]):
        self._connect = connect
        self._client: SidecarClient | None = None
        self.info: SidecarInfo | None = None
        self.epoch = 0
        self._redialer = Redialer(connect, self._take, type(self).__name__)

    def _attach(self, client: SidecarClient) -> None:
        raise NotImplementedError

    def _take(self, client: SidecarClient, info: SidecarInfo) -> None:
        self._attach(client)
        old, self._client = self._client, client
        self.info = info
        self.epoch += 1
        if old is not None:
            old.close()

    def connect(self) -> SidecarInfo:
        """The first channel (at start-up: the caller decides how long to wait for it)."""
        client, info = self._connect()
        self._take(client, info)
        self._redialer.follow(client)
        return info

    @property
    def broken(self) -> bool:
        """The channel closed (the sidecar stopped or restarted) and no new one is up yet."""
        return self._client is None or self._client.broken

    def redial(self) -> bool:
        """A caller that needs the channel now: one attempt at once if it is down (the
        redialer's own thread keeps trying either way). True when it is up."""
        return not self.broken or self._redialer.dial_now()

    def _client_or_reconnect(self) -> SidecarClient:
        if self.broken and not self.redial():
            raise ChannelError("the sidecar's channel is closed (dialing again)")
        return self._client

    def close(self) -> None:
        self._redialer.close()
        if self._client is not None:
            self._client.close()
            self._client = None

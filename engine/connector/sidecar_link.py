"""Connecting to the local sidecar: retry until it serves, then HELLO.

The engine and its sidecar start side by side; the engine waits up to
``connect_timeout_s`` for the sidecar's socket (and fails to start after
that: a P/D engine without its sidecar is misconfigured, better said at once).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from kvpush.contract.layout import KvLayout
from engine.channel import ChannelError, SidecarClient
from engine.pool import PoolDescription

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


class SchedulerChannel:
    """One channel client held by the scheduler's process (the decode scheduler's
    landing watch, the prefill scheduler's handover), reconnected at most once a
    second while the sidecar is away. Subclasses wire the client's callbacks in
    ``_attach``; they run on its reader thread."""

    def __init__(self, connect: Callable[[], tuple[SidecarClient, SidecarInfo]]):
        self._connect = connect
        self._client: SidecarClient | None = None
        self._next_connect = 0.0

    def _attach(self, client: SidecarClient) -> None:
        raise NotImplementedError

    def connect(self) -> SidecarInfo:
        """(Re)connect and HELLO; the sidecar may have restarted (a new incarnation)."""
        client, info = self._connect()
        self._attach(client)
        old, self._client = self._client, client
        if old is not None:
            old.close()
        return info

    @property
    def broken(self) -> bool:
        """The channel closed (the sidecar stopped or restarted): nothing more will be heard on it."""
        return self._client is None or self._client.broken

    def reconnect(self) -> SidecarInfo:
        """``connect`` at most once a second while the sidecar is away (``ChannelError`` otherwise)."""
        now = time.monotonic()
        if now < self._next_connect:
            raise ChannelError("the sidecar's channel is closed")
        self._next_connect = now + 1.0
        return self.connect()

    def _client_or_reconnect(self) -> SidecarClient:
        if self.broken:
            self.reconnect()
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

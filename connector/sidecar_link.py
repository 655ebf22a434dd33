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

from kvpush.layout import KvLayout
from worker.channel import ChannelError, SidecarClient
from worker.pools import PoolInfo

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers

PREFILL, DECODE = "prefill", "decode"


@dataclasses.dataclass(frozen=True)
class SidecarInfo:
    """What HELLO says about the sidecar: the engine's identity in kvpush."""

    role: str  # "prefill" (staging pool) or "decode" (landing pool)
    engine_id: str
    incarnation: str
    agent: str
    pool: PoolInfo

    @property
    def layout(self) -> KvLayout:
        return self.pool.layout

    @classmethod
    def from_hello(cls, hello: dict) -> SidecarInfo:
        return cls(hello["role"], hello["engine_id"], hello["incarnation"], hello.get("agent", ""),
                   PoolInfo.from_dict(hello["pool"]))


def connect(path: str, connect_timeout_s: float, channel_timeout_s: float,
            name: str = "vllm") -> tuple[SidecarClient, SidecarInfo]:
    deadline = time.monotonic() + connect_timeout_s
    last_error: Exception | None = None
    while True:
        try:
            client = SidecarClient(path, timeout_s=channel_timeout_s)
        except OSError as exc:
            last_error = exc
        else:
            try:
                info = SidecarInfo.from_hello(client.hello(name=name, pid=os.getpid()))
                return client, info
            except (ChannelError, KeyError) as exc:
                client.close()
                last_error = exc
        if time.monotonic() >= deadline:
            raise ChannelError(f"no kvpush sidecar at {path} within {connect_timeout_s:g} s: {last_error}")
        time.sleep(0.2)


def hello_once(path: str, connect_timeout_s: float, channel_timeout_s: float, name: str) -> SidecarInfo:
    client, info = connect(path, connect_timeout_s, channel_timeout_s, name)
    client.close()
    return info

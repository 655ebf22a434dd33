"""What one router worker tells the others (``kvpush router --workers N``): the turns it
sent and which decode engine served each (``kv_aware.RecentTurns``), so that a
conversation's next turn is guessed the same whichever worker the kernel gives its
connection to.

One Unix datagram socket per worker, in the supervisor's run directory; a message is a
hint (``a KEY COVERS``: a prompt ending in block KEY sent, covering at most COVERS
tokens with its answer; ``s KEY ENGINE``: decode engine ENGINE serves it). Datagrams from
one sender arrive in order; one lost (a sibling restarting, its queue full) costs a
guess, never an answer: the Reserve still decides.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Callable

from kvpush import log

_log = log.get("router")


def socket_path(run_dir: str, index: int) -> str:
    return os.path.join(run_dir, f"worker-{index}.sock")


class _Receiver(asyncio.DatagramProtocol):
    def __init__(self, on_message: Callable[[list[str]], None]) -> None:
        self.on_message = on_message

    def datagram_received(self, data: bytes, addr) -> None:
        try:
            self.on_message(data.decode().split(" ", 2))
        except (ValueError, UnicodeDecodeError) as exc:
            _log.warning("sibling message not understood", error=str(exc))

    def error_received(self, exc: Exception) -> None:  # a sibling not there (restarting): a hint lost
        pass


class Siblings:
    """This worker's socket, and its siblings' addresses."""

    def __init__(self, run_dir: str, index: int, count: int) -> None:
        self.path = socket_path(run_dir, index)
        self.others = [socket_path(run_dir, j) for j in range(count) if j != index]
        self._sock: socket.socket | None = None
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self, on_message: Callable[[list[str]], None]) -> None:
        if os.path.exists(self.path):  # left by this worker's previous life
            os.unlink(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.setblocking(False)
        self._transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Receiver(on_message), sock=self._sock)

    def tell(self, *fields) -> None:
        if self._transport is None:
            return
        data = " ".join(map(str, fields)).encode()
        for path in self.others:
            try:
                self._sock.sendto(data, path)   # (never blocks: a full queue drops the hint)
            except OSError:
                pass

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

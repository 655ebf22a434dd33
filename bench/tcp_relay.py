"""A bare TCP relay: bytes from the client to one upstream and back, nothing parsed.

The floor of any proxy on the token path, in the router's language and on its event loop
(uvloop): per event, a wakeup, decode's read and the client's write. ``router_cpu.py``
measures it beside the router, in front of the same decode engine, as the limit.

    .venv/bin/python bench/tcp_relay.py PORT UPSTREAM_HOST:UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import sys


class _Side(asyncio.Protocol):
    """One connection of a pair; what it reads goes to the other's transport. Each side
    stops reading while the other's send buffer is full (as a proxy must, or a slow
    client would make it hold a whole answer)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: "_Side | None" = None
        self.early: list[bytes] = []  # read before the other side was connected

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self.early.append(data)
        else:
            self.peer.transport.write(data)

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class _ClientSide(_Side):
    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self._upstream = upstream

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        try:
            _, up = await asyncio.get_running_loop().create_connection(_Side, *self._upstream)
        except OSError:
            self.transport.close()
            return
        up.peer, self.peer = self, up
        if self.transport.is_closing():
            up.transport.close()
            return
        for data in self.early:
            up.transport.write(data)
        self.early.clear()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: _ClientSide(upstream), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main() -> None:
    import uvloop
    port, to = int(sys.argv[1]), sys.argv[2]
    host, to_port = to.rsplit(":", 1)
    uvloop.run(serve(port, (host, int(to_port))))


if __name__ == "__main__":
    main()

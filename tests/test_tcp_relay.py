"""The router bench's limit, a bare TCP relay: what the client sends reaches the upstream,
what the upstream streams reaches the client, whole and in order, and either side closing
closes the other (else a bench phase would hang or count bytes that never arrived)."""

import asyncio

from aiohttp import web, ClientSession
from aiohttp.test_utils import TestServer

from bench.tcp_relay import serve
from kvpush.app.etcd_server import free_port


async def _relayed(upstream_port: int):
    port = free_port()
    task = asyncio.ensure_future(serve(port, ("127.0.0.1", upstream_port)))
    for _ in range(100):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return task, port
        except OSError:
            await asyncio.sleep(0.02)
    raise AssertionError("the relay did not listen")


async def test_a_streamed_answer_passes_whole_both_ways():
    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(200):
            await resp.write(b"data: %d %s\n\n" % (i, body))
        return resp
    app = web.Application()
    app.router.add_post("/s", stream)
    server = TestServer(app)
    await server.start_server()
    relay, port = await _relayed(server.port)
    try:
        async with ClientSession() as s:
            for _ in range(2):  # (a kept-alive connection carries the second)
                async with s.post(f"http://127.0.0.1:{port}/s", data=b"x" * 100_000) as r:
                    got = await r.read()
                assert got == b"".join(b"data: %d %s\n\n" % (i, b"x" * 100_000) for i in range(200))
    finally:
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        await server.close()


async def test_the_upstream_closing_closes_the_client():
    async def once(reader, writer):
        await reader.read(10)
        writer.write(b"bye")
        writer.close()
    upstream = await asyncio.start_server(once, "127.0.0.1", 0)
    relay, port = await _relayed(upstream.sockets[0].getsockname()[1])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.read(), 5) == b"bye"  # read to EOF: closed after it
        writer.close()
    finally:
        relay.cancel()
        await asyncio.gather(relay, return_exceptions=True)
        upstream.close()

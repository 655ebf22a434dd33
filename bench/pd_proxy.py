"""A minimal P/D proxy for vLLM's own NIXL connectors (the baselines in bench/e2e.py).

    python -m bench.pd_proxy --prefill URL --decode URL --port N [--ready-file PATH]

Per request (/v1/completions): send the request to the prefill engine with
max_tokens=1, no streaming and ``kv_transfer_params: {"do_remote_decode": true}``;
wait for its answer; then send the original request to the decode engine with
the prefill answer's ``kv_transfer_params`` and stream the decode answer back.
Both legs carry the same ``X-Request-Id``: the push connector matches the decode
engine's block registration to the prefill engine's finished request by that id
(pull mode carries ``remote_request_id`` in the params and does not need it).
This is the sequential flow every pull (and upstream push) deployment has: the
decode request cannot start before prefill has finished.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import uuid

import aiohttp
from aiohttp import web

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def build_app(prefill: str, decode: str) -> web.Application:
    app = web.Application()

    async def on_startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=120),
                                               connector=aiohttp.TCPConnector(limit=0))

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: aiohttp.ClientSession = app["session"]
        headers = {"X-Request-Id": f"pd-{uuid.uuid4().hex}"}
        p_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n")}
        p_body.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
        async with session.post(f"{prefill}/v1/completions", json=p_body, headers=headers) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                return web.json_response({"error": f"prefill answered {resp.status}", "detail": answer},
                                         status=502)
        d_body = dict(body, kv_transfer_params=answer.get("kv_transfer_params"))
        async with session.post(f"{decode}/v1/completions", json=d_body, headers=headers) as upstream:
            if not body.get("stream"):
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type="application/json")
            out = web.StreamResponse(status=upstream.status)
            out.content_type = "text/event-stream"
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(args) -> None:
    runner = web.AppRunner(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    if args.ready_file:
        pathlib.Path(args.ready_file).write_text("ready\n")
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ready-file")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()

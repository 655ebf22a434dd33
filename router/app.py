"""The router's HTTP surface: OpenAI-compatible endpoints, health, metrics."""

from __future__ import annotations

import asyncio
import json
import ssl
import time

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from client.control_plane import ControlPlaneClient
from kvpush import log
from kvpush.aio import tune_gc, until_signalled, write_ready_file
from router import metrics
from router.config import RouterConfig
from router.dispatch import Dispatcher
from router.engines import EngineDirectory
from router.errors import ApiError, json_error
from router.streams import ClientTooSlow
from router.tokens import HFTokenCounter, TokenCounter

_log = log.get("router")
MAX_BODY = 8 << 20
CFG = web.AppKey("cfg", RouterConfig)
COUNTER = web.AppKey("counter", object)
CP = web.AppKey("cp", ControlPlaneClient)
SESSION = web.AppKey("session", aiohttp.ClientSession)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)


def build_app(cfg: RouterConfig, counter: TokenCounter | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app[CFG] = cfg
    app[COUNTER] = counter or HFTokenCounter(cfg.tokenizer_dir)

    async def on_startup(app: web.Application) -> None:
        app[CP] = ControlPlaneClient(cfg.controlplane, cfg.token, cfg.tls_ca, cfg.tls_cert, cfg.tls_key,
                                     cfg.tls_server_name)
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=cfg.upstream_timeout_s, sock_connect=5))
        engines = EngineDirectory(cfg, app[CP])
        engines.start()
        app[DISPATCHER] = Dispatcher(cfg, app[COUNTER], app[CP], app[SESSION], engines)

    async def on_cleanup(app: web.Application) -> None:
        await app[DISPATCHER].engines.close()
        await app[DISPATCHER].close()
        await app[SESSION].close()
        await app[CP].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    def openai(endpoint: str):
        async def handler(request: web.Request) -> web.StreamResponse:
            metrics.IN_FLIGHT.inc()
            outcome = "ok"
            try:
                try:
                    # A body trickled in holds a handler and a connection: bounded. (No
                    # reservation is made before the body is whole.)
                    body = json.loads(await asyncio.wait_for(request.read(), cfg.body_timeout_s))
                except asyncio.TimeoutError:
                    raise ApiError(f"the request body did not arrive within {cfg.body_timeout_s:g} s", 408) from None
                except web.HTTPRequestEntityTooLarge:
                    raise ApiError(f"request body is larger than {MAX_BODY} bytes", 413) from None
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ApiError(f"body is not JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise ApiError("body must be a JSON object")
                if "kv_transfer_params" in body:
                    raise ApiError("kv_transfer_params is set by the router, not by clients",
                                   param="kv_transfer_params")
                return await request.app[DISPATCHER].handle(endpoint, body, request)
            except ApiError as exc:
                outcome = "bad_request" if exc.status < 500 else "unavailable"
                return exc.response()
            except asyncio.CancelledError:
                outcome = "client_gone"
                raise
            except ClientTooSlow:
                # Its reservation is released and decode's request closed by now. The
                # connection is aborted: this answer is never sent (aiohttp closes quietly
                # on the ConnectionError its writer meets).
                outcome = "client_too_slow"
                if request.transport is not None:
                    request.transport.abort()
                return web.Response(status=408)
            except aiohttp.ClientError as exc:
                outcome = "upstream_error"
                return json_error(f"engine unreachable: {exc}", 502)
            finally:
                metrics.IN_FLIGHT.dec()
                metrics.REQUESTS.labels(endpoint=endpoint, outcome=outcome).inc()
        return handler

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": cfg.model, "object": "model", "created": int(time.time()), "owned_by": "kvpush"}]})

    async def health(request: web.Request) -> web.Response:
        engines = request.app[DISPATCHER].engines
        # Not ready (503) while it knows no engine to serve with: a load balancer's
        # readiness probe then sends clients to a router that has some.
        serving = engines.ready.is_set() and bool(engines.decode_urls() or engines.prefill_urls())
        return web.json_response({"status": "ok" if serving else "no engines", **engines.describe()},
                                 status=200 if serving else 503)

    async def live(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})  # liveness: the process answers, engines or not

    async def prom(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.REGISTRY), content_type="text/plain")

    app.router.add_post("/v1/completions", openai("completions"))
    app.router.add_post("/v1/chat/completions", openai("chat"))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", prom)
    return app


def http_ssl_context(cfg: RouterConfig) -> ssl.SSLContext | None:
    if not cfg.http_tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cfg.http_tls_cert, cfg.http_tls_key)
    return context


async def start(cfg: RouterConfig, counter: TokenCounter | None = None) -> web.AppRunner:
    """The router serving on ``cfg.listen_host:listen_port`` (HTTPS with ``http_tls_*``)."""
    app = build_app(cfg, counter)
    # handler_cancellation: a client that disconnects cancels its handler, which
    # aborts both engine requests and releases the reservation.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.listen_host, cfg.listen_port, ssl_context=http_ssl_context(cfg))
    await site.start()
    _log.info("router listening", host=cfg.listen_host, port=cfg.listen_port, model=cfg.model,
              https=bool(cfg.http_tls_cert), controlplane_tls=bool(cfg.tls_ca or cfg.tls_cert))
    return runner


async def serve(cfg: RouterConfig, ready_file: str | None = None) -> None:
    runner = await start(cfg)
    tune_gc()
    write_ready_file(ready_file, f"{cfg.listen_port}\n")
    await until_signalled()
    await runner.cleanup()

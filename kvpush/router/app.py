"""The router's HTTP surface: OpenAI-compatible endpoints, health, metrics."""

from __future__ import annotations

import asyncio
import ssl
import time

import aiohttp
from aiohttp import web

from kvpush.client.registries import Registries
from kvpush import log
from kvpush.aio import tune_gc, until_signalled, write_ready_file
from kvpush.router import connections, metrics
from kvpush.router.body import MAX_BODY, read as read_body
from kvpush.router.config import RouterConfig
from kvpush.router.dispatch import Dispatcher
from kvpush.router.errors import ApiError, json_error, silent_engine
from kvpush.router.first_token import body_json
from kvpush.router.streams import ENDED_WITH_ERROR, ClientTooSlow
from kvpush.router.tokens import HFTokenCounter, TokenCounter

_log = log.get("router")
# The OpenAI endpoints (path: the endpoint label of their metrics).
OPENAI = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
CFG = web.AppKey("cfg", RouterConfig)
COUNTER = web.AppKey("counter", object)
REGISTRIES = web.AppKey("registries", Registries)
SESSION = web.AppKey("session", aiohttp.ClientSession)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)


def build_app(cfg: RouterConfig, counter: TokenCounter | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[connections.middleware, account])
    app.on_response_prepare.append(_answer_started)
    app[CFG] = cfg
    app[COUNTER] = counter or HFTokenCounter(cfg.tokenizer_dir)

    async def on_startup(app: web.Application) -> None:
        app[REGISTRIES] = Registries.connect(cfg.registry_targets(), cfg.tls_ca, cfg.tls_cert, cfg.tls_key,
                                             cfg.tls_server_name)
        app[SESSION] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), json_serialize=body_json,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=cfg.upstream_timeout_s))
        app[DISPATCHER] = Dispatcher(cfg, app[COUNTER], app[REGISTRIES], app[SESSION])
        app[DISPATCHER].engines.start()

    async def on_cleanup(app: web.Application) -> None:
        await app[DISPATCHER].close()
        await app[SESSION].close()
        await app[REGISTRIES].close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    async def openai(request: web.Request) -> web.StreamResponse:
        body = await read_body(request, cfg.body_timeout_s)
        if "kv_transfer_params" in body:
            raise ApiError("kv_transfer_params is set by the router, not by clients", param="kv_transfer_params")
        return await request.app[DISPATCHER].handle(OPENAI[request.path], body, request)

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
        return web.Response(body=metrics.collect(), content_type="text/plain")

    for path in OPENAI:
        app.router.add_post(path, openai)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", prom)
    return app


ANSWER_STARTED = web.RequestKey("answer_started", bool)


async def _answer_started(request: web.Request, response: web.StreamResponse) -> None:
    request[ANSWER_STARTED] = True


@web.middleware
async def account(request: web.Request, handler) -> web.StreamResponse:
    """Every answer on an OpenAI endpoint, counted in kvpush_router_requests_total by
    outcome, and every failure a JSON error object: refusals before the handler (a
    method not allowed), in it (a body too large, not JSON), and failures nobody
    foresaw (a 500, logged), none a plain-text page from aiohttp."""
    endpoint = OPENAI.get(request.path)
    if endpoint is None:
        return await handler(request)
    metrics.IN_FLIGHT.inc()
    outcome = "client_gone"  # unless it ends otherwise: a cancelled handler's client went away
    try:
        response = await handler(request)
        # (A stream that began and ended with an error event failed at its engine.)
        outcome = "upstream_error" if request.get(ENDED_WITH_ERROR) else "ok"
        return response
    except Exception as exc:  # (not CancelledError: a BaseException)
        outcome, response = _failed(request, endpoint, exc)
        if request.get(ANSWER_STARTED) and request.transport is not None:
            # Part of an answer is out: another cannot follow. The connection is aborted,
            # so the client sees the answer break off (this one is never sent: aiohttp
            # closes quietly on the ConnectionError its writer meets).
            request.transport.abort()
        return response
    finally:
        metrics.IN_FLIGHT.dec()
        metrics.REQUESTS.labels(endpoint=endpoint, outcome=outcome).inc()


def _failed(request: web.Request, endpoint: str, exc: Exception) -> tuple[str, web.StreamResponse]:
    """(outcome, answer) for a request that failed with ``exc``."""
    if isinstance(exc, ApiError):
        return ("bad_request" if exc.status < 500 else "unavailable"), exc.response()
    if isinstance(exc, ClientTooSlow):
        # Its reservation is released and decode's request closed by now; its stream
        # began, so the connection is aborted (below).
        return "client_too_slow", web.Response(status=408)
    if isinstance(exc, asyncio.TimeoutError) or (isinstance(exc, aiohttp.ClientError)
                                                 and isinstance(exc.__cause__, asyncio.TimeoutError)):
        # (aiohttp's read timeout is a ClientError too; a break before the answer's first byte,
        # upstream.BrokeBeforeAnswering, keeps it as its cause)
        silent = request.app[DISPATCHER].cfg.upstream_timeout_s
        return "upstream_error", json_error(silent_engine(silent), 504)
    if isinstance(exc, aiohttp.ClientError):
        return "upstream_error", json_error(f"engine unreachable: {exc}", 502)
    if isinstance(exc, web.HTTPException):  # aiohttp's refusals (405, ...)
        return ("bad_request" if exc.status < 500 else "error"), _http_error(request, exc)
    _log.exception("request failed unexpectedly", endpoint=endpoint, error=f"{type(exc).__name__}: {exc}")
    return "error", json_error(f"the router failed: {type(exc).__name__}: {exc}", 500)


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        response = json_error(f"method {request.method} is not allowed on {request.path}; use {allowed}", exc.status)
        response.headers["Allow"] = allowed
        return response
    return json_error(exc.reason, exc.status)


def http_ssl_context(cfg: RouterConfig) -> ssl.SSLContext | None:
    if not cfg.http_tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cfg.http_tls_cert, cfg.http_tls_key)
    return context


async def start(cfg: RouterConfig, counter: TokenCounter | None = None, worker=None) -> web.AppRunner:
    """The router serving on ``cfg.listen_host:listen_port`` (HTTPS with ``http_tls_*``);
    ``worker`` (``workers.Worker``): one of several on that port."""
    app = build_app(cfg, counter)
    if worker is not None:
        async def siblings(app: web.Application) -> None:
            app[DISPATCHER].kv_aware.siblings = worker.siblings
            await worker.siblings.start(app[DISPATCHER].kv_aware.heard)

        async def siblings_closed(app: web.Application) -> None:
            worker.siblings.close()
        app.on_startup.append(siblings)
        app.on_cleanup.append(siblings_closed)
    # handler_cancellation: a client that disconnects cancels its handler, which
    # aborts both engine requests and releases the reservation.
    guard = connections.ConnectionGuard(cfg.header_timeout_s, cfg.keepalive_timeout_s)
    runner = connections.GuardedRunner(app, guard, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.listen_host, cfg.listen_port, ssl_context=http_ssl_context(cfg),
                       reuse_port=worker is not None)
    await site.start()
    _log.info("router listening", host=cfg.listen_host, port=cfg.listen_port, model=cfg.model,
              worker=worker.index if worker is not None else None,
              https=bool(cfg.http_tls_cert), controlplane_tls=bool(cfg.tls_ca or cfg.tls_cert),
              header_timeout_s=cfg.header_timeout_s, keepalive_timeout_s=cfg.keepalive_timeout_s)
    return runner


async def serve(cfg: RouterConfig, ready_file: str | None = None, worker=None) -> None:
    runner = await start(cfg, worker=worker)
    tune_gc()
    write_ready_file(ready_file, f"{cfg.listen_port}\n")
    await until_signalled()
    await runner.cleanup()

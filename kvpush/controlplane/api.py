"""Wrappers shared by every service handler: refuse before the view is loaded,
turn ApiError into a gRPC status, never let an unexpected error crash a call
without a log line, and bind a fresh structlog context per call."""

from __future__ import annotations

import contextlib
import functools

import grpc
import structlog

from kvpush.controlplane.errors import ApiError
from kvpush.controlplane.validation import no_unknown_fields
from kvpush import log

_log = log.get("api")


class CorruptMessage:
    """Stands in for a request whose bytes did not parse, so the handler can answer
    INVALID_ARGUMENT (gRPC itself would answer UNKNOWN)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"request is not a valid {type_name}: {error}"


def _tolerant(deserializer, type_name: str):
    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # DecodeError, or worse: never crash on bytes
            return CorruptMessage(type_name, exc)
    return parse


def add_service(server: grpc.aio.Server, add_fn, servicer) -> None:
    """Register a generated servicer with parse errors routed to its handlers."""
    captured: dict = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            captured[name] = handlers

    add_fn(servicer, _Capture())
    for name, handlers in captured.items():
        patched = {method: h._replace(request_deserializer=_tolerant(h.request_deserializer, f"{name}.{method}"))
                   for method, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, patched),))
        server.add_registered_method_handlers(name, patched)


def check_parsed(request) -> None:
    if isinstance(request, CorruptMessage):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, request.message)


@contextlib.asynccontextmanager
async def _guard(view, context, name: str):
    structlog.contextvars.clear_contextvars()
    try:
        if not view.ready.is_set():
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "control plane is still loading the registry")
        yield
    except ApiError as exc:
        await context.abort(exc.code, exc.message)
    except grpc.aio.AbortError:
        raise
    except Exception:
        _log.exception("handler crashed", method=name)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged)")


def unary(method):
    @functools.wraps(method)
    async def handler(self, request, context):
        async with _guard(self.view, context, method.__name__):
            check_parsed(request)
            no_unknown_fields(request)
            return await method(self, request, context)
    return handler


def streaming(method):
    """For server-streaming and bidi handlers (``request`` may be an iterator)."""
    @functools.wraps(method)
    async def handler(self, request, context):
        async with _guard(self.view, context, method.__name__):
            if hasattr(request, "DESCRIPTOR"):
                no_unknown_fields(request)
            async for item in method(self, request, context):
                yield item
    return handler

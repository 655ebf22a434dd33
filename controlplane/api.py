"""Wrappers shared by every service handler: refuse before the view is loaded,
turn ApiError into a gRPC status, never let an unexpected error crash a call
without a log line, and bind a fresh structlog context per call."""

from __future__ import annotations

import functools

import grpc
import structlog

from controlplane.errors import ApiError
from controlplane.validation import no_unknown_fields
from kvpush import log

_log = log.get("api")


def unary(method):
    @functools.wraps(method)
    async def handler(self, request, context):
        structlog.contextvars.clear_contextvars()
        try:
            if not self.view.ready.is_set():
                raise ApiError(grpc.StatusCode.UNAVAILABLE, "control plane is still loading the registry")
            no_unknown_fields(request)
            return await method(self, request, context)
        except ApiError as exc:
            await context.abort(exc.code, exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception:
            _log.exception("handler crashed", method=method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged)")
    return handler


def streaming(method):
    @functools.wraps(method)
    async def handler(self, request, context):
        structlog.contextvars.clear_contextvars()
        try:
            if not self.view.ready.is_set():
                raise ApiError(grpc.StatusCode.UNAVAILABLE, "control plane is still loading the registry")
            if hasattr(request, "DESCRIPTOR"):
                no_unknown_fields(request)
            async for item in method(self, request, context):
                yield item
        except ApiError as exc:
            await context.abort(exc.code, exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception:
            _log.exception("stream handler crashed", method=method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error (logged)")
    return handler

"""Bearer tokens from gRPC metadata: tenants, engines (sidecars) and the admin.

Tenant tokens are stored only as SHA-256 hashes; admin and engine tokens come
from the operator (flags, env or files) and are compared in constant time.
"""

from __future__ import annotations

import hmac
import secrets

import grpc

from kvpush.controlplane.errors import ApiError
from kvpush.controlplane.records import TenantRecord
from kvpush.controlplane.view import View

TOKEN_PREFIX = "kvp_"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def bearer(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata")


class Auth:
    def __init__(self, view: View, admin_token: str, engine_token: str | None = None) -> None:
        if len(admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        self._view = view
        self._admin = admin_token.encode()
        self._engine = (engine_token or admin_token).encode()

    def tenant(self, context: grpc.aio.ServicerContext) -> TenantRecord:
        tenant = self._view.tenant_for_token(bearer(context))
        if tenant is None:
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "unknown or revoked tenant token")
        return tenant

    def admin(self, context: grpc.aio.ServicerContext) -> None:
        if not hmac.compare_digest(bearer(context).encode(), self._admin):
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "admin token required")

    def engine(self, context: grpc.aio.ServicerContext) -> None:
        token = bearer(context).encode()
        if not (hmac.compare_digest(token, self._engine) or hmac.compare_digest(token, self._admin)):
            raise ApiError(grpc.StatusCode.UNAUTHENTICATED, "engine token required")

"""TLS credentials for gRPC clients, from PEM files: one home for every client (the
control plane's clients, and the control plane's own client of etcd)."""

from __future__ import annotations

import grpc


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """Trust ``ca`` (the system's roots when empty); present ``cert``/``key`` when given."""
    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as f:
            return f.read()
    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))

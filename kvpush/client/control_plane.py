"""A small client for the control plane: channel, credentials and the bearer token
in one place, used by the CLI, the router, the sidecars, tests and benchmarks."""

from __future__ import annotations

import grpc

from kvpush.contract.v1 import admin_pb2_grpc, registry_pb2_grpc, scheduler_pb2_grpc
from kvpush.tls import channel_credentials


class ControlPlaneClient:
    def __init__(self, address: str, token: str, tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                 server_name: str = "") -> None:
        # An address listing several replicas (ipv4:a,b or a dns:/// name) spreads calls over
        # them: each replica follows only its own engines' requests, so all of a fleet's
        # clients on the first one (gRPC's default, pick_first) would leave the others idle.
        # A replica restarted (a rolling upgrade) is dialled again within 2 s: with gRPC's default
        # backoff (1 s growing to 120 s) a client could fail fast for many seconds after it was back.
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.lb_policy_name", "round_robin"),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls_ca or tls_cert:
            self.channel = grpc.aio.secure_channel(address, channel_credentials(tls_ca, tls_cert, tls_key), options)
        else:
            self.channel = grpc.aio.insecure_channel(address, options)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.scheduler = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.registry = registry_pb2_grpc.RegistryStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "ControlPlaneClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

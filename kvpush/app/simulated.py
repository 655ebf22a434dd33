"""A SIMULATED engine: registers with the control plane and heartbeats like a
sidecar, but owns no memory and moves no bytes. For the control-plane demo,
tests and benchmarks only; its NIXL metadata is a labelled placeholder."""

from __future__ import annotations

import asyncio
import secrets

import grpc

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.engine import EngineRecord
from kvpush.contract.layout import KvLayout
from kvpush.contract.v1 import registry_pb2, types_pb2

SIMULATED_METADATA = b"SIMULATED-ENGINE: no NIXL agent behind this record"


class SimulatedEngine:
    def __init__(self, client: ControlPlaneClient, engine_id: str, num_blocks: int, model: str = "sim-model",
                 layout: KvLayout | None = None, role: int = types_pb2.DECODE, pool: str = "default",
                 lease_ttl_s: int = 5, serving_url: str = "") -> None:
        self.client = client
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.model = model
        self.layout = layout or KvLayout(num_layers=4, block_size=16, num_kv_heads=2, head_dim=64)
        self.role = role
        self.pool = pool
        self.lease_ttl_s = lease_ttl_s
        self.serving_url = serving_url
        self.incarnation = secrets.token_hex(6)
        self.lease_id = 0
        self._beat: asyncio.Task | None = None
        self._stop = asyncio.Event()

    def record(self) -> types_pb2.Engine:
        return EngineRecord(engine_id=self.engine_id, role=self.role, layout=self.layout, incarnation=self.incarnation,
                            nixl_agent=f"sim-{self.engine_id}", nixl_metadata=SIMULATED_METADATA,
                            num_blocks=self.num_blocks, model=self.model, pool=self.pool,
                            sidecar_address="simulated", serving_url=self.serving_url,
                            # (no pools behind a simulated engine: a rank per TP rank, at address 0)
                            rank_pools=((0, 0),) * self.layout.tp_size if self.layout.tp_size > 1 else ()).to_proto()

    async def register(self) -> registry_pb2.RegisterEngineResponse:
        resp = await self.client.registry.RegisterEngine(
            registry_pb2.RegisterEngineRequest(engine=self.record(), lease_ttl_seconds=self.lease_ttl_s),
            metadata=self.client.metadata, timeout=10)
        self.lease_id = resp.lease_id
        self._stop.clear()
        self._alive = asyncio.Event()
        self._beat = asyncio.create_task(self._heartbeat())
        # Registered means the heartbeat stream is up: from here on a crash is noticed.
        await asyncio.wait_for(self._alive.wait(), 10)
        return resp

    async def _heartbeat(self) -> None:
        async def pings():
            while not self._stop.is_set():
                yield registry_pb2.HeartbeatPing(engine_id=self.engine_id, lease_id=self.lease_id)
                try:
                    await asyncio.wait_for(self._stop.wait(), max(self.lease_ttl_s / 3, 0.5))
                except asyncio.TimeoutError:
                    pass
        try:
            async for _ in self.client.registry.Heartbeat(pings(), metadata=self.client.metadata):
                self._alive.set()
        except grpc.aio.AioRpcError:
            pass

    async def stop(self) -> None:
        """End the heartbeat stream cleanly: the engine is deregistered."""
        self._stop.set()
        if self._beat:
            await asyncio.gather(self._beat, return_exceptions=True)

    async def crash(self) -> None:
        """Vanish without a word (the stream is cut), as a killed sidecar would."""
        if self._beat:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)

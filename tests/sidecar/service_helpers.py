"""Helpers for the ``kvpush sidecar`` tests: the scheduler's side (tenant, Reserve) and
reading reservations straight from etcd, with cheap, bounded polling."""

from __future__ import annotations

import asyncio
import time

from kvpush.controlplane import keys
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.controlplane.etcd import EtcdClient
from kvpush.contract.states import State
from kvpush.contract.engine import EngineRecord
from kvpush.controlplane.records import ReservationRecord
from kvpush.contract.layout import KvLayout
from tests.controlplane.helpers import make_tenant, reserve, settle  # noqa: F401  (re-exported)
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN


def record_of(res) -> dict:
    """The part of a decode engine's record a prefill engine needs, from a Reservation."""
    return {"engine_id": res.engine_id, "incarnation": res.engine_incarnation,
            "layout": {"block_size": res.block_size}}


def layout_pb(text: str):
    return KvLayout.parse(text).to_proto()


class Etcd:
    """Direct reads of etcd (no control plane in between)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.client = EtcdClient(endpoint)

    async def reservation(self, rid: str) -> ReservationRecord | None:
        kv = await self.client.get(keys.reservation(rid))
        return ReservationRecord.decode(kv.value) if kv else None

    async def engine(self, engine_id: str) -> EngineRecord | None:
        kv = await self.client.get(keys.engine(engine_id))
        return EngineRecord.decode(kv.value) if kv else None

    async def wait_reservation(self, rid: str, predicate, timeout_s: float = 10.0,
                               interval_s: float = 0.03) -> ReservationRecord:
        deadline = time.monotonic() + timeout_s
        while True:
            rec = await self.reservation(rid)
            if rec is not None and predicate(rec):
                return rec
            if time.monotonic() > deadline:
                raise AssertionError(f"reservation {rid} did not reach the condition in {timeout_s} s: {rec}")
            await asyncio.sleep(interval_s)

    async def wait_state(self, rid: str, state: State, timeout_s: float = 30.0, **kw) -> ReservationRecord:
        return await self.wait_reservation(rid, lambda r: r.state == state, timeout_s, **kw)

    async def wait_engine(self, engine_id: str, present: bool, timeout_s: float = 10.0,
                          predicate=lambda e: True) -> EngineRecord | None:
        deadline = time.monotonic() + timeout_s
        while True:
            rec = await self.engine(engine_id)
            if (rec is not None and predicate(rec)) == present:
                return rec
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {engine_id} {'not ' if present else ''}registered after {timeout_s} s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.client.close()


class Scheduler:
    """Admin + one tenant + the engine token, against one control-plane address."""

    def __init__(self, address: str):
        self.address = address
        self.admin = ControlPlaneClient(address, ADMIN_TOKEN)
        self.engine = ControlPlaneClient(address, ENGINE_TOKEN)
        self.tenant: ControlPlaneClient | None = None

    async def setup(self, tenant: str = "t1") -> "Scheduler":
        self.tenant = await make_tenant(self.admin, self.address, tenant)
        return self

    async def reserve(self, request_id: str, num_tokens: int, model: str = "m", **kw):
        return await reserve(self.tenant, request_id, num_tokens, model=model, **kw)

    async def close(self) -> None:
        for c in (self.admin, self.engine, self.tenant):
            if c is not None:
                await c.close()


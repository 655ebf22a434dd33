"""Every lease's keep-alives on one long-lived ``LeaseKeepAlive`` stream per etcd
endpoint, instead of a stream opened and closed for each one.

Each engine's heartbeat refreshes its lease every TTL/3; opening a gRPC stream per
refresh cost about a millisecond of a replica's CPU, so 1,000 engines took a third of
a core doing nothing else (docs/SCALING.md). Here a refresh is one message on a shared
stream, and its answer (etcd answers each request, in order, with the lease id and its
remaining TTL: 0 when the lease is gone) wakes the caller waiting for that lease.

A stream that breaks, ends, or does not answer in time fails everything waiting on it
with the ``AioRpcError`` it ended with (DEADLINE_EXCEEDED for a silence), which the
client's retry loop answers as it answers any call: another endpoint, or unavailable.
The next refresh opens a fresh stream.
"""

from __future__ import annotations

import asyncio
import collections

import grpc
from aetcd import rpc


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class KeepAliveStream:
    def __init__(self, lease_stub: rpc.LeaseStub, metadata) -> None:
        self.metadata = metadata
        self._requests: asyncio.Queue = asyncio.Queue()
        self._waiting: dict[int, collections.deque[asyncio.Future]] = {}
        self._call = lease_stub.LeaseKeepAlive(self._send(), metadata=metadata)
        self._reader = asyncio.ensure_future(self._read())
        self.broken: grpc.aio.AioRpcError | None = None

    async def _send(self):
        while True:
            yield rpc.LeaseKeepAliveRequest(ID=await self._requests.get())

    async def _read(self) -> None:
        try:
            async for resp in self._call:
                waiters = self._waiting.get(resp.ID)
                if not waiters:
                    continue
                fut = waiters.popleft()
                if not waiters:
                    del self._waiting[resp.ID]
                if not fut.done():
                    fut.set_result(resp.TTL)
            self._break(_error(grpc.StatusCode.UNAVAILABLE, "etcd ended the keep-alive stream"))
        except grpc.aio.AioRpcError as exc:
            self._break(exc)
        except asyncio.CancelledError:
            self._break(_error(grpc.StatusCode.CANCELLED, "keep-alive stream closed"))
            raise

    def _break(self, exc: grpc.aio.AioRpcError) -> None:
        if self.broken is None:
            self.broken = exc
        waiting, self._waiting = self._waiting, {}
        for waiters in waiting.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(self.broken)

    async def refresh(self, lease_id: int, timeout: float) -> int:
        """The lease's remaining TTL after one keep-alive (0 or less: it is gone)."""
        if self.broken is not None:
            raise self.broken
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(lease_id, collections.deque()).append(fut)
        self._requests.put_nowait(lease_id)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            # A member that stopped answering: this stream is done with; the caller fails over.
            self.close(_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no keep-alive answer within {timeout:.2f} s"))
            raise self.broken from None

    def close(self, exc: grpc.aio.AioRpcError | None = None) -> None:
        self._break(exc or _error(grpc.StatusCode.CANCELLED, "keep-alive stream closed"))
        self._call.cancel()
        self._reader.cancel()

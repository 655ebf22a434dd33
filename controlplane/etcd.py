"""A thin asyncio etcd client: transactions with revisions, leases, prefix watches.

It uses the protocol stubs that ship with aetcd (one etcd proto registration per
process) over our own gRPC channel, because the control plane needs what aetcd's
high-level API drops: the header revision of a transaction, ``ignore_lease`` on
puts, and a watch whose compaction we handle ourselves. ``--etcd a:1,b:2`` gives
gRPC several endpoints; it fails over between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator, Iterable, Sequence

import grpc
from aetcd import rpc

from controlplane import metrics

# etcd answers these while it is down, restarting or has no leader.
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}


class EtcdUnavailable(Exception):
    """etcd cannot be reached (or has no leader); the caller answers UNAVAILABLE."""


class EtcdLeaseNotFound(Exception):
    """A put named a lease that has expired or been revoked."""


class WatchCompacted(Exception):
    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"watch start revision compacted (at {compact_revision})")
        self.compact_revision = compact_revision


@dataclasses.dataclass(frozen=True)
class KV:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    deleted: bool
    kv: KV


@dataclasses.dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    ranges: list[list[KV]]  # one list per range op, in order
    nested: list[bool] = dataclasses.field(default_factory=list)  # per nested txn op: did it succeed


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end[: len(end)])
        end.pop()
    return b"\0"


def watch_event(ev) -> WatchEvent:
    return WatchEvent(ev.type == rpc.Event.DELETE, _kv(ev.kv))


def _kv(msg) -> KV:
    return KV(msg.key, msg.value, msg.mod_revision, msg.create_revision, msg.lease)


# Builders for transaction parts, so callers never touch raw protobufs.
def cmp_mod(key: bytes, revision: int):
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def cmp_create(key: bytes, revision: int):
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                       create_revision=revision)


def op_put(key: bytes, value: bytes, lease: int = 0, keep_lease: bool = False):
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=0 if keep_lease else lease,
                                                    ignore_lease=keep_lease))


def op_touch(key: bytes):
    """Bump a key's mod revision, keeping its value and lease (a fence write)."""
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, ignore_value=True, ignore_lease=True))


def op_delete(key: bytes):
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def op_delete_prefix(prefix: bytes):
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=prefix, range_end=prefix_end(prefix)))


def op_txn(compare: Sequence, success: Sequence):
    """A nested transaction: many independent compare-and-swaps in one round trip."""
    return rpc.RequestOp(request_txn=rpc.TxnRequest(compare=list(compare), success=list(success)))


def op_get(key: bytes, prefix: bool = False):
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=prefix_end(key) if prefix else b""))


class EtcdClient:
    def __init__(self, endpoints: str, timeout: float = 5.0) -> None:
        hosts = [e.strip() for e in endpoints.split(",") if e.strip()]
        if not hosts:
            raise ValueError("--etcd needs at least one host:port")
        # "ipv4:a:1,b:2" is gRPC's static multi-address target; names go through dns.
        if all(h.split(":")[0].replace(".", "").isdigit() for h in hosts):
            target = "ipv4:" + ",".join(hosts)
        else:
            target = "dns:///" + hosts[0]
        self.endpoints = hosts
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ])
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, fn, request, timeout: float | None = None):
        try:
            return await fn(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _UNAVAILABLE_CODES:
                raise EtcdUnavailable(f"etcd: {exc.code().name}: {exc.details()}") from exc
            if "lease not found" in (exc.details() or ""):
                raise EtcdLeaseNotFound(exc.details()) from exc
            raise

    async def txn(self, compare: Sequence, success: Sequence, failure: Sequence = ()) -> TxnResult:
        started = time.perf_counter()
        resp = await self._call(self._kv.Txn, rpc.TxnRequest(compare=list(compare), success=list(success),
                                                            failure=list(failure)))
        metrics.ETCD_TXN_LATENCY.observe(time.perf_counter() - started)
        ranges = [[_kv(kv) for kv in r.response_range.kvs] for r in resp.responses
                  if r.WhichOneof("response") == "response_range"]
        nested = [r.response_txn.succeeded for r in resp.responses if r.WhichOneof("response") == "response_txn"]
        return TxnResult(resp.succeeded, resp.header.revision, ranges, nested)

    async def get_prefix(self, prefix: bytes, revision: int = 0, page: int = 5000) -> tuple[list[KV], int]:
        """Every key under ``prefix`` as of one revision (the first page's, unless given).
        Read in pages: a registry of 200k reservations is ~100 MB, over gRPC's message limit."""
        end, start, out = prefix_end(prefix), prefix, []
        while True:
            resp = await self._call(self._kv.Range, rpc.RangeRequest(key=start, range_end=end, revision=revision,
                                                                     limit=page))
            out += [_kv(kv) for kv in resp.kvs]
            revision = revision or resp.header.revision
            if not resp.more or not resp.kvs:
                return out, revision
            start = resp.kvs[-1].key + b"\0"

    async def get(self, key: bytes) -> KV | None:
        resp = await self._call(self._kv.Range, rpc.RangeRequest(key=key))
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        resp = await self._call(self._kv.Put, rpc.PutRequest(key=key, value=value, lease=lease))
        return resp.header.revision

    async def delete(self, key: bytes) -> int:
        resp = await self._call(self._kv.DeleteRange, rpc.DeleteRangeRequest(key=key))
        return resp.deleted

    async def grant_lease(self, ttl: int) -> int:
        resp = await self._call(self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl))
        if resp.error:
            raise EtcdUnavailable(f"lease grant failed: {resp.error}")
        return resp.ID

    async def refresh_lease(self, lease_id: int) -> int:
        """One keep-alive; returns the remaining TTL (0 or less: the lease is gone)."""
        async def one():
            yield rpc.LeaseKeepAliveRequest(ID=lease_id)
        try:
            call = self._lease.LeaseKeepAlive(one(), timeout=self.timeout)
            async for resp in call:
                return resp.TTL
        except grpc.aio.AioRpcError as exc:
            raise EtcdUnavailable(f"etcd keepalive: {exc.code().name}") from exc
        return 0

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke; a lease already gone (expired, or revoked by a racing call) is fine."""
        try:
            await self._call(self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id))
        except EtcdLeaseNotFound:
            pass
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def watch_prefix(self, prefix: bytes, start_revision: int) -> AsyncIterator[tuple[int, Sequence]]:
        """Yields (revision, etcd events) from ``start_revision`` on (``watch_event``
        turns one into a WatchEvent); progress notifications come as empty event lists
        so idle watchers still learn the current revision."""
        requests: asyncio.Queue = asyncio.Queue()
        await requests.put(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision,
            progress_notify=True)))  # no prev_kv: etcd would read every previous value for nothing

        async def request_stream():
            while True:
                yield await requests.get()

        call = self._watch.Watch(request_stream())
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise WatchCompacted(resp.compact_revision)
                if resp.canceled:
                    raise EtcdUnavailable(f"watch canceled: {resp.cancel_reason}")
                # Raw events: one revision can delete tens of thousands of keys (a lease
                # running out), and the caller converts them a slice at a time.
                yield resp.header.revision, resp.events
        except grpc.aio.AioRpcError as exc:
            raise EtcdUnavailable(f"watch: {exc.code().name}: {exc.details()}") from exc
        finally:
            call.cancel()
        raise EtcdUnavailable("watch stream ended")


def chunks(items: Iterable, size: int) -> Iterable[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

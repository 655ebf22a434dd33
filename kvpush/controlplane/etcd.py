"""A thin asyncio etcd client: transactions with revisions, leases, prefix watches.

It uses the protocol stubs that ship with aetcd (one etcd proto registration per
process) over our own gRPC channel, because the control plane needs what aetcd's
high-level API drops: the header revision of a transaction, ``ignore_lease`` on
puts, and a watch whose compaction we handle ourselves.

Endpoints: ``--etcd a:2379,b:2379,https://c:2379`` (names or addresses). Each endpoint
is a channel of its own (a name is resolved by gRPC, again after a reconnect, so a
member whose address changed is followed). Calls go to the current endpoint; one that
answers unavailable (down, no leader, timed out) makes the next endpoint current. Reads
and lease keep-alives are retried on the next endpoints, within the call's timeout. A
write is retried only when etcd certainly did not apply it (no connection to the member,
or no leader: an election), so a Reserve rides out a leader's death as latency. A write
whose answer was lost (a timeout) may have committed, and a retry could commit it again:
the caller gets ``EtcdUnavailable``, and a retried Reserve with the same request id is
idempotent.

Security (``EtcdSecurity``): TLS to etcd, with a client certificate for etcd's
``--client-cert-auth``, and/or etcd's user/password authentication. With TLS configured,
a plaintext (``http://``) endpoint is refused. Auth tokens are kept per endpoint and
renewed when etcd says a token is invalid: simple tokens are valid only on the member
that issued them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Iterable, NamedTuple, Sequence

import grpc
from aetcd import rpc

from kvpush.controlplane import metrics
from kvpush.controlplane.etcd_keepalive import KeepAliveStream
from kvpush.tls import channel_credentials

log = logging.getLogger(__name__)

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


class KV(NamedTuple):
    # A tuple, not a frozen dataclass: every watch event and every write a replica
    # applies makes one, and a frozen dataclass's __init__ costs five times as much.
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int
    version: int = 0  # etcd's count of puts since the key was created (0: not known)


class WatchEvent(NamedTuple):
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
    return KV(msg.key, msg.value, msg.mod_revision, msg.create_revision, msg.lease, msg.version)


# Builders for transaction parts, so callers never touch raw protobufs.
def cmp_mod(key: bytes, revision: int):
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def cmp_create(key: bytes, revision: int):
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                       create_revision=revision)


def compared(compares: Sequence) -> dict[bytes, int]:
    """key -> the revision each compare (``cmp_mod``, ``cmp_create``) expects it at (0: absent)."""
    return {c.key: c.mod_revision if c.target == rpc.Compare.MOD else c.create_revision for c in compares}


def op_put(key: bytes, value: bytes, lease: int = 0, keep_lease: bool = False):
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=0 if keep_lease else lease,
                                                    ignore_lease=keep_lease))


def op_key(op) -> bytes:
    """The key a put or a delete writes."""
    return getattr(op, op.WhichOneof("request")).key


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


@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    """How the control plane authenticates to etcd (every field optional)."""

    ca: str = ""  # PEM: speak TLS to every endpoint, trusting this CA
    cert: str = ""  # PEM client certificate and key (etcd's --client-cert-auth)
    key: str = ""
    user: str = ""  # etcd authentication (auth enabled on the cluster)
    password: str = ""
    server_name: str = ""  # the name the members' certificates carry, when endpoints are addresses

    @property
    def tls(self) -> bool:
        return bool(self.ca or self.cert)


def parse_endpoints(endpoints: str, security: EtcdSecurity) -> tuple[list[str], bool]:
    """``--etcd`` items to ``host:port`` targets, and whether they speak TLS; a mix, or a
    plaintext endpoint where TLS is configured, is refused naming it."""
    items = [e.strip() for e in endpoints.split(",") if e.strip()]
    if not items:
        raise ValueError("--etcd needs at least one host:port")
    hosts, schemes = [], set()
    for item in items:
        scheme, sep, rest = item.partition("://")
        if not sep:
            scheme, rest = "", item
        elif scheme not in ("http", "https"):
            raise ValueError(f"--etcd endpoint {item!r}: scheme must be http:// or https://")
        host, colon, port = rest.rstrip("/").rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"--etcd endpoint {item!r}: expected host:port")
        if scheme == "http" and security.tls:
            raise ValueError(f"--etcd endpoint {item!r} is plaintext, and TLS to etcd is configured")
        schemes.add(scheme or ("https" if security.tls else "http"))
        hosts.append(f"{host}:{port}")
    if len(schemes) > 1:
        raise ValueError("--etcd mixes http:// and https:// endpoints")
    return hosts, schemes == {"https"}


class _Endpoint:
    def __init__(self, target: str, channel: grpc.aio.Channel) -> None:
        self.target = target
        self.channel = channel
        self.kv = rpc.KVStub(channel)
        self.lease = rpc.LeaseStub(channel)
        self.watch = rpc.WatchStub(channel)
        self.auth = rpc.AuthStub(channel)
        self.maintenance = rpc.MaintenanceStub(channel)
        self.token: str | None = None
        self.keepalives: KeepAliveStream | None = None  # every lease's refreshes, one stream


# Answers after which etcd has certainly not applied a request: it never reached a member,
# or the member refused it before proposing it (no leader). Only these retry a write.
_NOT_APPLIED = ("failed to connect", "connection refused", "connections to all backends failing",
                "etcdserver: no leader")


def _never_applied(exc: grpc.aio.AioRpcError | None) -> bool:
    return exc is not None and exc.code() == grpc.StatusCode.UNAVAILABLE and any(
        text in (exc.details() or "").lower() for text in _NOT_APPLIED)


def _auth_expired(exc: grpc.aio.AioRpcError) -> bool:
    details = exc.details() or ""
    return "invalid auth token" in details or "revision of auth store is old" in details


class EtcdClient:
    def __init__(self, endpoints: str, timeout: float = 5.0, security: EtcdSecurity | None = None) -> None:
        self.security = security or EtcdSecurity()
        hosts, tls = parse_endpoints(endpoints, self.security)
        self.endpoints = hosts
        self.timeout = timeout
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.lb_policy_name", "round_robin"),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]
        sec = self.security
        if sec.server_name:
            options.append(("grpc.ssl_target_name_override", sec.server_name))
        creds = channel_credentials(sec.ca, sec.cert, sec.key) if tls else None
        self._eps = [_Endpoint(h, grpc.aio.secure_channel(h, creds, options) if creds else
                               grpc.aio.insecure_channel(h, options)) for h in hosts]
        self._current = 0

    async def close(self) -> None:
        for ep in self._eps:
            if ep.keepalives is not None:
                ep.keepalives.close()
            await ep.channel.close()

    @property
    def current_endpoint(self) -> str:
        return self._eps[self._current].target

    def _fail_over(self, ep: _Endpoint, exc: grpc.aio.AioRpcError) -> None:
        if len(self._eps) > 1 and self._eps[self._current] is ep:
            self._current = (self._current + 1) % len(self._eps)
            log.warning("etcd endpoint %s unavailable (%s: %s); now using %s", ep.target, exc.code().name,
                        exc.details(), self._eps[self._current].target)

    async def _metadata(self, ep: _Endpoint, renew: bool = False):
        sec = self.security
        if not sec.user:
            return None
        if ep.token is None or renew:
            resp = await ep.auth.Authenticate(rpc.AuthenticateRequest(name=sec.user, password=sec.password),
                                              timeout=self.timeout)
            ep.token = resp.token
        return (("token", ep.token),)

    async def _call(self, service: str, method: str, request, timeout: float | None = None,
                    idempotent: bool = False):
        """One unary RPC (``ep.<service>.<method>``), as ``_retrying`` runs it."""
        def invoke(ep: _Endpoint, metadata, call_timeout: float):
            return getattr(getattr(ep, service), method)(request, timeout=call_timeout, metadata=metadata)
        return await self._retrying(invoke, timeout, idempotent)

    async def _retrying(self, invoke, timeout: float | None = None, idempotent: bool = False):
        """``await invoke(endpoint, metadata, timeout)``, within ``timeout`` in all. Retried
        on the next endpoints while that lasts when it is ``idempotent``, or when etcd
        certainly did not apply it (no connection, no leader: an election); never after an
        answer that leaves it unknown."""
        budget = timeout or self.timeout
        deadline = time.monotonic() + budget
        last: grpc.aio.AioRpcError | None = None
        tried = 0
        while True:
            ep = self._eps[self._current]
            remaining = deadline - time.monotonic()
            if remaining <= 0 and last is not None:
                break
            renew = False
            for _auth_try in range(2):
                try:
                    metadata = await self._metadata(ep, renew)
                    return await invoke(ep, metadata, max(remaining, 0.05))
                except grpc.aio.AioRpcError as exc:
                    if _auth_expired(exc) and not renew and self.security.user:
                        renew = True
                        continue
                    if exc.code() not in _UNAVAILABLE_CODES:
                        if "lease not found" in (exc.details() or ""):
                            raise EtcdLeaseNotFound(exc.details()) from exc
                        raise
                    self._fail_over(ep, exc)
                    last = exc
                    break
            if not (idempotent or _never_applied(last)):
                break
            tried += 1
            if tried % len(self._eps) == 0:  # every endpoint said so: an election, give it a moment
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        raise EtcdUnavailable(f"etcd: {last.code().name}: {last.details()}") from last

    async def txn(self, compare: Sequence, success: Sequence, failure: Sequence = ()) -> TxnResult:
        started = time.perf_counter()
        resp = await self._call("kv", "Txn", rpc.TxnRequest(compare=list(compare), success=list(success),
                                                           failure=list(failure)))
        metrics.ETCD_TXN_LATENCY.observe(time.perf_counter() - started)
        ranges = [[_kv(kv) for kv in r.response_range.kvs] for r in resp.responses
                  if r.WhichOneof("response") == "response_range"]
        nested = [r.response_txn.succeeded for r in resp.responses if r.WhichOneof("response") == "response_txn"]
        return TxnResult(resp.succeeded, resp.header.revision, ranges, nested)

    async def get_prefix(self, prefix: bytes, revision: int = 0, page: int = 5000) -> tuple[list[KV], int]:
        """Every key under ``prefix`` as of one revision (the first page's, unless given).
        Read in pages: a registry of 200k reservations is ~100 MB, over gRPC's message limit."""
        return await self.get_range(prefix, prefix_end(prefix), revision, page)

    async def get_range(self, start: bytes, end: bytes, revision: int = 0,
                        page: int = 5000) -> tuple[list[KV], int]:
        """Every key in [start, end) as of one revision, as ``get_prefix``."""
        out: list[KV] = []
        while True:
            resp = await self._call("kv", "Range", rpc.RangeRequest(key=start, range_end=end, revision=revision,
                                                                    limit=page), idempotent=True)
            out += [_kv(kv) for kv in resp.kvs]
            revision = revision or resp.header.revision
            if not resp.more or not resp.kvs:
                return out, revision
            start = resp.kvs[-1].key + b"\0"

    async def get(self, key: bytes) -> KV | None:
        resp = await self._call("kv", "Range", rpc.RangeRequest(key=key), idempotent=True)
        return _kv(resp.kvs[0]) if resp.kvs else None

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        resp = await self._call("kv", "Put", rpc.PutRequest(key=key, value=value, lease=lease))
        return resp.header.revision

    async def delete(self, key: bytes) -> int:
        resp = await self._call("kv", "DeleteRange", rpc.DeleteRangeRequest(key=key))
        return resp.deleted

    async def grant_lease(self, ttl: int) -> int:
        # Retried: a grant whose answer was lost leaves a lease nobody uses, which expires.
        resp = await self._call("lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=ttl), idempotent=True)
        if resp.error:
            raise EtcdUnavailable(f"lease grant failed: {resp.error}")
        return resp.ID

    async def refresh_lease(self, lease_id: int) -> int:
        """One keep-alive; returns the remaining TTL (0 or less: the lease is gone)."""
        async def first_ttl(ep: _Endpoint, metadata, call_timeout: float) -> int:
            stream = ep.keepalives
            if stream is None or stream.broken is not None or stream.metadata != metadata:
                if stream is not None:
                    stream.close()
                stream = ep.keepalives = KeepAliveStream(ep.lease, metadata)
            return await stream.refresh(lease_id, call_timeout)
        try:
            return await self._retrying(first_ttl, idempotent=True)
        # The heartbeat answers any failure of its keep-alive as etcd unavailable.
        except grpc.aio.AioRpcError as exc:
            raise EtcdUnavailable(f"etcd keepalive: {exc.code().name}: {exc.details()}") from exc
        except EtcdLeaseNotFound as exc:
            raise EtcdUnavailable(f"etcd keepalive: {exc}") from exc

    async def member_versions(self, timeout: float = 2.0) -> dict[str, str]:
        """Each endpoint's etcd release, as its status says; one that does not answer
        within ``timeout`` is left out."""
        async def one(ep: _Endpoint) -> str | None:
            try:
                resp = await ep.maintenance.Status(rpc.StatusRequest(), timeout=timeout,
                                                   metadata=await self._metadata(ep))
                return resp.version
            except grpc.aio.AioRpcError:
                return None
        answers = await asyncio.gather(*(one(ep) for ep in self._eps))
        return {ep.target: v for ep, v in zip(self._eps, answers) if v}

    async def revoke_lease(self, lease_id: int) -> None:
        """Revoke; a lease already gone (expired, or revoked by a racing call) is fine."""
        try:
            # etcd deletes every key of the lease in this call: tens of thousands at times
            await self._call("lease", "LeaseRevoke", rpc.LeaseRevokeRequest(ID=lease_id),
                             timeout=max(self.timeout, 10.0))
        except EtcdLeaseNotFound:
            pass
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise


class RangeWatch:
    """One etcd watch stream carrying a watcher per key range, each with an id of our
    choosing. Ranges are added and cancelled while it runs. ``request_progress`` asks etcd
    for the revision up to which every watcher on the stream has been sent its events: its
    answer comes as watch id ``PROGRESS``. (etcd before 3.5.8 may send that answer just
    ahead of events already due, so treat it as a hint for waiting, never as a fence.)"""

    PROGRESS = -1

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._requests: asyncio.Queue = asyncio.Queue()
        self._next_id = 1
        self._cancelled: set[int] = set()

    def add(self, start: bytes, end: bytes, start_revision: int) -> int:
        watch_id, self._next_id = self._next_id, self._next_id + 1
        # no prev_kv: etcd would read every previous value for nothing
        self._requests.put_nowait(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
            key=start, range_end=end, start_revision=start_revision, progress_notify=True, watch_id=watch_id)))
        return watch_id

    def cancel(self, watch_id: int) -> None:
        self._cancelled.add(watch_id)
        self._requests.put_nowait(rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch_id)))

    def request_progress(self) -> None:
        self._requests.put_nowait(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))

    async def responses(self) -> AsyncIterator[tuple[int, int, Sequence]]:
        """Yields (watch id, header revision, raw etcd events) for the live watchers, and
        (PROGRESS, revision, ()) for progress answers. Raises WatchCompacted when a
        watcher's start was compacted away, EtcdUnavailable when the stream breaks."""
        client = self._client

        async def request_stream():
            while True:
                yield await self._requests.get()

        ep = client._eps[client._current]
        try:
            call = ep.watch.Watch(request_stream(), metadata=await client._metadata(ep))
        except grpc.aio.AioRpcError as exc:  # the authentication before it
            client._fail_over(ep, exc)
            raise EtcdUnavailable(f"watch: {exc.code().name}: {exc.details()}") from exc
        try:
            async for resp in call:
                if resp.compact_revision:
                    raise WatchCompacted(resp.compact_revision)
                if resp.canceled:
                    if resp.watch_id in self._cancelled:
                        continue
                    raise EtcdUnavailable(f"watch canceled: {resp.cancel_reason}")
                if resp.watch_id in self._cancelled or resp.created:
                    continue
                yield resp.watch_id, resp.header.revision, resp.events
        except grpc.aio.AioRpcError as exc:
            if _auth_expired(exc):
                ep.token = None
            client._fail_over(ep, exc)
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

"""The control-plane process: one replica. Any number can run against one etcd."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import GaugeMetricFamily

from kvpush.controlplane import etcd_versions, free_summary, keys, metrics
from kvpush.controlplane.admin_service import AdminService
from kvpush.controlplane.api import add_service
from kvpush.controlplane.auth import Auth
from kvpush.controlplane.etcd import EtcdClient, EtcdSecurity
from kvpush.controlplane.leases import LeaseBuckets
from kvpush.controlplane.lifecycle import Lifecycle
from kvpush.controlplane.ownership import Membership, Ownership
from kvpush.controlplane.reaper import Reaper
from kvpush.controlplane.records import ReplicaRecord, now_ms
from kvpush.controlplane.registry_service import RegistryService
from kvpush.controlplane.reserver import Reserver
from kvpush.controlplane.scheduler_service import DEFAULT_DEADLINE_MS, SchedulerService
from kvpush.controlplane.follow import follow
from kvpush.controlplane.following import Following
from kvpush.controlplane.forwarding import Forwarder, PeerTls
from kvpush.controlplane.quota_shares import QuotaShares
from kvpush.controlplane.view import QUARANTINE_MS, View
from kvpush import log
from kvpush.aio import tune_gc, until_signalled, write_ready_file
from kvpush.contract.v1 import admin_pb2, admin_pb2_grpc, registry_pb2, registry_pb2_grpc, scheduler_pb2, \
    scheduler_pb2_grpc

_log = log.get("controlplane")
MAX_MESSAGE_BYTES = 4 << 20


@dataclasses.dataclass
class ControlPlaneConfig:
    listen: str = "127.0.0.1:50051"
    etcd: str = "127.0.0.1:2379"          # every member: host:port or https://host:port, comma-separated
    etcd_security: EtcdSecurity = dataclasses.field(default_factory=EtcdSecurity)
    # A call in flight when etcd's leader dies gets no answer: it waits this long, then the
    # next endpoint takes over. An election takes about a second (etcd's election timeout).
    etcd_timeout_s: float = 2.0
    admin_token: str = ""
    engine_token: str = ""
    metrics_port: int = 0                 # 0: no metrics endpoint
    metrics_host: str = "127.0.0.1"
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""               # set: clients must present a certificate (mTLS)
    max_batch: int = 60                   # etcd's default --max-txn-ops is 128
    group_commit: bool = True
    default_deadline_ms: int = DEFAULT_DEADLINE_MS
    replica_id: str = ""
    follow_all: bool = False  # follow every slot, not just those owned and needed (following.py)
    forward: bool = True      # send a Reserve for another replica's engine to its owner (elsewhere.py)
    quota_shares: bool = True  # hold shares of quota tenants' quotas (quota_shares.py)
    advertise: str = ""       # host:port the other replicas reach this one at (default: --listen's)
    peer_tls_ca: str = ""     # with TLS: the CA that signed the other replicas' certificates (forwarding)
    peer_tls_server_name: str = ""  # the name their certificates carry, when not their advertised host
    sweep_interval_s: float = 2.0
    quarantine_ms: int = QUARANTINE_MS    # blocks of unconsumed endings stay unused this long
    tombstone_ttl_s: int = 120            # an ended reservation stays readable this long (docs/SCALING.md)


class _ViewCollector:
    """Gauges read from the view at scrape time, so they can never go stale."""

    def __init__(self, view: View) -> None:
        self._view = view

    def collect(self):
        states = GaugeMetricFamily("kvpush_reservations", "Reservations known to this replica, by state",
                                   labels=["state"])
        for state, count in sorted(self._view.live_by_state().items()):
            states.add_metric([state], count)
        yield states
        free = GaugeMetricFamily("kvpush_engine_free_blocks", "Free landing blocks per engine this replica follows "
                                 "(each engine by its owner at least: take the max over replicas)", labels=["engine"])
        for engine_id in sorted(self._view.engines):
            if self._view.followed(keys.slot_of(engine_id)):
                free.add_metric([engine_id], self._view.free_blocks(engine_id))
        yield free


def server_credentials(cfg: ControlPlaneConfig) -> grpc.ServerCredentials | None:
    if not cfg.tls_cert:
        return None
    with open(cfg.tls_cert, "rb") as f:
        cert = f.read()
    with open(cfg.tls_key, "rb") as f:
        key = f.read()
    ca = None
    if cfg.tls_client_ca:
        with open(cfg.tls_client_ca, "rb") as f:
            ca = f.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def peer_tls(cfg: ControlPlaneConfig) -> tuple[bool, PeerTls | None]:
    """(whether Reserves may be forwarded to other replicas, how to dial them over TLS).
    With TLS a replica dials its peers presenting its own certificate (what mTLS asks of
    any client) and trusts --peer-tls-ca; without that CA it does not forward."""
    if not cfg.forward:
        return False, None
    if not cfg.tls_cert:
        return True, None
    if not cfg.peer_tls_ca:
        _log.info("Reserves are not forwarded to their engines' owners: TLS is on and no --peer-tls-ca "
                  "says whom to trust; a replica commits them itself (docs/SCALING.md)")
        return False, None
    return True, PeerTls(cfg.peer_tls_ca, cfg.tls_cert, cfg.tls_key, cfg.peer_tls_server_name)


class ControlPlane:
    def __init__(self, cfg: ControlPlaneConfig) -> None:
        self.cfg = cfg
        self.replica_id = cfg.replica_id or f"cp-{os.getpid()}-{secrets.token_hex(3)}"
        self.etcd = EtcdClient(cfg.etcd, timeout=cfg.etcd_timeout_s, security=cfg.etcd_security)
        self.view = View(cfg.quarantine_ms)
        self.leases = LeaseBuckets(self.etcd, cfg.tombstone_ttl_s)
        self.lifecycle = Lifecycle(self.etcd, self.view, self.leases, group_commit=cfg.group_commit)
        self.ownership = Ownership(self.view, self.replica_id)
        self.following = Following(self.view, self.ownership, follow_all=cfg.follow_all)
        self._membership: Membership | None = None
        self.quota_shares = QuotaShares(self.view, self.replica_id,
                                        lambda: self._membership.lease if self._membership is not None else 0,
                                        lambda: len(self.ownership.members), enabled=cfg.quota_shares)
        self.reserver = Reserver(self.etcd, self.view, self.leases, max_batch=cfg.max_batch, ownership=self.ownership,
                                 following=self.following, quota=self.quota_shares)
        self.reserver.batch_all_of_queue = cfg.group_commit
        forward, tls = peer_tls(cfg)
        self.forwarder = Forwarder(self.view, self.replica_id, self.reserver, tls, enabled=forward)
        self.reaper = Reaper(self.view, self.lifecycle, cfg.sweep_interval_s)
        self.auth = Auth(self.view, cfg.admin_token, cfg.engine_token or None)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._stop = asyncio.Event()
        self._follow: asyncio.Task | None = None
        self._member: asyncio.Task | None = None
        self._version_check: asyncio.Task | None = None
        self.etcd_defects: dict[str, list[str]] = {}  # endpoint -> what its release is known to lose
        self._health = health.aio.HealthServicer()

    async def start(self) -> None:
        self._follow = asyncio.gather(
            asyncio.create_task(follow(self.view, self.etcd, self._stop, self.following.interest), name="view-follow"),
            asyncio.create_task(self.following.run(self._stop), name="following"))
        self.reserver.start()
        self.reaper.start()
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.so_reuseport", 0),
        ])
        add_service(self.server, scheduler_pb2_grpc.add_SchedulerServicer_to_server,
                    SchedulerService(self.view, self.auth, self.reserver, self.lifecycle, self.etcd,
                                     self.following, self.forwarder, self.ownership, self.cfg.default_deadline_ms))
        self.registry = RegistryService(self.view, self.auth, self.etcd, self.lifecycle, self.following)
        add_service(self.server, registry_pb2_grpc.add_RegistryServicer_to_server, self.registry)
        add_service(self.server, admin_pb2_grpc.add_AdminServicer_to_server,
                    AdminService(self.view, self.auth, self.etcd, self.lifecycle, self.ownership,
                                 self.following))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        names = [d.services_by_name[n].full_name for d, n in (
            (scheduler_pb2.DESCRIPTOR, "Scheduler"), (registry_pb2.DESCRIPTOR, "Registry"),
            (admin_pb2.DESCRIPTOR, "Admin"))]
        reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        creds = server_credentials(self.cfg)
        if creds is None:
            self.port = self.server.add_insecure_port(self.cfg.listen)
        else:
            self.port = self.server.add_secure_port(self.cfg.listen, creds)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.cfg.listen}")
        await self.server.start()
        for name in names + [""]:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.cfg.metrics_port:
            REGISTRY.register(_ViewCollector(self.view))
            start_http_server(self.cfg.metrics_port, addr=self.cfg.metrics_host)
        self._membership = Membership(self.etcd, ReplicaRecord(self.replica_id, self._advertised(), now_ms()))
        self._member = asyncio.gather(
            asyncio.create_task(self._membership.run(self._stop), name="membership"),
            asyncio.create_task(free_summary.publish(self.etcd, self.view, self.ownership, self._membership,
                                                     self._stop), name="free-summary"),
            asyncio.create_task(self.quota_shares.run(self.etcd, self._stop), name="quota-shares"))
        asyncio.create_task(self._serving_when_ready(names + [""]))
        self._version_check = asyncio.create_task(self._check_etcd_versions(), name="etcd-versions")
        _log.info("control plane listening", listen=self.cfg.listen, port=self.port, etcd=self.cfg.etcd,
                  replica_id=self.replica_id, tls=creds is not None, metrics_port=self.cfg.metrics_port)

    def _advertised(self) -> str:
        """The address its membership record gives: --advertise, else the listen address with
        the port bound (a replica listening on 0.0.0.0 says so, and is not forwarded to)."""
        if self.cfg.advertise:
            return self.cfg.advertise
        host = self.cfg.listen.rpartition(":")[0] or "127.0.0.1"
        return f"{host}:{self.port}"

    async def _check_etcd_versions(self) -> None:
        """Say so, at start, of every member of --etcd on a release known to lose writes it
        acknowledged: what the registry promises (no answered reservation lost) rests on it."""
        versions = await self.etcd.member_versions()
        if unread := [ep for ep in self.etcd.endpoints if ep not in versions]:
            _log.warning("could not read the etcd release of these members at start; not checked for "
                         "known defects", endpoints=unread)
        for endpoint, version in versions.items():
            if found := etcd_versions.defects(version):
                self.etcd_defects[endpoint] = found
                _log.warning("etcd member has a known defect: upgrade it", endpoint=endpoint, version=version,
                             defects=found, safe_from=etcd_versions.CRASH_SAFE_FROM)
        metrics.ETCD_DEFECTIVE_MEMBERS.set(len(self.etcd_defects))

    async def _serving_when_ready(self, names: list[str]) -> None:
        await self.view.ready.wait()
        for name in names:
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float = 2.0) -> None:
        self._stop.set()
        if self.server is not None:
            self.registry.shutting_down = True  # a rolling restart must not kill the engines
        if self.server is not None:
            await self.server.stop(grace)
        await self.forwarder.close()
        await self.reserver.stop()
        await self.reaper.stop()
        if self._member is not None:
            self._member.cancel()  # (it may be waiting on a keep-alive to an unreachable etcd)
            await asyncio.gather(self._member, return_exceptions=True)
            await self._membership.leave()  # the others take its engines now, not after the TTL
        for task in (self._follow, self._version_check):
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.etcd.close()

    async def wait_closed(self) -> None:
        await self.server.wait_for_termination()


async def serve(cfg: ControlPlaneConfig, ready_file: str | None = None) -> None:
    cp = ControlPlane(cfg)
    await cp.start()
    await cp.view.ready.wait()
    tune_gc()
    metrics.watch_gc()
    write_ready_file(ready_file, f"{cp.port}\n")
    await until_signalled()
    _log.info("shutting down")
    await cp.stop()

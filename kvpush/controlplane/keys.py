"""The etcd key schema (DESIGN.md §4). Every key the control plane writes is built here."""

from __future__ import annotations

ROOT = b"/kvpush/v1/"
TENANTS = ROOT + b"tenants/"
ENGINES = ROOT + b"engines/"
POOLS = ROOT + b"pools/"              # per-engine fence: bumped by every reservation on it
RESERVATIONS = ROOT + b"reservations/"
REQUESTS = ROOT + b"requests/"        # (tenant, request id) -> reservation id, for idempotency
USAGE = ROOT + b"usage/"              # per-tenant fence: bumped by its quota-checked Reserves and record writes
PREFIXES = ROOT + b"prefixes/"        # per decode engine: its last prefix report (on the engine's lease)
REPLICAS = ROOT + b"replicas/"        # per live control-plane replica (on its own lease): who owns what


def tenant(name: str) -> bytes:
    return TENANTS + name.encode()


def engine(engine_id: str) -> bytes:
    return ENGINES + engine_id.encode()


def pool(engine_id: str) -> bytes:
    return POOLS + engine_id.encode()


def reservation(res_id: str) -> bytes:
    return RESERVATIONS + res_id.encode()


def request(tenant_name: str, request_id: str) -> bytes:
    return REQUESTS + tenant_name.encode() + b"/" + request_id.encode()


def prefixes(engine_id: str) -> bytes:
    return PREFIXES + engine_id.encode()


def replica(replica_id: str) -> bytes:
    return REPLICAS + replica_id.encode()


def usage(tenant_name: str) -> bytes:
    return USAGE + tenant_name.encode()


def name_of(key: bytes, prefix: bytes) -> str:
    return key[len(prefix):].decode()

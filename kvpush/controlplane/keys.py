"""The etcd key schema (DESIGN.md §4). Every key the control plane writes is built here.

Keys fall in three parts. The registry's shared state (tenants, engines, prefix reports,
replicas) lives under ``ROOT`` and every replica follows all of it. What each request
writes to its engine (its reservation, the engine's fence) lives under ``SLOTTED``,
partitioned by the decode engine's slot: ``SLOTTED/<slot>/...``, two hex digits. A replica
follows the slots it needs (kvpush/controlplane/following.py), so one prefix watch per slot
brings it just those requests. A reservation id begins with its slot, so a key is found
from an id alone. The request index (``REQUESTS``) is keyed by what the client sent, not by
an engine, so no slot can hold it; it is kept by tenant: a replica follows a tenant's part
when it counts that tenant's quota (request_index.py), all of it only when it follows every
slot. A Reserve asked again through a replica not following its key reads the key when its
transaction fails on it (a retry: kvpush/controlplane/reserver.py).
"""

from __future__ import annotations

import zlib

ROOT = b"/kvpush/v1/"
TENANTS = ROOT + b"tenants/"
ENGINES = ROOT + b"engines/"
PREFIXES = ROOT + b"prefixes/"        # per decode engine: its last prefix report (on the engine's lease)
REQUESTS = ROOT + b"requests/"        # (tenant, request id) -> reservation id and blocks (records.RequestEntry)
REPLICAS = ROOT + b"replicas/"        # per live control-plane replica (on its own lease): who owns what
FREE = ROOT + b"free/"                # per live replica (on its lease): its own engines' free blocks
SLOTTED = ROOT + b"slots/"            # per-request keys, by slot: SLOTTED + b"<slot>/" + one of the below
POOLS = b"pools/"                     # per engine: its fence, bumped by every reservation on it
RESERVATIONS = b"reservations/"
PUSHES = b"pushes/"                   # a copy of each reservation naming a prefill engine, under that engine's slot

SLOTS = 256
# The shared state is every key under ROOT outside REQUESTS and SLOTTED: three ranges, [start, end).
SHARED_RANGES = ((ROOT, REQUESTS), (REQUESTS[:-1] + b"0", SLOTTED), (SLOTTED[:-1] + b"0", ROOT[:-1] + b"0"))


def slot_of(engine_id: str) -> int:
    """The slot an engine's requests are kept (and owned) under."""
    return zlib.crc32(engine_id.encode()) % SLOTS


def slot_prefix(slot: int) -> bytes:
    return SLOTTED + b"%02x/" % slot


def slot_of_key(key: bytes) -> int | None:
    """The slot of a key under SLOTTED; None for a shared key."""
    if not key.startswith(SLOTTED):
        return None
    return int(key[len(SLOTTED):len(SLOTTED) + 2], 16)


def in_every_slot(kind: bytes) -> list[bytes]:
    """The prefixes of one kind (POOLS, RESERVATIONS, PUSHES) across the slots."""
    return [slot_prefix(slot) + kind for slot in range(SLOTS)]


def split_slotted(key: bytes) -> tuple[bytes, str]:
    """(kind, name) of a key under SLOTTED: kind is POOLS, RESERVATIONS or PUSHES (name:
    prefill engine/reservation id)."""
    rest = key[len(SLOTTED) + 3:]
    kind, _, name = rest.partition(b"/")
    return kind + b"/", name.decode()


def reservation_slot(res_id: str) -> int:
    """A reservation id is ``r-`` and 24 hex digits, the first two its slot (validation.py)."""
    return int(res_id[2:4], 16)


def tenant(name: str) -> bytes:
    return TENANTS + name.encode()


def engine(engine_id: str) -> bytes:
    return ENGINES + engine_id.encode()


def pool(engine_id: str) -> bytes:
    return slot_prefix(slot_of(engine_id)) + POOLS + engine_id.encode()


def reservation(res_id: str) -> bytes:
    return slot_prefix(reservation_slot(res_id)) + RESERVATIONS + res_id.encode()


def push(prefill_engine_id: str, res_id: str) -> bytes:
    """The copy of reservation ``res_id`` its prefill engine's sidecar is told from: under the
    prefill engine's slot, so that the replicas following that slot serve its stream."""
    return slot_prefix(slot_of(prefill_engine_id)) + PUSHES + prefill_engine_id.encode() + b"/" + res_id.encode()


def request(tenant_name: str, request_id: str) -> bytes:
    return tenant_requests(tenant_name) + request_id.encode()


def tenant_requests(tenant_name: str) -> bytes:
    """The prefix of a tenant's part of the request index (its usage fence included)."""
    return REQUESTS + tenant_name.encode() + b"/"


SHARE_MARK = "\x00"  # no request id holds it (validation.py): what follows is a replica's id


def share(tenant_name: str, replica_id: str) -> bytes:
    """A replica's share of a tenant's quota (quota_shares.py), inside the tenant's part of the
    request index so that the watcher bringing its entries brings it too."""
    return tenant_requests(tenant_name) + (SHARE_MARK + replica_id).encode()


def shares(tenant_name: str) -> bytes:
    """The prefix of every replica's share of ``tenant_name``'s quota."""
    return tenant_requests(tenant_name) + SHARE_MARK.encode()


def split_request(key: bytes) -> tuple[str, str]:
    """(tenant, request id) of a request index key; the request id is empty for the fence."""
    tenant, _, request_id = key[len(REQUESTS):].decode().partition("/")
    return tenant, request_id


def prefixes(engine_id: str) -> bytes:
    return PREFIXES + engine_id.encode()


def replica(replica_id: str) -> bytes:
    return REPLICAS + replica_id.encode()


def free(replica_id: str) -> bytes:
    return FREE + replica_id.encode()


def usage(tenant_name: str) -> bytes:
    """A tenant's usage fence: bumped by each of its quota-checked Reserves and its record's
    writes. Inside its part of the request index (no request id is empty), so that the
    watcher bringing its index keys brings the fence too, in order."""
    return tenant_requests(tenant_name)


def name_of(key: bytes, prefix: bytes) -> str:
    return key[len(prefix):].decode()

"""The registry's invariants, checked by reading etcd directly (DESIGN.md §4).

Used by every fault test after the dust settles, by the benchmarks after each
run, and by ``kvpush check``. It trusts nothing of the control plane: one
consistent range read of the whole prefix, then arithmetic.
"""

from __future__ import annotations

import dataclasses

from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient
from kvpush.contract.states import State
from kvpush.contract.engine import EngineRecord
from kvpush.contract.prefixes import PrefixReport, PrefixReportError
from kvpush.controlplane.records import RequestEntry, ReservationRecord, TenantRecord
from kvpush.controlplane.view import QUARANTINE_MS


@dataclasses.dataclass
class EngineBlocks:
    engine_id: str
    num_blocks: int
    reserved: set[int]
    free: set[int]


@dataclasses.dataclass
class InvariantReport:
    revision: int
    engines: dict[str, EngineBlocks]
    live: list[ReservationRecord]
    terminal: list[ReservationRecord]
    orphans: list[ReservationRecord]      # live, but their engine (incarnation) is gone
    tenant_usage: dict[str, int]
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        lines = [f"revision {self.revision}: {len(self.engines)} engines, {len(self.live)} live "
                 f"reservations, {len(self.orphans)} orphaned, {len(self.violations)} violations"]
        lines += [f"  VIOLATION: {v}" for v in self.violations[:50]]
        return "\n".join(lines)


async def check(etcd: EtcdClient | str, quiet: bool = False, allow_orphans: bool = False,
                quarantine_ms: int = QUARANTINE_MS) -> InvariantReport:
    """``quiet``: the system has settled, so nothing may be reserved at all.
    ``allow_orphans``: tolerate live reservations of a dead engine (the reaper
    has not run yet); otherwise they are violations. ``quarantine_ms``: the
    control plane's setting; a block of a reservation that ended unconsumed must
    not be in a reservation created within that long after the end."""
    client = EtcdClient(etcd) if isinstance(etcd, str) else etcd
    try:
        kvs, revision = await client.get_prefix(keys.ROOT)
    finally:
        if isinstance(etcd, str):
            await client.close()
    engines: dict[str, EngineRecord] = {}
    pools: set[str] = set()
    reservations: list[ReservationRecord] = []
    requests: dict[tuple[str, str], RequestEntry] = {}
    tenants: dict[str, TenantRecord] = {}
    prefix_reports: dict[str, bytes] = {}
    copies: dict[bytes, bytes] = {}  # prefill engines' copies (keys.push) -> value
    misplaced: list[str] = []  # a per-request key outside its slot: a replica following that slot misses it
    for kv in kvs:
        if kv.key.startswith(keys.ENGINES):
            rec = EngineRecord.decode(kv.value)
            engines[rec.engine_id] = rec
        elif kv.key.startswith(keys.SLOTTED):
            kind, name = keys.split_slotted(kv.key)
            if kind == keys.POOLS:
                pools.add(name)
                right = keys.pool(name)
            elif kind == keys.PUSHES:
                copies[kv.key] = kv.value
                right = kv.key if kv.key == keys.push(*name.split("/", 1)) else b"(not a push key)"
            else:
                res = ReservationRecord.decode(kv.value)
                reservations.append(res)
                right = keys.reservation(res.id)
                if keys.reservation_slot(res.id) != keys.slot_of(res.engine_id):
                    misplaced.append(f"reservation {res.id} is not in engine {res.engine_id}'s slot")
            if right != kv.key:
                misplaced.append(f"key {kv.key!r} belongs at {right!r}")
        elif kv.key.startswith(keys.REQUESTS):
            tenant, request_id = keys.split_request(kv.key)
            if request_id and not request_id.startswith(keys.SHARE_MARK):  # (not its usage fence, nor a share)
                requests[(tenant, request_id)] = RequestEntry.decode(kv.value)
        elif kv.key.startswith(keys.TENANTS):
            rec = TenantRecord.decode(kv.value)
            tenants[rec.name] = rec
        elif kv.key.startswith(keys.PREFIXES):
            prefix_reports[keys.name_of(kv.key, keys.PREFIXES)] = kv.value

    violations: list[str] = misplaced
    by_id = {r.id: r for r in reservations}
    for key, value in copies.items():  # written in the same transactions as the reservation
        copy = ReservationRecord.decode(value)
        original = by_id.get(copy.id)
        if original is None or original.prefill_engine_id != copy.prefill_engine_id or \
                (original.state, original.extents) != (copy.state, copy.extents):
            violations.append(f"prefill copy {key!r} does not match its reservation")
    for engine_id, value in prefix_reports.items():  # a report lives and dies with its engine's life
        eng = engines.get(engine_id)
        try:
            incarnation = PrefixReport.decode(value).incarnation
        except PrefixReportError as exc:
            violations.append(f"prefix report of engine {engine_id} is unreadable: {exc}")
            continue
        if eng is None or not eng.is_decode or eng.incarnation != incarnation:
            violations.append(f"prefix report of engine {engine_id} (incarnation {incarnation}) outlived it")

    live = [r for r in reservations if r.state.live]
    terminal = [r for r in reservations if not r.state.live]
    orphans = [r for r in live if r.engine_id not in engines or engines[r.engine_id].incarnation != r.incarnation]
    if orphans and not allow_orphans:
        violations += [f"reservation {r.id} is {r.state.name} but engine {r.engine_id} "
                       f"(incarnation {r.incarnation}) is gone" for r in orphans]

    live_by_id = {r.id: r for r in live}
    report_engines: dict[str, EngineBlocks] = {}
    for engine_id, eng in engines.items():
        if engine_id not in pools:
            violations.append(f"engine {engine_id} has no pool key")
        owner: dict[int, str] = {}
        for r in live:
            if r.engine_id != engine_id or r.incarnation != eng.incarnation:
                continue
            for b in r.blocks:
                if not 0 <= b < eng.num_blocks:
                    violations.append(f"reservation {r.id} holds block {b} outside engine {engine_id}'s "
                                      f"{eng.num_blocks} blocks")
                elif b in owner:
                    violations.append(f"block {b} of engine {engine_id} is in two live reservations: "
                                      f"{owner[b]} and {r.id}")
                else:
                    owner[b] = r.id
        for ended in terminal:
            if ended.engine_id != engine_id or ended.incarnation != eng.incarnation or \
                    ended.state == State.CONSUMED or not ended.ended_ms:
                continue
            for b in ended.blocks:
                holder = owner.get(b)
                if holder is None:
                    continue
                rec = live_by_id[holder]
                if rec.created_ms < ended.ended_ms + quarantine_ms:
                    violations.append(f"block {b} of engine {engine_id} reused by {holder} "
                                      f"{ended.ended_ms + quarantine_ms - rec.created_ms} ms before the "
                                      f"quarantine of {ended.id} ({ended.state.name}) ended")
        reserved = set(owner)
        free = set(range(eng.num_blocks)) - reserved
        if free & reserved or len(free) + len(reserved) != eng.num_blocks:
            violations.append(f"engine {engine_id}: free and reserved blocks do not partition the pool")
        report_engines[engine_id] = EngineBlocks(engine_id, eng.num_blocks, reserved, free)

    usage: dict[str, int] = {}
    for r in live:
        usage[r.tenant] = usage.get(r.tenant, 0) + r.num_blocks
        if len(set(r.blocks)) != len(r.blocks):
            violations.append(f"reservation {r.id} lists a block twice")
        if r.num_blocks * r.block_size < r.num_tokens - r.cached_tokens:
            violations.append(f"reservation {r.id} has {r.num_blocks} blocks for {r.num_tokens - r.cached_tokens} "
                              "tokens")
        entry = requests.get((r.tenant, r.request_id))
        if entry is None or entry.reservation_id != r.id:
            violations.append(f"live reservation {r.id} is missing from the request index")
        elif entry.num_blocks != r.num_blocks:
            violations.append(f"the request index holds {entry.num_blocks} blocks for {r.id}, which has {r.num_blocks}")
    for name, used in usage.items():
        tenant = tenants.get(name)
        if tenant is not None and tenant.quota_blocks and used > tenant.quota_blocks:
            violations.append(f"tenant {name} holds {used} blocks over its quota of {tenant.quota_blocks}")
    live_ids = {r.id for r in live}
    for (tenant, request_id), entry in requests.items():
        if (res_id := entry.reservation_id) not in live_ids:
            violations.append(f"request index ({tenant}, {request_id}) points at {res_id}, which is not live")
    if quiet and live:
        violations.append(f"system is quiet but {len(live)} reservations are live: "
                          + ", ".join(f"{r.id}={r.state.name}" for r in live[:10]))
    return InvariantReport(revision, report_engines, live, terminal, orphans, usage, violations)

"""A quota tenant served by several replicas, without the replicas taking turns.

A tenant's quota is counted over its part of the request index (request_index.py). Every
Reserve for a quota tenant used to compare and bump the tenant's usage fence, so replicas
serving that tenant at once failed each other's transactions and took turns (at four
replicas: 380 of 400 requests/s carried, Reserve p99 4.6 s, 1.45x the CPU per request).

Now each replica serving such a tenant holds a share of the quota: a key in the tenant's
part of the index (keys.share), on the replica's membership lease, saying how many blocks it
may hold. A Reserve that fits in this replica's share is committed with a compare on that
key alone (only this replica writes it), and its index entry names the share. One that does
not fit takes the fenced path, as before, and grows the share in the same transaction to
what the share's entries hold, plus what this batch takes, plus a headroom (what this
replica reserved for the tenant in the last ``WINDOW_S``). The fenced path counts what the
shares hold back:

    room = quota - used - what the other replicas' shares hold unused

(this replica's own unused share is its to rewrite). That is exact when the view is, and
errs safe when it lags: a share grows only through the fence, and every other change
(entries ending, a share shrinking, or going with a replica's lease, or deleted when the
quota changes) only makes room. A share no longer needed shrinks back every ``SHRINK_S``;
a replica gone takes its share with its lease (its entries then count as plain usage until
they end); UpdateTenant deletes every share of the tenant, so none outlives a quota.

The price: a replica's headroom can sit unused in its share while another replica refuses a
Reserve for want of room, for up to ``SHRINK_S``. Alone, a replica holds no share (nothing
to take turns with), and the fenced path is what it always was.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import numpy as np

from kvpush import log
from kvpush.controlplane import errors, keys, metrics
from kvpush.controlplane.etcd import EtcdClient, cmp_mod, op_delete, op_put
from kvpush.controlplane.records import TenantRecord
from kvpush.controlplane.reserve_plan import SHARE_SLACK, BatchState, Plan, ReserveAsk
from kvpush.controlplane.view import View

_log = log.get("quota_shares")

WINDOW_S = 0.5    # a share's headroom: what this replica reserved for the tenant over this long
SHRINK_S = 1.0    # how often shares no longer needed are given back
LEASE_RETRY_S = 2.0


class QuotaShares:
    def __init__(self, view: View, replica_id: str, lease: Callable[[], int], members: Callable[[], int],
                 enabled: bool = True) -> None:
        """``lease()``: this replica's membership lease (0: none yet); ``members()``: how many
        replicas are live; not ``enabled``: no shares held (every quota Reserve fenced)."""
        self._view = view
        self.enabled = enabled
        self.replica_id = replica_id
        self._lease = lease
        self._members = members
        self._bad_lease = (0, 0.0)  # (a lease a share put was refused on, until when it is not used)
        self._taken: dict[str, list] = {}  # tenant -> [window start, blocks this window, blocks last window]

    def mine(self) -> str:
        """This replica's id where it holds shares now, else ""."""
        lease = self._lease()
        if not self.enabled or not lease or self._members() < 2:
            return ""
        if lease == self._bad_lease[0] and time.monotonic() < self._bad_lease[1]:
            return ""
        return self.replica_id

    def lease_failed(self) -> None:
        """A transaction putting a share found a lease gone: maybe the membership lease, which
        membership (ownership.py) replaces within a third of its TTL. No shares on it for a
        while (it may have been a deadline lease instead: then they are back after it)."""
        self._bad_lease = (self._lease(), time.monotonic() + LEASE_RETRY_S)

    def room(self, ask: ReserveAsk, tenant: TenantRecord, fits: np.ndarray, need, batch: BatchState,
             credit: int) -> np.ndarray:
        """The candidates of ``fits`` whose ``need`` ``tenant``'s quota allows; sets
        ``ask.share`` (and ``ask.in_share``: committed within this replica's share)."""
        name, index, mine = tenant.name, self._view.requests, self.mine()
        if mine and ask.moving is None:
            found = index.share_left(name, mine)
            if found is not None:
                inside = fits & (need <= found[0] - batch.share_used.get(name, 0))
                if inside.any():
                    ask.in_share, ask.share = True, mine
                    return inside
        ask.in_share, ask.share = False, mine
        if credit and ask.moving is not None:
            # A move gives its old blocks back; not where another live replica's share holds
            # them (that share would then hold them back unused, counted twice).
            old = index.entries.get((name, ask.moving.request_id))
            if old is not None and old.share and old.share != mine and old.share in index.shares.get(name, {}):
                credit = 0
        others = index.held_back(name, but=mine)
        left = (tenant.quota_blocks - index.used.get(name, 0) - batch.share_used.get(name, 0)
                - batch.used.get(name, 0) + credit)
        within = fits & (need <= left - (0 if name in batch.reclaim else others))
        if others and not within.any() and (fits & (need <= left)).any() \
                and len(index.unused_shares(name, but=mine)) <= SHARE_SLACK:
            # What the others' shares hold unused is taken back (their keys deleted, compared),
            # rather than refusing a Reserve the quota has room for.
            batch.reclaim.add(name)
            within = fits & (need <= left)
        if fits.any() and not within.any():
            raise errors.exhausted(f"tenant {name!r} quota of {tenant.quota_blocks} blocks reached "
                                   f"({tenant.quota_blocks - max(left, 0)} reserved)")
        return within

    def fence(self, plan: Plan, ask: ReserveAsk) -> None:
        """What ``ask`` adds for its tenant's quota, once per batch: its share's key compared
        and put again as it is (``ask.in_share``), or the tenant's usage fence compared and
        bumped. The put is what a replica taking the share back compares: without it, entries
        committed within the share after that replica read it would go unseen, and counted twice."""
        name = ask.tenant.name
        if ask.in_share:
            if plan.fenced(("s", name)):
                key = keys.share(name, ask.share)
                blocks, revision = self._view.requests.shares[name][ask.share]
                plan.compares.append(cmp_mod(key, revision))
                self._put(plan, key, blocks)
        elif plan.fenced(("q", name)):
            plan.fence_usage(name, self._view.requests.fences.get(name, 0))

    def grow(self, plan: Plan, batch: BatchState, tenants: dict[str, TenantRecord]) -> None:
        """Each quota tenant this batch took from the pool for: the others' shares it took back
        deleted, and this replica's share rewritten (both before the fence's bump) to hold what
        its entries will, and a headroom: what it reserved lately, at most a 2N-th of what the
        quota has left, so that near the quota the shares hold nothing back."""
        mine, index = self.mine(), self._view.requests
        now = time.monotonic()
        for name in batch.reclaim:
            for replica, revision in index.unused_shares(name, but=mine):
                plan.compares.append(cmp_mod(keys.share(name, replica), revision))
                plan.ops.append(op_delete(keys.share(name, replica)))
        for name, pooled in batch.used.items():
            tenant = tenants.get(name)
            if not pooled or not mine or tenant is None or not tenant.quota_blocks:
                continue
            in_share = batch.share_used.get(name, 0)
            held = index.share_used.get(name, {}).get(mine, 0) + in_share + pooled
            others = 0 if name in batch.reclaim else index.held_back(name, but=mine)
            spare = tenant.quota_blocks - index.used.get(name, 0) - others - in_share - pooled
            headroom = max(min(self._recent(name, now), spare // (2 * self._members())), 0)
            self._put(plan, keys.share(name, mine), held + headroom)

    def _put(self, plan: Plan, key: bytes, blocks: int) -> None:
        """Put this replica's share ``key`` in ``plan`` (once: etcd refuses a key twice in a
        transaction; a batch within the share that also grows it puts the grown one)."""
        value, lease = b"%d" % blocks, self._lease()
        at = plan.share_puts.get(key)
        if at is None:
            plan.share_puts[key] = (len(plan.ops), len(plan.writes))
            plan.ops.append(op_put(key, value, lease))
            plan.writes.append((key, value, lease, None))
        else:
            plan.ops[at[0]], plan.writes[at[1]] = op_put(key, value, lease), (key, value, lease, None)

    def taken(self, tenant: str, blocks: int) -> None:
        """``blocks`` reserved for ``tenant`` here: what the next headroom is sized on."""
        now = time.monotonic()
        window = self._taken.get(tenant)
        if window is None or now - window[0] >= 2 * WINDOW_S:
            window = self._taken[tenant] = [now, 0, 0]
        elif now - window[0] >= WINDOW_S:
            window[:] = [now, 0, window[1]]
        window[1] += blocks

    def _recent(self, tenant: str, now: float) -> int:
        window = self._taken.get(tenant)
        if window is None or now - window[0] >= 2 * WINDOW_S:
            return 0
        return max(window[1], window[2]) if now - window[0] < WINDOW_S else window[1]

    async def run(self, etcd: EtcdClient, stop: asyncio.Event) -> None:
        """Give back, every SHRINK_S, what this replica's shares hold beyond their entries and
        a headroom; a share of a tenant not served here lately goes."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), SHRINK_S)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self._shrink(etcd)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # etcd unavailable: the next turn
                _log.debug("shares not shrunk", reason=str(exc) or type(exc).__name__)

    async def _shrink(self, etcd: EtcdClient) -> None:
        index, now, lease = self._view.requests, time.monotonic(), self._lease()
        for name, shares in list(index.shares.items()):
            found = shares.get(self.replica_id)
            if found is None:
                continue
            blocks, revision = found
            held = index.share_used.get(name, {}).get(self.replica_id, 0)
            # Kept: its entries, and a headroom while this replica holds shares and serves the tenant.
            target = held + (self._recent(name, now) if self.mine() else 0)
            if blocks <= target + target // 2 and target:
                continue
            key = keys.share(name, self.replica_id)
            op = op_put(key, b"%d" % target, lease) if target and lease else op_delete(key)
            result = await etcd.txn([cmp_mod(key, revision)], [op])
            if result.succeeded:
                metrics.QUOTA_SHARES_SHRUNK.inc()

"""The request index as a view holds it (keys.request): each tenant's request ids with
the live reservation each has, the tenant's usage (the blocks of those reservations) and
its usage fence.

A reservation's index key exists exactly while it is live (put with it, deleted when it
ends, on the same lease), so a tenant's usage is the sum over its part of the index, and
a replica counts a quota against it by following just that part: one prefix per tenant,
not every slot. The fence is the tenant's index key with the empty request id (no
request has one), bumped by every quota-checked Reserve after its index puts, so a view
that has the fence's revision has those puts too: they come on the same watcher, in the
transaction's order. The replicas' shares of the tenant's quota (quota_shares.py) are kept
there too, under request ids no request has (keys.share).
"""

from __future__ import annotations

from kvpush.controlplane import keys
from kvpush.controlplane.records import RequestEntry


class RequestIndex:
    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], RequestEntry] = {}
        self.used: dict[str, int] = {}     # tenant -> blocks its live reservations hold
        self.fences: dict[str, int] = {}   # tenant -> its usage fence's mod revision
        self.shares: dict[str, dict[str, tuple[int, int]]] = {}  # tenant -> replica -> (blocks, mod revision)
        self.share_used: dict[str, dict[str, int]] = {}          # tenant -> replica -> blocks its entries name

    def __len__(self) -> int:
        return len(self.entries)

    def reservation_id(self, tenant: str, request_id: str) -> str | None:
        entry = self.entries.get((tenant, request_id))
        return entry.reservation_id if entry is not None else None

    def apply(self, tenant: str, request_id: str, value: bytes | None, revision: int) -> None:
        """A put (``value``) or delete (None) of the index key of (``tenant``, ``request_id``)."""
        if not request_id:
            if value is None:
                self.fences.pop(tenant, None)
            else:
                self.fences[tenant] = revision
            return
        if request_id.startswith(keys.SHARE_MARK):
            self._apply_share(tenant, request_id[len(keys.SHARE_MARK):], value, revision)
            return
        old = self.entries.pop((tenant, request_id), None)
        if old is not None:
            self._count(tenant, -old.num_blocks, old.share)
        if value is not None:
            new = RequestEntry.decode(value)
            self.entries[(tenant, request_id)] = new
            self._count(tenant, new.num_blocks, new.share)

    def _apply_share(self, tenant: str, replica: str, value: bytes | None, revision: int) -> None:
        shares = self.shares.setdefault(tenant, {})
        if value is None:
            shares.pop(replica, None)
        else:
            try:
                shares[replica] = (int(value), revision)
            except ValueError:  # unreadable: counted as holding nothing back
                shares[replica] = (0, revision)
        if not shares:
            del self.shares[tenant]

    def _count(self, tenant: str, blocks: int, share: str) -> None:
        left = self.used.get(tenant, 0) + blocks
        if left:
            self.used[tenant] = left
        else:
            self.used.pop(tenant, None)
        if share:
            by_share = self.share_used.setdefault(tenant, {})
            left = by_share.get(share, 0) + blocks
            if left:
                by_share[share] = left
            else:
                del by_share[share]
                if not by_share:
                    del self.share_used[tenant]

    def held_back(self, tenant: str, but: str = "") -> int:
        """Blocks of ``tenant``'s quota the replicas' shares hold unused (``but`` that one's)."""
        shares = self.shares.get(tenant)
        if not shares:
            return 0
        used = self.share_used.get(tenant, {})
        return sum(max(blocks - used.get(replica, 0), 0) for replica, (blocks, _) in shares.items()
                   if replica != but)

    def unused_shares(self, tenant: str, but: str = "") -> list[tuple[str, int]]:
        """(replica, mod revision) of each share of ``tenant``'s quota holding blocks unused."""
        used = self.share_used.get(tenant, {})
        return [(replica, revision) for replica, (blocks, revision) in self.shares.get(tenant, {}).items()
                if replica != but and blocks > used.get(replica, 0)]

    def share_left(self, tenant: str, replica: str) -> tuple[int, int] | None:
        """(blocks left, mod revision) of ``replica``'s share of ``tenant``'s quota; None if none."""
        found = self.shares.get(tenant, {}).get(replica)
        if found is None:
            return None
        return found[0] - self.share_used.get(tenant, {}).get(replica, 0), found[1]

    def drop_tenant(self, tenant: str) -> None:
        """Forget ``tenant``'s part (no longer followed)."""
        for key in [k for k in self.entries if k[0] == tenant]:
            del self.entries[key]
        self.used.pop(tenant, None)
        self.fences.pop(tenant, None)
        self.shares.pop(tenant, None)
        self.share_used.pop(tenant, None)

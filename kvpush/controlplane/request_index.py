"""The request index as a view holds it (keys.request): each tenant's request ids with
the live reservation each has, the tenant's usage (the blocks of those reservations) and
its usage fence.

A reservation's index key exists exactly while it is live (put with it, deleted when it
ends, on the same lease), so a tenant's usage is the sum over its part of the index, and
a replica counts a quota against it by following just that part: one prefix per tenant,
not every slot. The fence is the tenant's index key with the empty request id (no
request has one), bumped by every quota-checked Reserve after its index puts, so a view
that has the fence's revision has those puts too: they come on the same watcher, in the
transaction's order.
"""

from __future__ import annotations

from kvpush.controlplane.records import RequestEntry


class RequestIndex:
    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], RequestEntry] = {}
        self.used: dict[str, int] = {}     # tenant -> blocks its live reservations hold
        self.fences: dict[str, int] = {}   # tenant -> its usage fence's mod revision

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
        old = self.entries.pop((tenant, request_id), None)
        if old is not None:
            self._count(tenant, -old.num_blocks)
        if value is not None:
            new = RequestEntry.decode(value)
            self.entries[(tenant, request_id)] = new
            self._count(tenant, new.num_blocks)

    def _count(self, tenant: str, blocks: int) -> None:
        left = self.used.get(tenant, 0) + blocks
        if left:
            self.used[tenant] = left
        else:
            self.used.pop(tenant, None)

    def drop_tenant(self, tenant: str) -> None:
        """Forget ``tenant``'s part (no longer followed)."""
        for key in [k for k in self.entries if k[0] == tenant]:
            del self.entries[key]
        self.used.pop(tenant, None)
        self.fences.pop(tenant, None)

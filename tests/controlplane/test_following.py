"""Which slots a replica follows (kvpush/controlplane/following.py), without etcd: its own
slots; a need's slots while it lasts and LINGER_S after; a quota tenant's request index
while its Reserves need it; every slot for a need of ALL, for --follow all, and (as one
watch) when it owns them all."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.controlplane import following as following_mod, keys
from kvpush.controlplane.etcd import KV
from kvpush.controlplane.following import ALL, Following
from kvpush.controlplane.ownership import Ownership
from kvpush.controlplane.records import ReplicaRecord, TenantRecord
from kvpush.controlplane.view import View


def view_with_replicas(*ids: str) -> View:
    view = View()
    for rid in ids:
        view.apply(KV(keys.replica(rid), ReplicaRecord(rid, "", 0).encode(), 1, 1, 0), False, 1)
    return view


def test_alone_it_follows_everything_with_one_watch():
    view = view_with_replicas("a")
    assert Following(view, Ownership(view, "a")).wanted() is None


async def test_its_own_slots_then_a_need_while_it_lasts_and_a_while_after(monkeypatch):
    view = view_with_replicas("a", "b")
    ownership = Ownership(view, "a")
    following = Following(view, ownership)
    own = following.wanted()
    assert own == ownership.owned and 0 < len(own) < keys.SLOTS
    other = next(s for s in range(keys.SLOTS) if s not in own)
    view.following = frozenset(own)  # as the follow would have it
    monkeypatch.setattr(following_mod, "LINGER_S", 0.2)

    async def take_on():  # the follow, in short: it takes on what is wanted
        while True:
            wanted = following.wanted()
            view.following = None if wanted is None else frozenset(wanted)
            await asyncio.sleep(0.01)
    follower = asyncio.create_task(take_on())
    try:
        async with following.needing([other]):
            assert other in following.wanted()
            assert following.covers([other])
        assert other in following.wanted()  # lingering
        await asyncio.sleep(0.3)
        assert following.wanted() == own
        async with following.needing([ALL]):
            assert following.wanted() is None and following.covers([ALL])
        assert following.wanted() is None  # lingering too
        await asyncio.sleep(0.3)
        assert following.wanted() == own
        following.borrow([other])
        assert other in following.wanted()
    finally:
        follower.cancel()


def test_follow_all_means_every_slot_and_a_tenant_index_is_followed_only_while_needed():
    view = view_with_replicas("a", "b")
    following = Following(view, Ownership(view, "a"))
    before = following.wanted()
    assert before is not None and not any(isinstance(p, str) for p in before)
    tenant = TenantRecord("capped", 100, [], "0" * 64)
    view.apply(KV(keys.tenant("capped"), tenant.encode(), 2, 2, 0), False, 2)
    assert following.wanted() == before               # a quota alone: nothing to count yet
    following.borrow(["capped"])                      # a Reserve of its
    assert following.wanted() == before | {"capped"}  # its usage, not every slot
    view2 = view_with_replicas("a", "b")
    assert Following(view2, Ownership(view2, "a"), follow_all=True).wanted() is None


async def test_a_need_that_cannot_be_met_in_time_is_refused(monkeypatch):
    from kvpush.controlplane.errors import ApiError
    view = view_with_replicas("a", "b")
    following = Following(view, Ownership(view, "a"))
    view.following = frozenset(following.wanted())  # and nothing ever takes more on
    monkeypatch.setattr(following_mod, "COVER_WAIT_S", 0.1)
    other = next(s for s in range(keys.SLOTS) if s not in view.following)
    with pytest.raises(ApiError) as exc:
        async with following.needing([other]):
            pass
    assert "retry" in exc.value.message

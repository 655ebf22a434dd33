"""Ownership of engines by replicas (kvpush/controlplane/ownership.py): the rendezvous map,
what a view's set of replicas makes of it, and which candidates a Reserve prefers."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np

from kvpush.controlplane import keys
from kvpush.controlplane.etcd import KV
from kvpush.controlplane.ownership import OWN_SLACK, SLOTS, Ownership, assign, slot_of
from kvpush.controlplane.records import ReplicaRecord
from kvpush.controlplane.view import View


def test_every_slot_has_one_owner_and_the_share_is_even():
    members = [f"cp-{i}" for i in range(4)]
    owners = assign(members)
    assert len(owners) == SLOTS and set(owners) == set(members)
    shares = collections.Counter(owners)
    # 64 each on average; rendezvous over 256 slots stays within about 3 sigma of it.
    assert all(40 <= n <= 90 for n in shares.values()), shares
    assert assign(reversed(members)) == owners  # every replica computes the same map


def test_a_join_or_a_leave_moves_only_the_slots_of_that_replica():
    before = assign(["a", "b", "c", "d"])
    joined = assign(["a", "b", "c", "d", "e"])
    moved = [s for s in range(SLOTS) if before[s] != joined[s]]
    assert moved and all(joined[s] == "e" for s in moved)
    assert 25 <= len(moved) <= 80  # about a fifth
    left = assign(["a", "c", "d"])
    assert all(left[s] == before[s] for s in range(SLOTS) if before[s] != "b")
    assert all(left[s] != "b" for s in range(SLOTS))


def test_engines_spread_over_the_slots():
    slots = collections.Counter(slot_of(f"decode-{i}") for i in range(10_000))
    assert len(slots) == SLOTS and max(slots.values()) < 3 * 10_000 / SLOTS


def _join(view: View, replica_id: str, revision: int) -> None:
    view.apply(KV(keys.replica(replica_id), ReplicaRecord(replica_id, "x:1", 1).encode(), revision, revision, 0),
               False, revision)


def test_the_views_replicas_decide_and_a_replica_always_counts_itself():
    view = View()
    me = Ownership(view, "cp-a")
    assert me.owns("decode-1") and len(me.owned) == SLOTS  # alone (its own key not seen yet)
    _join(view, "cp-b", 2)
    _join(view, "cp-a", 3)
    other = Ownership(view, "cp-b")
    assert me.members == other.members == ("cp-a", "cp-b")
    assert me.owned.isdisjoint(other.owned) and len(me.owned | other.owned) == SLOTS
    engine = next(f"decode-{i}" for i in range(1000) if not me.owns(f"decode-{i}"))
    assert me.owner_of(engine) == "cp-b" and other.owns(engine)
    view.apply(KV(keys.replica("cp-b"), b"", 4, 4, 0), True, 4)  # cp-b's lease ran out
    assert len(me.owned) == SLOTS and me.owns(engine)


def test_a_reserve_prefers_its_own_engines_while_they_score_near_the_best():
    view = View()
    _join(view, "cp-a", 2)
    _join(view, "cp-b", 3)
    me = Ownership(view, "cp-a")
    ids = [f"decode-{i}" for i in range(40)]
    cands = SimpleNamespace(engines=tuple(SimpleNamespace(engine_id=e) for e in ids))
    mine = np.array([me.owns(e) for e in ids])
    assert mine.any() and not mine.all()
    fits = np.ones(len(ids), dtype=bool)
    score = np.ones(len(ids))  # every engine as free as the others
    assert (me.prefer(cands, fits, score) == mine).all()
    # None of its own fits: every engine that fits is a choice.
    assert (me.prefer(cands, fits & ~mine, score) == (fits & ~mine)).all()
    # Its own are fuller than another by more than the slack (or another holds more of the
    # prompt: the score counts that too): every engine is a choice.
    score[mine] = 1.0 - OWN_SLACK - 0.01
    assert (me.prefer(cands, fits, score) == fits).all()
    score[int(np.flatnonzero(mine)[0])] = 1.0 - OWN_SLACK / 2  # one of its own within the slack
    assert (me.prefer(cands, fits, score) == mine).all()

"""The other replicas' free summaries as a view keeps them (kvpush/controlplane/free_told.py):
two tellers of one engine give the lesser count, blocks reserved through an owner are counted
off until that owner tells again, and the version moves with every summary."""

from __future__ import annotations

from kvpush.controlplane.free_told import FreeTold
from kvpush.controlplane.records import encode_free


def test_the_least_of_two_tellers_and_what_was_spent_since():
    told = FreeTold()
    told.apply("a", encode_free({"e1": 10, "e2": 40}))
    told.apply("b", encode_free({"e2": 30, "e3": 5}))
    assert told.merged() == {"e1": 10, "e2": 30, "e3": 5}
    version = told.version
    told.count_spent("e2", 4)
    told.count_spent("e2", 1)
    told.count_spent("e3", 9)        # never below nothing
    told.count_spent("unknown", 3)   # an engine no one told of stays unknown
    assert told.version == version   # (the candidates' arrays stay; they take it off as read)
    assert [told.estimate(e) for e in ("e1", "e2", "e3", "unknown")] == [10, 25, 0, None]
    # The owner tells again: its figure replaces the estimate for its engines only.
    told.apply("b", encode_free({"e2": 28, "e3": 6}))
    assert told.version > version
    assert [told.estimate(e) for e in ("e2", "e3")] == [28, 6]
    told.apply("a", None)            # a's lease went: its engines are no longer told of
    assert told.merged() == {"e2": 28, "e3": 6} and told.estimate("e1") is None


def test_a_bad_summary_steers_nothing():
    told = FreeTold()
    told.apply("a", b"not json")
    assert told.merged() == {}

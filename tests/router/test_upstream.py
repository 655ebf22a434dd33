"""How the router counts requests per engine (its least-loaded choices read the counts)."""

from __future__ import annotations

from kvpush.router.upstream import Answering


def test_a_continuation_is_counted_on_the_engine_answering_it_through_every_move():
    outstanding = {"http://d0": 2}
    answering = Answering(outstanding, "http://d0")
    assert outstanding == {"http://d0": 3}
    answering.move("http://d1")  # the reservation moved: the other engine answers now
    assert outstanding == {"http://d0": 2, "http://d1": 1}
    answering.move("http://d1")  # the same engine again: counted once
    assert outstanding == {"http://d0": 2, "http://d1": 1}
    answering.move("http://d2")  # a resume on a third engine
    answering.done()
    assert outstanding == {"http://d0": 2, "http://d1": 0, "http://d2": 0}

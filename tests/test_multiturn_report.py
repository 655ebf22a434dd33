"""The multi-turn bench's account of answers that differ from the aggregated engine's: where
a conversation first parted, and whether the aggregated engine's own logprobs call it a
float near-tie or something to look into (the bench itself needs engines; these parts do not)."""

from bench.multiturn_report import (NEAR_TIE_NATS, divergence_lines, first_divergence, later_turns, merged,
                                    ratio_interval)


def test_first_divergence_finds_where_two_answers_part():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter answer parts where it ends


def _run(name: str, divergences: list[dict]) -> dict:
    return {"name": name, "rows": {1: []}, "answers": {}, "wrong": len(divergences), "equal": 0, "cpu": {},
            "wall": 0.0, "divergences": divergences}


def test_divergences_are_kept_per_round_and_judged_by_the_gap():
    tie = {"conv": 1, "turn": 3, "token": 127, "gap_nats": -NEAR_TIE_NATS / 100, "why": ""}
    far = {"conv": 0, "turn": 2, "token": 4, "gap_nats": 2.5, "why": ""}
    lost = {"conv": 2, "turn": 1, "token": 0, "gap_nats": None, "why": "a token not among the aggregated engine's top 5"}
    run = merged([_run("kvpush", [tie]), _run("kvpush", [far, lost])])
    assert [d["round"] for d in run["divergences"]] == [1, 2, 2]
    lines = divergence_lines([merged([_run("aggregated", [])]), run])
    body = [line for line in lines if line.startswith("- ")]
    assert len(body) == 3
    # places counted from 1; a tie that turned over on recomputing is still a tie
    assert "round 1, conversation 2, turn 3, token 128" in body[0] and "-1.0e-05 nats" in body[0]
    assert "a float32 near-tie" in body[0]
    assert "+2.5e+00 nats" in body[1] and "not a near-tie" in body[1]
    assert "not among the aggregated engine's top 5" in body[2] and "look into it" in body[2]


def test_the_interval_draws_whole_conversations():
    # Each conversation's turns alike, conversations apart: drawing turns one by one would
    # pretend to 4x the independent draws there are, and narrow the interval.
    convs, turns = 12, 4
    xs = [10.0 + 3 * c for _ in range(turns) for c in range(convs)]
    base = [50.0 + (c % 3) for _ in range(turns) for c in range(convs)]
    places = [c for _ in range(turns) for c in range(convs)]
    lo, hi = ratio_interval(xs, base, places)
    lo1, hi1 = ratio_interval(xs, base, list(range(len(xs))))
    assert hi - lo > 1.3 * (hi1 - lo1)
    assert lo <= (sorted(xs)[len(xs) // 2 - 1] + sorted(xs)[len(xs) // 2]) / 2 / 51.0 <= hi


def test_later_turns_name_each_turns_conversation():
    rows = {1: [{"ttft_ms": 100.0}] * 2, 2: [{"ttft_ms": 20.0}, {"ttft_ms": 21.0}], 3: [22.0, 23.0]}
    assert later_turns(rows) == ([20.0, 21.0, 22.0, 23.0], [0, 1, 0, 1])


def test_no_divergence_says_nothing():
    assert divergence_lines([merged([_run("kvpush", [])])]) == []

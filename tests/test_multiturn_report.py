"""The multi-turn bench's account of answers that differ from the aggregated engine's: where
a conversation first parted, and whether the aggregated engine's own logprobs call it a
float near-tie or something to look into (the bench itself needs engines; these parts do not)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.multiturn_report import NEAR_TIE_NATS, divergence_lines, first_divergence, merged  # noqa: E402


def test_first_divergence_finds_where_two_answers_part():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter answer parts where it ends


def _run(name: str, divergences: list[dict]) -> dict:
    return {"name": name, "rows": {1: []}, "answers": {}, "wrong": len(divergences), "cpu": {}, "wall": 0.0,
            "divergences": divergences}


def test_divergences_are_kept_per_round_and_judged_by_the_gap():
    tie = {"conv": 1, "turn": 3, "token": 127, "gap_nats": NEAR_TIE_NATS / 100}
    far = {"conv": 0, "turn": 2, "token": 4, "gap_nats": 2.5}
    lost = {"conv": 2, "turn": 1, "token": 0, "gap_nats": None}
    run = merged([_run("kvpush", [tie]), _run("kvpush", [far, lost])])
    assert [d["round"] for d in run["divergences"]] == [1, 2, 2]
    lines = divergence_lines([merged([_run("aggregated", [])]), run])
    body = [line for line in lines if line.startswith("- ")]
    assert len(body) == 3
    assert "round 1, conversation 1, from turn 3 token 127" in body[0] and "a float32 near-tie" in body[0]
    assert "2.5e+00 nats apart" in body[1] and "not a near-tie" in body[1]
    assert "not in its top 5" in body[2] and "not a near-tie" in body[2]


def test_no_divergence_says_nothing():
    assert divergence_lines([merged([_run("kvpush", [])])]) == []

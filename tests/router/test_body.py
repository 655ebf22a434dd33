"""The body's depth check against the JSON parser itself: it refuses exactly the valid
bodies nested deeper than MAX_DEPTH, whatever their strings hold, and stays fast on the
worst bodies the size limit lets in."""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import given, settings, strategies as st

from kvpush.router.body import MAX_BODY, MAX_DEPTH, parse, too_deep
from kvpush.router.errors import ApiError


def depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


TRICKY = '[]{}"\\/ ab\u00e9\n'  # what could fool a scan: brackets, quotes, backslashes, escapes


def values_near_the_limit(rnd) -> object:
    """A JSON value whose deepest branch is MAX_DEPTH - 2 .. MAX_DEPTH + 2 levels deep,
    with shallow siblings and tricky strings on the way down."""
    def text() -> str:
        return "".join(rnd.choices(TRICKY, k=rnd.randint(0, 8)))

    def leaf():
        return rnd.choice([None, rnd.randint(-9, 9), text()])

    value = leaf()
    for _ in range(rnd.randint(MAX_DEPTH - 2, MAX_DEPTH + 2)):
        siblings = [rnd.choice([leaf(), [leaf()], {}]) for _ in range(rnd.randint(0, 2))]
        if rnd.random() < 0.5:
            value = [*siblings, value] if rnd.random() < 0.5 else [value, *siblings]
        else:
            value = {text(): value, **{f"k{i}": s for i, s in enumerate(siblings)}}
    return value


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_too_deep_is_exactly_deeper_than_the_limit_for_valid_json(seed):
    rnd = random.Random(seed)  # (one draw: hypothesis's own randoms record every call, 100x slower)
    value = values_near_the_limit(rnd)
    raw = json.dumps(value, ensure_ascii=rnd.random() < 0.5).encode()
    assert too_deep(raw) == (depth(value) > MAX_DEPTH)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300).map(lambda b: b"[" * 150 + b))
def test_what_passes_the_check_never_recurses_the_parser_too_deeply(raw):
    try:
        parse(raw)
    except ApiError as exc:
        assert exc.status == 400


def test_unfinished_bodies_are_not_too_deep_but_invalid():
    for raw in (b"[" * MAX_DEPTH, b"[" * MAX_DEPTH + b'"open string [[[[', b"]" + b"[" * 500):
        assert not too_deep(raw)
        with pytest.raises(ApiError, match="not JSON"):
            parse(raw)
    assert too_deep(b"[" * (MAX_DEPTH + 1))


@pytest.mark.parametrize("raw", [
    b"[" * MAX_BODY,                                                           # one long descent
    b"[]" * (MAX_BODY // 2),                                                   # as many arrays as fit
    (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) * (MAX_BODY // (2 * MAX_DEPTH)),     # as deep as allowed, over and over
    b'"' + b'\\"' * (MAX_BODY // 2 - 1) + b"\\",                                 # a string that never ends
])
def test_the_check_is_fast_on_the_worst_bodies(raw):
    started = time.perf_counter()
    too_deep(raw)
    assert time.perf_counter() - started < 1.5  # about 0.15 s on a 2-core CI machine

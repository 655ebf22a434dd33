"""The path a request takes (``kvpush.router.ask``), for the fields that decide it."""

from __future__ import annotations

import pytest

from kvpush.router import ask as asks
from tests.router.fakes import WordTokenizer

LIMITS = asks.Limits(max_model_len=1000)


@pytest.mark.parametrize("extra, path, why", [
    ({}, asks.FIRST_TOKEN, ""),
    ({"temperature": 0.7}, asks.FIRST_TOKEN, ""),                      # sampled, unseeded: one draw either way
    ({"seed": 3, "temperature": 0.7}, asks.PUSH, "seeded_sampling"),   # decode must draw from the seed's start
    ({"seed": 3}, asks.PUSH, "seeded_sampling"),                       # (the default temperature samples)
    ({"seed": 3, "temperature": 0}, asks.FIRST_TOKEN, ""),             # greedy: the seed draws nothing
    ({"presence_penalty": 0.5}, asks.PUSH, "output_penalties"),
    ({"max_tokens": 1}, asks.PREFILL_ONLY, ""),
    ({"n": 2}, asks.DECODE_ONLY, "n"),
])
def test_the_path_by_field(extra, path, why):
    got = asks.parse("completions", {"model": "tiny", "prompt": "a b c", "max_tokens": 8, **extra}, WordTokenizer(),
                     LIMITS)
    assert (got.path, got.why) == (path, why)

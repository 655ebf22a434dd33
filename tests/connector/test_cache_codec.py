"""The CPU cache codec's token index (fast, no engine): for any block order and
token range it names, element by element, the positions a per-token reference
computes from the probed permutation; and reading then writing it round-trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.cache_codec import BlockCodec

BS, HEADS, DIM = 32, 2, 64


@pytest.fixture(scope="module")
def codec():
    return BlockCodec.probe_cpu_attn(BS, HEADS, DIM, "vec")


def reference(codec: BlockCodec, block_ids, start: int, end: int) -> np.ndarray:
    out = np.empty((2, end - start, HEADS, DIM), dtype=np.int64)
    for i, t in enumerate(range(start, end)):
        out[:, i] = block_ids[t // BS] * codec.block_elems + codec.perm[:, t % BS]
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_token_index_matches_a_per_token_reference(codec, data):
    n_blocks = data.draw(st.integers(1, 12))
    block_ids = data.draw(st.permutations(range(40)))[:n_blocks]
    start = data.draw(st.integers(0, n_blocks * BS - 1))
    end = data.draw(st.integers(start + 1, n_blocks * BS))
    idx = codec.token_index(block_ids, start, end)
    assert np.array_equal(idx, reference(codec, block_ids, start, end))
    cache = np.random.default_rng(start).random(40 * codec.block_elems).astype(np.float32)
    tokens = codec.read(cache, block_ids, start, end, idx)
    before = cache.copy()
    codec.write(cache, block_ids, tokens, start, end)  # writing back what was read changes nothing
    assert np.array_equal(cache, before)


def test_token_index_refuses_ranges_it_cannot_name(codec):
    with pytest.raises(ValueError, match="bad token range"):
        codec.token_index([0], 5, 5)
    with pytest.raises(ValueError, match="need 2 blocks"):
        codec.token_index([0], 0, BS + 1)

"""The CPU cache codec (fast, no engine): for any block order and token range its
index names, element by element, the positions a per-token reference computes from
the probed permutation; reading then writing round-trips; and the strided copies
(the fast path for layouts that are axis permutations) read and write exactly what
the index path does, leaving every other element of the cache alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.connector.copiers.cache_codec import BlockCodec

BS, HEADS, DIM = 32, 2, 64


@pytest.fixture(scope="module")
def codec():
    return BlockCodec.probe_cpu_attn(BS, HEADS, DIM, "vec")


def reference(codec: BlockCodec, block_ids, start: int, end: int) -> np.ndarray:
    out = np.empty((2, end - start, HEADS, DIM), dtype=np.int64)
    for i, t in enumerate(range(start, end)):
        out[:, i] = block_ids[t // BS] * codec.block_elems + codec.perm[:, t % BS]
    return out


@st.composite
def token_ranges(draw):
    """A request's blocks (in token order) and a token range inside them."""
    n_blocks = draw(st.integers(1, 12))
    block_ids = draw(st.permutations(range(40)))[:n_blocks]
    start = draw(st.integers(0, n_blocks * BS - 1))
    return block_ids, start, draw(st.integers(start + 1, n_blocks * BS))


@settings(max_examples=60, deadline=None)
@given(r=token_ranges())
def test_token_index_matches_a_per_token_reference(codec, r):
    block_ids, start, end = r
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


def test_the_cpu_layout_is_detected_as_strided(codec):
    # vLLM's vec ISA: K as [head][dim][token], V as [head][token][dim] inside a block.
    assert codec.strides == ((0, 1, 2 * BS * DIM, BS), (BS * DIM, DIM, 2 * BS * DIM, 1))
    shuffled = BlockCodec(BS, HEADS, DIM, np.random.default_rng(0).permutation(codec.block_elems)
                          .reshape(2, BS, HEADS, DIM))
    assert shuffled.strides is None and shuffled.prepare([0], 0, 5) is not None  # falls back to the index


@settings(max_examples=60, deadline=None)
@given(r=token_ranges())
def test_strided_copies_equal_the_index_path(codec, r):
    block_ids, start, end = r
    rng = np.random.default_rng(end)
    cache = rng.random(40 * codec.block_elems).astype(np.float32)
    idx = codec.token_index(block_ids, start, end)
    assert codec.prepare(block_ids, start, end) is None
    assert np.array_equal(codec.read(cache, block_ids, start, end), codec.read(cache, block_ids, start, end, idx))
    tokens = rng.random((2, end - start, HEADS, DIM)).astype(np.float32)
    by_index, strided = cache.copy(), cache.copy()
    codec.write(by_index, block_ids, tokens, start, end, idx)
    codec.write(strided, block_ids, tokens, start, end)
    assert np.array_equal(strided, by_index)

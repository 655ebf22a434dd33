"""Byte geometry: which bytes a push moves and how descriptors pair up (property tests)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.contract.layout import KvLayout
from kvpush.channel.geometry import DestGeometry
from kvpush.sidecar.descriptors import blocks_segment_map, pair_descriptors, staging_segment_map
from kvpush.channel.pool import StagingAllocation, StagingExtent


def reference_mask(geom: DestGeometry, start: int, end: int) -> np.ndarray:
    mask = np.zeros(geom.layer_bytes, dtype=bool)
    d, tpb = geom.block_size, geom.token_part_bytes
    for t in range(start, end):
        j, slot = divmod(t, d)
        for part in range(geom.kv_parts):
            off = j * geom.block_layer_bytes + part * d * tpb + slot * tpb
            mask[off:off + tpb] = True
    return mask


@st.composite
def geometries(draw):
    geom = DestGeometry(draw(st.sampled_from([1, 2, 3, 16, 32])), draw(st.sampled_from([1, 4, 6])),
                        draw(st.sampled_from([1, 2])), draw(st.integers(1, 150)))
    start = draw(st.integers(0, geom.num_tokens - 1))
    end = draw(st.integers(start + 1, geom.num_tokens))
    return geom, start, end


@given(geometries())
@settings(max_examples=300, deadline=None)
def test_token_ranges_cover_exactly_the_tokens(case):
    geom, start, end = case
    ranges = geom.token_ranges(start, end)
    mask = np.zeros(geom.layer_bytes, dtype=bool)
    for lo, hi in ranges:
        assert not mask[lo:hi].any(), "ranges overlap"
        mask[lo:hi] = True
    assert np.array_equal(mask, reference_mask(geom, start, end))
    # Merged: sorted, and no two ranges touch.
    assert all(ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1))


def test_whole_request_of_contiguous_blocks_is_one_descriptor():
    geom = DestGeometry(16, 256, 2, 64)
    ranges = geom.token_ranges(0, 64)
    local = staging_segment_map(StagingAllocation(1, "", (StagingExtent(5, 4, 0, 4),), geom.block_layer_bytes,
                                                  4, geom.block_layer_bytes, 10 ** 6), 0, 1 << 20)
    remote = blocks_segment_map([7, 8, 9, 10], geom.block_layer_bytes, 1 << 30)
    loc, rem = pair_descriptors(ranges, local, remote)
    assert loc.shape == (1, 3) and loc[0, 1] == geom.layer_bytes
    assert rem[0, 0] == (1 << 30) + 7 * geom.block_layer_bytes


@st.composite
def push_cases(draw):
    geom, start, end = draw(geometries())
    pool_blocks = geom.num_blocks + draw(st.integers(0, 6))
    block_ids = draw(st.permutations(list(range(pool_blocks))))[:geom.num_blocks]
    if draw(st.booleans()):
        block_ids = sorted(block_ids)
    # Staging extents: split the request's blocks into 1..3 block-aligned extents with gaps.
    cuts = sorted(draw(st.sets(st.integers(1, max(1, geom.num_blocks - 1)), max_size=2)))
    cuts = [c for c in cuts if 0 < c < geom.num_blocks]
    bounds = [0, *cuts, geom.num_blocks]
    return geom, start, end, pool_blocks, block_ids, bounds


@given(push_cases())
@settings(max_examples=200, deadline=None)
def test_paired_descriptors_move_exactly_the_pushed_bytes(case):
    geom, start, end, pool_blocks, block_ids, bounds = case
    blb = geom.block_layer_bytes
    extents, unit = [], 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        extents.append(StagingExtent(unit, hi - lo, lo, hi - lo))
        unit += hi - lo + 1  # leave a gap so extents are not adjacent
    alloc = StagingAllocation(1, "", tuple(extents), blb, geom.num_blocks, blb, unit * blb)
    rng = np.random.default_rng(0)
    virtual = rng.integers(0, 256, geom.layer_bytes, dtype=np.uint8)
    local_mem = np.zeros(unit * blb, dtype=np.uint8)
    remote_mem = np.full(pool_blocks * blb, 7, dtype=np.uint8)
    local = staging_segment_map(alloc, 0, 0)
    remote = blocks_segment_map(block_ids, blb, 0)
    # Fill staging through the map, as the engine's staging copy would.
    addrs, lens = local.resolve(np.array([[0, geom.layer_bytes]]))
    pos = 0
    for a, n in zip(addrs, lens):
        local_mem[a:a + n] = virtual[pos:pos + n]
        pos += n
    loc, rem = pair_descriptors(geom.token_ranges(start, end), local, remote)
    assert np.array_equal(loc[:, 1], rem[:, 1])
    for (la, n, _), (ra, _, _) in zip(loc.tolist(), rem.tolist()):
        remote_mem[ra:ra + n] = local_mem[la:la + n]
    # Expected remote: the pushed token bytes at their block's place, 7 elsewhere.
    expected = np.full_like(remote_mem, 7)
    mask = reference_mask(geom, start, end)
    for j, b in enumerate(block_ids):
        sl = slice(j * blb, (j + 1) * blb)
        dst = expected[b * blb:(b + 1) * blb]
        dst[mask[sl]] = virtual[sl][mask[sl]]
    assert np.array_equal(remote_mem, expected)
    # Descriptor count: no more cuts than the two memories and the ranges force.
    assert len(loc) <= len(geom.token_ranges(start, end)) + local.num_segments + remote.num_segments


def test_out_of_range_tokens_are_refused():
    geom = DestGeometry.for_layout(KvLayout(2, 16, 1, 8), 16, 20)
    with pytest.raises(ValueError):
        geom.token_ranges(0, 21)
    with pytest.raises(ValueError):
        geom.token_ranges(5, 5)
    with pytest.raises(ValueError):
        DestGeometry.for_layout(KvLayout(2, 16, 1, 8), 16, 0)

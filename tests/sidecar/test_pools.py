"""Shared-memory pools, the staging allocator and the engine-side re-blocking copies."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.contract.layout import KvLayout
from kvpush.channel import reblock
from kvpush.channel.geometry import DestGeometry
from kvpush.channel.memory import SHM_DIR, ShmMemory
from kvpush.channel.attach import attach_pool
from kvpush.sidecar.pools import LandingPool, StagingFull, StagingPool

LAYOUT = KvLayout(num_layers=3, block_size=16, num_kv_heads=2, head_dim=4, dtype="float16")


def test_shm_pool_is_shared_by_name_and_removed_on_close():
    pool = LandingPool.create_shm("t-share", LAYOUT, 8)
    name = pool.memory.name
    assert os.path.exists(os.path.join(SHM_DIR, name))
    other = ShmMemory.attach(name, pool.memory.size)
    pool.memory.host_view()[123] = 42
    assert other.host_view()[123] == 42  # same bytes, another mapping
    other.close()
    pool.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    pool.close()  # idempotent


def test_the_engine_attaches_a_pool_from_its_description_and_refuses_a_kind_it_cannot_map():
    pool = StagingPool.create_shm("t-describe", LAYOUT, 8)
    desc = pool.info()
    assert (desc.memory_kind, desc.share_handle, desc.size_bytes) == ("DRAM", pool.memory.name, pool.memory.size)
    mapped = attach_pool(desc)
    pool.memory.host_view()[7] = 9
    assert mapped.host_view()[7] == 9 and mapped.mem_kind == "DRAM"
    mapped.close()
    try:
        with pytest.raises(ValueError, match="'HBM' memory"):
            attach_pool(dataclasses.replace(desc, memory_kind="HBM"))
        with pytest.raises(ValueError, match="VRAM on cuda:0; this engine process has no CUDA device"):
            attach_pool(dataclasses.replace(desc, memory_kind="VRAM"))
    finally:
        pool.close()


def test_attach_refuses_foreign_names():
    with pytest.raises(ValueError):
        ShmMemory.attach("not-ours")


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.sampled_from([1, 2, 3])), max_size=60))
@settings(max_examples=100, deadline=None)
def test_staging_allocator_never_overlaps_never_leaks(ops):
    pool = StagingPool(LAYOUT, 40, _FakeMemory(LAYOUT.pool_bytes(40)))
    unit = pool.unit_bytes
    live = {}
    for is_free, nblocks, scale in ops:
        if is_free and live:
            alloc_id = sorted(live)[nblocks % len(live)]
            assert pool.free(alloc_id)
            assert not pool.free(alloc_id)  # a double free is refused
            del live[alloc_id]
            continue
        dest_blb = unit * scale // 2 if scale != 2 else unit  # smaller, equal, larger than a unit
        t0 = time.perf_counter()
        try:
            alloc = pool.allocate(dest_blb, nblocks, owner=f"o{nblocks % 3}")
        except StagingFull:
            assert time.perf_counter() - t0 < 0.05  # refusing never waits
            continue
        # Every destination block lies inside one extent; extents cover the blocks in order.
        first = 0
        for ext in alloc.extents:
            assert ext.first_block == first and ext.num_blocks * dest_blb <= ext.unit_count * unit
            first += ext.num_blocks
        assert first == nblocks
        live[alloc.alloc_id] = alloc
        used = np.zeros(40, dtype=int)
        for a in live.values():
            for ext in a.extents:
                used[ext.unit_start:ext.unit_start + ext.unit_count] += 1
        assert used.max() <= 1, "two live allocations share a unit"
        assert pool.free_units == 40 - used.sum()
    pool.free_owner("o0"), pool.free_owner("o1"), pool.free_owner("o2")
    assert pool.free_units == 40 and pool.live_allocations == 0
    assert pool._free_starts == [0] and pool._free_counts == [40]  # fully merged again


class _FakeMemory:
    """Host memory for allocator tests that need no sharing."""

    def __init__(self, size):
        self._buf = np.zeros(size, dtype=np.uint8)
        self.size, self.name, self.mem_kind, self.device_id = size, "fake", "DRAM", 0
        self.base_address = int(self._buf.ctypes.data)

    def host_view(self):
        return self._buf

    def share_handle(self):
        return self.name

    def close(self):
        pass


@pytest.mark.parametrize("p_block,d_block", [(16, 16), (16, 32), (32, 16), (16, 48)])
@pytest.mark.parametrize("fragmented", [False, True])
def test_staging_copy_reblocks_exactly(p_block, d_block, fragmented):
    src_layout = KvLayout(3, p_block, 2, 4, "float16")
    tokens = 101
    geom = DestGeometry.for_layout(src_layout, d_block, tokens)
    pool = StagingPool(src_layout, 64, _FakeMemory(src_layout.pool_bytes(64)))
    if fragmented:  # leave holes so the request needs several extents
        holes = [pool.allocate(src_layout.block_layer_bytes, 1) for _ in range(64)]
        for k in range(3):  # free runs of 3 units between kept ones
            for h in holes[k::4]:
                pool.free(h.alloc_id)
    alloc = pool.allocate(geom.block_layer_bytes, geom.num_blocks)
    assert (len(alloc.extents) > 1) == fragmented
    rng = np.random.default_rng(3)
    width = src_layout.head_dim * src_layout.itemsize
    cache = rng.integers(0, 256, (3, 20, 2, p_block, 2, width), dtype=np.uint8)
    cache_ids = list(rng.permutation(20)[:src_layout.blocks_for_tokens(tokens)])
    mem = pool.memory.host_view()
    for layer in range(3):
        for start, end in ((0, 40), (40, 41), (41, tokens)):  # chunks cut mid-block
            reblock.stage_from_cache(mem, alloc, geom, layer, cache[layer], cache_ids, start, end)
    for layer in range(3):
        expected = reblock.gather_tokens(cache[layer], cache_ids, 0, tokens)
        got = np.concatenate([
            reblock.gather_tokens(blocks, list(range(blocks.shape[0])), 0,
                                  min(blocks.shape[0] * d_block, tokens - first)).reshape(2, -1, 2, width)
            for first, blocks in reblock.staging_blocks(mem, alloc, geom, layer, 2)], axis=1)
        assert np.array_equal(got, expected)

"""The torch copier on CPU tensors laid out as vLLM's GPU backends lay out their caches:
every KVCacheLayout of the pinned vLLM, every dtype, a re-blocked, chunked, scattered
request staged, moved and loaded byte for byte, and nothing else touched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpush.channel import reblock
from kvpush.connector.copiers.copier import CopyError
from kvpush.channel.geometry import DestGeometry
from kvpush.connector.copiers.torch_copier import TorchCopier, stored_dtype
from kvpush.contract.layout import KvLayout
from kvpush.sidecar.pools import LandingPool, StagingPool

HEADS, DIM, LAYERS, BLOCKS = 2, 8, 3, 12
P_BS, D_BS = 16, 32  # prefill and decode block sizes differ: the push re-blocks
TOKENS = 70  # five prefill blocks, three decode blocks, the last of each partial
P_IDS, D_IDS, LANDING_IDS = [7, 2, 9, 4, 0], [5, 1, 10], [6, 3, 11]
SENTINEL = 0xAB
# (tensor dtype, vLLM --kv-cache-dtype): the plain ones, and fp8 as vLLM keeps it (uint8
# tensors for "fp8"/"fp8_e5m2", float8_e4m3fn for "fp8_inc"), moved as the bytes they are.
DTYPES = [(torch.float16, "auto"), (torch.bfloat16, "auto"), (torch.float32, "auto"),
          (torch.float8_e4m3fn, "fp8_inc"), (torch.uint8, "fp8"), (torch.uint8, "fp8_e5m2")]


def layer_views(layout: KVCacheLayout, dtype, block_size: int, fill) -> list[torch.Tensor]:
    """One allocation for every layer in ``layout``'s physical order, seen through the logical
    ``[L, B, H, N, 2 * D]`` axes, as vLLM hands a connector its per-layer views."""
    logical = (LAYERS, BLOCKS, HEADS, block_size, 2 * DIM)
    order = layout.stride_order
    physical = torch.empty([logical[o] for o in order], dtype=dtype)
    flat = physical.view(torch.uint8).view(-1)
    flat.copy_(fill(flat.numel()))
    view = physical.permute(*np.argsort(order).tolist())
    assert tuple(view.shape) == logical
    return [view[i] for i in range(LAYERS)]


def token_bytes(views, layer: int, ids, block_size: int, t: int) -> np.ndarray:
    return views[layer][ids[t // block_size], :, t % block_size, :].contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES, ids=lambda x: str(x).removeprefix("torch."))
def test_a_request_staged_moved_and_loaded_arrives_byte_for_byte(layout, dtype, cache_dtype):
    name = stored_dtype(cache_dtype, dtype)
    lp = KvLayout(num_layers=LAYERS, block_size=P_BS, num_kv_heads=HEADS, head_dim=DIM, dtype=name)
    ld = KvLayout(num_layers=LAYERS, block_size=D_BS, num_kv_heads=HEADS, head_dim=DIM, dtype=name)
    rng = np.random.default_rng(11)
    src = layer_views(layout, dtype, P_BS, lambda n: torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)))
    dst = layer_views(layout, dtype, D_BS, lambda n: torch.full((n,), SENTINEL, dtype=torch.uint8))
    staging = StagingPool.create_shm("t-torch.staging", lp, 8)
    landing = LandingPool.create_shm("t-torch.landing", ld, 12)
    try:
        geom = DestGeometry.for_layout(lp, D_BS, TOKENS)
        # Fragment staging so the request lies in two extents.
        x = staging.allocate(geom.block_layer_bytes, 1)
        staging.allocate(geom.block_layer_bytes, 1)
        staging.free(x.alloc_id)
        alloc = staging.allocate(geom.block_layer_bytes, geom.num_blocks)
        assert len(alloc.extents) == 2

        prefill = TorchCopier(P_BS, cache_dtype=cache_dtype)
        prefill.bind_caches(src, lp)
        prefill.bind_pool(staging.memory, staging.info())
        for start, end in ((0, 40), (40, TOKENS)):  # chunked prefill: two pieces, every layer each
            plan = prefill.plan(P_IDS, start, end)
            for layer in range(LAYERS):
                prefill.stage(layer, P_IDS, start, end, alloc, geom, plan)

        # The push: each staged destination block to its landing block, as the sidecar writes it.
        host_s, host_l = staging.memory.host_view(), landing.memory.host_view()
        for layer in range(LAYERS):
            for ext in alloc.extents:
                for i in range(ext.num_blocks):
                    j = ext.first_block + i
                    s = alloc.extent_offset(ext, layer) + i * geom.block_layer_bytes
                    d = landing.unit_offset(layer, LANDING_IDS[j])
                    host_l[d:d + geom.block_layer_bytes] = host_s[s:s + geom.block_layer_bytes]

        # The landing blocks hold kvpush's canonical layout: K then V, token-major, per block.
        for layer in range(LAYERS):
            got = reblock.gather_tokens(landing.blocks_view(layer), LANDING_IDS, 0, TOKENS)
            for t in (0, 15, 16, 31, 32, 69):
                want = token_bytes(src, layer, P_IDS, P_BS, t).reshape(HEADS, 2, -1)
                assert np.array_equal(got[0, t], want[:, 0]) and np.array_equal(got[1, t], want[:, 1])

        decode = TorchCopier(D_BS, cache_dtype=cache_dtype)
        decode.bind_caches(dst, ld)
        decode.bind_pool(landing.memory, landing.info())
        decode.load(D_IDS, 0, TOKENS, LANDING_IDS)
        for layer in range(LAYERS):
            for t in range(TOKENS):
                assert np.array_equal(token_bytes(dst, layer, D_IDS, D_BS, t), token_bytes(src, layer, P_IDS, P_BS, t))
            # Untouched: other blocks, and the tail of the last, partial block.
            bytes_of = [dst[layer][b].contiguous().view(torch.uint8) for b in range(BLOCKS)]
            assert all(bool((bytes_of[b] == SENTINEL).all()) for b in range(BLOCKS) if b not in D_IDS)
            tail = dst[layer][D_IDS[-1], :, TOKENS % D_BS:, :].contiguous().view(torch.uint8)
            assert bool((tail == SENTINEL).all())
    finally:
        staging.close()
        landing.close()


def test_caches_the_copier_cannot_move_are_refused_naming_what_is_wrong():
    layout = KvLayout(num_layers=1, block_size=P_BS, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16")
    good = torch.zeros(4, HEADS, P_BS, 2 * DIM, dtype=torch.bfloat16)
    with pytest.raises(CopyError, match="a float16 KV cache \\(kv-cache-dtype 'auto'\\), the sidecar's layout holds bfloat16"):
        TorchCopier(P_BS).bind_caches([good.to(torch.float16)], layout)
    with pytest.raises(CopyError, match="kv_heads, block_size, 2 \\* head_dim"):
        TorchCopier(P_BS).bind_caches([torch.zeros(4, P_BS, HEADS, 2 * DIM, dtype=torch.bfloat16)], layout)
    with pytest.raises(CopyError, match="MLA"):
        TorchCopier(P_BS).bind_caches([good], KvLayout(num_layers=1, block_size=P_BS, num_kv_heads=HEADS,
                                                       head_dim=DIM, dtype="bfloat16", kv_parts=1))
    with pytest.raises(CopyError, match="content axis"):
        TorchCopier(P_BS).bind_caches([good.transpose(2, 3).contiguous().transpose(2, 3)], layout)


def test_the_connector_chooses_its_copier_by_backend_and_refuses_what_it_cannot_move():
    from kvpush.connector.kvpush_connector import choose_copier
    from kvpush.connector.copiers.cpu_copier import CpuCopier

    probed = []
    cpu = lambda: probed.append(1) or CpuCopier.__new__(CpuCopier)  # noqa: E731 (the probe needs vLLM's CPU kernel)
    flash = layer_views(KVCacheLayout.LBNHC, torch.bfloat16, P_BS, lambda n: torch.zeros(n, dtype=torch.uint8))[0]
    assert isinstance(choose_copier("CPU_ATTN", flash, P_BS, cpu), CpuCopier) and probed == [1]
    for backend in ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"):
        copier = choose_copier(backend, flash, P_BS, cpu)
        assert isinstance(copier, TorchCopier) and copier.block_size == P_BS
    with pytest.raises(CopyError, match=r"FLASHMLA attention backend's KV cache \(shape .*dtype torch.bfloat16\).*MLA"):
        choose_copier("FLASHMLA", torch.zeros(BLOCKS, P_BS, 576, dtype=torch.bfloat16), P_BS, cpu)
    # The copier it chooses refuses what it cannot move when the connector binds the caches
    # at start-up, naming the backend, the cache's layout and dtype.
    layout = KvLayout(num_layers=1, block_size=P_BS, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16")
    int8 = flash.to(torch.int8)
    with pytest.raises(CopyError, match=r"FLASH_ATTN attention backend's KV cache .*dtype torch.int8.*"
                                        r"kv-cache-dtype 'auto' over torch.int8 tensors is not a format kvpush moves"):
        choose_copier("FLASH_ATTN", int8, P_BS, cpu).bind_caches([int8], layout)
    # fp8 formats whose scales are computed per token at run time (or fp4) are refused by name.
    packed = flash.to(torch.uint8)
    fp8 = KvLayout(num_layers=1, block_size=P_BS, num_kv_heads=HEADS, head_dim=DIM, dtype="float8_e4m3fn")
    for cache_dtype in ("fp8_per_token_head", "nvfp4", "int8_per_token_head"):
        with pytest.raises(CopyError, match=rf"FLASH_ATTN .*dtype torch.uint8.*kv-cache-dtype '{cache_dtype}'"):
            choose_copier("FLASH_ATTN", packed, P_BS, cpu, cache_dtype).bind_caches([packed], fp8)
    choose_copier("FLASH_ATTN", packed, P_BS, cpu, "fp8").bind_caches([packed], fp8)  # fp8 as vLLM stores it
    with pytest.raises(CopyError, match=r"a float8_e5m2 KV cache \(kv-cache-dtype 'fp8_e5m2'\), the sidecar's "
                                        r"layout holds float8_e4m3fn"):
        choose_copier("FLASH_ATTN", packed, P_BS, cpu, "fp8_e5m2").bind_caches([packed], fp8)
    odd = torch.zeros(BLOCKS, HEADS, 32, 2 * DIM, dtype=torch.bfloat16)
    with pytest.raises(CopyError, match=r"FLASH_ATTN .*shape \(12, 2, 32, 16\).*expected the logical view"):
        choose_copier("FLASH_ATTN", odd, P_BS, cpu).bind_caches([odd], layout)


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_one_head_share_is_staged_alone_in_its_own_geometry(layout):
    # A tensor-parallel push stages each head share apart (kvpush/channel/head_plan.py): here head
    # 1 of 2, in rows of one head, chunked; nothing of head 0 and nothing past it is written.
    lp = KvLayout(num_layers=LAYERS, block_size=P_BS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16")
    rng = np.random.default_rng(5)
    src = layer_views(layout, torch.float16, P_BS, lambda n: torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)))
    staging = StagingPool.create_shm("t-torch-share.staging", lp, 8)
    try:
        staging.memory.host_view()[:] = SENTINEL
        share_bytes = DIM * 2  # one head of float16 per token and part
        blocks = -(-TOKENS // D_BS)
        alloc = staging.allocate(2 * D_BS * share_bytes, blocks)
        alloc = dataclasses.replace(alloc, first_head=1, num_heads=1)
        geom = reblock.share_geometry(lp, alloc, D_BS, TOKENS)
        assert geom.token_part_bytes == share_bytes
        copier = TorchCopier(P_BS, cache_dtype="auto")
        copier.bind_caches(src, lp)
        copier.bind_pool(staging.memory, staging.info())
        for start, end in ((0, 40), (40, TOKENS)):
            plan = copier.plan(P_IDS, start, end)
            for layer in range(LAYERS):
                copier.stage(layer, P_IDS, start, end, alloc, geom, plan)
        host = staging.memory.host_view()
        for layer in range(LAYERS):
            base = alloc.extent_offset(alloc.extents[0], layer)
            image = host[base:base + geom.layer_bytes].reshape(blocks, 2, D_BS, share_bytes)
            for t in range(TOKENS):
                want = token_bytes(src, layer, P_IDS, P_BS, t).reshape(HEADS, 2, -1)[1]
                assert np.array_equal(image[t // D_BS, :, t % D_BS], want), (layer, t)
            assert bool((image[-1, :, TOKENS % D_BS:] == SENTINEL).all())  # the tail is not written
        # Nothing beyond the share's own bytes was written.
        used = {alloc.extent_offset(alloc.extents[0], layer) + i for layer in range(LAYERS)
                for i in range(geom.layer_bytes)}
        rest = np.array([b for b in range(0, host.size, 97) if b not in used])
        assert bool((host[rest] == SENTINEL).all())
    finally:
        staging.close()


def test_a_reservation_from_a_first_token_stages_and_loads_the_rest_only():
    """KV-aware routing: decode holds the prompt's first FIRST tokens; prompt tokens
    [FIRST, FIRST + TOKENS) are staged as the push's tokens [0, TOKENS) and loaded back
    into the same prompt positions, the held ones left alone."""
    first = 32  # a decode block: reservations start block-aligned
    p_ids, d_ids = [7, 2, 9, 4, 0, 8, 1], [5, 1, 10, 2]  # 7 prefill, 4 decode blocks: 102 prompt tokens
    layout = KVCacheLayout.BHLNC  # (every layout is covered above: the offset is the same for all)
    lp = KvLayout(num_layers=LAYERS, block_size=P_BS, num_kv_heads=HEADS, head_dim=DIM, dtype="float16")
    ld = dataclasses.replace(lp, block_size=D_BS)
    rng = np.random.default_rng(12)
    src = layer_views(layout, torch.float16, P_BS, lambda n: torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)))
    dst = layer_views(layout, torch.float16, D_BS, lambda n: torch.full((n,), SENTINEL, dtype=torch.uint8))
    staging = StagingPool.create_shm("t-torch-first.staging", lp, 8)
    landing = LandingPool.create_shm("t-torch-first.landing", ld, 12)
    try:
        geom = DestGeometry.for_layout(lp, D_BS, TOKENS)
        alloc = staging.allocate(geom.block_layer_bytes, geom.num_blocks)
        prefill = TorchCopier(P_BS)
        prefill.bind_caches(src, lp)
        prefill.bind_pool(staging.memory, staging.info())
        plan = prefill.plan(p_ids, first, first + TOKENS)
        for layer in range(LAYERS):
            prefill.stage(layer, p_ids, first, first + TOKENS, alloc, geom, plan, offset=first)
        host_s, host_l = staging.memory.host_view(), landing.memory.host_view()
        for layer in range(LAYERS):  # the push, one extent
            (ext,) = alloc.extents
            for j in range(geom.num_blocks):
                s = alloc.extent_offset(ext, layer) + j * geom.block_layer_bytes
                d = landing.unit_offset(layer, LANDING_IDS[j])
                host_l[d:d + geom.block_layer_bytes] = host_s[s:s + geom.block_layer_bytes]
        decode = TorchCopier(D_BS)
        decode.bind_caches(dst, ld)
        decode.bind_pool(landing.memory, landing.info())
        decode.load(d_ids, first, first + TOKENS, LANDING_IDS, offset=first)
        for layer in range(LAYERS):
            for t in range(first, first + TOKENS):
                assert np.array_equal(token_bytes(dst, layer, d_ids, D_BS, t), token_bytes(src, layer, p_ids, P_BS, t))
            held = dst[layer][d_ids[0]].contiguous().view(torch.uint8)  # tokens [0, 32): decode's own, untouched
            assert bool((held == SENTINEL).all())
    finally:
        staging.close()
        landing.close()


def test_a_cuda_fence_waits_on_its_own_device(monkeypatch):
    """The frames' sender thread starts on GPU 0: waiting for a copy on cuda:1 must set that
    device first (else a context, and memory, on another GPU). CUDA's calls stood in for."""
    import kvpush.connector.copiers.torch_copier as tc
    calls = []

    class Event:
        def __init__(self, blocking):
            calls.append(("event", blocking))

        def record(self, stream):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append(("synchronize",))

    monkeypatch.setattr(tc.torch.cuda, "Event", Event)
    monkeypatch.setattr(tc.torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(tc.torch.cuda, "set_device", lambda device: calls.append(("set_device", str(device))))
    fence = tc.CudaFence(tc.torch.device("cuda:1"))
    fence.wait()
    assert calls == [("event", True), ("record", "stream of cuda:1"), ("set_device", "cuda:1"), ("synchronize",)]

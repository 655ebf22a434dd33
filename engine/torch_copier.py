"""``TorchCopier``: the ``CacheCopier`` for vLLM's plain KV layouts, in torch ops on the
cache's own device.

In the vLLM we pin (0.32, RFC #42082, ``vllm/v1/kv_cache_layout.py``) every attention
backend but the CPU one sees a layer's cache as the *logical* view
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``: K in the first ``head_dim``
of the last axis, V in the second (FlashAttention splits it so:
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``). What differs between backends
and settings is the physical order of those axes (``KVCacheLayout``: NHD, HND, block
or layer outermost), which the view's strides carry; the content axis is always the
innermost, so a layer is viewable as bytes and moves as it is stored (fp8 included).

This copier indexes the logical view, so one code path serves every stride order and
dtype: a request's tokens are gathered (prefill) or scattered (decode) with two index
tensors, block and slot per token, computed once per piece (``plan``) and reused by
every layer; no per-token Python. Staging and landing blocks are kvpush's canonical
``[K/V][token][kv_head][head_dim]`` per block (``kvpush.contract.layout``), so a pool
row of ``num_kv_heads * head_dim`` bytes is one token's K or V.

What is not here yet (issue #11): the device pool (VRAM by IPC handle; ``bind_pool``
takes the pool's bytes through ``PoolMemory.host_view`` today), the CUDA event that
orders PUSH after ``stage``'s copy (today the copy to the host pool is synchronous, so it
is ordered, and slow). The connector chooses this copier for every backend but
``CPU_ATTN`` and MLA ones (``choose_copier``); it has not been run on a GPU yet. The CPU
tests run this very code on CPU tensors in each stride order.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from engine.copier import CacheCopier, CopyError
from engine.geometry import DestGeometry
from engine.memory import PoolMemory
from engine.pool import PoolDescription, StagingAllocation
from kvpush.contract.layout import KvLayout

TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "uint8"}


def describe_cache(backend: str, cache: torch.Tensor) -> str:
    """A cache as refusals name it: the backend, its layout (shape, strides) and dtype."""
    return (f"the {backend} attention backend's KV cache (shape {tuple(cache.shape)}, strides "
            f"{tuple(cache.stride())}, dtype {cache.dtype})")


@dataclasses.dataclass(frozen=True)
class _Plan:
    blocks: torch.Tensor  # (T,) cache block of each token, on the cache's device
    slots: torch.Tensor  # (T,) slot of each token in its block
    # staging allocation id -> K rows of the piece's tokens in layer 0 (every layer is the
    # same rows, one layer stride further): computed by the first layer's stage, reused
    staging_rows: dict = dataclasses.field(default_factory=dict)


class TorchCopier(CacheCopier):
    def __init__(self, block_size: int, backend: str = "?"):
        self._block_size = block_size
        self._backend = backend  # the attention backend's name, for refusals
        self._layers: list[torch.Tensor] = []  # per layer: the logical view as bytes (B, H, N, 2 * D * itemsize)
        self._rows: torch.Tensor | None = None  # the pool as rows of one token's K or V bytes
        self._pool: PoolDescription | None = None
        self._token_part = 0  # bytes of one token's K (or V) in one layer
        self._device = torch.device("cpu")

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def token_layer_bytes(self) -> int:
        return 2 * self._token_part

    def bind_caches(self, caches: Sequence[torch.Tensor], layout: KvLayout) -> None:
        views = []
        for i, cache in enumerate(caches):
            what = f"KVPushConnector cannot move {describe_cache(self._backend, cache)}: layer {i}"
            if layout.kv_parts != 2:
                raise CopyError(f"{what}: the sidecar's layout has {layout.kv_parts} KV part(s); this copier "
                                "moves K and V (an MLA latent cache is not supported)")
            name = TORCH_DTYPES.get(cache.dtype)
            if name is None:
                raise CopyError(f"{what}: dtype not one of {sorted(TORCH_DTYPES.values())}")
            if name != layout.dtype:
                raise CopyError(f"{what}: a {cache.dtype} KV cache, the sidecar's layout holds {layout.dtype}")
            want = (layout.num_kv_heads, self._block_size, 2 * layout.head_dim)
            if cache.dim() != 4 or tuple(cache.shape[1:]) != want:
                raise CopyError(f"{what}: expected the logical view (blocks, {want[0]}, {want[1]}, {want[2]}) = "
                                "(blocks, kv_heads, block_size, 2 * head_dim)")
            if cache.stride(-1) != 1:
                raise CopyError(f"{what}: the cache's content axis is not innermost")
            views.append(cache.view(torch.uint8))  # bytes as stored: no conversion, fp8 as it is
        self._layers = views
        self._token_part = layout.token_part_bytes
        self._device = caches[0].device

    def bind_pool(self, memory: PoolMemory, desc: PoolDescription) -> None:
        lo = desc.layout
        if lo.token_part_bytes != self._token_part:
            raise CopyError(f"the sidecar's pool holds {lo.token_part_bytes}-byte token parts, the cache "
                            f"{self._token_part}")
        pool = torch.from_numpy(memory.host_view())
        self._rows = pool.view(-1, self._token_part)
        self._pool = desc

    def plan(self, cache_block_ids: Sequence[int], start: int, end: int) -> _Plan:
        if not 0 <= start < end:
            raise ValueError(f"bad token range [{start}, {end})")
        if (end - 1) // self._block_size >= len(cache_block_ids):
            raise ValueError(f"tokens [{start}, {end}) need {(end - 1) // self._block_size + 1} blocks, "
                             f"the request has {len(cache_block_ids)}")
        tokens = torch.arange(start, end)
        ids = torch.as_tensor(list(cache_block_ids), dtype=torch.long)
        return _Plan(ids[tokens // self._block_size].to(self._device), (tokens % self._block_size).to(self._device))

    def stage(self, layer: int, cache_block_ids: Sequence[int], start: int, end: int, alloc: StagingAllocation,
              geom: DestGeometry, plan: _Plan | None = None) -> None:
        plan = plan or self.plan(cache_block_ids, start, end)
        tokens = self._layers[layer][plan.blocks, :, plan.slots, :]  # (T, H, 2 * Db): a gather, on the device
        rows0 = plan.staging_rows.get(alloc.alloc_id)
        if rows0 is None:
            rows0 = plan.staging_rows[alloc.alloc_id] = self._staging_rows(alloc, geom, start, end)
        k_rows = rows0 + layer * (alloc.layer_stride // self._token_part)
        half = tokens.shape[-1] // 2
        self._rows[k_rows] = tokens[..., :half].reshape(len(k_rows), -1).to(self._rows.device)
        self._rows[k_rows + geom.block_size] = tokens[..., half:].reshape(len(k_rows), -1).to(self._rows.device)

    def load(self, cache_block_ids: Sequence[int], start: int, end: int, landing_block_ids: Sequence[int],
             plan: _Plan | None = None) -> None:
        plan = plan or self.plan(cache_block_ids, start, end)
        lo = self._pool.layout
        t = torch.arange(start, end)
        ids = torch.as_tensor(list(landing_block_ids), dtype=torch.long)
        if (end - 1) // lo.block_size >= len(ids):
            raise ValueError(f"tokens [{start}, {end}) need more than the {len(ids)} landing blocks")
        heads, per_block = lo.num_kv_heads, 2 * lo.block_size
        # K rows in layer 0 (a landing block is [K/V][slot] rows; V is block_size rows further);
        # every layer is the same rows, one layer of the pool further.
        rows0 = ids[t // lo.block_size] * per_block + t % lo.block_size
        for layer, cache in enumerate(self._layers):
            k_rows = rows0 + layer * self._pool.num_units * per_block
            both = torch.cat([self._rows[k_rows], self._rows[k_rows + lo.block_size]], dim=-1)  # (T, 2 * H * Db)
            # (T, 2, H, Db) -> (T, H, 2 * Db): K and V side by side per head, as the logical view holds them
            both = both.view(len(t), 2, heads, -1).transpose(1, 2).reshape(len(t), heads, -1)
            cache[plan.blocks, :, plan.slots, :] = both.to(cache.device)

    # -- pool rows --------------------------------------------------------------------------
    def _staging_rows(self, alloc: StagingAllocation, geom: DestGeometry, start: int, end: int) -> torch.Tensor:
        """K rows of tokens ``[start, end)`` in layer 0 of the request's staging allocation,
        which holds them in the destination's block geometry, extent by extent (a
        destination block is [K/V][slot] rows: V is ``geom.block_size`` rows further)."""
        d = geom.block_size
        t = torch.arange(start, end)
        dest = t // d
        base = torch.empty(alloc.num_dest_blocks, dtype=torch.long)
        for ext in alloc.extents:  # a handful of extents: each a run of destination blocks
            first = alloc.extent_offset(ext, 0) // self._token_part
            base[ext.first_block:ext.first_block + ext.num_blocks] = (
                first + torch.arange(ext.num_blocks) * 2 * d)
        return base[dest] + t % d

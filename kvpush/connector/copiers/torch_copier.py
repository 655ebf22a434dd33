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

Where the bytes go and on which stream (the GPU data path, docs/ARCHITECTURE.md):

* the pool is the sidecar's: device memory on the cache's GPU, mapped through its CUDA
  IPC handle (``kvpush.channel.device_memory``), or a host segment (a CPU engine; or a GPU engine
  whose sidecar keeps a DRAM pool, where each copy is a synchronous device<->host copy,
  the forward pass waiting for it: a fallback, not the product);
* every copy runs on the engine's current stream, the one vLLM runs the forward pass on.
  ``stage`` follows the attention layer that wrote the layer's KV on that stream, so it
  needs no cross-stream wait, and ``load`` precedes the forward pass that reads it.
  The cost is the copy's time on that stream: a gather of the request's KV, well under
  the layer's own compute (an 8B model's 1k-token layer is 4 MiB: ~1-2 us at H200 bandwidth);
* the host does not wait: ``stage`` and ``load`` return a ``CudaFence`` (an event recorded
  after the copy) and the connector sends the frame that lets the sidecar read (PUSH) or
  reuse (CONSUMED) the pool only once it has passed (``kvpush/connector/ordered_sends.py``);
  on CPU tensors the copy is complete on return and the fence is None;
* index tensors reach the GPU from pinned memory without blocking (a pageable host to
  device copy in torch synchronises the stream: the forward pass would stall on it).

The connector chooses this copier for every backend but ``CPU_ATTN`` and MLA ones
(``choose_copier``); the CPU tests run this very code on CPU tensors in each stride order.
It has not been run on a GPU yet (no machine lent); ``bench/gpu_check.py`` is the check.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from kvpush.connector.copiers.copier import CacheCopier, CopyError
from kvpush.channel.geometry import DestGeometry
from kvpush.channel.memory import DeviceMemory, PoolMemory
from kvpush.channel.pool import PoolDescription, StagingAllocation
from kvpush.contract.layout import KvLayout

TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.uint8: "uint8"}
# vLLM's ``--kv-cache-dtype`` values whose bytes kvpush moves as they are, and what the bytes
# are. vLLM keeps these fp8 caches in uint8 tensors; their per-layer scales are the
# layout's ``scales`` (checked by the connector). "auto" and the plain names: the tensor's dtype.
FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_inc": "float8_e4m3fn",
                    "fp8_e5m2": "float8_e5m2"}
PLAIN_CACHE_DTYPES = ("auto", "float32", "float16", "half", "bfloat16", "float")


def describe_cache(backend: str, cache: torch.Tensor) -> str:
    """A cache as refusals name it: the backend, its layout (shape, strides) and dtype."""
    return (f"the {backend} attention backend's KV cache (shape {tuple(cache.shape)}, strides "
            f"{tuple(cache.stride())}, dtype {cache.dtype})")


class CudaFence:
    """Completion of the copies enqueued so far on a device's current stream. ``wait`` blocks
    the calling thread, asleep (a blocking-sync event, no spinning), until they have run."""

    def __init__(self, device: torch.device):
        self.device = device
        self._event = torch.cuda.Event(blocking=True)
        self._event.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        # Called on the frames' sender thread, which starts on GPU 0: a worker on another
        # GPU would make a context there (memory on a GPU that is not its own) to wait.
        torch.cuda.set_device(self.device)
        self._event.synchronize()


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (indices) on ``device``, without synchronising its stream."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _fence(device: torch.device) -> CudaFence | None:
    return CudaFence(device) if device.type == "cuda" else None


@dataclasses.dataclass(frozen=True)
class _Plan:
    blocks: torch.Tensor  # (T,) cache block of each token, on the cache's device
    slots: torch.Tensor  # (T,) slot of each token in its block
    # staging allocation id -> K rows of the piece's tokens in layer 0 (every layer is the
    # same rows, one layer stride further): computed by the first layer's stage, reused
    staging_rows: dict = dataclasses.field(default_factory=dict)


def stored_dtype(cache_dtype: str, tensor_dtype: torch.dtype) -> str | None:
    """What a cache's bytes are, as a layout dtype name; None where kvpush cannot move them as
    they are (per-token scales computed at run time, fp4, int8 and other packed formats)."""
    if cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[cache_dtype]
    if cache_dtype in PLAIN_CACHE_DTYPES:
        return TORCH_DTYPES.get(tensor_dtype)
    return None


class TorchCopier(CacheCopier):
    def __init__(self, block_size: int, backend: str = "?", cache_dtype: str = "auto"):
        self._block_size = block_size
        self._backend = backend  # the attention backend's name, for refusals
        self._cache_dtype = cache_dtype  # vLLM's --kv-cache-dtype
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
            name = stored_dtype(self._cache_dtype, cache.dtype)
            if name is None:
                raise CopyError(f"{what}: kv-cache-dtype {self._cache_dtype!r} over {cache.dtype} tensors is not a "
                                f"format kvpush moves (it moves {sorted(set(TORCH_DTYPES.values()) - {'uint8'})} "
                                f"caches, and fp8 ones {sorted(FP8_CACHE_DTYPES)} with per-layer scales)")
            if name != layout.dtype:
                raise CopyError(f"{what}: a {name} KV cache (kv-cache-dtype {self._cache_dtype!r}), the sidecar's "
                                f"layout holds {layout.dtype}")
            want = (layout.local_kv_heads, self._block_size, 2 * layout.head_dim)
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
        if isinstance(memory, DeviceMemory):
            pool = memory.tensor()
            if self._layers and pool.device != self._device:
                raise CopyError(f"the sidecar's {desc.role} pool is on {pool.device}, the KV cache on "
                                f"{self._device}: a sidecar's pool must be on its engine's GPU")
        else:
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
        return _Plan(_to(ids[tokens // self._block_size], self._device), _to(tokens % self._block_size, self._device))

    def stage(self, layer: int, cache_block_ids: Sequence[int], start: int, end: int, alloc: StagingAllocation,
              geom: DestGeometry, plan: _Plan | None = None, offset: int = 0) -> CudaFence | None:
        plan = plan or self.plan(cache_block_ids, start, end)
        tokens = self._layers[layer][plan.blocks, :, plan.slots, :]  # (T, H, 2 * Db): a gather, on the device
        rows, part = self._rows, self._token_part
        if alloc.num_heads:  # one head share: its heads, in rows of their size
            tokens = tokens[:, alloc.first_head:alloc.first_head + alloc.num_heads]
            part = geom.token_part_bytes
            rows = self._rows.view(-1, part)
        rows0 = plan.staging_rows.get(alloc.alloc_id)
        if rows0 is None:
            rows0 = plan.staging_rows[alloc.alloc_id] = _to(
                self._staging_rows(alloc, geom, start - offset, end - offset, part), rows.device)
        k_rows = rows0 + layer * (alloc.layer_stride // part)
        half = tokens.shape[-1] // 2
        rows[k_rows] = tokens[..., :half].reshape(len(k_rows), -1).to(rows.device)
        rows[k_rows + geom.block_size] = tokens[..., half:].reshape(len(k_rows), -1).to(rows.device)
        return _fence(self._rows.device)  # PUSH lets the sidecar read these rows: only once written

    def load(self, cache_block_ids: Sequence[int], start: int, end: int, landing_block_ids: Sequence[int],
             plan: _Plan | None = None, offset: int = 0) -> CudaFence | None:
        plan = plan or self.plan(cache_block_ids, start, end)
        lo = self._pool.layout
        t = torch.arange(start - offset, end - offset)
        ids = torch.as_tensor(list(landing_block_ids), dtype=torch.long)
        if (end - offset - 1) // lo.block_size >= len(ids):
            raise ValueError(f"landing tokens [{start - offset}, {end - offset}) need more than the {len(ids)} "
                             "landing blocks")
        heads, per_block = lo.local_kv_heads, 2 * lo.block_size
        # K rows in layer 0 (a landing block is [K/V][slot] rows; V is block_size rows further);
        # every layer is the same rows, one layer of the pool further.
        rows0 = _to(ids[t // lo.block_size] * per_block + t % lo.block_size, self._rows.device)
        for layer, cache in enumerate(self._layers):
            k_rows = rows0 + layer * self._pool.num_units * per_block
            both = torch.cat([self._rows[k_rows], self._rows[k_rows + lo.block_size]], dim=-1)  # (T, 2 * H * Db)
            # (T, 2, H, Db) -> (T, H, 2 * Db): K and V side by side per head, as the logical view holds them
            both = both.view(len(t), 2, heads, -1).transpose(1, 2).reshape(len(t), heads, -1)
            cache[plan.blocks, :, plan.slots, :] = both.to(cache.device)
        # CONSUMED frees the landing blocks for the next push: only once these copies read them.
        # The forward pass that reads the cache is later on the same stream: ordered already.
        return _fence(self._rows.device)  # a host pool was read by the host: done on return

    def fence(self) -> CudaFence | None:
        return _fence(self._rows.device) if self._rows is not None else None

    # -- pool rows --------------------------------------------------------------------------
    def _staging_rows(self, alloc: StagingAllocation, geom: DestGeometry, start: int, end: int,
                      part: int) -> torch.Tensor:
        """K rows of tokens ``[start, end)`` in layer 0 of the request's staging allocation,
        which holds them in the destination's block geometry, extent by extent (a
        destination block is [K/V][slot] rows: V is ``geom.block_size`` rows further)."""
        d = geom.block_size
        t = torch.arange(start, end)
        dest = t // d
        base = torch.empty(alloc.num_dest_blocks, dtype=torch.long)
        for ext in alloc.extents:  # a handful of extents: each a run of destination blocks
            first = alloc.extent_offset(ext, 0) // part
            base[ext.first_block:ext.first_block + ext.num_blocks] = (
                first + torch.arange(ext.num_blocks) * 2 * d)
        return base[dest] + t % d

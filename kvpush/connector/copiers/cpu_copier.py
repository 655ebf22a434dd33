"""``CpuCopier``: the ``CacheCopier`` for caches in host memory, through the probed codec.

The block codec (``kvpush/connector/copiers/cache_codec.py``) knows where each canonical element sits in
one of the backend's cache blocks; the re-blocking copies (``kvpush/channel/reblock.py``) put
tokens into staging in the destination's block geometry and take them out of landing
blocks. Both work on numpy views of the cache tensors and the shared-memory pool: no
copy but the one that moves the bytes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvpush.channel import reblock
from kvpush.connector.copiers.cache_codec import BlockCodec, flat_layer
from kvpush.connector.copiers.copier import CacheCopier, CopyError
from kvpush.channel.geometry import DestGeometry
from kvpush.channel.memory import PoolMemory
from kvpush.channel.pool import PoolDescription, StagingAllocation
from kvpush.contract.layout import KvLayout


class CpuCopier(CacheCopier):
    def __init__(self, codec: BlockCodec):
        self.codec = codec
        self._flat: list[np.ndarray] = []  # per layer: a flat writable view of the cache tensor
        self._pool: np.ndarray | None = None  # the pool's bytes
        self._landing: list[np.ndarray] = []  # decode: per layer, the landing blocks

    @property
    def block_size(self) -> int:
        return self.codec.block_size

    @property
    def token_layer_bytes(self) -> int:
        return self.codec.token_layer_bytes

    def bind_caches(self, caches: Sequence, layout: KvLayout) -> None:
        codec = self.codec
        if (codec.num_kv_heads, codec.head_dim) != (layout.local_kv_heads, layout.head_dim):
            raise CopyError(f"the model has {codec.num_kv_heads} KV heads of {codec.head_dim}, the sidecar's "
                            f"layout {layout.local_kv_heads} of {layout.head_dim}")
        if layout.dtype != str(codec.dtype) or layout.kv_parts != 2:
            raise CopyError(f"the sidecar's layout holds {layout.dtype} x{layout.kv_parts}, the cache "
                            f"{codec.dtype} x2")
        num_blocks = caches[0].shape[0]
        self._flat = [flat_layer(tensor, num_blocks, codec) for tensor in caches]

    def bind_pool(self, memory: PoolMemory, desc: PoolDescription) -> None:
        self._pool = memory.host_view()
        self._landing = []
        if desc.role == "landing":
            lo, units = desc.layout, desc.num_units
            stride = units * lo.block_layer_bytes
            self._landing = [self._pool[i * stride:(i + 1) * stride].reshape(
                units, lo.kv_parts, lo.block_size, lo.local_kv_heads, lo.head_dim * lo.itemsize)
                for i in range(lo.num_layers)]

    def plan(self, cache_block_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        return self.codec.prepare(cache_block_ids, start, end)

    def stage(self, layer: int, cache_block_ids: Sequence[int], start: int, end: int, alloc: StagingAllocation,
              geom: DestGeometry, plan: object = None, offset: int = 0) -> None:
        tokens = reblock.share_heads(self.codec.read(self._flat[layer], cache_block_ids, start, end, plan), alloc)
        reblock.stage_tokens(self._pool, alloc, geom, layer, tokens.view(np.uint8), start - offset, end - offset)

    def load(self, cache_block_ids: Sequence[int], start: int, end: int, landing_block_ids: Sequence[int],
             plan: object = None, offset: int = 0) -> None:
        index = self.codec.prepare(cache_block_ids, start, end) if plan is None else plan
        for layer, cache in enumerate(self._flat):
            raw = reblock.gather_tokens(self._landing[layer], landing_block_ids, start - offset, end - offset)
            self.codec.write(cache, cache_block_ids, raw.view(self.codec.dtype), start, end, index)

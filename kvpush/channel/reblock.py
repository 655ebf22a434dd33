"""The engine-side copies: paged KV cache <-> staging / landing, with re-blocking.

These run in the vLLM process (the connector), not in the sidecar: the
connector copies a layer of a request out of its paged cache (prefill block
size P) into the request's staging allocation in the *destination* geometry
(block size D), and on the decode side copies landed blocks into its own cache.
Tests use them to play the engine. All arrays are raw bytes shaped
``(blocks, kv_parts, block_size, kv_heads, head_dim * itemsize)`` so every KV
dtype works, including ones numpy lacks; a real connector would view its
torch tensors the same way.

Token order is preserved exactly: token ``t`` of the request lives at block
``t // B``, slot ``t % B`` in any geometry of block size ``B``.
"""

from __future__ import annotations

import numpy as np

from kvpush.channel.geometry import DestGeometry
from kvpush.channel.head_plan import HeadPlan
from kvpush.channel.pool import PoolDescription, StagingAllocation
from kvpush.contract.layout import KvLayout


def gather_tokens(layer_blocks: np.ndarray, block_ids, start: int, end: int) -> np.ndarray:
    """Tokens ``[start, end)`` of a request whose blocks (token order) are ``block_ids``.

    ``layer_blocks`` is one layer of a paged cache ``(num_blocks, parts, B, H, Db)``.
    Returns a contiguous ``(parts, end - start, H, Db)`` array.
    """
    bsz = layer_blocks.shape[2]
    first, last = start // bsz, (end - 1) // bsz
    ids = np.asarray(block_ids[first:last + 1], dtype=np.int64)
    picked = layer_blocks[ids]  # (m, parts, B, H, Db), a copy
    m, parts, _, heads, width = picked.shape
    tokens = picked.transpose(1, 0, 2, 3, 4).reshape(parts, m * bsz, heads, width)
    lo = start - first * bsz
    return np.ascontiguousarray(tokens[:, lo:lo + (end - start)])


def write_tokens(blocks: np.ndarray, first_token: int, tokens: np.ndarray, start: int, end: int) -> None:
    """Write tokens ``[start, end)`` (``tokens`` as from ``gather_tokens``) into
    consecutive blocks ``blocks`` whose first slot holds token ``first_token``.
    At most three slice assignments: a partial head block, whole blocks, a partial tail."""
    bsz = blocks.shape[2]
    parts, _, heads, width = tokens.shape
    t = start
    while t < end:
        j, a = divmod(t - first_token, bsz)
        if a == 0 and end - t >= bsz:
            m = (end - t) // bsz
            src = tokens[:, t - start:t - start + m * bsz].reshape(parts, m, bsz, heads, width)
            blocks[j:j + m] = src.transpose(1, 0, 2, 3, 4)
            t += m * bsz
        else:
            b = min(bsz, a + end - t)
            blocks[j, :, a:b] = tokens[:, t - start:t - start + (b - a)]
            t += b - a


def staging_blocks(pool_bytes: np.ndarray, alloc: StagingAllocation, geom: DestGeometry,
                   layer: int, heads: int):
    """Yield ``(first_token, blocks_view)`` for each extent of ``alloc`` in ``layer``:
    writable views ``(n, parts, D, H, Db)`` of the staging pool in destination geometry."""
    width = geom.token_part_bytes // heads
    for ext in alloc.extents:
        off = alloc.extent_offset(ext, layer)
        flat = pool_bytes[off:off + ext.num_blocks * geom.block_layer_bytes]
        yield (ext.first_block * geom.block_size,
               flat.reshape(ext.num_blocks, geom.kv_parts, geom.block_size, heads, width))


def stage_tokens(pool_bytes: np.ndarray, alloc: StagingAllocation, geom: DestGeometry, layer: int,
                 tokens: np.ndarray, start: int, end: int) -> None:
    """Copy tokens ``[start, end)`` of one layer into the request's staging allocation."""
    heads = tokens.shape[2]
    for first_token, blocks in staging_blocks(pool_bytes, alloc, geom, layer, heads):
        last_token = first_token + blocks.shape[0] * geom.block_size
        lo, hi = max(start, first_token), min(end, last_token)
        if lo < hi:
            write_tokens(blocks, first_token, tokens[:, lo - start:hi - start], lo, hi)


def share_geometry(layout: KvLayout, alloc: StagingAllocation, dest_block_size: int, num_tokens: int) -> DestGeometry:
    """The geometry an allocation stages in: the destination's block size, the heads of
    its share (``alloc.num_heads``; 0: all the rank's)."""
    heads = alloc.num_heads or layout.local_kv_heads
    return DestGeometry(dest_block_size, heads * layout.head_dim * layout.itemsize, layout.kv_parts, num_tokens)


def share_heads(tokens: np.ndarray, alloc: StagingAllocation) -> np.ndarray:
    """The heads of ``tokens`` (``(parts, n, heads, width)``, the rank's own) that ``alloc`` stages."""
    return tokens[:, :, alloc.first_head:alloc.first_head + alloc.num_heads] if alloc.num_heads else tokens


def stage_from_cache(pool_bytes: np.ndarray, alloc: StagingAllocation, geom: DestGeometry, layer: int,
                     cache_layer: np.ndarray, cache_block_ids, start: int, end: int) -> None:
    """The connector's per-layer save: paged cache (block size P) -> staging (block size D)."""
    stage_tokens(pool_bytes, alloc, geom, layer, gather_tokens(cache_layer, cache_block_ids, start, end),
                 start, end)


def unshare_landing(pool_bytes, desc: PoolDescription, plan: HeadPlan, rank: int, block_ids,
                    num_tokens: int) -> None:
    """Decode, before loading: a reservation's landing blocks on ``rank``, which hold the
    head shares of several prefill ranks one after another (``kvpush/channel/head_plan.py``),
    rewritten in place in the canonical layout, layer by layer. Only this rank reads its
    pool, and only after LANDED: nothing else sees the blocks in between. ``pool_bytes``:
    the pool as 1-D uint8, host memory (numpy) or a device pool's torch tensor (the
    copies then run on its device, ordered before the load's on the same stream)."""
    lo, units = desc.layout, desc.num_units
    stride = units * lo.block_layer_bytes
    ids = list(block_ids[:lo.blocks_for_tokens(num_tokens)])
    for layer in range(lo.num_layers):
        view = pool_bytes[layer * stride:(layer + 1) * stride].reshape(units, lo.block_layer_bytes)
        landed = view[ids].reshape(-1)  # (a copy: fancy indexing)
        view[ids] = plan.unshare(rank, landed, num_tokens).reshape(len(ids), -1)

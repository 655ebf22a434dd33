"""Reading and writing tokens of vLLM's paged KV cache in kvpush's canonical layout.

kvpush moves KV in one canonical per-block layout, ``[K/V][token][kv_head][head_dim]``
(``kvpush.layout``), so that engines whose caches are arranged differently can
still exchange it. Inside vLLM the arrangement of a block is the attention
backend's business and, on the CPU, it is not a plain array: the CPU backend
(``CPU_ATTN``) stores each block as ``[kv_head][K|V][...]`` with the tokens and
dimensions *packed* for its SIMD kernel (the ``vec`` ISA interleaves tokens
within groups of dimensions; ``amx`` and ``neon`` pack differently). Reading
it as ``[token][dim]`` gives wrong numbers that still look like numbers.

Rather than re-implementing each packing, ``BlockCodec.probe`` asks the real
kernel: it writes a block whose every element holds its own canonical index
with vLLM's ``cpu_attn_reshape_and_cache`` (the op the model uses) into a
scratch block, and reads back where each element went. That permutation,
``perm[canonical index] = position in the block``, turns any token range of
any request into one fancy-index gather (read) or scatter (write) over the
layer's flat cache: no per-token Python loop, exact for every ISA the probe
supports, and verified at start-up (a permutation that is not a bijection is
refused).

Only float32 caches are probed (indices are exact in float32 up to 2**24);
that is what the CPU build runs. GPU backends use plain layouts and would get
an identity-like codec from their own probe; that path is not built here.
"""

from __future__ import annotations

import dataclasses

import numpy as np


class CodecError(RuntimeError):
    """The engine's KV cache cannot be read or written by this codec."""


@dataclasses.dataclass(frozen=True)
class BlockCodec:
    block_size: int
    num_kv_heads: int
    head_dim: int
    perm: np.ndarray  # (2, block_size, heads, head_dim) int64: element position inside a block
    dtype: np.dtype = np.dtype(np.float32)

    @property
    def block_elems(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @property
    def token_layer_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def identity(cls, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype=np.float32) -> BlockCodec:
        """A block stored exactly in the canonical layout (tests, plain backends)."""
        n = 2 * block_size * num_kv_heads * head_dim
        perm = np.arange(n, dtype=np.int64).reshape(2, block_size, num_kv_heads, head_dim)
        return cls(block_size, num_kv_heads, head_dim, perm, np.dtype(dtype))

    @classmethod
    def from_writer(cls, block_size: int, num_kv_heads: int, head_dim: int, write_block) -> BlockCodec:
        """Probe a block layout through ``write_block(key, value, scratch)``.

        ``key``/``value`` are float32 tensors ``(block_size, heads, head_dim)`` for the
        tokens of slot 0..block_size-1 of block 0; ``scratch`` is a float32 tensor of
        one block, filled with -1, that ``write_block`` must fill the way the engine
        does. Each element carries its canonical index, so reading ``scratch`` back
        gives the permutation.
        """
        import torch

        per_part = block_size * num_kv_heads * head_dim
        n = 2 * per_part
        if n >= 1 << 24:
            raise CodecError(f"a block of {n} elements is too large to probe in float32")
        canon = torch.arange(n, dtype=torch.float32).reshape(2, block_size, num_kv_heads, head_dim)
        scratch_flat = write_block(canon[0].contiguous(), canon[1].contiguous())
        got = np.asarray(scratch_flat, dtype=np.float64).reshape(-1)
        if got.size != n:
            raise CodecError(f"probe block has {got.size} elements, expected {n}")
        if np.any(got < 0) or np.any(got != np.round(got)):
            raise CodecError("the cache writer left parts of the probe block unwritten or altered values")
        positions = got.astype(np.int64)
        perm = np.full(n, -1, dtype=np.int64)
        perm[positions] = np.arange(n, dtype=np.int64)  # perm[canonical] = position
        if np.any(perm < 0):
            raise CodecError("the cache writer's layout is not a permutation of the block")
        return cls(block_size, num_kv_heads, head_dim, perm.reshape(2, block_size, num_kv_heads, head_dim))

    @classmethod
    def probe_cpu_attn(cls, block_size: int, num_kv_heads: int, head_dim: int, isa: str) -> BlockCodec:
        """The codec of vLLM's CPU attention backend for ``isa`` (float32 cache)."""
        import torch
        from vllm import _custom_ops as ops

        def write(key, value):
            scratch = torch.full((1, num_kv_heads, block_size, 2 * head_dim), -1.0, dtype=torch.float32)
            # The same view the backend's do_kv_cache_update takes of its cache.
            view = scratch.view(1, num_kv_heads, block_size * 2, head_dim)
            key_cache, value_cache = view.chunk(2, dim=2)
            slots = torch.arange(block_size, dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
            return scratch.numpy()

        return cls.from_writer(block_size, num_kv_heads, head_dim, write)

    # -- token ranges -----------------------------------------------------------------------
    def token_index(self, block_ids, start: int, end: int) -> np.ndarray:
        """Flat element positions ``(2, end - start, heads, head_dim)`` of tokens
        ``[start, end)`` of a request whose blocks (token order) are ``block_ids``."""
        if not 0 <= start < end:
            raise ValueError(f"bad token range [{start}, {end})")
        bs = self.block_size
        if (end - 1) // bs >= len(block_ids):
            raise ValueError(f"tokens [{start}, {end}) need {(end - 1) // bs + 1} blocks, "
                             f"the request has {len(block_ids)}")
        first, last = start // bs, (end - 1) // bs
        blocks = np.asarray(block_ids[first:last + 1], dtype=np.int64)
        # Every block of the covering run holds its tokens the same way: the in-block
        # positions broadcast against the blocks' bases (one pass; gathering the perm
        # per token cost 40x more, on the critical path of every load and push).
        cover = self.perm[:, None] + (blocks * self.block_elems)[None, :, None, None, None]  # (2, m, B, H, D)
        cover = cover.reshape(2, len(blocks) * bs, self.num_kv_heads, self.head_dim)
        lo = start - first * bs
        return cover[:, lo:lo + (end - start)]

    def read(self, flat_cache: np.ndarray, block_ids, start: int, end: int,
             index: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[start, end)`` of one layer, canonical ``(2, T, heads, head_dim)`` (a copy)."""
        idx = self.token_index(block_ids, start, end) if index is None else index
        return flat_cache[idx]

    def write(self, flat_cache: np.ndarray, block_ids, tokens: np.ndarray, start: int, end: int,
              index: np.ndarray | None = None) -> None:
        """Store canonical ``tokens`` ``(2, T, heads, head_dim)`` as tokens ``[start, end)``."""
        idx = self.token_index(block_ids, start, end) if index is None else index
        if tokens.shape != idx.shape:
            raise ValueError(f"tokens shaped {tokens.shape}, expected {idx.shape}")
        flat_cache[idx] = tokens


def flat_layer(tensor, num_blocks: int, codec: BlockCodec) -> np.ndarray:
    """A writable flat numpy view of one layer's cache tensor (no copy)."""
    if tensor.device.type != "cpu":
        raise CodecError(f"kvpush's connector copies through host memory; the cache is on {tensor.device}")
    if not tensor.is_contiguous():
        raise CodecError("the layer's KV cache tensor is not contiguous")
    if tensor.numel() != num_blocks * codec.block_elems:
        raise CodecError(f"layer cache has {tensor.numel()} elements, expected {num_blocks} blocks of "
                         f"{codec.block_elems}")
    arr = tensor.detach().view(-1).numpy()
    if arr.dtype != codec.dtype:
        raise CodecError(f"KV cache dtype {arr.dtype} is not supported (only {codec.dtype})")
    return arr

"""Reading and writing tokens of vLLM's paged KV cache in kvpush's canonical layout.

kvpush moves KV in one canonical per-block layout, ``[K/V][token][kv_head][head_dim]``
(``kvpush.contract.layout``), so that engines whose caches are arranged differently can
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

When the map turns out to be a plain axis permutation per K/V part (position =
base + t*st + h*sh + d*sd, which is what the ``vec`` ISA does: K as [head][dim][token],
V as [head][token][dim]), ``strides`` names it and reads and writes are strided
numpy copies over the request's gathered blocks instead of a fancy index per element:
measured in isolation, 2x faster for a 1024-token decode load and 2.7x for a staged
prefill layer, both on the time-to-first-token path.

Only float32 caches are probed (indices are exact in float32 up to 2**24);
that is what the CPU build runs. GPU backends use plain layouts and would get
an identity-like codec from their own probe; that path is not built here.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvpush.connector.copiers.copier import CopyError


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
            raise CopyError(f"a block of {n} elements is too large to probe in float32")
        canon = torch.arange(n, dtype=torch.float32).reshape(2, block_size, num_kv_heads, head_dim)
        scratch_flat = write_block(canon[0].contiguous(), canon[1].contiguous())
        got = np.asarray(scratch_flat, dtype=np.float64).reshape(-1)
        if got.size != n:
            raise CopyError(f"probe block has {got.size} elements, expected {n}")
        if np.any(got < 0) or np.any(got != np.round(got)):
            raise CopyError("the cache writer left parts of the probe block unwritten or altered values")
        positions = got.astype(np.int64)
        perm = np.full(n, -1, dtype=np.int64)
        perm[positions] = np.arange(n, dtype=np.int64)  # perm[canonical] = position
        if np.any(perm < 0):
            raise CopyError("the cache writer's layout is not a permutation of the block")
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

    # -- layout analysis -------------------------------------------------------------------
    @functools.cached_property
    def strides(self) -> tuple[tuple[int, int, int, int], ...] | None:
        """Per K/V part ``(base, token, head, dim)`` element strides inside a block, when the
        permutation is one; None when it is not (then every copy goes through the index)."""
        t, h, d = np.meshgrid(np.arange(self.block_size), np.arange(self.num_kv_heads), np.arange(self.head_dim),
                              indexing="ij")
        out = []
        for kv in range(2):
            p = self.perm[kv]
            base = int(p[0, 0, 0])
            st = int(p[1, 0, 0]) - base if self.block_size > 1 else 0
            sh = int(p[0, 1, 0]) - base if self.num_kv_heads > 1 else 0
            sd = int(p[0, 0, 1]) - base if self.head_dim > 1 else 0
            if not np.array_equal(p, base + st * t + sh * h + sd * d):
                return None
            out.append((base, st, sh, sd))
        return tuple(out)

    def prepare(self, block_ids, start: int, end: int) -> np.ndarray | None:
        """What ``read``/``write`` of this token range reuse across layers: the element
        index when the layout needs one, None when strided copies do without."""
        return None if self.strides is not None else self.token_index(block_ids, start, end)

    def _covering(self, block_ids, start: int, end: int) -> tuple[np.ndarray, int]:
        """The blocks holding tokens ``[start, end)`` and the first token's slot in the first."""
        if not 0 <= start < end:
            raise ValueError(f"bad token range [{start}, {end})")
        bs = self.block_size
        if (end - 1) // bs >= len(block_ids):
            raise ValueError(f"tokens [{start}, {end}) need {(end - 1) // bs + 1} blocks, "
                             f"the request has {len(block_ids)}")
        first, last = start // bs, (end - 1) // bs
        return np.asarray(block_ids[first:last + 1], dtype=np.int64), start - first * bs

    def _part_view(self, rows: np.ndarray, kv: int) -> np.ndarray:
        """K or V of gathered blocks ``rows`` (m, block_elems), as (m, B, H, D): a strided view."""
        base, st, sh, sd = self.strides[kv]
        isz = rows.itemsize
        return as_strided(rows[:, base:], shape=(rows.shape[0], self.block_size, self.num_kv_heads, self.head_dim),
                          strides=(rows.strides[0], st * isz, sh * isz, sd * isz))

    def _read_strided(self, flat_cache: np.ndarray, block_ids, start: int, end: int) -> np.ndarray:
        ids, lo = self._covering(block_ids, start, end)
        rows = flat_cache.reshape(-1, self.block_elems)[ids]
        m, n = len(ids), end - start
        out = np.empty((2, m * self.block_size, self.num_kv_heads, self.head_dim), dtype=flat_cache.dtype)
        for kv in range(2):
            out[kv].reshape(m, self.block_size, self.num_kv_heads, self.head_dim)[...] = self._part_view(rows, kv)
        return out if lo == 0 and n == m * self.block_size else np.ascontiguousarray(out[:, lo:lo + n])

    def _write_strided(self, flat_cache: np.ndarray, block_ids, tokens: np.ndarray, start: int, end: int) -> None:
        ids, lo = self._covering(block_ids, start, end)
        m, n, bs = len(ids), end - start, self.block_size
        shape = (self.num_kv_heads, self.head_dim)
        if tokens.shape != (2, n, *shape):
            raise ValueError(f"tokens shaped {tokens.shape}, expected {(2, n, *shape)}")
        blocks = flat_cache.reshape(-1, self.block_elems)
        # Blocks the range covers whole are written outright; a partial first or last
        # block is read, merged and written back (its other tokens are kept).
        j0 = 1 if lo else 0
        j1 = m - 1 if (lo + n) % bs else m
        if j1 > j0:
            rows = np.empty((j1 - j0, self.block_elems), dtype=flat_cache.dtype)
            a = j0 * bs - lo
            for kv in range(2):
                self._part_view(rows, kv)[...] = tokens[kv, a:a + (j1 - j0) * bs].reshape(j1 - j0, bs, *shape)
            blocks[ids[j0:j1]] = rows
        first_token = start - lo  # the token in slot 0 of the first covering block
        for j in dict.fromkeys(j for j in (0, m - 1) if not j0 <= j < j1):
            row = blocks[ids[j:j + 1]]
            block_start = first_token + j * bs
            t0, t1 = max(start, block_start), min(end, block_start + bs)
            at = t0 - block_start
            for kv in range(2):
                view = self._part_view(row, kv)
                view[0, at:at + (t1 - t0)] = tokens[kv, t0 - start:t1 - start]
            blocks[ids[j]] = row[0]

    # -- token ranges -----------------------------------------------------------------------
    def token_index(self, block_ids, start: int, end: int) -> np.ndarray:
        """Flat element positions ``(2, end - start, heads, head_dim)`` of tokens
        ``[start, end)`` of a request whose blocks (token order) are ``block_ids``."""
        bs = self.block_size
        blocks, lo = self._covering(block_ids, start, end)
        # Every block of the covering run holds its tokens the same way: the in-block
        # positions broadcast against the blocks' bases (one pass; gathering the perm
        # per token cost 40x more, on the critical path of every load and push).
        cover = self.perm[:, None] + (blocks * self.block_elems)[None, :, None, None, None]  # (2, m, B, H, D)
        cover = cover.reshape(2, len(blocks) * bs, self.num_kv_heads, self.head_dim)
        return cover[:, lo:lo + (end - start)]

    def read(self, flat_cache: np.ndarray, block_ids, start: int, end: int,
             index: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[start, end)`` of one layer, canonical ``(2, T, heads, head_dim)`` (a copy)."""
        if index is None and self.strides is not None:
            return self._read_strided(flat_cache, block_ids, start, end)
        idx = self.token_index(block_ids, start, end) if index is None else index
        return flat_cache[idx]

    def write(self, flat_cache: np.ndarray, block_ids, tokens: np.ndarray, start: int, end: int,
              index: np.ndarray | None = None) -> None:
        """Store canonical ``tokens`` ``(2, T, heads, head_dim)`` as tokens ``[start, end)``."""
        if index is None and self.strides is not None:
            return self._write_strided(flat_cache, block_ids, tokens, start, end)
        idx = self.token_index(block_ids, start, end) if index is None else index
        if tokens.shape != idx.shape:
            raise ValueError(f"tokens shaped {tokens.shape}, expected {idx.shape}")
        flat_cache[idx] = tokens


def flat_layer(tensor, num_blocks: int, codec: BlockCodec) -> np.ndarray:
    """A writable flat numpy view of one layer's cache tensor (no copy)."""
    if tensor.device.type != "cpu":
        raise CopyError(f"kvpush's connector copies through host memory; the cache is on {tensor.device}")
    if not tensor.is_contiguous():
        raise CopyError("the layer's KV cache tensor is not contiguous")
    if tensor.numel() != num_blocks * codec.block_elems:
        raise CopyError(f"layer cache has {tensor.numel()} elements, expected {num_blocks} blocks of "
                         f"{codec.block_elems}")
    arr = tensor.detach().view(-1).numpy()
    if arr.dtype != codec.dtype:
        raise CopyError(f"KV cache dtype {arr.dtype} is not supported (only {codec.dtype})")
    return arr

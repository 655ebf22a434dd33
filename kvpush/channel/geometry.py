"""Byte geometry of one request's KV in the destination's block geometry.

Every push is described in a request's *virtual layer space*: the bytes of one
layer of the request laid out in the destination's block geometry,
``[dest block j][K/V][token in block][head][dim]`` for ``j`` in token order.
``DestGeometry`` says where each token's bytes sit in that space. The engine
stages into it (``kvpush/channel/reblock.py``) and the sidecar writes it out
(``kvpush/sidecar/descriptors.py`` maps it to addresses on both ends).

Why stage in the destination's geometry: re-blocking (prefill block size P !=
decode block size D) changes where every token sits inside a block. Doing it
in the engine's staging copy is free (that copy happens anyway), and then a
whole-block push is a byte-for-byte image of the landing blocks: one
descriptor per contiguous run, as large as possible. Re-blocking in the NIXL
write instead would split every P-block at D boundaries and K/V halves,
multiplying descriptors by ~2x(P/D or D/P), which is what costs on the wire.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvpush.contract.layout import KvLayout


@dataclasses.dataclass(frozen=True)
class DestGeometry:
    """One request's KV in the destination's block geometry."""

    block_size: int  # destination tokens per block
    token_part_bytes: int  # bytes of one token's K (or V) in one layer
    kv_parts: int
    num_tokens: int

    @classmethod
    def for_layout(cls, layout: KvLayout, dest_block_size: int, num_tokens: int) -> "DestGeometry":
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        return cls(dest_block_size, layout.token_part_bytes, layout.kv_parts, num_tokens)

    @property
    def block_layer_bytes(self) -> int:
        return self.kv_parts * self.block_size * self.token_part_bytes

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def layer_bytes(self) -> int:
        return self.num_blocks * self.block_layer_bytes

    def token_ranges(self, start: int, end: int) -> np.ndarray:
        """Virtual byte ranges ``(k, 2)`` of tokens ``[start, end)`` in one layer, merged.

        A run of whole blocks is one range; a partial block contributes one
        range per K/V part.
        """
        if not 0 <= start < end <= self.num_tokens:
            raise ValueError(f"token range [{start}, {end}) outside [0, {self.num_tokens})")
        d, tpb, blb = self.block_size, self.token_part_bytes, self.block_layer_bytes
        ranges: list[list[int]] = []

        def add(lo: int, hi: int) -> None:
            if ranges and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])

        def partial(block: int, a: int, b: int) -> None:
            for part in range(self.kv_parts):
                base = block * blb + part * d * tpb
                add(base + a * tpb, base + b * tpb)

        first, last = start // d, (end - 1) // d
        if first == last:
            a, b = start - first * d, end - first * d
            if a == 0 and b == d:
                add(first * blb, (first + 1) * blb)
            else:
                partial(first, a, b)
            return np.asarray(ranges, dtype=np.int64)
        full_lo, full_hi = first, last + 1  # whole blocks [full_lo, full_hi)
        if start % d:
            partial(first, start % d, d)
            full_lo = first + 1
        if end % d:
            full_hi = last
        if full_hi > full_lo:
            add(full_lo * blb, full_hi * blb)
        if end % d:
            partial(last, 0, end - last * d)
        return np.asarray(ranges, dtype=np.int64)

    def block_ranges(self, block: int) -> np.ndarray:
        """Virtual ranges of block ``block`` that a full push writes (the tail of
        the last block, past ``num_tokens``, is never written)."""
        lo = block * self.block_size
        return self.token_ranges(lo, min(lo + self.block_size, self.num_tokens))

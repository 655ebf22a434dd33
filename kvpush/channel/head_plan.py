"""Which KV heads each prefill rank writes into which decode rank, and where they land.

Tensor parallelism splits every layer's KV heads over an engine's ranks: rank ``r``
holds ``KvLayout.rank_heads(r)``, a contiguous run, or a single head replicated on
``tp // heads`` ranks when there are fewer heads than ranks (an MLA latent is one
"head" on every rank). A prefill engine of any TP feeds a decode engine of any TP of
the same heads: each decode rank must receive every head it holds, exactly once.

The plan lists, per decode rank, its **shares**: maximal runs of its heads that one
prefill rank sends. A head that several prefill ranks hold (replicated) is sent by one
of them, decode rank ``d`` taking holder ``d % holders``, so decode ranks spread their
reads over the copies instead of all loading the first rank.

**Where a share lands.** A decode rank with one share (P TP <= D TP: its heads all
live on one prefill rank) has its landing blocks laid out as ever, and a run of whole
blocks is one descriptor. With ``k > 1`` shares (merging ranks: P TP > D TP) the shares'
heads interleave in every token of the canonical block, so writing them in place would
cost a descriptor per token and part. Instead a reservation's landing bytes of one
layer (its virtual layer space, ``kvpush/channel/geometry.py``) hold the shares one after the
other, each a whole image of the request in its own head count::

    [share][dest block][K/V][token in block][the share's heads][head_dim]

so a prefill rank's write of a layer is one range cut only where the landing blocks
are not contiguous, and the decode side puts heads in place (``unshare``) in the copy
out of the landing blocks that it makes anyway. The total is the same bytes as the
canonical blocks: the reservation's blocks hold it.

A plan depends only on the two layouts and is cached per pair, like peer metadata.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from kvpush.channel.geometry import DestGeometry
from kvpush.contract.layout import KvLayout, LayoutError


@dataclasses.dataclass(frozen=True)
class HeadShare:
    """Heads ``[first_head, first_head + num_heads)`` of the model, sent by prefill rank
    ``src_rank`` into decode rank ``dst_rank``."""

    src_rank: int
    dst_rank: int
    first_head: int
    num_heads: int
    src_offset: int  # index of first_head among the source rank's heads (its cache's head axis)
    dst_offset: int  # ... among the destination rank's heads
    slot: int  # place among the destination rank's shares (landing order)

    @property
    def heads(self) -> range:
        return range(self.first_head, self.first_head + self.num_heads)


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    src: KvLayout
    dst: KvLayout
    shares: tuple[HeadShare, ...]  # by destination rank, then slot

    def into_rank(self, dst_rank: int) -> tuple[HeadShare, ...]:
        return tuple(s for s in self.shares if s.dst_rank == dst_rank)

    def from_rank(self, src_rank: int) -> tuple[HeadShare, ...]:
        return tuple(s for s in self.shares if s.src_rank == src_rank)

    def in_place(self, dst_rank: int) -> bool:
        """Whether ``dst_rank``'s landing blocks are laid out as ever (one share)."""
        return len(self.into_rank(dst_rank)) == 1

    # -- bytes ----------------------------------------------------------------------------
    def geometry(self, share: HeadShare, num_tokens: int) -> DestGeometry:
        """The share's own virtual layer space: the request in the destination's block
        size, with only the share's heads. The source stages exactly this image."""
        dst = self.dst
        return DestGeometry(dst.block_size, share.num_heads * dst.head_dim * dst.itemsize, dst.kv_parts, num_tokens)

    def landing_offset(self, share: HeadShare, num_tokens: int) -> int:
        """Where the share's image starts in the destination rank's virtual layer space."""
        before = sum(s.num_heads for s in self.into_rank(share.dst_rank) if s.slot < share.slot)
        return self.geometry(share, num_tokens).layer_bytes // share.num_heads * before

    def write_ranges(self, share: HeadShare, start: int, end: int, num_tokens: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Virtual ranges ``(k, 2)`` of tokens ``[start, end)`` of one layer: in the source's
        staged image of the share, and in the destination rank's landing space."""
        src = self.geometry(share, num_tokens).token_ranges(start, end)
        return src, src + self.landing_offset(share, num_tokens)

    def unshare(self, dst_rank: int, landed, num_tokens: int):
        """One layer of a reservation's landing bytes (``landed``: its virtual layer space,
        1-D ``uint8``, a numpy array or a torch tensor on any device) as canonical blocks
        ``(blocks, parts, block_size, heads, head_dim bytes)`` of ``dst_rank``. A view when
        the rank's landing is in place."""
        dst = self.dst
        width = dst.head_dim * dst.itemsize
        geom = DestGeometry.for_layout(dst.rank_layout(), dst.block_size, num_tokens)
        shape = (geom.num_blocks, dst.kv_parts, dst.block_size, dst.local_kv_heads, width)
        if len(landed) != geom.layer_bytes:
            raise ValueError(f"landed layer of {len(landed)} bytes, expected {geom.layer_bytes}")
        if self.in_place(dst_rank):
            return landed.reshape(shape)
        out = np.empty(shape, dtype=landed.dtype) if isinstance(landed, np.ndarray) else landed.new_empty(shape)
        for share in self.into_rank(dst_rank):
            lo = self.landing_offset(share, num_tokens)
            n = self.geometry(share, num_tokens).layer_bytes
            image = landed[lo:lo + n].reshape(shape[:3] + (share.num_heads, width))
            out[:, :, :, share.dst_offset:share.dst_offset + share.num_heads] = image
        return out


def plan_heads(src: KvLayout, dst: KvLayout) -> HeadPlan:
    """The head plan from a prefill engine of layout ``src`` into a decode engine of ``dst``;
    ``LayoutError`` naming both layouts when none exists."""
    why = src.feed_error(dst)
    if why:
        raise LayoutError(why)
    shares = _plan(src.num_kv_heads, src.tp_size, dst.tp_size)
    return HeadPlan(src, dst, shares)


@functools.lru_cache(maxsize=512)
def _plan(heads: int, src_tp: int, dst_tp: int) -> tuple[HeadShare, ...]:
    src = KvLayout(1, 1, heads, 1, tp_size=src_tp)
    dst = KvLayout(1, 1, heads, 1, tp_size=dst_tp)
    holders: dict[int, list[int]] = {}
    for rank in range(src_tp):
        for head in src.rank_heads(rank):
            holders.setdefault(head, []).append(rank)
    shares: list[HeadShare] = []
    for d in range(dst_tp):
        mine = dst.rank_heads(d)
        runs: list[list[int]] = []  # [src_rank, first_head, count]
        for head in mine:
            ranks = holders[head]
            rank = ranks[d % len(ranks)]
            if runs and runs[-1][0] == rank and runs[-1][1] + runs[-1][2] == head:
                runs[-1][2] += 1
            else:
                runs.append([rank, head, 1])
        for slot, (rank, first, count) in enumerate(runs):
            shares.append(HeadShare(src_rank=rank, dst_rank=d, first_head=first, num_heads=count,
                                    src_offset=first - src.rank_heads(rank).start,
                                    dst_offset=first - mine.start, slot=slot))
    return tuple(shares)

"""A request's head shares as the pusher moves them: planned and staged at BEGIN, and
turned into NIXL descriptors for each piece a rank stages.

The plan (``kvpush/channel/head_plan.py``) comes from this engine's layout and the decode
engine's tensor parallelism, which the reservation names: so BEGIN can allocate every
share's staging before the decode peer's record is even loaded. Each share is staged
by its source rank, in that rank's staging pool, in the share's own geometry; a piece
of a rank (a layer, a run of tokens) is one transfer carrying every share that rank
sends, each cut where its staging or its landing blocks are not contiguous.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from kvpush.channel.geometry import DestGeometry
from kvpush.channel.head_plan import HeadPlan, plan_heads
from kvpush.contract.layout import KvLayout
from kvpush.contract.target import PushTarget
from kvpush.sidecar.descriptors import blocks_segment_map, pair_descriptors, staging_segment_map
from kvpush.sidecar.outbound import Slice
from kvpush.sidecar.peers import RemotePeer
from kvpush.sidecar.pools import StagingFull, StagingPool


def plan_request(layout: KvLayout, target: PushTarget) -> tuple[HeadPlan, DestGeometry]:
    """The head plan into ``target``'s decode engine and the request's geometry in one
    decode rank's landing blocks. ``LayoutError`` (a ValueError) when the decode TP cannot
    split the heads. The decode layout is taken to have our heads: the peer's record is
    checked against that once it is loaded (``PushEngine._check_peer``)."""
    dst = dataclasses.replace(layout, block_size=target.block_size, tp_size=target.tp_size)
    return plan_heads(layout, dst), DestGeometry.for_layout(dst, target.block_size, target.num_tokens)


def allocate(plan: HeadPlan, num_tokens: int, pools: Sequence[StagingPool], owner: str,
             make_room: Callable[[], bool]) -> tuple[Slice, ...]:
    """Staging for every share, each in its source rank's pool, all or nothing: on
    ``StagingFull`` what was taken is given back, ``make_room()`` (held staging evicted)
    is asked once per retry, and ``StagingFull`` raised when it has nothing left."""
    while True:
        taken: list[Slice] = []
        try:
            for share in plan.shares:
                geom = plan.geometry(share, num_tokens)
                alloc = pools[share.src_rank].allocate(geom.block_layer_bytes, geom.num_blocks, owner)
                alloc = dataclasses.replace(alloc, first_head=share.src_offset, num_heads=share.num_heads)
                taken.append(Slice(share, geom, alloc, plan.landing_offset(share, num_tokens)))
            return tuple(taken)
        except StagingFull:
            free(taken, pools)
            if not make_room():
                raise


def free(slices: Sequence[Slice], pools: Sequence[StagingPool]) -> None:
    for sl in slices:
        pools[sl.share.src_rank].free(sl.alloc.alloc_id)


def attach(slices: Sequence[Slice], pools: Sequence[StagingPool], block_ids, geom: DestGeometry,
           peer: RemotePeer) -> None:
    """Layer 0's staging and landing of each slice, once the peer is known."""
    for sl in slices:
        sl.local0 = staging_segment_map(sl.alloc, 0, pools[sl.share.src_rank].base_address)
        landing = blocks_segment_map(block_ids[:geom.num_blocks], geom.block_layer_bytes,
                                     peer.layer_base(0, sl.share.dst_rank))
        sl.remote0 = landing.window(sl.landing_offset, sl.geom.layer_bytes)


def piece(slices: Sequence[Slice], pool: StagingPool, peer: RemotePeer, layer: int, start: int, end: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """Descriptors (local, remote) of tokens ``[start, end)`` of ``layer`` of every slice one
    rank sends (``pool``: that rank's staging)."""
    locs, rems = [], []
    for sl in slices:
        loc, rem = pair_descriptors(sl.geom.token_ranges(start, end),
                                    sl.local0.shifted(layer * pool.layer_stride),
                                    sl.remote0.shifted(layer * peer.layer_stride),
                                    pool.memory.device_id, peer.device(sl.share.dst_rank))
        locs.append(loc)
        rems.append(rem)
    if len(locs) == 1:
        return locs[0], rems[0]
    return np.concatenate(locs), np.concatenate(rems)

"""NIXL descriptors for one push: the destination geometry's virtual ranges mapped to
addresses on both ends.

Both ends map a request's virtual layer space (``kvpush/channel/geometry.py``) to physical
addresses with a ``SegmentMap``:

* staging (local): the request's staging extents, block-aligned;
* landing (remote): the reservation's block ids; consecutive ids are merged
  into one run, so a reservation of contiguous blocks is one segment.

``pair_descriptors`` cuts the pushed virtual ranges wherever either side is
discontiguous and returns matching local/remote descriptor arrays for one
transfer: as few descriptors as the two memories allow. ``block_checksums``
is the debug mode's per-block CRC32 over the same ranges.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from kvpush.channel.geometry import DestGeometry


@dataclasses.dataclass(frozen=True)
class SegmentMap:
    """Virtual offset -> address, piecewise: segment i covers ``[vstart[i], vstart[i+1])``
    (the last one up to ``vend``) and starts at address ``addr[i]``."""

    vstart: np.ndarray  # int64, sorted, vstart[0] == 0
    addr: np.ndarray  # uint64-valued int64 is enough for user-space addresses
    vend: int

    def shifted(self, delta: int) -> "SegmentMap":
        return SegmentMap(self.vstart, self.addr + delta, self.vend)

    def window(self, offset: int, length: int) -> "SegmentMap":
        """The map of virtual bytes ``[offset, offset + length)``, re-based to 0: where one
        head share lands in a decode rank's landing space (``kvpush/channel/head_plan.py``)."""
        if offset == 0 and length == self.vend:
            return self
        if offset < 0 or length <= 0 or offset + length > self.vend:
            raise ValueError(f"window [{offset}, {offset + length}) outside [0, {self.vend})")
        first = int(np.searchsorted(self.vstart, offset, side="right")) - 1
        stop = int(np.searchsorted(self.vstart, offset + length, side="left"))
        vstart, addr = self.vstart[first:stop].copy(), self.addr[first:stop].copy()
        addr[0] += offset - vstart[0]
        vstart[0] = offset
        return SegmentMap(vstart - offset, addr, length)

    @property
    def num_segments(self) -> int:
        return len(self.vstart)

    def resolve(self, ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and lengths of ``ranges`` cut at segment boundaries."""
        starts, ends = _cut(ranges, self.vstart)
        i = np.searchsorted(self.vstart, starts, side="right") - 1
        return self.addr[i] + (starts - self.vstart[i]), ends - starts


def blocks_segment_map(block_ids, block_layer_bytes: int, layer_base: int) -> SegmentMap:
    """Map for destination blocks ``block_ids`` (token order) in one layer of a
    layer-major pool whose layer starts at ``layer_base``; consecutive ids merge."""
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.size == 0:
        raise ValueError("no blocks")
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    run_first = np.concatenate(([0], breaks))
    return SegmentMap(run_first * block_layer_bytes, layer_base + ids[run_first] * block_layer_bytes,
                      int(ids.size) * block_layer_bytes)


def staging_segment_map(alloc, layer: int, pool_base: int) -> SegmentMap:
    """Map for a ``StagingAllocation`` in ``layer`` of a staging pool at ``pool_base``."""
    vstart = np.array([e.first_block * alloc.dest_block_layer_bytes for e in alloc.extents], dtype=np.int64)
    addr = np.array([pool_base + alloc.extent_offset(e, layer) for e in alloc.extents], dtype=np.int64)
    return SegmentMap(vstart, addr, alloc.num_dest_blocks * alloc.dest_block_layer_bytes)


def _cut(ranges: np.ndarray, cuts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(ranges) == 1:
        lo, hi = int(ranges[0][0]), int(ranges[0][1])
        inner = cuts[np.searchsorted(cuts, lo, side="right"):np.searchsorted(cuts, hi, side="left")]
        return np.concatenate(([lo], inner)), np.concatenate((inner, [hi]))
    starts, ends = [], []
    for lo, hi in ranges:
        inner = cuts[(cuts > lo) & (cuts < hi)]
        starts.append(np.concatenate(([lo], inner)))
        ends.append(np.concatenate((inner, [hi])))
    return np.concatenate(starts).astype(np.int64), np.concatenate(ends).astype(np.int64)


def pair_descriptors(ranges: np.ndarray, local: SegmentMap, remote: SegmentMap,
                     local_dev: int = 0, remote_dev: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Matching ``(n, 3)`` uint64 descriptor arrays (addr, len, dev) for ``ranges``."""
    if len(ranges) == 0:
        raise ValueError("nothing to push")
    if ranges[-1][1] > min(local.vend, remote.vend):
        raise ValueError(f"range end {ranges[-1][1]} past the mapped bytes ({local.vend}, {remote.vend})")
    if local.num_segments == 1 and remote.num_segments == 1:
        # The common case (one staging extent, contiguous blocks): no cutting at all.
        n = len(ranges)
        loc = np.empty((n, 3), dtype=np.uint64)
        rem = np.empty((n, 3), dtype=np.uint64)
        loc[:, 0] = local.addr[0] + ranges[:, 0]
        rem[:, 0] = remote.addr[0] + ranges[:, 0]
        loc[:, 1] = rem[:, 1] = ranges[:, 1] - ranges[:, 0]
        loc[:, 2] = local_dev
        rem[:, 2] = remote_dev
        return loc, rem
    cuts = local.vstart if remote.num_segments == 1 else (
        remote.vstart if local.num_segments == 1 else np.union1d(local.vstart, remote.vstart))
    starts, ends = _cut(ranges, cuts)
    li = np.searchsorted(local.vstart, starts, side="right") - 1
    ri = np.searchsorted(remote.vstart, starts, side="right") - 1
    n = len(starts)
    loc = np.empty((n, 3), dtype=np.uint64)
    rem = np.empty((n, 3), dtype=np.uint64)
    loc[:, 0] = local.addr[li] + (starts - local.vstart[li])
    rem[:, 0] = remote.addr[ri] + (starts - remote.vstart[ri])
    loc[:, 1] = rem[:, 1] = ends - starts
    loc[:, 2] = local_dev
    rem[:, 2] = remote_dev
    return loc, rem


def block_checksums(geom: DestGeometry, num_layers: int, memory: np.ndarray, memory_base: int,
                    layer_map) -> list[int]:
    """CRC32 of each destination block over all layers (only the bytes a push writes).

    ``layer_map(layer) -> SegmentMap`` locates the request in ``memory`` (a
    uint8 view whose first byte is at address ``memory_base``): staging on the
    prefill side, landing blocks on the decode side, so both compute the same
    numbers from their own copy.
    """
    maps = [layer_map(layer) for layer in range(num_layers)]
    sums = []
    for block in range(geom.num_blocks):
        ranges = geom.block_ranges(block)
        crc = 0
        for smap in maps:
            addrs, lens = smap.resolve(ranges)
            for a, n in zip(addrs.tolist(), lens.tolist()):
                off = a - memory_base
                crc = zlib.crc32(memory[off:off + n], crc)
        sums.append(crc)
    return sums

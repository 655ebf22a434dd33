"""Landing and staging pools: layer-major KV memory a sidecar registers once.

Both pools use the layout of ``kvpush.contract.layout``: ``[layer][unit][K/V][token][head][dim]``.

* A **landing pool** (decode role) holds ``num_blocks`` blocks of the decode
  engine's layout; the control plane hands out block ids ``0..num_blocks-1``
  and prefill sidecars write into them. The sidecar itself never allocates
  here: which blocks are free is the control plane's business.
* A **staging pool** (prefill role) is carved per request. The engine copies a
  request's KV into its allocation, the sidecar pushes it and frees it as soon
  as the last write is DONE. Allocation is first-fit over free extents, never
  waits (``StagingFull`` at once when the pool cannot hold the request) and is
  tagged with an owner so that everything of a vanished engine connection can
  be freed in one call.

Staging holds KV in the *destination's* block geometry (see
``kvpush/channel/geometry.py`` for why), so an allocation is sized in destination
blocks; every destination block lies inside one extent, which keeps the
engine's copy a handful of numpy slice assignments even when the pool is
fragmented.
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import Collection

import numpy as np

from kvpush.contract.layout import KvLayout
from kvpush.contract.states import DECODE, PREFILL
from kvpush.channel.memory import PoolMemory, SegmentName, ShmMemory, safe_tag, sweep_stale_segments
from kvpush.channel.pool import PoolDescription, StagingAllocation, StagingExtent


def make_pool_memory(tag: str, size: int, device: int | None) -> PoolMemory:
    """The sidecar's pool memory: a shared-memory segment (``device`` None) or device memory
    on GPU ``device`` (``kvpush.channel.device_memory``, imported only then: it needs torch)."""
    if device is None:
        return ShmMemory.create(tag, size)
    from kvpush.channel.device_memory import CudaPoolMemory
    return CudaPoolMemory.create(tag, size, device)


# <engine id>.<role>[.r<rank>].<landing|staging>, read from the right: engine ids may hold dots.
_POOL_TAG = re.compile(rf"^(?P<engine>.+)\.(?:{PREFILL}|{DECODE})(?:\.r\d+)?\.(?:landing|staging)$")


def pool_tag(engine_id: str, role: str, rank: int) -> str:
    """The tag of a sidecar's pool of ``rank`` (the pool adds ``.landing`` or ``.staging``):
    its segment's name begins with it, so the engine's next sidecar can find what is left."""
    return f"{engine_id}.{role}" + (f".r{rank}" if rank else "")


def remove_dead_pools(engine_id: str, owners: Collection[int] | None = None) -> list[str]:
    """Unlink the shared-memory pools that sidecars of ``engine_id`` (either role) left when
    they died without cleaning up (SIGKILL, OOM killer), and return their names. ``owners``:
    only those made by these pids. A live sidecar's pools (another sidecar of the same engine
    id included) and other engines' are kept: ``kvpush.channel.memory.sweep_stale_segments``."""
    engine = safe_tag(engine_id)

    def accept(name: SegmentName) -> bool:
        found = _POOL_TAG.match(name.tag)
        return found is not None and found["engine"] == engine and (owners is None or name.owner.pid in owners)
    return sweep_stale_segments(accept)


class StagingFull(Exception):
    """The staging pool cannot hold this request right now (never waits)."""


class LayerMajorPool:
    """A pool of ``num_units`` units of ``layout`` in layer-major order."""

    role = "pool"

    def __init__(self, layout: KvLayout, num_units: int, memory: PoolMemory):
        if num_units <= 0:
            raise ValueError(f"{self.role} pool needs at least one block, got {num_units}")
        need = layout.pool_bytes(num_units)
        if memory.size < need:
            raise ValueError(f"{self.role} memory has {memory.size} bytes, layout needs {need}")
        self.layout = layout
        self.num_units = num_units
        self.memory = memory

    @property
    def unit_bytes(self) -> int:
        return self.layout.block_layer_bytes

    @property
    def layer_stride(self) -> int:
        return self.num_units * self.unit_bytes

    @property
    def base_address(self) -> int:
        return self.memory.base_address

    @property
    def size_bytes(self) -> int:
        return self.layout.pool_bytes(self.num_units)

    def unit_offset(self, layer: int, unit: int) -> int:
        return self.layout.offset(layer, unit, self.num_units)

    def blocks_view(self, layer: int) -> np.ndarray:
        """Layer ``layer`` as ``(num_units, kv_parts, block_size, kv_heads, head_dim)`` raw bytes.

        The dtype is left as bytes (the last axis is ``head_dim * itemsize``
        bytes) so that views work for every KV dtype, including ones numpy
        lacks (bfloat16, fp8).
        """
        lo = self.layout
        start = layer * self.layer_stride
        flat = self.memory.host_view()[start:start + self.layer_stride]
        return flat.reshape(self.num_units, lo.kv_parts, lo.block_size, lo.local_kv_heads, lo.head_dim * lo.itemsize)

    def info(self) -> PoolDescription:
        m = self.memory
        return PoolDescription(self.role, m.mem_kind, m.share_handle(), m.size, self.num_units, self.unit_bytes,
                               self.layout, m.device_id)

    def close(self) -> None:
        self.memory.close()


class LandingPool(LayerMajorPool):
    role = "landing"

    @classmethod
    def create(cls, tag: str, layout: KvLayout, num_blocks: int, device: int | None = None) -> "LandingPool":
        return cls(layout, num_blocks, make_pool_memory(f"{tag}.landing", layout.pool_bytes(num_blocks), device))

    @classmethod
    def create_shm(cls, tag: str, layout: KvLayout, num_blocks: int) -> "LandingPool":
        return cls.create(tag, layout, num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.num_units


class StagingPool(LayerMajorPool):
    role = "staging"

    def __init__(self, layout: KvLayout, num_units: int, memory: PoolMemory):
        super().__init__(layout, num_units, memory)
        # Free extents as parallel sorted lists of starts and counts.
        self._free_starts: list[int] = [0]
        self._free_counts: list[int] = [num_units]
        self._live: dict[int, StagingAllocation] = {}
        self._ids = itertools.count(1)

    @classmethod
    def create(cls, tag: str, layout: KvLayout, num_units: int, device: int | None = None) -> "StagingPool":
        return cls(layout, num_units, make_pool_memory(f"{tag}.staging", layout.pool_bytes(num_units), device))

    @classmethod
    def create_shm(cls, tag: str, layout: KvLayout, num_units: int) -> "StagingPool":
        return cls.create(tag, layout, num_units)

    @property
    def free_units(self) -> int:
        return sum(self._free_counts)

    @property
    def live_allocations(self) -> int:
        return len(self._live)

    def allocate(self, dest_block_layer_bytes: int, num_dest_blocks: int, owner: str = "") -> StagingAllocation:
        """Room for ``num_dest_blocks`` destination blocks in every layer, or ``StagingFull``.

        First fit: one extent when any free extent is big enough (the usual
        case, and one NIXL descriptor per destination run); otherwise free
        extents in address order, each taking only whole destination blocks.
        """
        if dest_block_layer_bytes <= 0 or num_dest_blocks <= 0:
            raise ValueError("allocation needs a positive block size and block count")
        per_block_units = dest_block_layer_bytes / self.unit_bytes
        need_units = -(-num_dest_blocks * dest_block_layer_bytes // self.unit_bytes)
        for i, count in enumerate(self._free_counts):
            if count >= need_units:
                ext = StagingExtent(self._free_starts[i], need_units, 0, num_dest_blocks)
                self._take(i, need_units)
                return self._record([ext], dest_block_layer_bytes, num_dest_blocks, owner)
        # Fragmented: gather whole destination blocks from several extents.
        plan: list[tuple[int, int, int]] = []  # (free index, units, blocks)
        remaining = num_dest_blocks
        for i, count in enumerate(self._free_counts):
            blocks = min(remaining, int(count * self.unit_bytes // dest_block_layer_bytes))
            if blocks:
                plan.append((i, -(-blocks * dest_block_layer_bytes // self.unit_bytes), blocks))
                remaining -= blocks
                if not remaining:
                    break
        if remaining:
            raise StagingFull(
                f"staging pool cannot hold {num_dest_blocks} blocks of {dest_block_layer_bytes} bytes "
                f"(~{per_block_units * num_dest_blocks:.0f} of {self.num_units} units; {self.free_units} free, "
                f"{len(self._free_counts)} free extents)")
        extents, first = [], 0
        for i, units, blocks in plan:
            extents.append(StagingExtent(self._free_starts[i], units, first, blocks))
            first += blocks
        for i, units, _ in sorted(plan, reverse=True):  # high index first keeps indices valid
            self._take(i, units)
        return self._record(extents, dest_block_layer_bytes, num_dest_blocks, owner)

    def free(self, alloc_id: int) -> bool:
        """Return an allocation's units; False (and nothing done) if already freed."""
        alloc = self._live.pop(alloc_id, None)
        if alloc is None:
            return False
        for ext in alloc.extents:
            self._give_back(ext.unit_start, ext.unit_count)
        return True

    def free_owner(self, owner: str) -> int:
        """Free every allocation of ``owner`` (a closed engine connection)."""
        ids = [a.alloc_id for a in self._live.values() if a.owner == owner]
        for alloc_id in ids:
            self.free(alloc_id)
        return len(ids)

    def get(self, alloc_id: int) -> StagingAllocation | None:
        return self._live.get(alloc_id)

    def _record(self, extents, dest_block_layer_bytes, num_dest_blocks, owner) -> StagingAllocation:
        alloc = StagingAllocation(next(self._ids), owner, tuple(extents), dest_block_layer_bytes,
                                  num_dest_blocks, self.unit_bytes, self.layer_stride)
        self._live[alloc.alloc_id] = alloc
        return alloc

    def _take(self, index: int, units: int) -> None:
        if self._free_counts[index] == units:
            del self._free_starts[index]
            del self._free_counts[index]
        else:
            self._free_starts[index] += units
            self._free_counts[index] -= units

    def _give_back(self, start: int, count: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        # Merge with the following and the preceding free extent when adjacent.
        if i < len(self._free_starts) and start + count == self._free_starts[i]:
            self._free_starts[i] = start
            self._free_counts[i] += count
        else:
            self._free_starts.insert(i, start)
            self._free_counts.insert(i, count)
        if i > 0 and self._free_starts[i - 1] + self._free_counts[i - 1] == self._free_starts[i]:
            self._free_counts[i - 1] += self._free_counts[i]
            del self._free_starts[i]
            del self._free_counts[i]

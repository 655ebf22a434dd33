"""The pool types that cross the local channel: how the engine maps a pool, and where
a staging allocation lies in it."""

from __future__ import annotations

import dataclasses

from kvpush.contract.layout import KvLayout


@dataclasses.dataclass(frozen=True)
class PoolDescription:
    """What the engine process needs to map a pool and address it: the sidecar's
    HELLO answer. ``kvpush.channel.memory.attach_pool`` maps it by its memory kind."""

    role: str  # "landing" | "staging"
    memory_kind: str  # "DRAM" (a shared-memory segment) or "VRAM" (device memory, by IPC handle)
    share_handle: str  # what maps the same bytes in another process: a segment name, an IPC handle
    size_bytes: int
    num_units: int  # blocks (landing) or allocation units (staging)
    unit_bytes: int  # bytes of one unit in one layer
    layout: KvLayout
    device_id: int = 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layout"] = self.layout.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "PoolDescription":
        return cls(**{**d, "layout": KvLayout.from_dict(d["layout"])})


@dataclasses.dataclass(frozen=True)
class StagingExtent:
    """``unit_count`` units from ``unit_start`` holding destination blocks
    ``first_block .. first_block + num_blocks - 1`` of the request, in every layer."""

    unit_start: int
    unit_count: int
    first_block: int
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class StagingAllocation:
    alloc_id: int
    owner: str
    extents: tuple[StagingExtent, ...]
    dest_block_layer_bytes: int  # bytes of one destination block in one layer
    num_dest_blocks: int
    unit_bytes: int
    layer_stride: int  # bytes between the same unit in consecutive layers
    # The heads staged here, of the rank's own (its cache's head axis): a tensor-parallel
    # push stages one allocation per head share (``kvpush/channel/head_plan.py``). 0 heads: all.
    first_head: int = 0
    num_heads: int = 0

    @property
    def num_units(self) -> int:
        return sum(e.unit_count for e in self.extents)

    def extent_offset(self, extent: StagingExtent, layer: int) -> int:
        """Pool offset of ``extent``'s first destination block in ``layer``."""
        return layer * self.layer_stride + extent.unit_start * self.unit_bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["extents"] = [dataclasses.astuple(e) for e in self.extents]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StagingAllocation":
        return cls(**{**d, "extents": tuple(StagingExtent(*e) for e in d["extents"])})

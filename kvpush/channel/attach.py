"""Mapping the pool a sidecar made into the engine's process, by its memory kind: host
shared memory (``memory.ShmMemory``) or a GPU's, by CUDA IPC (``device_memory``, imported
only where a VRAM pool is used: torch and CUDA stay out of a CPU engine's way). Apart
from both, so that neither memory module imports the other."""

from __future__ import annotations

from kvpush.channel.memory import PoolMapError, PoolMemory, ShmMemory
from kvpush.channel.pool import PoolDescription


def _attach_vram(desc: PoolDescription, engine_device: int | None) -> PoolMemory:
    from kvpush.channel.device_memory import CudaPoolMemory
    return CudaPoolMemory.attach(desc, engine_device)


# How the engine maps a pool its sidecar made, by memory kind.
_ATTACH = {"DRAM": lambda desc, _device: ShmMemory.attach(desc.share_handle, desc.size_bytes),
           "VRAM": _attach_vram}


def attach_pool(desc: PoolDescription, engine_device: int | None = None) -> PoolMemory:
    """Map the pool an ``PoolDescription`` describes into this process.
    ``engine_device``: the CUDA device index of the engine (None: none), which a VRAM pool
    must be on. Raises ``PoolMapError`` (a ``ValueError``) or ``OSError`` naming the pool."""
    attach = _ATTACH.get(desc.memory_kind)
    if attach is None:
        raise PoolMapError(f"the sidecar's {desc.role} pool is {desc.memory_kind!r} memory; the engine side "
                           f"maps {sorted(_ATTACH)}")
    return attach(desc, engine_device)

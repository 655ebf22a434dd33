"""GPU pools: device memory the sidecar allocates on its engine's GPU, registers with
NIXL as VRAM, and shares with the engine process by a CUDA IPC handle.

Why torch's CUDA storage sharing (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``,
what ``torch.multiprocessing`` uses) rather than ``cuda-python``'s ``cudaIpcGetMemHandle``:
both ends already run torch on the GPU (the engine is vLLM; the sidecar needs it for nothing
else, and imports it only for a VRAM pool), so it adds no dependency; it hands over the
offset of the pool inside the caching allocator's segment, which a raw IPC handle of a
torch allocation would need us to track; and it keeps the exporter's allocation alive
while an importer holds it (its reference counter). The cost of either is paid once, at
the channel's HELLO, not per request; nothing of it is on the TTFT path. Not yet run on a
GPU (no machine was lent): the refusals below are tested on the CPU, the mapping itself
only where ``torch.cuda`` is available.

Refusals, each a ``PoolMapError`` naming the pool and the reason, never a crash later:
a malformed handle (the field named), a pool on another GPU than the engine's, a pool
whose exporting sidecar has exited (the handle names its pid), no CUDA in this process.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os

from kvpush.channel.memory import DeviceMemory, PoolMapError, pid_alive
from kvpush.channel.pool import PoolDescription

HANDLE_PREFIX = "cuda-ipc:"


def current_cuda_device() -> int | None:
    """This process's CUDA device index, or None where it has none (a CPU engine). Imports
    torch only if it is already loaded, so a process without it is not made to load it."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def parse_device(text: str) -> int | None:
    """A sidecar's pool device setting: ``cpu`` -> None (a shared-memory pool), ``cuda:N`` -> N."""
    if text == "cpu":
        return None
    kind, sep, index = text.partition(":")
    if kind != "cuda" or not sep or not index.isdigit():
        raise ValueError(f"pool device must be 'cpu' or 'cuda:N', got {text!r}")
    return int(index)


@dataclasses.dataclass(frozen=True)
class CudaIpcHandle:
    """What ``_share_cuda_`` exports for a storage, plus the exporter's pid; carried as the
    pool description's ``share_handle`` (``encode``: one printable string)."""

    device: int
    handle: bytes  # the cudaIpcMemHandle of the allocator segment holding the storage
    size: int  # the storage's bytes
    offset: int  # the storage's offset in that segment
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    pid: int

    _BYTES = ("handle", "ref_counter_handle", "event_handle")

    def encode(self) -> str:
        d = dataclasses.asdict(self)
        for k in self._BYTES:
            d[k] = None if d[k] is None else base64.b64encode(d[k]).decode()
        return HANDLE_PREFIX + json.dumps(d, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> "CudaIpcHandle":
        if not isinstance(text, str) or not text.startswith(HANDLE_PREFIX):
            raise PoolMapError(f"pool.share_handle is not a CUDA IPC handle (expected {HANDLE_PREFIX!r}...)")
        try:
            d = json.loads(text[len(HANDLE_PREFIX):])
        except ValueError as exc:
            raise PoolMapError(f"pool.share_handle: not JSON after {HANDLE_PREFIX!r}: {exc}") from None
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) != set(fields):
            raise PoolMapError(f"pool.share_handle must have exactly the fields {sorted(fields)}")
        for k in ("device", "size", "offset", "ref_counter_offset", "pid"):
            if not isinstance(d[k], int) or isinstance(d[k], bool) or d[k] < 0:
                raise PoolMapError(f"pool.share_handle.{k} must be a non-negative integer, got {d[k]!r}")
        if not isinstance(d["event_sync_required"], bool):
            raise PoolMapError("pool.share_handle.event_sync_required must be a boolean")
        for k in cls._BYTES:
            if d[k] is None and k == "event_handle":
                continue
            try:
                d[k] = base64.b64decode(d[k], validate=True)
            except (TypeError, ValueError):
                raise PoolMapError(f"pool.share_handle.{k} is not base64") from None
        return cls(**d)


def check_pool_device(desc: PoolDescription, engine_device: int | None) -> None:
    """A VRAM pool is usable only by an engine on the same GPU: refuse anything else before
    any CUDA call. ``engine_device`` is the engine's CUDA device index (None: no GPU)."""
    if desc.memory_kind != "VRAM":
        return
    if engine_device is None:
        raise PoolMapError(f"the sidecar's {desc.role} pool is VRAM on cuda:{desc.device_id}; this engine process "
                           "has no CUDA device (run the sidecar with --pool-device cpu)")
    if engine_device != desc.device_id:
        raise PoolMapError(f"the sidecar's {desc.role} pool is on cuda:{desc.device_id}, this engine on "
                           f"cuda:{engine_device}: a sidecar serves the GPU of its own engine "
                           f"(--pool-device cuda:{engine_device})")


class CudaPoolMemory(DeviceMemory):
    """A pool in device memory: made by the sidecar (``create``) or opened by the engine from
    its handle (``attach``). ``tensor`` is the pool as a 1-D uint8 CUDA tensor."""

    def __init__(self, name: str, tensor, handle: str, owner: bool):
        self._name = name
        self._tensor = tensor
        self._handle = handle
        self._owner = owner
        self._device = tensor.device.index

    @classmethod
    def create(cls, tag: str, size: int, device: int) -> "CudaPoolMemory":
        import torch

        if size <= 0:
            raise ValueError(f"pool size must be positive, got {size}")
        if not torch.cuda.is_available():
            raise PoolMapError(f"pool device cuda:{device}: this process sees no CUDA device "
                               "(torch.cuda.is_available() is False)")
        if device >= torch.cuda.device_count():
            raise PoolMapError(f"pool device cuda:{device}: this process sees {torch.cuda.device_count()} GPU(s)")
        try:
            tensor = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
        except torch.cuda.OutOfMemoryError as exc:
            raise MemoryError(f"cannot allocate a {size}-byte pool on cuda:{device}: {exc}") from None
        try:
            share = tensor.untyped_storage()._share_cuda_()
        except RuntimeError as exc:  # e.g. an allocator setting whose segments cannot be exported
            raise PoolMapError(f"cannot export the pool on cuda:{device} by CUDA IPC: {exc} (check "
                               "PYTORCH_CUDA_ALLOC_CONF in the sidecar's environment)") from None
        handle = CudaIpcHandle(share[0], share[1], share[2], share[3], share[4], share[5], share[6],
                               bool(share[7]), os.getpid())
        return cls(f"{tag}@cuda:{device}", tensor, handle.encode(), owner=True)

    @classmethod
    def attach(cls, desc: PoolDescription, engine_device: int | None) -> "CudaPoolMemory":
        check_pool_device(desc, engine_device)
        h = CudaIpcHandle.decode(desc.share_handle)
        if h.device != desc.device_id:
            raise PoolMapError(f"pool.share_handle.device is {h.device}, the pool's device_id {desc.device_id}")
        if h.size < desc.size_bytes:
            raise PoolMapError(f"pool.share_handle.size is {h.size} bytes, the pool {desc.size_bytes}")
        if not pid_alive(h.pid):
            raise PoolMapError(f"the sidecar's {desc.role} pool on cuda:{h.device} is gone: its process "
                               f"{h.pid} has exited")
        import torch

        if not torch.cuda.is_available():
            raise PoolMapError(f"the sidecar's {desc.role} pool is VRAM; this process sees no CUDA device")
        try:
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(h.device, h.handle, h.size, h.offset,
                                                            h.ref_counter_handle, h.ref_counter_offset,
                                                            h.event_handle, h.event_sync_required)
        except RuntimeError as exc:  # an exporter that exited between our check and here, a foreign GPU
            raise PoolMapError(f"cannot open the sidecar's {desc.role} pool on cuda:{h.device} "
                               f"(exported by pid {h.pid}): {exc}") from None
        tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}")
        tensor.set_(storage, 0, (desc.size_bytes,), (1,))
        return cls(f"ipc:{h.pid}@cuda:{h.device}", tensor, desc.share_handle, owner=False)

    @property
    def name(self) -> str:
        return self._name

    @property
    def base_address(self) -> int:
        return self._tensor.data_ptr() if self._tensor is not None else 0

    @property
    def size(self) -> int:
        return self._tensor.numel() if self._tensor is not None else 0

    @property
    def device_id(self) -> int:
        return self._device

    def share_handle(self) -> str:
        return self._handle

    def tensor(self):
        if self._tensor is None:
            raise ValueError(f"pool {self._name} is closed")
        return self._tensor

    def close(self) -> None:
        # Dropping the tensor releases the mapping (importer) or the allocation (owner, once
        # no importer holds it: torch's IPC reference counter).
        self._tensor = None

"""Memory that a sidecar registers with NIXL and shares with its vLLM engine.

A pool is one contiguous region. On the CPU it is a POSIX shared-memory segment
(a file under /dev/shm): the sidecar creates it, the engine process maps the
same bytes by name, and NIXL registers it as DRAM. On a GPU it is device memory on
the engine's GPU, registered as VRAM and mapped by the engine through a CUDA IPC
handle (``DeviceMemory``; ``engine/device_memory.py``).

Segment names embed the creating process id, so a sidecar that was killed
(SIGKILL leaves its segments behind) can be cleaned up by the next one:
``sweep_stale_segments`` unlinks segments whose owner is no longer alive.
"""

from __future__ import annotations

import abc
import mmap
import os
import re
import secrets

import numpy as np

from engine.pool import PoolDescription

SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvpush"
# kvpush-<tag>-<pid>-<random>: tag is the caller's (engine id + role), sanitised.
_NAME_RE = re.compile(rf"^{NAME_PREFIX}-(?P<tag>[A-Za-z0-9_.]+)-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)$")
_TAG_SAFE = re.compile(r"[^A-Za-z0-9_.]")


class PoolMemory(abc.ABC):
    """One contiguous, registrable region of pool memory, mapped by two processes.

    Who uses what, and when:

    * the sidecar makes it at start (``SidecarBase.start``, through ``sidecar/pools.py``:
      ``ShmMemory.create``); its transport registers it (``base_address``, ``size``,
      ``mem_kind``, ``device_id``) and the same numbers go into the engine's record for
      peers to address it;
    * the sidecar's HELLO answer describes it (``PoolDescription``: ``mem_kind``,
      ``share_handle``, sizes); the engine maps it with ``attach_pool`` when its
      connector starts (``KVPushWorker.__init__``) and again after reconnecting to a
      restarted sidecar;
    * ``host_view`` is for host memory only: the CPU copier's views
      (``CpuCopier.bind_pool``), the pools' block views and the debug checksums;
    * ``close`` when either process is done with it (the creator's also destroys it).
    """

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    @property
    @abc.abstractmethod
    def base_address(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    @property
    @abc.abstractmethod
    def mem_kind(self) -> str:
        """NIXL memory type: "DRAM" or "VRAM"."""

    @property
    def device_id(self) -> int:
        return 0

    @abc.abstractmethod
    def share_handle(self) -> str:
        """What the local engine process needs to map the same bytes (shm name, IPC handle)."""

    @abc.abstractmethod
    def host_view(self) -> np.ndarray:
        """The bytes as a uint8 array (host memory only; device memory raises)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap and, for the owner, destroy the region. Idempotent."""


class PoolMapError(ValueError):
    """A pool cannot be made or mapped in this process; the message says which and why."""


class DeviceMemory(PoolMemory, abc.ABC):
    """GPU pools: device memory the sidecar allocates on its engine's GPU, registered
    with NIXL as VRAM, shared with the engine by a CUDA IPC handle (``share_handle``
    returns it serialised). ``tensor`` is what copies use instead of ``host_view``.
    The implementation is ``engine.device_memory.CudaPoolMemory``."""

    @property
    def mem_kind(self) -> str:
        return "VRAM"

    def host_view(self) -> np.ndarray:
        raise TypeError("device memory has no host view; copy through the engine")

    @abc.abstractmethod
    def tensor(self):
        """The pool as a 1-D uint8 tensor on its device."""


def _segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def make_segment_name(tag: str) -> str:
    """A fresh segment name for ``tag``; unique, and recognisable by the sweeper."""
    safe = _TAG_SAFE.sub("_", tag)[:120] or "pool"
    return f"{NAME_PREFIX}-{safe}-{os.getpid()}-{secrets.token_hex(4)}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(tag_prefix: str = "") -> list[str]:
    """Unlink kvpush segments whose creating process is dead.

    Only names that match our own pattern (and ``tag_prefix``, when given) are
    considered, so foreign segments are never touched.
    """
    removed = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = _NAME_RE.match(entry)
        if not match or not match.group("tag").startswith(_TAG_SAFE.sub("_", tag_prefix)):
            continue
        if pid_alive(int(match.group("pid"))):
            continue
        try:
            os.unlink(_segment_path(entry))
            removed.append(entry)
        except FileNotFoundError:
            pass
    return removed


class ShmMemory(PoolMemory):
    """A POSIX shared-memory segment mapped into this process.

    ``create`` makes and owns the segment (``close`` unlinks it); ``attach``
    maps an existing one by name (``close`` only unmaps). The backing pages
    are allocated up front with ``posix_fallocate`` so that a full /dev/shm
    fails here, with a clear error, instead of as SIGBUS in the middle of a
    transfer; it also spares the first NIXL write the page faults.
    """

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool):
        self._name = name
        self._size = size
        self._mm: mmap.mmap | None = mm
        self._owner = owner
        self._array: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)
        self._base = int(self._array.ctypes.data)

    @classmethod
    def create(cls, tag: str, size: int) -> "ShmMemory":
        if size <= 0:
            raise ValueError(f"pool size must be positive, got {size}")
        name = make_segment_name(tag)
        path = _segment_path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise MemoryError(f"cannot reserve {size} bytes in {SHM_DIR} for {name}: {exc}") from exc
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the segment alive
        return cls(name, size, mm, owner=True)

    @classmethod
    def attach(cls, name: str, size: int | None = None) -> "ShmMemory":
        if not _NAME_RE.match(name):
            raise ValueError(f"not a kvpush segment name: {name!r}")
        fd = os.open(_segment_path(name), os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if size is not None and size != actual:
                raise ValueError(f"segment {name} has {actual} bytes, expected {size}")
            mm = mmap.mmap(fd, actual, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, actual, mm, owner=False)

    @property
    def name(self) -> str:
        return self._name

    @property
    def base_address(self) -> int:
        return self._base

    @property
    def size(self) -> int:
        return self._size

    @property
    def mem_kind(self) -> str:
        return "DRAM"

    @property
    def owner(self) -> bool:
        return self._owner

    def share_handle(self) -> str:
        return self._name

    def host_view(self) -> np.ndarray:
        if self._array is None:
            raise ValueError(f"segment {self._name} is closed")
        return self._array

    def close(self) -> None:
        if self._mm is None:
            return
        if self._owner:
            try:
                os.unlink(_segment_path(self._name))
            except FileNotFoundError:
                pass
        self._array = None
        try:
            self._mm.close()
        except BufferError:
            # Someone still holds a numpy view: the mapping goes when they drop
            # it. The name is already unlinked, so nothing leaks past that.
            pass
        self._mm = None

    def __enter__(self) -> "ShmMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _attach_vram(desc: PoolDescription, engine_device: int | None) -> PoolMemory:
    from engine.device_memory import CudaPoolMemory  # torch and CUDA only where a VRAM pool is used
    return CudaPoolMemory.attach(desc, engine_device)


# How the engine maps a pool its sidecar made, by memory kind.
_ATTACH = {"DRAM": lambda desc, _device: ShmMemory.attach(desc.share_handle, desc.size_bytes),
           "VRAM": _attach_vram}


def attach_pool(desc: PoolDescription, engine_device: int | None = None) -> PoolMemory:
    """Map the pool an ``engine.pool.PoolDescription`` describes into this process.
    ``engine_device``: the CUDA device index of the engine (None: none), which a VRAM pool
    must be on. Raises ``PoolMapError`` (a ``ValueError``) or ``OSError`` naming the pool."""
    attach = _ATTACH.get(desc.memory_kind)
    if attach is None:
        raise PoolMapError(f"the sidecar's {desc.role} pool is {desc.memory_kind!r} memory; the engine side "
                           f"maps {sorted(_ATTACH)}")
    return attach(desc, engine_device)

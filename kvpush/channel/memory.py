"""Memory that a sidecar registers with NIXL and shares with its vLLM engine.

A pool is one contiguous region. On the CPU it is a POSIX shared-memory segment
(a file under /dev/shm): the sidecar creates it, the engine process maps the
same bytes by name, and NIXL registers it as DRAM. On a GPU it is device memory on
the engine's GPU, registered as VRAM and mapped by the engine through a CUDA IPC
handle (``DeviceMemory``; ``kvpush/channel/device_memory.py``).

A segment's name says whose it is (``SegmentName``: the caller's tag, then the creating
process's pid and start time), because a sidecar killed with SIGKILL leaves its segments
behind: ``sweep_stale_segments`` unlinks those of ours whose owner is no longer alive, so
the next sidecar of the same engine (``kvpush.sidecar.pools.remove_dead_pools``) or whoever
stopped it cleans up.
"""

from __future__ import annotations

import abc
import dataclasses
import mmap
import os
import re
import secrets
import stat
from typing import Callable

import numpy as np

SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvpush"
# kvpush-<tag>-<pid>-<started>-<nonce>, read from the right: the tag may hold "-" (engine ids do).
_NAME_RE = re.compile(
    rf"^{NAME_PREFIX}-(?P<tag>[A-Za-z0-9_.:-]+)-(?P<pid>\d+)-(?P<started>\d+)-(?P<nonce>[0-9a-f]+)$")
_TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
_MAX_TAG = 200  # a file name has 255 bytes: the owner and the nonce need about 40 of them


class PoolMemory(abc.ABC):
    """One contiguous, registrable region of pool memory, mapped by two processes.

    Who uses what, and when:

    * the sidecar makes it at start (``SidecarBase.start``, through ``kvpush/sidecar/pools.py``:
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
    The implementation is ``kvpush.channel.device_memory.CudaPoolMemory``."""

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


def safe_tag(tag: str) -> str:
    """``tag`` as a segment name holds it (an engine id, ``[A-Za-z0-9._:-]``, unchanged)."""
    return _TAG_UNSAFE.sub("_", tag)[:_MAX_TAG] or "pool"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) of ``pid``; None: no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ")".
    fields = raw[raw.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])


@dataclasses.dataclass(frozen=True)
class SegmentOwner:
    """The process that made a segment. Its start time tells it apart from a later process
    the kernel gave the same pid (pids are reused, soonest in a container's small range)."""

    pid: int
    started: int  # clock ticks after boot; 0 where /proc cannot say (then the pid alone decides)

    @classmethod
    def this_process(cls) -> "SegmentOwner":
        found = _proc_stat(os.getpid())
        return cls(os.getpid(), found[1] if found else 0)

    def alive(self) -> bool:
        """Whether the owner still runs. A zombie does not: killed and not yet reaped by its
        parent, it has no mappings left, and a restarted sidecar must not wait for the reaping."""
        if not os.path.isdir("/proc/self"):
            return pid_alive(self.pid)
        found = _proc_stat(self.pid)
        if found is None:
            return False
        state, started = found
        return state not in ("Z", "X") and (not self.started or started == self.started)


@dataclasses.dataclass(frozen=True)
class SegmentName:
    """A segment's file name in SHM_DIR, in its parts: the creator's tag (for a sidecar's
    pools its engine id, role and pool: ``kvpush.sidecar.pools.pool_tag``), its owner, a nonce."""

    tag: str
    owner: SegmentOwner
    nonce: str

    @classmethod
    def fresh(cls, tag: str) -> "SegmentName":
        return cls(safe_tag(tag), SegmentOwner.this_process(), secrets.token_hex(4))

    @classmethod
    def parse(cls, name: str) -> "SegmentName | None":
        """The parts of ``name``, or None when it is not a kvpush segment's."""
        m = _NAME_RE.match(name)
        if m is None:
            return None
        return cls(m["tag"], SegmentOwner(int(m["pid"]), int(m["started"])), m["nonce"])

    def __str__(self) -> str:
        return f"{NAME_PREFIX}-{self.tag}-{self.owner.pid}-{self.owner.started}-{self.nonce}"


def make_segment_name(tag: str) -> str:
    """A fresh segment name for ``tag``, owned by this process; unique."""
    return str(SegmentName.fresh(tag))


def _ours(entry: str) -> bool:
    """A regular file of our uid: what another user (or a symlink) put there is never ours."""
    try:
        st = os.lstat(_segment_path(entry))
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def sweep_stale_segments(accept: Callable[[SegmentName], bool] = lambda _name: True) -> list[str]:
    """Unlink the stale segments that ``accept`` picks, and return their names.

    Stale: named as kvpush names segments, a regular file of our uid, and its owner no
    longer alive (``SegmentOwner.alive``). A live process's segment, another user's file
    and whatever else lies in SHM_DIR are never touched.
    """
    removed = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for entry in entries:
        name = SegmentName.parse(entry)
        if name is None or not accept(name) or not _ours(entry) or name.owner.alive():
            continue
        try:
            os.unlink(_segment_path(entry))
        except FileNotFoundError:  # another sweeper was first
            continue
        removed.append(entry)
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
        if SegmentName.parse(name) is None:
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

"""An in-process ``Transport``: real bytes, moved by this module, on the test's schedule.

``FakeFabric`` is the network: the transports made on it reach each other by name.
A posted write is pending until the test completes it (``complete``, in any order it
likes) or fails it (``fail``); ``auto_complete=True`` completes every write at once.
Completing a write copies its bytes from the writer's registered memory into the
peer's and only then queues its notification, as NIXL does; a standalone
``send_notif`` is queued at once (it has no order against writes, as in NIXL).
Every descriptor must lie inside memory the two ends registered: a write outside is
refused with ``TransferError``, the way a remote key error would be.

It is for the unit tests of the push and landing logic (``tests/sidecar/test_push_fake.py``):
fast, deterministic, and able to do what a real network does only rarely (complete
writes out of order, fail the third one).
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np

from kvpush.channel.memory import PoolMemory
from kvpush.sidecar.transport.base import DONE, ERR, PROC, TransferError, Transport


@dataclasses.dataclass
class FakeWrite:
    id: int
    sender: "FakeTransport"
    receiver: str
    local: np.ndarray  # (n, 2+) address, length
    remote: np.ndarray
    notif: bytes
    state: str = PROC
    released: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum())


class FakeFabric:
    def __init__(self, auto_complete: bool = False):
        self.auto_complete = auto_complete
        self.transports: dict[str, FakeTransport] = {}
        self.writes: list[FakeWrite] = []  # every write posted, in posting order
        self._ids = itertools.count(1)

    def transport(self, name: str) -> "FakeTransport":
        if name in self.transports:
            raise ValueError(f"a transport named {name!r} is already on this fabric")
        t = self.transports[name] = FakeTransport(self, name)
        return t

    @property
    def pending(self) -> list[FakeWrite]:
        return [w for w in self.writes if w.state == PROC]

    def complete(self, write: FakeWrite) -> None:
        """The write's bytes land, then its notification is queued at the receiver."""
        if write.state != PROC:
            return
        peer = self.transports[write.receiver]
        for (src, n), (dst, m) in zip(write.local[:, :2].tolist(), write.remote[:, :2].tolist()):
            peer._view(dst, m)[:] = write.sender._view(src, n)
        write.state = DONE
        if write.notif:
            peer._inbox.append((write.sender.name, write.notif))

    def fail(self, write: FakeWrite) -> None:
        """The write fails: nothing of it lands, its notification is never delivered."""
        if write.state == PROC:
            write.state = ERR

    def _post(self, write: FakeWrite) -> None:
        self.writes.append(write)
        if self.auto_complete:
            self.complete(write)


class FakeTransport(Transport):
    def __init__(self, fabric: FakeFabric, name: str):
        self.fabric = fabric
        self._name = name
        self._regions: list[tuple[int, int, np.ndarray]] = []  # base, size, host bytes
        self._remotes: set[str] = set()
        self._inbox: list[tuple[str, bytes]] = []
        self.closed = False

    @property
    def name(self) -> str:
        return self._name

    def register(self, memory: PoolMemory) -> None:
        self._regions.append((memory.base_address, memory.size, memory.host_view()))

    def metadata(self) -> bytes:
        return json.dumps({"fake_transport": self._name}).encode()

    def add_remote(self, metadata: bytes) -> str:
        try:
            name = json.loads(metadata)["fake_transport"]
        except (ValueError, KeyError, TypeError):
            raise TransferError("not a fake transport's metadata") from None
        if name not in self.fabric.transports:
            raise TransferError(f"no transport {name!r} on this fabric")
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        self._remotes.discard(name)

    def connect(self, name: str) -> None:
        self._peer(name)

    def post_write(self, local: np.ndarray, remote: np.ndarray, remote_agent: str, *, local_kind: str = "DRAM",
                   remote_kind: str = "DRAM", notif: bytes = b"") -> tuple[object, bool]:
        peer = self._peer(remote_agent)
        if len(local) != len(remote) or not np.array_equal(local[:, 1], remote[:, 1]):
            raise TransferError("descriptor lists do not pair")
        for addr, n in local[:, :2].tolist():
            self._view(addr, n)
        for addr, n in remote[:, :2].tolist():
            peer._view(addr, n)
        write = FakeWrite(next(self.fabric._ids), self, remote_agent, np.array(local), np.array(remote), notif)
        self.fabric._post(write)
        return write, write.state == DONE

    def check(self, handle: FakeWrite) -> str:
        return handle.state

    def release(self, handle: FakeWrite) -> bool:
        if handle.state == PROC:
            handle.state = ERR  # cancelled: it will never land
        handle.released = True
        return True

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        self._peer(remote_agent)._inbox.append((self._name, message))

    def poll_notifs(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        for sender, message in self._inbox:
            out.setdefault(sender, []).append(message)
        self._inbox.clear()
        return out

    def close(self) -> None:
        self.closed = True
        self._regions.clear()

    # -- internals ----------------------------------------------------------------------------
    def _peer(self, name: str) -> "FakeTransport":
        if name not in self._remotes or name not in self.fabric.transports:
            raise TransferError(f"{self._name} has not loaded {name!r}", peer_gone=name not in self.fabric.transports)
        return self.fabric.transports[name]

    def _view(self, address: int, length: int) -> np.ndarray:
        for base, size, view in self._regions:
            if base <= address and address + length <= base + size:
                return view[address - base:address - base + length]
        raise TransferError(f"{length} bytes at {address:#x} are outside {self._name}'s registered memory")

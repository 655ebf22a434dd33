"""The ``Transport`` seam: how a sidecar moves bytes to and hears from its peers.

A sidecar owns one transport for its life. Every call comes from the sidecar's
asyncio loop thread (never two threads: the NIXL agent is made without locks) and
none may block: a transfer is *posted*, then polled for. Implementations:

* ``kvpush.sidecar.transport.nixl.NixlTransport``: a NIXL agent with its progress thread
  off, on a configurable backend (``UCX`` today; ``LIBFABRIC`` for AWS EFA where the
  NIXL build and the host have it; refused at start, with the reason, where not);
* ``kvpush.sidecar.transport.fake.FakeTransport``: in-process, for unit tests of the push
  and landing logic; it copies bytes itself and lets a test choose when each write
  completes, in which order, and which fail.

Who calls what, and when (P = prefill sidecar, D = decode sidecar):

=====================  ======  ==========================================================
method                 caller  moment
=====================  ======  ==========================================================
``register``           P, D    start, once per pool, before ``metadata``
``metadata``           P, D    start: published in the engine's record (control plane)
``add_remote``         P       the first reservation naming a decode engine (``PeerRegistry``)
``connect``            P       right after ``add_remote``: set-up off any request's path
``remove_remote``      P       the peer restarted (new incarnation) or was replaced
``post_write``         P       each staged piece (``PushEngine``); the final piece carries
                               the LANDED notification and is posted only once every
                               earlier write of its request is DONE
``send_notif``         P       BEGIN / FINAL / ABORT hints (``kvpush/sidecar/notify.py``)
``check``              P       every poll while a write is in flight (``ProgressDriver``)
``release``            P       once a write is DONE, failed or timed out; after it returns
                               True the write reads its source no more
``poll_notifs``        P, D    every poll (``ProgressDriver``); on D this is what moves a
                               transfer along and how LANDED arrives
``close``              P, D    stop, after every transfer was released
=====================  ======  ==========================================================
"""

from __future__ import annotations

import abc

import numpy as np

from kvpush.channel.memory import PoolMemory

# What ``check`` answers.
DONE, PROC, ERR = "DONE", "PROC", "ERR"


class TransferError(Exception):
    """A transport operation failed; ``peer_gone`` when the remote side disconnected."""

    def __init__(self, message: str, peer_gone: bool = False):
        super().__init__(message)
        self.peer_gone = peer_gone


class TransportUnavailable(RuntimeError):
    """The transport (or the backend asked for) cannot run on this host; said at start."""


class Transport(abc.ABC):
    @property
    @abc.abstractmethod
    def name(self) -> str:
        """This end's name as peers address it (unique per engine incarnation)."""

    @abc.abstractmethod
    def register(self, memory: PoolMemory) -> None:
        """Make ``memory`` readable/writable by peers (and by this end's writes)."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer loads (``add_remote``) to reach this end and its registered memory."""

    @abc.abstractmethod
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's name. ``TransferError`` if unusable."""

    @abc.abstractmethod
    def remove_remote(self, name: str) -> None:
        """Forget a peer (nothing to undo if it is gone already)."""

    @abc.abstractmethod
    def connect(self, name: str) -> None:
        """Start connecting to a loaded peer now, so that the first write does not pay for it."""

    @abc.abstractmethod
    def post_write(self, local: np.ndarray, remote: np.ndarray, remote_agent: str, *, local_kind: str = "DRAM",
                   remote_kind: str = "DRAM", notif: bytes = b"") -> tuple[object, bool]:
        """Post one WRITE of paired descriptors (``(n, 2)`` arrays of address, length;
        ``local`` row i goes to ``remote`` row i). ``notif`` reaches the peer after all the
        write's bytes. Returns ``(handle, done_already)``; raises ``TransferError``."""

    @abc.abstractmethod
    def check(self, handle) -> str:
        """``DONE``, ``PROC`` or ``ERR`` (never raises)."""

    @abc.abstractmethod
    def release(self, handle) -> bool:
        """Let go of a write, cancelling it if still running; False if that cannot be done yet
        (then the write may still read its source, and the caller tries again later)."""

    @abc.abstractmethod
    def send_notif(self, remote_agent: str, message: bytes) -> None:
        """A standalone notification (no ordering against writes); ``TransferError`` on failure."""

    @abc.abstractmethod
    def poll_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender name, in arrival order; also drives progress."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister memory and let go of the transport. Idempotent."""

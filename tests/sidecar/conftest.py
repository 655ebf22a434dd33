"""Fixtures for the sidecar data-plane tests: real sidecar processes, real NIXL
agents, real shared memory. Every process a test starts is stopped (SIGKILL as
the last resort) and every shared-memory segment checked and removed."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvpush.connector.sidecar_client import SidecarClient  # noqa: E402
from kvpush.channel.memory import SHM_DIR, SegmentName  # noqa: E402

# Processes of this test session (this one and every sidecar it starts): other
# sessions on the same machine (another engineer's run) have segments of their own.
OUR_PIDS: set[int] = {os.getpid()}


def segment_owner(name: str) -> int:
    """The pid that made the kvpush segment ``name``."""
    return SegmentName.parse(name).owner.pid


def kvpush_segments(ours_only: bool = False) -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if (m := SegmentName.parse(n))
            and (not ours_only or m.owner.pid in OUR_PIDS)}


def remove_segments_of(pid: int) -> list[str]:
    gone = []
    for name in kvpush_segments():
        if segment_owner(name) == pid:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
            except FileNotFoundError:
                pass
    return gone


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail a test that leaves a kvpush shared-memory segment behind (and remove it)."""
    before = kvpush_segments(ours_only=True)
    yield
    leaked = kvpush_segments(ours_only=True) - before
    for name in leaked:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"test leaked shared-memory segments: {sorted(leaked)}"


@dataclasses.dataclass
class SidecarProc:
    role: str
    engine_id: str
    layout: str
    socket: str
    record_path: str
    proc: subprocess.Popen
    log_path: str
    record: dict | None = None

    def ready(self, timeout_s: float = 90.0) -> "SidecarProc":
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.record_path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar {self.engine_id} exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sidecar {self.engine_id} not ready in {timeout_s} s:\n{self.log()}")
            time.sleep(0.02)
        with open(self.record_path) as f:
            self.record = json.load(f)
        return self

    def client(self, timeout_s: float = 5.0) -> SidecarClient:
        return SidecarClient(self.socket, timeout_s=timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash: the process gets no chance to clean up."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log(self) -> str:
        try:
            return pathlib.Path(self.log_path).read_text()[-6000:]
        except OSError:
            return ""


def stop_sidecars(procs, timeout_s: float) -> None:
    """SIGTERM them all, then wait (SIGKILL past ``timeout_s``) and remove what a
    SIGKILLed sidecar could not remove itself."""
    for sp in procs:
        if sp.proc.poll() is None:
            sp.proc.send_signal(signal.SIGTERM)
    for sp in procs:
        try:
            sp.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            sp.proc.kill()
            sp.proc.wait(timeout=5)
        remove_segments_of(sp.pid)


class SidecarLauncher:
    def __init__(self, workdir: pathlib.Path):
        self.workdir = workdir
        self.procs: list[SidecarProc] = []

    def launch(self, role: str, engine_id: str, layout: str, blocks: int, *extra: str) -> SidecarProc:
        """Start a sidecar process (call ``.ready()`` on the result before using it)."""
        sock = str(self.workdir / f"{engine_id}.sock")
        record = str(self.workdir / f"{engine_id}.json")
        log_path = str(self.workdir / f"{engine_id}.log")
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "kvpush.sidecar.sidecar", "--role", role, "--engine-id", engine_id,
               "--layout", layout, "--blocks", str(blocks), "--socket", sock, "--record-out", record,
               "--log-level", "INFO", *extra]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
        OUR_PIDS.add(proc.pid)
        sp = SidecarProc(role, engine_id, layout, sock, record, proc, log_path)
        self.procs.append(sp)
        return sp

    def stop_all(self) -> None:
        stop_sidecars(self.procs, timeout_s=5)


@pytest.fixture
def sidecars():
    # Unix socket paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvpw-", dir="/tmp"))
    launcher = SidecarLauncher(workdir)
    try:
        yield launcher
    finally:
        launcher.stop_all()
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()


# ---------------------------------------------------------------------------------------------
# The sidecar as a service: a real control plane (its own process, restartable on the same
# port) and sidecars started with the ``kvpush sidecar`` command.

from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN  # noqa: E402


def kvpush_command() -> list[str]:
    """The installed ``kvpush`` console script of this interpreter's environment."""
    script = pathlib.Path(sys.executable).with_name("kvpush")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvpush.app.cli"]


class ControlPlaneProc:
    """One control-plane replica process on a fixed port, so it can be restarted in place."""

    def __init__(self, etcd_endpoint: str, workdir: pathlib.Path, extra: tuple[str, ...] = ()):
        from kvpush.app.etcd_server import free_port
        self.extra = extra
        self.etcd_endpoint = etcd_endpoint
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.ready_file = str(workdir / f"cp-{self.port}.ready")
        self.log_path = str(workdir / f"cp-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 90.0) -> "ControlPlaneProc":
        if os.path.exists(self.ready_file):
            os.unlink(self.ready_file)
        cmd = [*kvpush_command(), "controlplane", "--listen", self.address, "--etcd", self.etcd_endpoint,
               "--admin-token", ADMIN_TOKEN, "--engine-token", ENGINE_TOKEN, "--ready-file", self.ready_file,
               "--log-level", "info", *self.extra]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.ready_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"control plane exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"control plane not ready in {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def log(self) -> str:
        try:
            return pathlib.Path(self.log_path).read_text()[-6000:]
        except OSError:
            return ""


@dataclasses.dataclass
class ServiceProc(SidecarProc):
    """A ``kvpush sidecar`` process: its ready file is written once it is registered."""

    @property
    def ready_path(self) -> str:
        return self.record_path

    def terminate(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)


class Stack:
    """etcd (the shared fixture), one control-plane process, and ``kvpush sidecar`` processes."""

    def __init__(self, etcd, workdir: pathlib.Path):
        self.etcd = etcd
        self.workdir = workdir
        self.cp = ControlPlaneProc(etcd.endpoint, workdir)
        self.procs: list[ServiceProc] = []

    def sidecar(self, role: str, engine_id: str, layout: str, blocks: int, model: str = "m", *extra: str,
                env: dict | None = None) -> ServiceProc:
        sock = str(self.workdir / f"{engine_id}.sock")
        ready = str(self.workdir / f"{engine_id}.ready")
        log_path = str(self.workdir / f"{engine_id}.log")
        cmd = [*kvpush_command(), "sidecar", "--role", role, "--engine-id", engine_id,
               "--controlplane", self.cp.address, "--kv-layout", layout, "--num-blocks", str(blocks),
               "--model", model, "--socket", sock, "--ready-file", ready, "--lease-ttl", "6", *extra]
        environ = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", KVPUSH_ENGINE_TOKEN=ENGINE_TOKEN,
                       **(env or {}))
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, cwd=str(ROOT), env=environ, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        OUR_PIDS.add(proc.pid)
        sp = ServiceProc(role, engine_id, layout, sock, ready, proc, log_path)
        self.procs.append(sp)
        return sp

    def logs(self) -> str:
        return "\n".join(f"--- {sp.engine_id}\n{sp.log()}" for sp in self.procs) + f"\n--- cp\n{self.cp.log()}"

    def stop_all(self) -> None:
        stop_sidecars(self.procs, timeout_s=10)
        self.cp.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def stack(etcd, request):
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvps-", dir="/tmp"))
    st = Stack(etcd, workdir)
    st.cp.start()
    try:
        yield st
    finally:
        if request.node.stash.get(_CALL_FAILED, False):  # the processes' own story, for the failure report
            print(f"\n===== logs of the failed test's processes =====\n{st.logs()}")
        st.stop_all()
        for p in workdir.iterdir():
            p.unlink()
        workdir.rmdir()

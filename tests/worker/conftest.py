"""Fixtures for the sidecar data-plane tests: real sidecar processes, real NIXL
agents, real shared memory. Every process a test starts is stopped (SIGKILL as
the last resort) and every shared-memory segment checked and removed."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worker.channel import SidecarClient  # noqa: E402
from worker.memory import SHM_DIR  # noqa: E402

SEGMENT_RE = re.compile(r"^kvpush-.*-(?P<pid>\d+)-[0-9a-f]+$")


def kvpush_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if SEGMENT_RE.match(n)}


def remove_segments_of(pid: int) -> list[str]:
    gone = []
    for name in kvpush_segments():
        if int(SEGMENT_RE.match(name).group("pid")) == pid:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone.append(name)
            except FileNotFoundError:
                pass
    return gone


@pytest.fixture(autouse=True)
def no_leaked_segments():
    """Fail a test that leaves a kvpush shared-memory segment behind (and remove it)."""
    before = kvpush_segments()
    yield
    leaked = kvpush_segments() - before
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

    def ready(self, timeout_s: float = 20.0) -> "SidecarProc":
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
            return pathlib.Path(self.log_path).read_text()[-4000:]
        except OSError:
            return ""


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
        cmd = [sys.executable, "-m", "worker.sidecar", "--role", role, "--engine-id", engine_id,
               "--layout", layout, "--blocks", str(blocks), "--socket", sock, "--record-out", record,
               "--log-level", "INFO", *extra]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
        sp = SidecarProc(role, engine_id, layout, sock, record, proc, log_path)
        self.procs.append(sp)
        return sp

    def stop_all(self) -> None:
        for sp in self.procs:
            if sp.proc.poll() is None:
                sp.proc.send_signal(signal.SIGTERM)
        for sp in self.procs:
            try:
                sp.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                sp.proc.kill()
                sp.proc.wait(timeout=5)
            remove_segments_of(sp.pid)  # what a SIGKILLed sidecar could not remove itself


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

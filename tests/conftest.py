"""Shared fixtures: a real etcd per test, control planes in-process or as processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
import pytest_asyncio

from kvpush.client.control_plane import ControlPlaneClient
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.app.etcd_server import EmbeddedEtcd, free_port

ADMIN_TOKEN = "test-admin-token-0123456789"
ENGINE_TOKEN = "test-engine-token-0123456789"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def etcd():
    server = EmbeddedEtcd(unsafe_no_fsync=True).start()
    yield server
    server.stop()


@pytest_asyncio.fixture
async def cp(etcd):
    """An in-process control plane (fast); its address is ``cp.address``."""
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            engine_token=ENGINE_TOKEN, sweep_interval_s=0.5))
    await plane.start()
    await plane.view.ready.wait()
    plane.address = f"127.0.0.1:{plane.port}"
    yield plane
    await plane.stop(grace=0.1)


@pytest_asyncio.fixture
async def admin(cp):
    client = ControlPlaneClient(cp.address, ADMIN_TOKEN)
    yield client
    await client.close()


@pytest_asyncio.fixture
async def engine_client(cp):
    client = ControlPlaneClient(cp.address, ENGINE_TOKEN)
    yield client
    await client.close()


class ControlPlaneProcess:
    """A control-plane replica in its own OS process."""

    def __init__(self, etcd_endpoint: str, extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_path = tempfile.mktemp(prefix="kvpush-cp-", suffix=".log")
        self.ready_file = tempfile.mktemp(prefix="kvpush-cp-ready-")
        cmd = [sys.executable, "-m", "kvpush.app.cli", "controlplane", "--listen", self.address,
               "--etcd", etcd_endpoint, "--admin-token", ADMIN_TOKEN, "--engine-token", ENGINE_TOKEN,
               "--ready-file", self.ready_file, *(extra or [])]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 30.0) -> "ControlPlaneProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"control plane exited: {open(self.log_path).read()[-2000:]}")
            if os.path.exists(self.ready_file):
                return self
            time.sleep(0.05)
        raise TimeoutError("control plane did not start")

    def tail(self, size: int = 4000) -> str:
        """The end of its log (it is removed at ``stop``)."""
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read()[-size:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        for path in (self.ready_file, self.log_path):
            if os.path.exists(path):
                os.unlink(path)


@pytest.fixture
def cp_processes(etcd):
    started: list[ControlPlaneProcess] = []

    def start(n: int = 1, extra: list[str] | None = None) -> list[ControlPlaneProcess]:
        procs = [ControlPlaneProcess(etcd.endpoint, extra) for _ in range(n)]
        started.extend(procs)
        return [p.wait_ready() for p in procs]

    yield start
    for proc in started:
        proc.stop()

"""Fixtures for the connector tests: real sidecar processes (``python -m kvpush.sidecar.sidecar``,
peers added over the channel's ADMIN ``add_peer``) and real vLLM engines
(``python -m vllm.entrypoints.openai.api_server`` on the tiny model). Every process a
fixture starts is stopped (SIGKILL as the last resort), waits are bounded."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvpush.app.engines import engine_env, kvpush_transfer_config, vllm_command  # noqa: F401 (re-exported)
from kvpush.app.etcd_server import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvpush.connector.sidecar_client import SidecarClient

VENV_BIN = pathlib.Path(sys.executable).parent


def _stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the process and its children (vLLM's EngineCore)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: str, n: int = 6000) -> str:
    try:
        return pathlib.Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def keep_logs(workdir: pathlib.Path) -> None:
    """Copy a test's working directory (logs, counters, records) to ``$KVPUSH_KEEP_TEST_LOGS``
    when set; not its sockets (vLLM's ZMQ ones have no suffix): only files and folders."""
    keep = os.environ.get("KVPUSH_KEEP_TEST_LOGS")
    if keep:
        shutil.copytree(workdir, keep, dirs_exist_ok=True,
                        ignore=lambda d, names: [n for n in names if not (pathlib.Path(d, n).is_file()
                                                                          or pathlib.Path(d, n).is_dir())])


def serve_module(stack, workdir: pathlib.Path, logs):
    """A module fixture's body: start ``stack`` and yield it; if it fails to start, print
    ``logs()`` (its processes' logs); always stop it, keep its logs and remove ``workdir``."""
    try:
        yield stack.start()
    except BaseException:
        print(logs())
        raise
    finally:
        stack.stop()
        keep_logs(workdir)
        shutil.rmtree(workdir, ignore_errors=True)


def prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary, the same for the same seed."""
    return [int(x) for x in np.random.default_rng(seed).integers(7, 1000, size=n)]


class PrivateShm:
    """A private /dev/shm (mount namespace + tmpfs) for the processes a test starts.

    Sidecars create their pools in /dev/shm and engines map them by name. On a machine
    shared with other test runs, another run's leak check (or sweep) may remove segments
    it did not create, and ours may look like its leaks; a namespace of our own keeps both
    apart. Processes join it through ``nsenter``; ``prefix`` is empty (shared /dev/shm)
    where namespaces are not permitted.
    """

    def __init__(self, size: str = "8g"):
        self.holder: subprocess.Popen | None = None
        self.prefix: list[str] = []
        if not (shutil.which("unshare") and shutil.which("nsenter")):
            return
        script = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && echo ready && exec sleep 100000"
        try:
            self.holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                           stdin=subprocess.DEVNULL, start_new_session=True, text=True)
            line = self.holder.stdout.readline().strip()
        except OSError:
            line = ""
        if line == "ready":
            self.prefix = ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"]
        else:
            self.close()

    def close(self) -> None:
        if self.holder is not None:
            _stop(self.holder, timeout_s=5)
            self.holder = None


class SidecarProc:
    def __init__(self, engine_id: str, role: str, workdir: pathlib.Path, layout: str, blocks: int, *extra: str,
                 prefix: tuple[str, ...] = ()):
        self.engine_id = engine_id
        self.role = role
        self.socket = str(workdir / f"{engine_id}.sock")
        self.record_path = str(workdir / f"{engine_id}.json")
        self.log_path = str(workdir / f"{engine_id}.sidecar.log")
        cmd = [*prefix, sys.executable, "-m", "kvpush.sidecar.sidecar", "--role", role, "--engine-id", engine_id,
               "--layout", layout, "--blocks", str(blocks), "--socket", self.socket,
               "--record-out", self.record_path, "--log-level", "INFO", *extra]
        self.cmd = cmd
        self.record: dict | None = None
        self._spawn()

    def _spawn(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def restart(self, timeout_s: float = 30.0) -> SidecarProc:
        """Stop and start again: same engine id, socket and pool size; a new incarnation."""
        self.stop()
        if os.path.exists(self.record_path):
            os.unlink(self.record_path)
        self.record = None
        self._spawn()
        return self.ready(timeout_s)

    def ready(self, timeout_s: float = 30.0) -> SidecarProc:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.record_path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar {self.engine_id} exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"sidecar {self.engine_id} not ready in {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)
        with open(self.record_path) as f:
            self.record = json.load(f)
        return self

    def client(self, timeout_s: float = 5.0) -> SidecarClient:
        return SidecarClient(self.socket, timeout_s=timeout_s)

    def admin(self, op: str, **fields) -> dict:
        with self.client() as c:
            return c.admin(op, **fields)

    def log(self) -> str:
        return _tail(self.log_path)

    def stop(self) -> None:
        _stop(self.proc)


def sidecar_pair(workdir: pathlib.Path, layout: str, d_blocks: int = 256, p_units: int = 256,
                 prefix: tuple[str, ...] = (), d_layout: str = "") -> tuple[SidecarProc, SidecarProc]:
    """A decode and a prefill sidecar, the prefill one knowing the decode one."""
    dec = SidecarProc("D1", "decode", workdir, d_layout or layout, d_blocks, prefix=prefix)
    pre = SidecarProc("P1", "prefill", workdir, layout, p_units, prefix=prefix)
    try:
        dec.ready(), pre.ready()
        pre.admin("add_peer", record=dec.record)
    except BaseException:
        pre.stop(), dec.stop()
        raise
    return dec, pre


@pytest.fixture
def workdir():
    # Unix socket paths must stay short (~107 bytes): not pytest's tmp_path.
    path = pathlib.Path(tempfile.mkdtemp(prefix="kvpc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sidecars(workdir):
    procs: list[SidecarProc] = []

    def start(layout: str, d_blocks: int = 256, p_units: int = 256, d_layout: str = ""):
        dec, pre = sidecar_pair(workdir, layout, d_blocks, p_units, d_layout=d_layout)
        procs.extend([dec, pre])
        return dec, pre

    try:
        yield start
    finally:
        for p in procs:
            p.stop()


# -- vLLM engines ----------------------------------------------------------------------------


class VllmEngine:
    """One ``python -m vllm.entrypoints.openai.api_server`` process."""

    def __init__(self, name: str, model: str, workdir: pathlib.Path, kv_transfer_config: dict | None = None,
                 extra_args: tuple[str, ...] = (), prefix: tuple[str, ...] = (), eager: bool = True):
        self.name = name
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = str(workdir / f"{name}.vllm.log")
        # The served name is the model path: requests name the model by its path.
        cmd = [*prefix, *vllm_command(model, self.port, model, kv_transfer_config, max_num_seqs=4,
                                      extra=tuple(extra_args), eager=eager)]
        env = dict(os.environ, **engine_env(pair=True, ipc_dir=str(workdir)))  # engines run side by side here
        self.started = time.monotonic()
        self.ready_after_s: float | None = None
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout_s: float = 240.0) -> VllmEngine:
        deadline = self.started + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine {self.name} exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_after_s = time.monotonic() - self.started
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name} not ready in {timeout_s} s:\n{self.log()}")
            time.sleep(0.5)

    def complete(self, prompt, max_tokens: int, kv_transfer_params: dict | None = None,
                 timeout_s: float = 120.0, **extra) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "return_token_ids": True, **extra}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        req = urllib.request.Request(f"{self.url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{self.name} answered {exc.code}: {exc.read()[:2000]!r}") from None

    def log(self) -> str:
        return _tail(self.log_path, 8000)

    def stop(self) -> None:
        _stop(self.proc, timeout_s=20.0)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model
    return ensure_model(str(ROOT / DEFAULT_DIR))

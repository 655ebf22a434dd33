"""Child processes for the demo, the end-to-end tests and the benchmarks: each in
its own process group with its log in a file, waited for by a readiness check,
and stopped (TERM, then KILL) so nothing is ever left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Callable


class ProcessFailed(RuntimeError):
    pass


class ManagedProcess:
    def __init__(self, name: str, cmd: list[str], log_path: str, env: dict | None = None,
                 cwd: str | None = None) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str = "ready",
                   progress: Callable[[str], None] | None = None) -> None:
        started = time.monotonic()
        next_note = started + 10
        while not ready():
            if not self.alive():
                raise ProcessFailed(f"{self.name} exited with {self.proc.returncode} before it was {what}; "
                                    f"last lines of {self.log_path}:\n{self.tail()}")
            now = time.monotonic()
            if now - started > timeout:
                raise ProcessFailed(f"{self.name} not {what} after {timeout:.0f}s; see {self.log_path}")
            if progress and now >= next_note:
                progress(f"still waiting for {self.name} ({now - started:.0f}s)")
                next_note = now + 10
            time.sleep(0.2)

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever the group left behind (vLLM spawns workers) goes too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the main process only (a crash, for fault tests)."""
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def kill_group(self) -> None:
        """SIGKILL the process and every process it started (a container that dies
        whole: a vLLM API server with its EngineCore), for fault tests."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False
    return check


def file_exists(path: str) -> Callable[[], bool]:
    return lambda: os.path.exists(path)


def python() -> str:
    return sys.executable

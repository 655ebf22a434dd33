"""Child processes for the demo, the end-to-end tests and the benchmarks: each in
its own process group with its log in a file, waited for by a readiness check,
and stopped (TERM, then KILL) so nothing is ever left running: not its process
group, not what it started in a group of its own (every descendant seen is
remembered, and this process is made their subreaper, so a vLLM EngineCore whose API
server was killed stays ours to stop), and not the POSIX semaphores of Python's
multiprocessing that a killed process could not unlink (``sweep_semaphores``)."""

from __future__ import annotations

import ctypes
import glob
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Callable

import psutil

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphans of our children are reparented to this process, not to init: stopped and
    reaped by us (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def sweep_semaphores(since: float) -> list[str]:
    """Unlink ``/dev/shm/sem.mp-*`` made since ``since`` (a time) that no living process
    maps: multiprocessing's named semaphores, which their resource tracker unlinks at
    exit unless it was killed with the rest (a vLLM engine killed with -9). Returns the
    paths removed."""
    candidates = []
    for path in glob.glob("/dev/shm/sem.mp-*"):
        try:
            if os.stat(path).st_mtime >= since - 1:
                candidates.append(path)
        except OSError:
            pass
    if not candidates:
        return []
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[-1].strip() for line in f if "/dev/shm/sem." in line)
        except OSError:
            pass
    removed = []
    for path in candidates:
        if path not in mapped:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


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
        self._descendants: dict[int, float] = {}  # pid -> start time: what it started, as last seen

    def note_descendants(self) -> None:
        """Remember every process it has started so far (they may leave its group)."""
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self._descendants[child.pid] = child.create_time()
        except psutil.Error:
            pass

    def _kill_descendants(self) -> None:
        alive = []
        for pid, started in self._descendants.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started:
                    p.kill()
                    alive.append(p)
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)  # reaps those reparented to us (become_subreaper)

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
            self.note_descendants()
            if progress and now >= next_note:
                progress(f"still waiting for {self.name} ({now - started:.0f}s)")
                next_note = now + 10
            time.sleep(0.2)

    def stop(self, timeout: float = 15.0) -> None:
        self.note_descendants()
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
        self._kill_descendants()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the main process only (a crash, for fault tests: what it started lives
        on, as it would, until ``stop``)."""
        self.note_descendants()
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def kill_group(self) -> None:
        """SIGKILL the process and every process it started (a container that dies
        whole: a vLLM API server with its EngineCore), for fault tests."""
        self.note_descendants()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)
        self._kill_descendants()


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

"""What the demo, the tests and the benchmarks start, they stop completely: a process
that left its parent's group (as a vLLM EngineCore outlives its API server killed with
-9) is stopped with it, and the named semaphores a process killed with -9 could not
unlink are removed."""

from __future__ import annotations

import glob
import os
import sys
import time

import psutil

from kvpush.app.procs import ManagedProcess, become_subreaper, sweep_semaphores

# A parent that makes a named multiprocessing semaphore (its resource tracker would unlink
# it at exit) and starts a child in a session of its own, then waits.
PARENT = """
import multiprocessing as mp, subprocess, sys, time
sem = mp.get_context("spawn").Semaphore()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("child", child.pid, flush=True)
time.sleep(600)
"""


def start(tmp_path, name: str) -> tuple[ManagedProcess, int]:
    log = tmp_path / f"{name}.log"
    proc = ManagedProcess(name, [sys.executable, "-c", PARENT], str(log))
    proc.wait_until(lambda: "child" in log.read_text(), 30, "started its child")
    child = int(log.read_text().split()[1])
    proc.note_descendants()
    return proc, child


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_process_killed_alone_leaves_nothing_once_stopped(tmp_path):
    become_subreaper()
    proc, child = start(tmp_path, "alone")
    proc.kill()  # the main process only: what it started lives on, as after a crash ...
    assert not gone(child)
    proc.stop()  # ... until it is stopped
    assert gone(child)


def test_a_group_killed_whole_leaves_no_process_and_no_semaphore(tmp_path):
    become_subreaper()
    since = time.time()
    before = set(glob.glob("/dev/shm/sem.mp-*"))
    proc, child = start(tmp_path, "whole")
    made = set(glob.glob("/dev/shm/sem.mp-*")) - before
    assert made, "the parent's semaphore is a file in /dev/shm"
    proc.kill_group()  # its resource tracker dies with it: nobody unlinks the semaphore
    assert gone(child)  # (it had left the group; it was remembered)
    assert all(os.path.exists(p) for p in made)
    removed = sweep_semaphores(since)
    assert made <= set(removed) and not any(os.path.exists(p) for p in made)
    proc.stop()

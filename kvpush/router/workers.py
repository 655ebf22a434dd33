"""Several router processes on one port: ``kvpush router --workers N``.

Past the first token the router passes decode's events on as bytes (``relay.py``), but
it is still one Python process per core. With N workers each is a whole router (its
own event loop, control-plane streams, engine connections) bound to the port with
SO_REUSEPORT, so the kernel spreads client connections over them. The process started
is their supervisor: it starts them, starts one again when it dies (a second later),
and stops them on SIGTERM or SIGINT; it says it is ready (``--ready-file``) once every
worker is.

What a worker learns that the others need:
- the turns it sent and which decode engine served each (KV-aware routing's guess of a
  decode-alone turn): told to the others over Unix datagrams (``siblings.py``), since a
  conversation's next turn may reach any worker;
- its metrics: prometheus_client's multiprocess mode (one directory of files; /metrics on
  any worker adds them up, ``metrics.collect``);
- the learned hold (``kv_aware.GuessHold``) is not shared: every worker measures the same
  control plane's round trips.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time

from kvpush import log
from kvpush.aio import write_ready_file
from kvpush.router.config import RouterConfig
from kvpush.router.siblings import Siblings, socket_path

_log = log.get("router")
RESTART_AFTER_S = 1.0
READY_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Worker:
    """One worker's place among the others."""
    index: int
    count: int
    run_dir: str

    def __post_init__(self) -> None:
        self.siblings = Siblings(self.run_dir, self.index, self.count)

    @property
    def ready_file(self) -> str:
        return os.path.join(self.run_dir, f"worker-{self.index}.ready")


def _worker_main(cfg: RouterConfig, worker: Worker, log_level: str) -> None:
    from kvpush import aio
    from kvpush.router.app import serve
    log.configure("router", log_level)
    aio.run(serve(cfg, worker.ready_file, worker))


def _reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to the port with SO_REUSEPORT and never listening: it holds the
    port (and picks one for port 0) while the workers come and go."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def supervise(cfg: RouterConfig, count: int, ready_file: str | None, log_level: str = "info") -> int:
    """Run ``count`` workers until signalled; the exit status."""
    run_dir = tempfile.mkdtemp(prefix="kvpush-router-")
    if len(socket_path(run_dir, count - 1).encode()) > 100:  # (a Unix socket's path has at most 107 bytes)
        shutil.rmtree(run_dir, ignore_errors=True)
        _log.error("the temporary directory's path is too long for the workers' sockets; set TMPDIR shorter",
                   run_dir=run_dir)
        return 2
    metrics_dir = os.path.join(run_dir, "metrics")
    os.makedirs(metrics_dir)
    # Read by prometheus_client when each worker imports it (spawned: a fresh interpreter).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    holder = _reserve_port(cfg.listen_host, cfg.listen_port)
    cfg = dataclasses.replace(cfg, listen_port=holder.getsockname()[1])
    ctx = multiprocessing.get_context("spawn")
    procs: dict[int, multiprocessing.Process] = {}
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def spawn(i: int) -> None:
        worker = Worker(i, count, run_dir)
        if os.path.exists(worker.ready_file):
            os.unlink(worker.ready_file)
        procs[i] = ctx.Process(target=_worker_main, args=(cfg, worker, log_level), name=f"kvpush-router-{i}")
        procs[i].start()

    try:
        for i in range(count):
            spawn(i)
        _log.info("router workers starting", workers=count, port=cfg.listen_port)
        deadline = time.monotonic() + READY_TIMEOUT_S
        ready = False
        dead_since: dict[int, float] = {}
        while not stopping:
            if not ready and all(os.path.exists(Worker(i, count, run_dir).ready_file) for i in range(count)):
                ready = True
                write_ready_file(ready_file, f"{cfg.listen_port}\n")
                _log.info("router workers ready", workers=count, port=cfg.listen_port)
            if not ready and time.monotonic() > deadline:
                _log.error("router workers did not become ready", timeout_s=READY_TIMEOUT_S)
                return 1
            for i, p in list(procs.items()):
                if p.is_alive():
                    continue
                if i not in dead_since:
                    dead_since[i] = time.monotonic()
                    _log.warning("router worker died; starting it again", worker=i, exitcode=p.exitcode,
                                 after_s=RESTART_AFTER_S)
                    from prometheus_client import multiprocess
                    multiprocess.mark_process_dead(p.pid, metrics_dir)
                elif time.monotonic() - dead_since[i] >= RESTART_AFTER_S:
                    del dead_since[i]
                    spawn(i)
            time.sleep(0.1)
        return 0
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        holder.close()
        shutil.rmtree(run_dir, ignore_errors=True)

"""An opt-in timeline of each request inside the engines, for finding where TTFT goes.

With ``KVPUSH_TRACE_DIR`` set in an engine's environment, the connector appends
one line per event to ``<dir>/<engine>-<pid>.trace``: wall-clock time, event,
reservation id (or ``-``), detail. ``bench/ttft_breakdown.py`` lines these up
with the router's per-request ``served`` log line (which carries the same
reservation id). Unset, every call is a no-op: nothing is opened or formatted.

Events: prefill ``push_begin``, ``layer_staged`` (detail: layer), ``push_end``;
decode ``load_planned``, ``landed`` (the sidecar's event arrived), ``loaded``
(copied into vLLM's blocks); both ``step`` (the scheduler planned a step, detail:
tokens) and ``forward_done`` (the worker's forward pass of a step ended).
"""

from __future__ import annotations

import os
import threading
import time

ENV = "KVPUSH_TRACE_DIR"


class Trace:
    def __init__(self, name: str) -> None:
        directory = os.environ.get(ENV, "")
        self._file = None
        self._lock = threading.Lock()  # the channel's reader thread traces too
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"{name}-{os.getpid()}.trace"), "a", buffering=1)

    @classmethod
    def off(cls) -> "Trace":
        """A trace that records nothing, whatever the environment says."""
        trace = cls.__new__(cls)
        trace._file, trace._lock = None, threading.Lock()
        return trace

    @property
    def on(self) -> bool:
        return self._file is not None

    def __call__(self, event: str, reservation_id: str = "-", detail: object = "") -> None:
        if self._file is None:
            return
        line = f"{time.time():.6f} {event} {reservation_id or '-'} {detail}\n"
        with self._lock:
            self._file.write(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_traces(directory: str) -> list[tuple[float, str, str, str, str]]:
    """Every event of every trace file in ``directory``: (time, engine, event, reservation, detail)."""
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".trace"):
            continue
        engine = name[:-len(".trace")].rsplit("-", 1)[0]
        with open(os.path.join(directory, name)) as f:
            for line in f:
                parts = line.rstrip("\n").split(" ", 3)
                if len(parts) == 4:
                    out.append((float(parts[0]), engine, parts[1], parts[2], parts[3]))
    out.sort()
    return out

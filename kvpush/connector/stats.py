"""Counters that prove what the connector did, readable from outside the engine.

The worker side keeps them and, at the end of every engine step that changed
them, writes ``<stats_dir>/<engine>.json`` atomically (write + rename: a reader
never sees half a file). Scheduler-side counts travel to the worker in the
step's metadata, so one file holds everything.

Prefill engine:
    requests_begun        reservations whose staging was allocated (BEGIN accepted)
    push_refused          BEGIN refused by the sidecar (bad target, staging full, ...)
    requests_pushed       every layer of every token posted, END sent
    requests_aborted      the request ended before it was fully pushed
    layers_pushed         PUSH frames sent (one per layer per chunk)
    bytes_staged          bytes copied from the paged cache into staging
    push_PUSHED / push_FAILED / push_CANCELLED   outcomes reported back by the sidecar

Decode engine:
    loads_started         requests waiting for their reservation to land
    loads_landed          requests whose KV arrived by push and was loaded
    load_wait_ms_total / load_wait_ms_max   time from the request's arrival to its admission (landed)
    load_copy_us_total    time copying landing blocks into the paged cache (and CONSUMED)
    tokens_loaded         prompt tokens loaded from landing blocks (not recomputed)
    bytes_loaded          bytes copied from landing blocks into the paged cache
    load_errors           loads that failed: those prompts are computed locally
    load_error_<reason>   by reason: failed, cancelled, timeout, restarted, channel, copy
    loads_abandoned       requests that ended before their reservation landed
    releases_consumed     landed reservations freed without being loaded
    idle_waits / idle_wait_us_total   an idle engine slept for a landing instead of stepping

Scheduler (either role):
    requests_plain        requests without kvpush params (served normally)
    bad_params            kvpush params that do not parse (served normally)
    role_ignored          a role this engine's sidecar does not serve (served normally)
    refused_<reason>      a kvpush request served normally: short_prompt, wrong_engine, channel
    load_skipped_local_hit  decode prompt already in the local prefix cache
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time


class Counters:
    def __init__(self, path: str = "", identity: dict | None = None):
        self.path = path
        self.identity = dict(identity or {})
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._dirty = bool(path)

    def inc(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n
                self._dirty = True

    def maximum(self, name: str, value: int) -> None:
        with self._lock:
            if value > self._counts[name]:
                self._counts[name] = value
                self._dirty = True

    def merge(self, counts: dict) -> None:
        if counts:
            with self._lock:
                self._counts.update(counts)
                self._dirty = True

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts[name]

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def flush(self, force: bool = False) -> None:
        """Write the file if anything changed since the last write (or ``force``)."""
        if not self.path:
            return
        # Snapshot and write under one lock: two threads flushing at once (the engine's
        # step and the channel's event thread) must not let an older snapshot land last.
        with self._write_lock:
            with self._lock:
                if not (self._dirty or force):
                    return
                data = {**self.identity, "updated_unix": time.time(), "counters": dict(self._counts)}
                self._dirty = False
            tmp = f"{self.path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            except OSError:
                with self._lock:
                    self._dirty = True


def read_counters(path: str) -> dict:
    """The counters in a stats file (empty if it does not exist yet)."""
    try:
        with open(path) as f:
            return json.load(f).get("counters", {})
    except FileNotFoundError:
        return {}

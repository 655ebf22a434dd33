"""Helpers shared by the benchmarks: percentiles, CPU accounting, report sections."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import numpy as np
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "docs" / "BENCHMARKS.md"


def pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def cpu_seconds(proc: psutil.Process, children: bool = True) -> float:
    """User + system CPU seconds of ``proc`` (and its descendants, when ``children``);
    ``psutil.Error`` if ``proc`` itself is gone."""
    t = proc.cpu_times()
    total = t.user + t.system
    for child in proc.children(recursive=True) if children else ():
        try:
            ct = child.cpu_times()
            total += ct.user + ct.system
        except psutil.Error:
            pass
    return total


@dataclasses.dataclass
class CpuMeter:
    """CPU seconds used by a set of processes over an interval. Names ending in
    '+' count the process's children too (say, a launcher and its workers)."""
    procs: dict[str, psutil.Process]
    _start: dict[str, float] = dataclasses.field(default_factory=dict)

    @staticmethod
    def _cpu(proc: psutil.Process, children: bool) -> float:
        try:
            return cpu_seconds(proc, children)
        except psutil.Error:
            return 0.0

    def start(self) -> None:
        self._start = {name: self._cpu(p, name.endswith("+")) for name, p in self.procs.items()}

    def stop(self) -> dict[str, float]:
        return {name.rstrip("+"): self._cpu(p, name.endswith("+")) - self._start.get(name, 0.0)
                for name, p in self.procs.items()}


def update_section(name: str, text: str, path: pathlib.Path = BENCHMARKS_MD) -> None:
    """Replace the block between <!-- name:begin --> and <!-- name:end --> (append if absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    current = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(current):
        current = pattern.sub(lambda _: block, current)
    else:
        current = current.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(current)


def wait_idle(proc: psutil.Process, threshold: float = 0.05, window_s: float = 1.0, timeout_s: float = 120.0) -> float:
    """Wait until ``proc`` uses under ``threshold`` of a core over ``window_s`` (say,
    etcd finishing a compaction) so one measurement does not pay for the last one's
    cleanup. Returns the seconds waited."""
    import time
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        before = proc.cpu_times()
        time.sleep(window_s)
        after = proc.cpu_times()
        if (after.user + after.system - before.user - before.system) / window_s < threshold:
            break
    return time.monotonic() - started

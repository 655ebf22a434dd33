"""The run of ``bench/gpu_check.py`` (issue #33): each part in its own process, under its own
timeout, killed with whatever it started when it runs out; its rows relayed the moment they
come and one ``PART`` line when it ends, so one part's failure is its line and the next part
still runs. Then the table, and the docs (only a CUDA run of every part writes them)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import torch

from kvpush.channel.memory import sweep_stale_segments

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARK_BEGIN, MARK_END = "<!-- gpu_check:begin -->", "<!-- gpu_check:end -->"
PARTS = ("ipc", "copy", "nixl")
TIMEOUTS = {"ipc": 120.0, "copy": 300.0, "nixl": 240.0}  # seconds, per process (nixl: per request size)


def _units(parts: list[str], tokens: list[int]) -> list[tuple[str, int | None]]:
    """The processes to run, in order: NIXL once per request size (a hang at one size keeps the other)."""
    return [(p, n) for p in PARTS if p in parts for n in (tokens if p == "nixl" else [None])]


def run_unit(script: pathlib.Path, part: str, tokens: int | None, argv: list[str], timeout_s: float,
             rows: list[dict]) -> tuple[str, str]:
    """Run one part in its own process group; relay its rows as they come (appended to ``rows``);
    kill the group at ``timeout_s``. Returns (state, why): state ok, FAILED or SKIPPED."""
    cmd = [sys.executable, "-u", str(script), "--run-part", part] + argv
    if tokens is not None:
        cmd += ["--tokens", str(tokens)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    err: list[str] = []

    def read_out():
        for line in proc.stdout:
            if line.startswith("ROW "):
                try:
                    row = json.loads(line[4:])
                except ValueError:
                    continue
                rows.append(row)
                print(line.rstrip("\n"), flush=True)

    def read_err():
        for line in proc.stderr:
            err.append(line)
            del err[:-40]

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for t in readers:
        t.start()
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    if rc is None or rc != 0:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and whatever it started (IPC child, receiver)
        except ProcessLookupError:
            pass
        proc.wait()
    for t in readers:
        t.join(5)
    # A part killed (or a receiver that died) leaves its host pools in /dev/shm: the check's
    # own, their makers gone, are removed here (live processes' and others' never are).
    sweep_stale_segments(lambda name: name.tag.startswith("gpucheck."))
    lines = [line.strip() for line in err if line.strip()]
    tail = lines[-1][-300:] if lines else ""  # the exception, where it raised
    if rc is None:
        return "FAILED", f"no result after {timeout_s:.0f} s (timed out, killed)"
    if rc != 0:
        how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        return "FAILED", f"{how}: {tail}" if tail else how
    mine = [r for r in rows if r.get("part") == part and (tokens is None or r.get("tokens") == tokens)]
    if not mine:
        return "FAILED", "exited without a result"
    if any("skipped" in r for r in mine):
        return "SKIPPED", mine[-1]["skipped"]
    if not all(_row_ok(r) for r in mine):
        return "FAILED", "not byte-exact"
    return "ok", ""


def _row_ok(r: dict) -> bool:
    if "skipped" in r:
        return True
    if "error" in r:
        return False
    if r["part"] == "ipc":
        return bool(r["ok"])
    if r["part"] == "copy":
        return bool(r["exact"])
    return bool(r["layered"]["exact"] and r["after"]["exact"])


def _timeouts(spec: str | None) -> dict[str, float]:
    out = dict(TIMEOUTS)
    for item in filter(None, (spec or "").split(",")):
        part, eq, sec = item.rpartition("=")
        if not eq:
            out = {p: float(sec) for p in out}
        elif part not in PARTS:
            raise SystemExit(f"--timeout: no part {part!r} (parts: {', '.join(PARTS)})")
        else:
            out[part] = float(sec)
    return out


def _parts(spec: str | None, skip: str | None) -> list[str]:
    chosen = [p.strip() for p in (spec or ",".join(PARTS)).split(",") if p.strip()]
    skipped = [p.strip() for p in (skip or "").split(",") if p.strip()]
    for p in chosen + skipped:
        if p not in PARTS:
            raise SystemExit(f"no part {p!r} (parts: {', '.join(PARTS)})")
    return [p for p in PARTS if p in chosen and p not in skipped]


def run_all(script: pathlib.Path, device: torch.device, child_argv: list[str], parts: list[str],
            tokens: list[int], timeouts: dict[str, float]) -> tuple[str, bool]:
    """Every selected part, one process each (``script --run-part``), each line printed as it
    comes. Returns the table and whether a part failed."""
    t0 = time.monotonic()
    rows: list[dict] = []
    notes, failed = [], False
    for part in PARTS:
        if part not in parts:
            print(f"PART {part}: SKIPPED (not selected)", flush=True)
            notes.append(f"{part}: not run (not selected)")
    for part, n in _units(parts, tokens):
        name = part if n is None else f"{part}[{n}]"
        t1 = time.monotonic()
        state, why = run_unit(script, part, n, child_argv, timeouts[part], rows)
        print(f"PART {name}: {state} in {time.monotonic() - t1:.1f} s" + (f": {why}" if why else ""), flush=True)
        if state == "FAILED":
            failed = True
            notes.append(f"{name}: FAILED: {why}")
            if part == "nixl" and not any(r["part"] == "nixl" and r.get("tokens") == n for r in rows):
                rows.append({"part": "nixl", "tokens": n, "error": why})
            if part == "ipc" and not any(r["part"] == "ipc" for r in rows):
                rows.append({"part": "ipc", "error": why})
    ipc = next((r for r in rows if r["part"] == "ipc"), None)
    copies = [r for r in rows if r["part"] == "copy"]
    pushes = [r for r in rows if r["part"] == "nixl"]
    text = table(device, ipc, copies, pushes, notes) + f"\n\nWall time of the check: {time.monotonic() - t0:.0f} s."
    print(text, flush=True)
    return text, failed


# -- the table ----------------------------------------------------------------------------------------
def _nan(d: dict, key: str) -> float:
    v = d.get(key)
    return float("nan") if v is None else v


def table(device: torch.device, ipc: dict | None, copies: list[dict], pushes: list, notes: list[str] = ()) -> str:
    """``ipc`` None: not run; a row with "error": that part failed. ``notes``: one line per part
    that failed or was skipped, under the tables."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run, not GPU figures)"
    out = [f"Device: {name}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
           f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
           "", "| IPC | pool | mapped by a 2nd process | map time | byte-exact both ways |", "|---|---|---|---|---|"]
    if ipc is None:
        out.append("| not run | | | | |")
    elif "error" in ipc:
        out.append(f"| FAILED: {ipc['error']} | | | | |")
    else:
        out.append(f"| {ipc.get('kind', '?')} | {ipc.get('mib', '?')} MiB | yes | {_nan(ipc, 'map_ms'):.1f} ms | "
                   f"{'yes' if ipc['ok'] else 'NO: ' + ipc.get('why', '')} |")
    out += ["", "| layout | dtype | bytes | stage (all layers) | load | d2d copy (limit) | stage / limit "
            "| load / limit | byte-exact, others untouched |", "|---|---|---|---|---|---|---|---|---|"]
    for r in copies:
        out.append(f"| {r['layout']} | {r['dtype']} | {r['mib']:.1f} MiB | {r['stage_us']:.0f} us | "
                   f"{r['load_us']:.0f} us | {r['limit_us']:.0f} us | {r['stage_us'] / r['limit_us']:.2f}x | "
                   f"{r['load_us'] / r['limit_us']:.2f}x | {'yes' if r['exact'] else 'NO'} |")
    out += ["", "| tokens | bytes | memory | layered: exposed after prefill | layered: GB/s | one WRITE after "
            "prefill: exposed | its GB/s | exposed ratio | byte-exact |", "|---|---|---|---|---|---|---|---|---|"]
    for p in pushes:
        if "skipped" in p or "error" in p:
            why = f"not run: {p['skipped']}" if "skipped" in p else f"FAILED: {p['error']}"
            out.append(f"| {p['tokens']} | - | - | {why} | | | | | |")
            continue
        a, b = p["layered"], p["after"]
        out.append(f"| {p['tokens']} | {p['mib']:.0f} MiB | {p['kind']} | {a['exposed_ms']:.2f} ms | "
                   f"{a['gbps']:.1f} | {b['exposed_ms']:.2f} ms | {b['gbps']:.1f} | "
                   f"{a['exposed_ms'] / b['exposed_ms']:.2f}x | {'yes' if a['exact'] and b['exact'] else 'NO'} |")
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return "\n".join(out)


def write_docs(text: str, path: pathlib.Path) -> None:
    doc = path.read_text()
    if MARK_BEGIN not in doc:
        raise SystemExit(f"{path} has no {MARK_BEGIN} ... {MARK_END} section")
    head, rest = doc.split(MARK_BEGIN, 1)
    _, tail = rest.split(MARK_END, 1)
    path.write_text(f"{head}{MARK_BEGIN}\n{text}\n{MARK_END}{tail}")


def docs_to_write(device: torch.device, no_docs: bool, parts: list[str]) -> pathlib.Path | None:
    """The docs file a run writes its table into: only a CUDA run of every part, without
    ``--no-docs`` (a partial run would replace the whole table with gaps)."""
    if device.type != "cuda" or no_docs or set(parts) != set(PARTS):
        return None
    return ROOT / "docs" / "BENCHMARKS.md"



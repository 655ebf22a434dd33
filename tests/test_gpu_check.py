"""``bench/gpu_check.py`` (issue #11's GPU check) runs here as its smoke run on the CPU:
every part (IPC mapping by a second process, the copies in every layout and dtype, the
NIXL push with its notification between two processes) ends byte-exact. Its figures are
not asserted (a benchmark, not a timed test) and a CPU run leaves the docs alone. Its
table of vLLM's stride orders is the installed vLLM's. Each part runs in its own process:
one that raises, hangs or dies (or whose NIXL receiver dies) is that part's line, printed
when it ends, and the parts after it still run (issue #33)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

pytestmark = pytest.mark.timeout(300)


def test_its_stride_orders_are_the_pinned_vllms():
    from vllm.v1.kv_cache_layout import KVCacheLayout
    import gpu_check

    assert gpu_check.STRIDE_ORDERS == {layout.name: tuple(layout.stride_order) for layout in KVCacheLayout}


def test_the_smoke_run_on_the_cpu_is_byte_exact_everywhere_and_writes_no_docs():
    docs = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--tokens", "64,200",
                           "--copy-tokens", "70", "--layers", "3", "--heads", "2", "--dim", "16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    copies = [r for r in rows if r.split("|")[2].strip() in ("float16", "bfloat16", "float32", "float8_e4m3fn")]
    assert len(copies) == 24 and all(r.rstrip(" |").endswith("yes") for r in copies)
    pushes = [r for r in rows if r.split("|")[1].strip() in ("64", "200")]
    assert len(pushes) == 2 and all("DRAM" in r and r.rstrip(" |").endswith("yes") for r in pushes)
    for part in ("ipc", "copy", "nixl[64]", "nixl[200]"):
        assert f"PART {part}: ok in " in done.stdout
    assert "CPU (smoke run, not GPU figures)" in done.stdout
    assert (ROOT / "docs" / "BENCHMARKS.md").read_text() == docs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_says_so_and_measures_nothing():
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "no CUDA device here" in done.stderr and "nothing measured" in done.stderr


SMALL = ["--device", "cpu", "--copy-tokens", "70", "--layers", "3", "--heads", "2", "--dim", "16", "--tokens", "64"]


def _run(faults: str, *args: str) -> tuple[int, list[tuple[float, str]], float]:
    """The check with ``faults`` injected: its exit status, its stdout lines with the second
    each arrived, and the second it ended."""
    env = {**os.environ, "KVPUSH_GPU_CHECK_FAULT": faults}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "bench/gpu_check.py", *SMALL, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = [(time.monotonic() - t0, line.rstrip("\n")) for line in proc.stdout]
    return proc.wait(60), lines, time.monotonic() - t0


def _part_lines(lines) -> dict[str, tuple[float, str]]:
    return {text.split(":")[0][len("PART "):]: (t, text) for t, text in lines if text.startswith("PART ")}


def test_a_part_that_raises_or_hangs_is_its_line_at_once_and_the_next_part_still_runs():
    docs = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    rc, lines, end = _run("ipc=raise,copy=hang", "--timeout", "copy=6")
    parts = _part_lines(lines)
    assert rc == 1
    assert "FAILED" in parts["ipc"][1] and "RuntimeError: fault injected into ipc" in parts["ipc"][1]
    assert "FAILED" in parts["copy"][1] and "timed out, killed" in parts["copy"][1]
    assert "nixl[64]: ok" in parts["nixl[64]"][1]
    # printed when it ended, not with the table: the hang (6 s) came after it
    assert parts["ipc"][0] < parts["copy"][0] - 5
    assert any(t.startswith("ROW ") and '"part": "nixl"' in t for _, t in lines)
    table = [t for _, t in lines if t.startswith("| 64 |")]
    assert len(table) == 1 and table[0].rstrip(" |").endswith("yes")
    assert any(t.startswith("- copy: FAILED: no result after 6 s") for _, t in lines)
    assert (ROOT / "docs" / "BENCHMARKS.md").read_text() == docs
    assert end < 60


def test_a_part_that_dies_or_whose_receiver_dies_loses_nothing_else():
    rc, lines, _ = _run("ipc=die,nixl=recv-die", "--tokens", "64,80")
    parts = _part_lines(lines)
    assert rc == 1
    assert "FAILED" in parts["ipc"][1] and "killed by signal 9" in parts["ipc"][1]
    assert "copy: ok" in parts["copy"][1]
    assert len([t for _, t in lines if t.startswith('ROW {"part": "copy"')]) == 24
    for n in ("64", "80"):  # each request size its own process and its own line
        assert "FAILED" in parts[f"nixl[{n}]"][1] and "exit status 1" in parts[f"nixl[{n}]"][1]
        assert any(t.startswith(f"| {n} | - | - | FAILED") for _, t in lines)
    # The dead receivers' landing pools are not left in /dev/shm.
    from kvpush.channel.memory import SHM_DIR, SegmentName
    left = [n for n in os.listdir(SHM_DIR) if (s := SegmentName.parse(n)) and s.tag.startswith("gpucheck.")
            and not s.owner.alive()]
    assert not left, left


def test_parts_can_be_chosen_or_skipped():
    rc, lines, _ = _run("", "--parts", "ipc,nixl", "--skip", "nixl")
    parts = _part_lines(lines)
    assert rc == 0 and "ipc: ok" in parts["ipc"][1]
    assert parts["copy"][1] == "PART copy: SKIPPED (not selected)"
    assert parts["nixl"][1] == "PART nixl: SKIPPED (not selected)"
    assert not any(t.startswith("ROW ") and '"part": "ipc"' not in t for _, t in lines)
    done = subprocess.run([sys.executable, "bench/gpu_check.py", *SMALL, "--skip", "nvlink"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no part 'nvlink'" in done.stderr


def test_the_docs_are_written_only_by_a_cuda_run_of_every_part_without_no_docs():
    import gpu_check

    cuda, cpu, every = torch.device("cuda:0"), torch.device("cpu"), list(gpu_check.PARTS)
    assert gpu_check.docs_to_write(cuda, False, every) == ROOT / "docs" / "BENCHMARKS.md"
    assert gpu_check.docs_to_write(cuda, True, every) is None
    assert gpu_check.docs_to_write(cuda, False, ["ipc", "copy"]) is None
    assert gpu_check.docs_to_write(cpu, False, every) is None
    assert gpu_check._parts(None, "copy") == ["ipc", "nixl"]
    assert gpu_check._parts("nixl,ipc", None) == ["ipc", "nixl"]
    assert gpu_check._timeouts("30,nixl=90") == {"ipc": 30.0, "copy": 30.0, "nixl": 90.0}


def test_each_part_sets_its_cuda_device_before_anything_else(monkeypatch):
    import gpu_check

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setenv(gpu_check.FAULT_ENV, "ipc=raise")
    with pytest.raises(RuntimeError, match="fault injected"):
        gpu_check.run_part("ipc", torch.device("cuda:1"), gpu_check.Shape(2, 2, 16), 16, None)
    assert calls == [("set_device", torch.device("cuda:1"))]
    gpu_check.use_device(torch.device("cpu"))
    assert len(calls) == 1

"""``bench/gpu_check.py`` (issue #11's GPU check) runs here as its smoke run on the CPU:
every part (IPC mapping by a second process, the copies in every layout and dtype, the
NIXL push with its notification between two processes) ends byte-exact. Its figures are
not asserted (a benchmark, not a timed test) and a CPU run leaves the docs alone. Its
table of vLLM's stride orders is the installed vLLM's."""

from __future__ import annotations

import pathlib
import subprocess
import sys

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
    assert "CPU (smoke run, not GPU figures)" in done.stdout
    assert (ROOT / "docs" / "BENCHMARKS.md").read_text() == docs


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_says_so_and_measures_nothing():
    done = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "no CUDA device here" in done.stderr and "nothing measured" in done.stderr

"""Per-layer host cost of building a WRITE: prepped lists vs initialize_xfer (measured)."""

from __future__ import annotations

import pytest

from kvpush.contract.layout import KvLayout
from bench.xfer_cost import measure


@pytest.mark.timeout(60)
def test_initialize_xfer_costs_about_what_prepped_lists_cost():
    layout = KvLayout(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    results = measure(layout, num_tokens=512, pool_blocks=96, reps=20)
    print()
    for r in results:
        print(f"{r.method:16s} blocks={r.blocks} contiguous={r.contiguous!s:5s} descriptors={r.descriptors:3d} "
              f"create {r.create_us:7.1f} us  per layer {r.total_us:8.1f} us")
    by = {(r.method, r.contiguous): r for r in results}
    for contiguous in (True, False):
        dyn, prep = by[("initialize_xfer", contiguous)], by[("prepped", contiguous)]
        # Building descriptors per layer must not be what limits a push: tens of microseconds.
        assert dyn.create_us < 500
        assert dyn.descriptors <= prep.descriptors

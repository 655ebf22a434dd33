"""The Reserve's engine choice over arrays: the free counts behave as the dict they
replace (through growth past their first size), and the choice is the one the
one-by-one rule made: the largest free fraction, ties to the largest id, quota and
room refused with the same messages."""

from __future__ import annotations

import numpy as np
import pytest

from kvpush.controlplane.free_counts import FreeCounts


def test_free_counts_behave_as_a_dict_through_growth():
    counts, ref = FreeCounts(), {}
    rng = np.random.default_rng(3)
    for step in range(2000):
        eid = f"e{rng.integers(0, 300)}"
        op = rng.integers(0, 3)
        if op == 0:
            counts[eid] = ref[eid] = int(rng.integers(0, 10_000))
        elif op == 1 and eid in ref:
            counts[eid] -= 7
            ref[eid] -= 7
        elif op == 2:
            assert counts.pop(eid, None) == ref.pop(eid, None)
        assert (eid in counts) == (eid in ref) and counts.get(eid, -1) == ref.get(eid, -1)
    for eid, value in ref.items():
        assert counts[eid] == value and counts.array[counts.slot(eid)] == value
    with pytest.raises(KeyError):
        counts["never"]


async def test_each_reserve_takes_the_least_loaded_of_many_engines(cp, admin, engine_client, etcd):
    from kvpush.app.simulated import SimulatedEngine
    from kvpush.contract.v1 import scheduler_pb2
    from tests.controlplane.helpers import make_tenant, reserve, settle

    # More engines than the free counts' first array holds, of different sizes.
    engines = [SimulatedEngine(engine_client, f"decode-{i:02d}", num_blocks=16 + (i % 5) * 8) for i in range(70)]
    for engine in engines:
        await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    for i in range(60):
        listed = await tenant.scheduler.ListEngines(scheduler_pb2.ListEnginesRequest(), metadata=tenant.metadata)
        best = max(listed.engines, key=lambda e: (e.free_blocks / e.num_blocks, e.engine_id))
        res = await reserve(tenant, f"r{i}", 16 * (1 + i % 3))
        assert res.engine_id == best.engine_id, (i, res.engine_id, best.engine_id)
    await tenant.close()
    for engine in engines:
        await engine.stop()
    await settle(etcd.endpoint, quiet=True)

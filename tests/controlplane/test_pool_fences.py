"""pool_fences: a view that missed a transaction on an engine (a watch event never
delivered) gives up that engine's fence and is loaded again, rather than plan on a
current fence over a stale bitmap (which etcd would let it grant from a second time)."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.app.simulated import SimulatedEngine
from kvpush.controlplane import keys
from kvpush.controlplane.etcd import EtcdClient
from kvpush.controlplane.follow import follow
from kvpush.controlplane.pool_fences import PoolFences, WatchGap
from kvpush.controlplane.view import View
from tests.controlplane.helpers import make_tenant, reserve
from tests.polling import until


def test_a_version_step_of_more_than_one_drops_the_fence():
    fences = PoolFences()
    fences.put("e", 10, 1)
    fences.put("e", 12, 2)
    fences.put("e", 13, 0)                        # its own writes: no version
    fences.put("e", 14, 0)
    fences.echo(keys.pool("e"), 13, 3)            # the copy of the older one says nothing
    fences.echo(keys.pool("e"), 14, 4)            # ... the last one's says where it stands
    fences.put("e", 15, 5)
    with pytest.raises(WatchGap, match="5 to 7"):
        fences.put("e", 20, 7)
    assert "e" not in fences
    fences.put("e", 21, 8)                        # read again: known from there
    assert fences["e"] == 21
    del fences["e"]
    fences.put("e", 30, 1)                        # deleted and made again: version 1


async def test_a_view_that_missed_a_transaction_loads_again(cp, admin, engine_client, etcd):
    engine = SimulatedEngine(engine_client, "decode-0", num_blocks=8, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, cp.address, "acme")
    client = EtcdClient(etcd.endpoint)
    view, stop = View(), asyncio.Event()
    loads, dropped = [], []
    load, apply = view.load, view.apply

    def counted_load(*args, **kw):
        loads.append(1)
        return load(*args, **kw)

    def lossy_apply(kv, deleted, revision, record=None):
        # The watch loses one transaction on the engine: a reservation and the pool key's bump.
        if lose and kv.key.startswith(keys.slot_prefix(keys.slot_of("decode-0"))):
            dropped.append(kv.key)
            if kv.key == keys.pool("decode-0"):
                lose.clear()
            return None
        return apply(kv, deleted, revision, record)
    view.load, view.apply = counted_load, lossy_apply
    lose: dict = {}
    follower = asyncio.create_task(follow(view, client, stop))
    try:
        await view.ready.wait()
        await reserve(tenant, "one", 16)
        await until(lambda: view.free_blocks("decode-0") == 7, 10, "the first grant applied")
        lose["armed"] = True
        await reserve(tenant, "two", 16)          # lost on the way to the view
        await until(lambda: not lose, 10, "the second grant lost")
        await reserve(tenant, "three", 16)        # seen: its version is two past the last
        await until(lambda: len(loads) == 2, 10, "the view loaded again")
        assert keys.pool("decode-0") in dropped and len(dropped) >= 2
        await until(lambda: view.free_blocks("decode-0") == 5 and "decode-0" in view.pool_fences, 10,
                    "the view whole again")
        assert len(view.live_reservations(engine_id="decode-0")) == 3
    finally:
        stop.set()
        await follower
        await client.close()
        await tenant.close()
        await engine.stop()

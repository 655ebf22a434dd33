"""Group commit against a real etcd: transitions of one key never share a transaction
(etcd would refuse the whole of it), each holds or fails alone, and a Reserve batch stays
within etcd's limit on one transaction's operations."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.controlplane.etcd import EtcdClient, cmp_create, op_put, op_txn
from kvpush.controlplane.group_commit import GroupCommit


@pytest.fixture
async def client(etcd):
    c = EtcdClient(etcd.endpoint)
    yield c
    await c.close()


def put_new(key: bytes) -> tuple[list, list, tuple]:
    return [cmp_create(key, 0)], [op_put(key, b"v")], (key,)


async def test_two_writes_of_one_key_go_in_separate_transactions(client):
    # etcd refuses a transaction that writes one key twice, even in two nested ones:
    with pytest.raises(Exception, match="duplicate key"):
        await client.txn([], [op_txn(*put_new(b"/t/k")[:2]), op_txn(*put_new(b"/t/k")[:2])])
    commits = GroupCommit(client)
    first, second, other = await asyncio.gather(commits.commit(*put_new(b"/t/k")), commits.commit(*put_new(b"/t/k")),
                                                commits.commit(*put_new(b"/t/other")))
    assert first[0] and not second[0] and other[0]  # the second's compare saw the first's write
    assert second[1] >= first[1]  # (had they shared one, etcd would have refused it, as above)


async def test_a_batch_spread_over_many_engines_stays_within_etcds_default_limit_on_operations():
    """etcd refuses a transaction of more than --max-txn-ops (128 by default) operations; 60
    Reserves over 40 engines are 120 puts and 40 fences: the batch is split in two."""
    from kvpush.app.etcd_server import EmbeddedEtcd
    from kvpush.app.simulated import SimulatedEngine
    from kvpush.client.control_plane import ControlPlaneClient
    from kvpush.client.reserve_stream import StreamReserver
    from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
    from kvpush.contract.v1 import scheduler_pb2
    from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
    from tests.controlplane.helpers import make_tenant, settle

    etcd = EmbeddedEtcd(unsafe_no_fsync=True, max_txn_ops=128).start()
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, admin_token=ADMIN_TOKEN,
                                            engine_token=ENGINE_TOKEN, max_batch=60))
    try:
        await plane.start()
        await plane.view.ready.wait()
        address = f"127.0.0.1:{plane.port}"
        admin, engines = ControlPlaneClient(address, ADMIN_TOKEN), ControlPlaneClient(address, ENGINE_TOKEN)
        sims = [SimulatedEngine(engines, f"decode-{i}", num_blocks=4) for i in range(40)]
        for sim in sims:
            await sim.register()
        tenant = await make_tenant(admin, address, "acme")
        reserver = StreamReserver(tenant)
        asks = [scheduler_pb2.ReserveRequest(request_id=f"w{i}", num_tokens=16, model="sim-model") for i in range(60)]
        granted = await asyncio.gather(*(reserver.reserve(a, timeout=10) for a in asks))
        assert len({r.engine_id for r in granted}) == 40  # least loaded first: every engine got some
        report = await settle(etcd.endpoint, until=lambda r: len(r.live) == 60)
        assert report.ok, report.summary()
        await reserver.close()
        for client in (tenant, admin, engines):
            await client.close()
    finally:
        await plane.stop(grace=0.1)
        etcd.stop()

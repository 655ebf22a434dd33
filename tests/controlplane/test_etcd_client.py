"""The etcd client's own behaviour that the registry relies on, against a real etcd."""

from __future__ import annotations

from kvpush.controlplane.etcd import EtcdClient, op_put


async def test_get_prefix_reads_in_pages_at_one_revision(etcd):
    """A registry larger than one gRPC message is read page by page, and every page
    comes from the same revision: writes after the first page are not mixed in."""
    client = EtcdClient(etcd.endpoint)
    try:
        await client.txn([], [op_put(b"/p/k%03d" % i, b"v%d" % i) for i in range(25)])
        await client.put(b"/q/outside", b"x")
        kvs, revision = await client.get_prefix(b"/p/", page=7)
        assert [kv.key for kv in kvs] == [b"/p/k%03d" % i for i in range(25)]
        assert [kv.value for kv in kvs] == [b"v%d" % i for i in range(25)]

        # Pin the revision, then change keys: a paged read at it still sees the old values.
        await client.put(b"/p/k000", b"changed")
        await client.put(b"/p/k024", b"changed")
        again, rev = await client.get_prefix(b"/p/", revision=revision, page=4)
        assert rev == revision and [kv.value for kv in again] == [kv.value for kv in kvs]
        latest, newer = await client.get_prefix(b"/p/", page=4)
        assert newer > revision and latest[0].value == b"changed" and latest[-1].value == b"changed"
    finally:
        await client.close()

"""A real ``kvpush sidecar`` (decode, ``--kv-events``) following an engine's KV event
stream and keeping the control plane's view of the engine's prefix cache current:
stores and removals reach a replica's view (a real ``View`` following etcd), a gap in
the stream starts the view over from what is held after it, and the engine's report
goes with the engine. The publisher is a plain ZMQ PUB socket sending the frames vLLM's
publisher sends (``(topic, seq, msgpack([ts, events, dp_rank]))``), so the test picks
the sequence numbers; vLLM's own publisher is tested in test_kv_events.py and with a
real engine in tests/engine/test_e2e_prefix_events.py."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq

from kvpush.app.etcd_server import free_port
from kvpush.controlplane.etcd import EtcdClient
from kvpush.controlplane.follow import follow
from kvpush.controlplane.view import View
from kvpush.contract.block_hash import BlockHasher
from tests.sidecar.test_kv_events import stored
from tests.sidecar.test_service_metrics import scrape
from tests.polling import until

pytestmark = pytest.mark.timeout(90)

LAYOUT = "layers=2,block=16,heads=2,dim=16,dtype=float16"
HASHER = BlockHasher(16)


class Publisher:
    def __init__(self, endpoint: str, topic: str):
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.bind(endpoint)
        self.topic = topic.encode()
        self.seq = 0

    def send(self, *events, seq: int | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        payload = msgspec.msgpack.encode([time.time(), list(events), None])
        self.sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)


def blocks(tokens, parent=None):
    return stored(tokens, parent=parent, hasher=HASHER)




async def test_the_control_planes_view_follows_the_engines_prefix_cache(stack, tmp_path):
    endpoint = f"ipc://{tmp_path}/D1.kvevents"
    pub = Publisher(endpoint, "kv")
    metrics_port = free_port()
    dec = stack.sidecar("decode", "D1", LAYOUT, 32, "m", "--kv-events", endpoint, "--kv-events-topic", "kv",
                        "--metrics-port", str(metrics_port))
    dec.ready()
    etcd = EtcdClient(stack.etcd.endpoint)
    view, stop = View(), asyncio.Event()
    follower = asyncio.create_task(follow(view, etcd, stop))
    incarnation = dec.record["incarnation"]
    try:
        await view.ready.wait()
        convo = list(range(64))  # 4 blocks of 16
        keys = HASHER.keys(convo)
        # PUB/SUB: what is sent before the sidecar's subscription arrives is lost (it joins
        # late, which is fine): send the first block until the sidecar holds it.
        with dec.client() as c:
            while c.admin("stats")["prefix_blocks_held"] == 0:
                pub.send(blocks(convo[:16]))
                await asyncio.sleep(0.05)
        pub.send(blocks(convo[16:], parent=HASHER.hashes(convo)[0]))
        await until(lambda: view.prefixes.overlap("D1", incarnation, keys, 16) == 4, 15, "stores reach the view")

        pub.send({"type": "BlockRemoved", "block_hashes": [HASHER.hashes(convo)[2]], "medium": "GPU"})
        await until(lambda: view.prefixes.overlap("D1", incarnation, keys, 16) == 2, 15, "a removal reaches it")
        assert view.prefixes.held_blocks("D1") == 3

        other = list(range(100, 132))
        pub.send(blocks(other), seq=pub.seq + 5)  # batches lost: removals may have been among them
        other_keys = HASHER.keys(other)
        await until(lambda: view.prefixes.held_blocks("D1") == 2, 15, "a gap starts the view over")
        assert view.prefixes.overlap("D1", incarnation, keys, 16) == 0
        assert view.prefixes.overlap("D1", incarnation, other_keys, 16) == 2
        with dec.client() as c:
            stats = c.admin("stats")
            service = c.admin("service")
        assert stats["prefix_events"]["gaps"] == 1 and stats["prefix_blocks_held"] == 2
        assert service["prefix_reports"]["snapshots"] >= 2 and service["prefix_reports"]["failed"] == 0, service
        # The same on its Prometheus endpoint, for dashboards and alerts.
        scraped = scrape(metrics_port)
        assert scraped[("kvpush_sidecar_prefix_blocks_held", ())] == 2
        assert scraped[("kvpush_sidecar_prefix_stream_total", (("event", "gaps"),))] == 1
        assert scraped[("kvpush_sidecar_prefix_stream_total", (("event", "batches"),))] == stats["prefix_events"]["batches"]
        assert scraped[("kvpush_sidecar_prefix_blocks_total", (("change", "stored"),))] >= 5
        assert scraped[("kvpush_sidecar_prefix_blocks_total", (("change", "removed"),))] == 1
        assert scraped[("kvpush_sidecar_prefix_checks_total", (("result", "verified"),))] >= 2
        assert scraped[("kvpush_sidecar_prefix_usable", ())] == 1
        assert scraped[("kvpush_sidecar_prefix_reports_total", (("kind", "snapshots"),))] >= 2
        # One report an interval, not one a batch: 5 batches here, a few reports.
        assert service["prefix_reports"]["snapshots"] + service["prefix_reports"]["deltas"] <= stats[
            "prefix_events"]["batches"], (service, stats)

        assert dec.terminate() == 0  # deregisters: the engine and its report go
        await until(lambda: view.prefixes.held_blocks("D1") == 0 and view.engine("D1") is None,
                    15, "the report goes with the engine")
        assert await etcd.get(b"/kvpush/v1/prefixes/D1") is None
    finally:
        stop.set()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await etcd.close()
        pub.close()

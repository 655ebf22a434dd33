"""Idle cost of a sidecar process, and the local channel's round trip from sync code."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from tests.sidecar.engines import DecodeEngine, PrefillEngine, wait_state
from kvpush.connector.sidecar_client import measure_rtt

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"


def cpu_share(pids, seconds: float) -> dict[int, float]:
    procs = {pid: psutil.Process(pid) for pid in pids}
    before = {pid: sum(p.cpu_times()[:2]) for pid, p in procs.items()}
    time.sleep(seconds)
    return {pid: (sum(p.cpu_times()[:2]) - before[pid]) / seconds for pid, p in procs.items()}


def test_idle_sidecars_use_at_most_two_percent_of_a_core(sidecars):
    dec = sidecars.launch("decode", "D1", LAYOUT, 64)
    pre = sidecars.launch("prefill", "P1", LAYOUT, 256)
    dec.ready(), pre.ready()
    prefill, decode = PrefillEngine(pre.client()), DecodeEngine(dec.client())
    try:
        # Work first (connections up, a push landed), then nothing.
        prefill.client.admin("add_peer", record=dec.record)
        ids = prefill.cache_blocks_for(64)
        decode.client.subscribe("res-1")
        alloc = prefill.begin("r1", "res-1", dec.record, [0, 1, 2, 3], 64)
        prefill.push_all("r1", alloc, 16, 64, ids)
        assert wait_state(decode.client, "res-1").state == "LANDED"
        time.sleep(0.3)  # past the warm window
        shares = cpu_share([dec.pid, pre.pid], 3.0)
        print(f"\nidle CPU: decode sidecar {shares[dec.pid] * 100:.2f}% of a core, "
              f"prefill sidecar {shares[pre.pid] * 100:.2f}%")
        assert shares[dec.pid] <= 0.02 and shares[pre.pid] <= 0.02, shares
    finally:
        prefill.close(), decode.close()


def test_channel_round_trip_from_a_sync_client(sidecars):
    dec = sidecars.launch("decode", "D1", LAYOUT, 64).ready()
    with dec.client() as client:
        stats = measure_rtt(client, samples=1000)
        print(f"\nchannel round trip: p50 {stats.p50_us:.0f} us, p99 {stats.p99_us:.0f} us, "
              f"max {stats.max_us:.0f} us; fire-and-forget send {stats.send_only_us:.1f} us")
        assert stats.p50_us < 2000 and stats.p99_us < 100_000  # bounds for a shared 2-core box
        # Usable from several threads of a sync program at once (calls are matched by seq).
        errors = []

        def worker(n):
            try:
                for i in range(100):
                    assert client.query(f"t{n}-{i}").state in ("UNKNOWN", "EXPECTED")
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        [t.start() for t in threads]
        [t.join(10) for t in threads]
        assert not errors


def test_fire_and_forget_never_waits_on_the_sidecar(sidecars):
    """Push frames go into the socket buffer: a stopped sidecar does not block the caller."""
    pre = sidecars.launch("prefill", "P1", LAYOUT, 256).ready()
    client = pre.client()
    try:
        client.ping()
        pre.proc.send_signal(19)  # SIGSTOP: the sidecar reads nothing from now on
        t0 = time.perf_counter()
        for i in range(500):
            client.push("nobody", i % 4, 0, 16)
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.5, f"500 fire-and-forget frames took {elapsed:.3f} s"
        pre.proc.send_signal(18)  # SIGCONT: the backlog drains, in order, before the ping
        client.ping()
    finally:
        pre.proc.send_signal(18)
        client.close()

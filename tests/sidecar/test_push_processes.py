"""Two real sidecar processes, two real NIXL agents, real bytes through shared memory."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.sidecar.engines import SENTINEL, DecodeEngine, PrefillEngine, wait_state
from kvpush.connector.sidecar_client import ChannelError

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block={bs},heads=2,dim=16,dtype=float16"


def start_pair(sidecars, p_block=16, d_block=16, d_blocks=64, p_units=256, p_extra=(), d_layout=None):
    dec = sidecars.launch("decode", "D1", d_layout or LAYOUT.format(bs=d_block), d_blocks)
    pre = sidecars.launch("prefill", "P1", LAYOUT.format(bs=p_block), p_units, *p_extra)
    dec.ready(), pre.ready()
    prefill = PrefillEngine(pre.client())
    decode = DecodeEngine(dec.client())
    prefill.client.admin("add_peer", record=dec.record)
    return dec, pre, prefill, decode


def test_multilayer_push_lands_exactly_in_reserved_blocks(sidecars):
    dec, pre, prefill, decode = start_pair(sidecars)
    try:
        decode.fill_sentinel()
        d_bs = decode.layout.block_size
        # Three requests: contiguous blocks, scattered blocks, chunked prefill with a partial last block.
        cases = [("r1", "res-1", [8, 9, 10, 11], 64, 1),
                 ("r2", "res-2", [40, 3, 17, 18, 19, 62], 90, 1),
                 ("r3", "res-3", [20, 21, 22, 30, 31], 77, 3)]
        pushes = []
        for request_id, res, block_ids, tokens, chunks in cases:
            decode.client.subscribe(res)
            cache_ids = prefill.cache_blocks_for(tokens)
            alloc = prefill.begin(request_id, res, dec.record, block_ids, tokens)
            prefill.push_all(request_id, alloc, d_bs, tokens, cache_ids, chunks=chunks)
            assert wait_state(decode.client, res).state == "LANDED"
            assert wait_state(prefill.client, res).state == "PUSHED"
            pushes.append((block_ids, lambda layer, ids=cache_ids, t=tokens: prefill.tokens(ids, layer, t), tokens))
        # Every reserved token slot holds exactly the prefill's bytes; every other byte is untouched.
        expected = decode.expected_image(pushes)
        assert np.array_equal(decode.mem, expected)
        stats = prefill.client.admin("stats")
        assert stats["peer_loads"] == 1, "remote metadata must be loaded once, not per request"
        assert stats["staging_free_units"] == stats["staging_units"] and stats["staging_allocations"] == 0
        # Contiguous whole blocks = one descriptor per layer.
        assert stats["pushed"] == 3
    finally:
        prefill.close(), decode.close()


def test_large_final_writes_are_announced_and_land_exactly(sidecars):
    # 8 MiB per layer: once the pusher has measured its write rate, the final write
    # is long enough to be announced (FINAL notice) and the decode side polls fine.
    layout = "layers=2,block=16,heads=8,dim=128,dtype=float16"
    dec = sidecars.launch("decode", "D1", layout, 300)
    pre = sidecars.launch("prefill", "P1", layout, 300)
    dec.ready(), pre.ready()
    prefill, decode = PrefillEngine(pre.client(), cache_blocks=128), DecodeEngine(dec.client())
    prefill.client.admin("add_peer", record=dec.record)
    try:
        decode.fill_sentinel()
        tokens, pushes = 2048, []
        for n, first in enumerate((0, 150)):
            res, block_ids = f"res-{n}", list(range(first, first + tokens // 16))
            decode.client.subscribe(res)
            cache_ids = prefill.cache_blocks_for(tokens)
            alloc = prefill.begin(f"r{n}", res, dec.record, block_ids, tokens)
            prefill.push_all(f"r{n}", alloc, 16, tokens, cache_ids)
            assert wait_state(decode.client, res).state == "LANDED"
            assert wait_state(prefill.client, res).state == "PUSHED"
            pushes.append((block_ids, lambda layer, ids=cache_ids: prefill.tokens(ids, layer, tokens), tokens))
        assert np.array_equal(decode.mem, decode.expected_image(pushes))
        # The first request measured the rate; the second's final write was announced.
        assert decode.client.admin("stats")["final_notices"] >= 1
    finally:
        prefill.close(), decode.close()


@pytest.mark.parametrize("p_block,d_block", [(16, 32), (32, 16)])
def test_reblocking_is_byte_exact_both_ways(sidecars, p_block, d_block):
    dec, pre, prefill, decode = start_pair(sidecars, p_block=p_block, d_block=d_block, d_blocks=32)
    try:
        decode.fill_sentinel()
        tokens = 150  # not a multiple of either block size
        block_ids = [int(b) for b in np.random.default_rng(1).permutation(32)[:-(-tokens // d_block)]]
        cache_ids = prefill.cache_blocks_for(tokens)
        decode.client.subscribe("res-rb")
        alloc = prefill.begin("rb", "res-rb", dec.record, block_ids, tokens)
        prefill.push_all("rb", alloc, d_block, tokens, cache_ids, chunks=2)
        assert wait_state(decode.client, "res-rb").state == "LANDED"
        for layer in range(decode.layout.num_layers):
            got = decode.read_tokens(block_ids, layer, tokens)
            assert np.array_equal(got, prefill.tokens(cache_ids, layer, tokens)), f"layer {layer}"
        expected = decode.expected_image([(block_ids, lambda l: prefill.tokens(cache_ids, l, tokens), tokens)])
        assert np.array_equal(decode.mem, expected)
    finally:
        prefill.close(), decode.close()


def test_layout_mismatch_is_refused_and_nothing_written(sidecars):
    dec, pre, prefill, decode = start_pair(sidecars, d_layout="layers=4,block=16,heads=4,dim=16,dtype=float16")
    try:
        decode.fill_sentinel()
        with pytest.raises(ChannelError, match="num_kv_heads differs"):
            prefill.begin("bad", "res-bad", dec.record, [0, 1], 20)
        # Refused (the outcome callback reports it FAILED), no staging held, nothing written.
        prefill.client.push("bad", 0)  # a push for the refused request is ignored
        prefill.client.ping()
        stats = prefill.client.admin("stats")
        assert stats["refused"] == 1 and stats["staging_allocations"] == 0 and "transfers" not in stats
        time.sleep(0.2)
        assert decode.client.query("res-bad").state in ("UNKNOWN", "EXPECTED")
        assert np.all(decode.mem == SENTINEL)
    finally:
        prefill.close(), decode.close()


def test_push_to_killed_decode_fails_fast_and_frees_staging(sidecars):
    dec, pre, prefill, decode = start_pair(sidecars)
    decode.close()
    d_bs = 16
    # A first request connects the agents.
    ids = prefill.cache_blocks_for(32)
    alloc = prefill.begin("ok", "res-ok", dec.record, [0, 1], 32)
    prefill.push_all("ok", alloc, d_bs, 32, ids)
    assert wait_state(prefill.client, "res-ok").state == "PUSHED"
    dec.kill()
    t0 = time.monotonic()
    alloc = prefill.begin("dead", "res-dead", dec.record, [2, 3], 32)
    prefill.push_all("dead", alloc, d_bs, 32, ids)
    event = wait_state(prefill.client, "res-dead", 5)
    elapsed = time.monotonic() - t0
    assert event.state == "FAILED", event
    assert elapsed < 2.5, f"failure took {elapsed:.2f} s"
    stats = prefill.client.admin("stats")
    assert stats["staging_allocations"] == 0 and stats["staging_free_units"] == stats["staging_units"]
    # The peer is now known dead: the next request is refused at once, nothing staged.
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="gone|disconnect|DISCONNECT"):
        prefill.begin("after", "res-after", dec.record, [4, 5], 32)
    assert time.monotonic() - t0 < 0.5
    prefill.close()
    print(f"\npush to a killed decode process failed after {elapsed * 1e3:.1f} ms: {event.reason}")


def test_killing_prefill_mid_push_never_lands(sidecars):
    big = "layers=8,block=16,heads=8,dim=128,dtype=float16"  # 64 KiB per block-layer
    dec = sidecars.launch("decode", "D1", big, 256)
    pre = sidecars.launch("prefill", "P1", big, 512)
    dec.ready(), pre.ready()
    decode = DecodeEngine(dec.client())
    prefill = PrefillEngine(pre.client(), cache_blocks=128)
    try:
        prefill.client.admin("add_peer", record=dec.record)
        tokens = 2000  # 125 blocks: 8 MiB per layer
        ids = prefill.cache_blocks_for(tokens)
        decode.client.subscribe("res-kill")
        alloc = prefill.begin("k", "res-kill", dec.record, list(range(100, 225)), tokens)
        for layer in range(prefill.layout.num_layers - 1):  # every layer but the last
            prefill.stage(alloc, 16, tokens, ids, layer)
            prefill.client.push("k", layer)
        pre.kill()  # while those writes are in flight
        time.sleep(1.0)
        state = decode.client.query("res-kill").state
        assert state in ("PUSHING", "EXPECTED"), state
        assert not decode.client.events(), "no LANDED (or any end) may be reported"
    finally:
        prefill.staging.close()
        decode.close()


def test_cancelled_reservation_stops_pending_pushes(sidecars):
    dec, pre, prefill, decode = start_pair(sidecars)
    try:
        decode.fill_sentinel()
        ids = prefill.cache_blocks_for(64)
        decode.client.subscribe("res-c")
        alloc = prefill.begin("c", "res-c", dec.record, [4, 5, 6, 7], 64)
        for layer in range(2):
            prefill.stage(alloc, 16, 64, ids, layer)
            prefill.client.push("c", layer)
        assert prefill.client.admin("cancel", reservation_id="res-c", reason="deadline")["cancelled"]
        assert wait_state(prefill.client, "res-c").state == "CANCELLED"
        for layer in range(2, prefill.layout.num_layers):  # late pushes are dropped
            prefill.client.push("c", layer)
        event = wait_state(decode.client, "res-c", 5)
        assert event.state == "FAILED" and "deadline" in event.reason
        # Staging is freed once NIXL lets go of the writes that were in flight when the
        # cancel came (push.py: a zombie write must never send a later request's bytes),
        # which may be a moment after the decode side heard of it.
        deadline = time.monotonic() + 5
        while (stats := prefill.client.admin("stats"))["staging_allocations"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stats["staging_allocations"] == 0 and stats.get("cancelled") == 1
        # Layers 2 and 3 were never written.
        for layer in range(2, decode.layout.num_layers):
            assert np.all(decode.layer(layer)[4:8] == SENTINEL)
    finally:
        prefill.close(), decode.close()


def test_engine_disconnect_mid_request_frees_staging_and_never_lands(sidecars):
    dec, pre, prefill, decode = start_pair(sidecars)
    try:
        ids = prefill.cache_blocks_for(64)
        decode.client.subscribe("res-d")
        alloc = prefill.begin("d", "res-d", dec.record, [0, 1, 2, 3], 64)
        prefill.stage(alloc, 16, 64, ids, 0)
        prefill.client.push("d", 0)
        prefill.client.close()  # the engine process went away
        prefill.client = pre.client()
        deadline = time.monotonic() + 5
        while prefill.client.admin("stats")["staging_allocations"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert wait_state(decode.client, "res-d", 5).state == "FAILED"
    finally:
        prefill.close(), decode.close()


def test_checksum_mode_verifies_and_catches_corruption(sidecars):
    dec, pre, prefill, decode = start_pair(sidecars, p_extra=("--checksums",))
    try:
        ids = prefill.cache_blocks_for(40)
        for res, corrupt in (("res-good", False), ("res-bad", True)):
            decode.client.subscribe(res)
            alloc = prefill.begin(res, res, dec.record, [10, 11, 12], 40)
            for layer in range(prefill.layout.num_layers):
                prefill.stage(alloc, 16, 40, ids, layer)
                prefill.client.push(res, layer)
                if corrupt and layer == 0:
                    prefill.client.ping()  # layer 0 is written; change the staging copy behind it
                    time.sleep(0.1)
                    off = alloc.extent_offset(alloc.extents[0], 0)
                    prefill.staging.host_view()[off + 5] ^= 0xFF
            event = wait_state(decode.client, res)
            if corrupt:
                assert event.state == "FAILED" and "checksum mismatch in landing blocks [10]" in event.reason
            else:
                assert event.state == "LANDED"
        assert decode.client.admin("stats").get("verified") == 1
    finally:
        prefill.close(), decode.close()


def test_staging_full_is_refused_at_once(sidecars):
    dec, pre, prefill, decode = start_pair(sidecars, p_units=8)
    try:
        t0 = time.monotonic()
        with pytest.raises(ChannelError, match="staging pool cannot hold"):
            prefill.begin("huge", "res-huge", dec.record, list(range(20)), 20 * 16)
        assert time.monotonic() - t0 < 0.5
        stats = prefill.client.admin("stats")
        assert stats["refused"] == 1 and stats["staging_allocations"] == 0
    finally:
        prefill.close(), decode.close()


@pytest.mark.parametrize("delay_s", [0.0, 0.01, 0.03, 0.3])
def test_prefill_killed_at_any_moment_lands_only_complete_data(sidecars, delay_s):
    """Every layer is pushed and the prefill sidecar is SIGKILLed after ``delay_s``: whatever
    the moment, the decode side either never reports LANDED or has every byte."""
    big = "layers=8,block=16,heads=8,dim=128,dtype=float16"
    dec = sidecars.launch("decode", "D1", big, 160)
    pre = sidecars.launch("prefill", "P1", big, 160)
    dec.ready(), pre.ready()
    decode = DecodeEngine(dec.client())
    prefill = PrefillEngine(pre.client(), cache_blocks=128)
    try:
        decode.fill_sentinel()
        prefill.client.admin("add_peer", record=dec.record)
        tokens, block_ids = 2000, list(range(20, 145))
        ids = prefill.cache_blocks_for(tokens)
        decode.client.subscribe("res-any")
        alloc = prefill.begin("a", "res-any", dec.record, block_ids, tokens)
        for layer in range(prefill.layout.num_layers):
            prefill.stage(alloc, 16, tokens, ids, layer)
        for layer in range(prefill.layout.num_layers):
            prefill.client.push("a", layer)
        time.sleep(delay_s)
        pre.kill()
        time.sleep(0.5)
        state = decode.client.query("res-any").state
        if state == "LANDED":
            expected = decode.expected_image([(block_ids, lambda l: prefill.tokens(ids, l, tokens), tokens)])
            assert np.array_equal(decode.mem, expected)
        else:
            assert state in ("PUSHING", "EXPECTED"), state
        print(f"\nkilled {delay_s * 1e3:.0f} ms after the last push frame: decode says {state}")
    finally:
        prefill.staging.close()
        decode.close()

"""The decode sidecar's view of its engine's prefix cache, from vLLM's KV events:
unit rules of ``HeldBlocks`` and the follower against vLLM's own ZMQ publisher."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpush.contract.block_hash import BlockHasher
from kvpush.sidecar.kv_events import HeldBlocks, KvEventFollower

HASHER = BlockHasher(4)


def stored(tokens, parent=None, hasher=HASHER, as_int=False):
    hashes, p = [], parent
    for i in range(0, len(tokens), hasher.block_size):
        p = hasher.chain(p, tokens[i:i + hasher.block_size])
        hashes.append(p)
    if as_int:
        hashes = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": list(tokens),
            "block_size": hasher.block_size, "medium": "GPU"}


def test_stored_blocks_are_held_and_overlap_stops_at_the_first_missing_block():
    held = HeldBlocks(HASHER)
    tokens = list(range(16))
    keys = HASHER.keys(tokens)
    held.apply(0, [stored(tokens[:8])])
    assert held.overlap(keys) == 2 and len(held) == 2
    parent = HASHER.hashes(tokens[:8])[-1]
    change = held.apply(1, [stored(tokens[8:], parent=parent)])
    assert held.overlap(keys) == 4 and change.stored == tuple(keys[2:])
    change = held.apply(2, [{"type": "BlockRemoved", "block_hashes": [HASHER.hashes(tokens)[1]], "medium": "GPU"}])
    assert change.removed == (keys[1],) and held.overlap(keys) == 1  # a hole ends the prefix, as in vLLM
    assert held.counters["verified"] == 2


def test_a_gap_in_the_sequence_forgets_everything_and_all_blocks_cleared_too():
    held = HeldBlocks(HASHER)
    held.apply(5, [stored(list(range(8)))])  # joining late is fine
    assert len(held) == 2
    change = held.apply(7, [stored(list(range(100, 104)))])  # batch 6 lost: its removals may be
    assert change.cleared and len(held) == 1 and held.counters["gaps"] == 1
    change = held.apply(8, [{"type": "AllBlocksCleared"}])
    assert change.cleared and len(held) == 0


def test_an_engine_hashing_otherwise_is_refused_once_and_holds_nothing():
    held = HeldBlocks(HASHER)
    other = BlockHasher(4, seed="another-seed")
    held.apply(0, [stored(list(range(8)), hasher=other)])
    assert held.unusable and "seed" in held.unusable and len(held) == 0
    held.apply(1, [stored(list(range(8)))])
    assert len(held) == 0  # stays off: its keys could never match a router's


def test_a_salted_block_is_checked_with_its_salt_and_other_extra_keys_are_held_unchecked():
    held = HeldBlocks(HASHER)
    tokens = list(range(8))
    salted = stored(tokens)  # the engine's hashes of a request with cache_salt="tenant-a"
    salted["block_hashes"] = HASHER.hashes(tokens, cache_salt="tenant-a")
    salted["extra_keys"] = [("tenant-a",), None]  # as vLLM publishes them: untagged, per block
    held.apply(0, [salted])
    assert not held.unusable and held.counters["verified"] == 1
    assert held.overlap(HASHER.keys(tokens, cache_salt="tenant-a")) == 2 and held.overlap(HASHER.keys(tokens)) == 0
    # a LoRA's, a multimodal and a prompt-embeds first block: kvpush cannot rebuild their
    # hashes (a LoRA's covers its adapter path), so they are held as the engine names them
    # and never counted against it: no client's request switches prefix-aware routing off
    others = [({"lora_name": "adapter"}, ("adapter",)), ({"lora_id": 3}, ("adapter",)), ({}, (("img-hash", 0),)),
              ({}, (b"embeds-digest",))]
    for seq, (fields, extra) in enumerate(others, start=1):
        event = stored(list(range(100 * seq, 100 * seq + 4)))
        event["block_hashes"] = [bytes([seq]) * 32]  # whatever the engine hashed
        event.update(fields, extra_keys=[extra])
        held.apply(seq, [event])
    assert not held.unusable and held.counters["unchecked"] == 4 and len(held) == 6
    wrong = stored(list(range(200, 204)))
    wrong["block_hashes"] = [b"\x01" * 32]  # a plain block hashed otherwise still turns it off
    held.apply(5, [wrong])
    assert held.unusable and len(held) == 0


def test_integer_hashes_map_to_the_same_keys_and_other_media_are_ignored():
    held = HeldBlocks(HASHER)
    tokens = list(range(8))
    held.apply(0, [stored(tokens, as_int=True)])
    assert held.overlap(HASHER.keys(tokens)) == 2
    offload = dict(stored(list(range(50, 54))), medium="CPU")
    held.apply(1, [offload])
    assert len(held) == 2 and held.counters["ignored"] == 1


def test_a_bounded_set_drops_the_oldest_first():
    held = HeldBlocks(HASHER, max_blocks=3)
    tokens = list(range(20))
    change = held.apply(0, [stored(tokens)])
    keys = HASHER.keys(tokens)
    assert len(held) == 3 and change.removed == tuple(keys[:2])


def test_the_follower_tracks_vllms_own_publisher(tmp_path):
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="vLLM's publisher is the reference")

    async def main():
        endpoint = f"ipc://{tmp_path}/kv-events"
        pub = kv_events.ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
        changes = []
        follower = KvEventFollower(endpoint, HeldBlocks(HASHER), topic="kv", on_change=changes.append)
        follower.start()
        try:
            tokens = list(range(12))
            keys = HASHER.keys(tokens)
            deadline = time.monotonic() + 10
            while follower.held.overlap(keys) < 3:  # PUB/SUB: batches before the join are missed; publish again
                assert time.monotonic() < deadline, follower.held.counters
                ev = stored(tokens)
                pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[kv_events.BlockStored(
                    block_hashes=ev["block_hashes"], parent_block_hash=None, token_ids=tokens, block_size=4,
                    lora_id=None, medium="GPU", lora_name=None)]))
                await asyncio.sleep(0.05)
            pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[kv_events.BlockRemoved(
                block_hashes=[HASHER.hashes(tokens)[2]], medium="GPU")]))
            while follower.held.overlap(keys) != 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert changes[-1].removed == (keys[2],) and follower.held.counters["gaps"] == 0
        finally:
            await follower.stop()
            pub.shutdown()

    asyncio.run(main())

"""The head plan between tensor-parallel ranks (``kvpush/channel/head_plan.py``), checked byte by
byte for every pairing of prefill and decode TP up to 8: a model's KV is split over the
prefill ranks the way vLLM splits it, each share is staged from its source rank's heads,
written by the plan's ranges (in chunks, as layer-wise pushes do) into the destination
rank's landing bytes, and read back through ``unshare``. Every byte of every decode rank
must arrive exactly once and equal that rank's slice of the model's KV."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from kvpush.channel.head_plan import plan_heads
from kvpush.contract.layout import KvLayout, LayoutError

WIDTH = 2  # bytes of one head's K (or V) per token: small, every byte still distinct
HEADS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 48, 840)  # 840: every TP of 1..8 splits it evenly
TPS = range(1, 9)


def valid(heads: int, tp: int) -> bool:
    return heads % tp == 0 or tp % heads == 0


PAIRINGS = [(h, p, d) for h, p, d in itertools.product(HEADS, TPS, TPS) if valid(h, p) and valid(h, d)]


def layout(heads: int, tp: int, block: int = 8, parts: int = 2) -> KvLayout:
    return KvLayout(num_layers=1, block_size=block, num_kv_heads=heads, head_dim=WIDTH, dtype="uint8",
                    kv_parts=parts, tp_size=tp)


def blocks_image(tokens: np.ndarray, block: int) -> np.ndarray:
    """Tokens ``(parts, T, heads, width)`` as blocks ``(blocks, parts, block, heads, width)``,
    written token by token (the plainest statement of token t's place), zero past T."""
    parts, n, heads, width = tokens.shape
    out = np.zeros((-(-n // block), parts, block, heads, width), dtype=tokens.dtype)
    for t in range(n):
        out[t // block, :, t % block] = tokens[:, t]
    return out


def push(plan, model_kv: np.ndarray, chunks) -> tuple[dict, dict]:
    """Play every prefill rank: stage each of its shares, write it in ``chunks`` of tokens.
    Returns each decode rank's landing bytes and how many times each byte was written."""
    src, dst = plan.src, plan.dst
    n = model_kv.shape[1]
    landed, writes = {}, {}
    for d in range(dst.tp_size):
        size = plan.geometry(plan.into_rank(d)[0], n).layer_bytes // plan.into_rank(d)[0].num_heads \
            * dst.local_kv_heads
        landed[d], writes[d] = np.zeros(size, np.uint8), np.zeros(size, np.int32)
    for p in range(src.tp_size):
        rank_kv = model_kv[:, :, list(src.rank_heads(p))]  # what prefill rank p's cache holds
        for share in plan.from_rank(p):
            assert set(share.heads) <= set(src.rank_heads(p)), "a rank sends only heads it holds"
            mine = rank_kv[:, :, share.src_offset:share.src_offset + share.num_heads]
            image = blocks_image(mine, dst.block_size).reshape(-1)
            assert image.size == plan.geometry(share, n).layer_bytes
            for a, b in chunks:
                s_ranges, d_ranges = plan.write_ranges(share, a, b, n)
                for (s0, s1), (d0, d1) in zip(s_ranges, d_ranges, strict=True):
                    assert s1 - s0 == d1 - d0 > 0
                    landed[share.dst_rank][d0:d1] = image[s0:s1]
                    writes[share.dst_rank][d0:d1] += 1
    return landed, writes


@pytest.mark.parametrize("block", [8, 16])
def test_every_pairing_up_to_tp8_lands_each_byte_once_on_the_right_rank(block):
    rng = np.random.default_rng(7)
    n = 37  # not a multiple of either block size: a partial last block
    chunks = [(0, 5), (5, 19), (19, n)]  # chunked prefill: some cut blocks, some not
    for heads, p_tp, d_tp in PAIRINGS:
        src, dst = layout(heads, p_tp, block=4), layout(heads, d_tp, block=block)
        plan = plan_heads(src, dst)
        model_kv = rng.integers(0, 256, size=(2, n, heads, WIDTH), dtype=np.uint8)
        landed, writes = push(plan, model_kv, chunks)
        for d in range(d_tp):
            want = model_kv[:, :, list(dst.rank_heads(d))]
            got = plan.unshare(d, landed[d], n)
            tokens = got.transpose(1, 0, 2, 3, 4).reshape(2, -1, dst.local_kv_heads, WIDTH)[:, :n]
            case = f"heads={heads} P tp={p_tp} D tp={d_tp} decode rank {d}"
            np.testing.assert_array_equal(tokens, want, err_msg=case)
            assert writes[d].max() == 1, f"{case}: a byte written twice"
            assert writes[d].sum() == want.size, f"{case}: bytes of the request left unwritten"
            covered = [h for s in plan.into_rank(d) for h in s.heads]
            assert covered == list(dst.rank_heads(d)), case
            assert [s.slot for s in plan.into_rank(d)] == list(range(len(plan.into_rank(d)))), case


def test_the_pairings_cover_splits_merges_uneven_ratios_and_replicated_heads():
    # The exhaustive test above is only as good as what PAIRINGS holds.
    assert (8, 1, 2) in PAIRINGS and (8, 2, 1) in PAIRINGS and (8, 8, 8) in PAIRINGS
    assert (12, 3, 2) in PAIRINGS  # a prefill rank split over two decode ranks, unevenly
    assert (2, 8, 1) in PAIRINGS and (2, 1, 8) in PAIRINGS  # fewer heads than ranks, both ways
    for p_tp, d_tp in itertools.product(TPS, TPS):  # every pairing, with more than one head
        assert any((h, p_tp, d_tp) in PAIRINGS for h in HEADS if h > 1), (p_tp, d_tp)


def test_equal_tp_and_splits_write_whole_blocks_as_one_range_per_share():
    n = 64  # whole blocks of 16
    for p_tp, d_tp in [(1, 1), (2, 2), (8, 8), (1, 2), (1, 8), (2, 8), (4, 1), (8, 2)]:
        plan = plan_heads(layout(8, p_tp, block=16), layout(8, d_tp, block=16))
        for share in plan.shares:
            s_ranges, d_ranges = plan.write_ranges(share, 0, n, n)
            assert len(s_ranges) == len(d_ranges) == 1, (p_tp, d_tp, share)
        # A merge (P TP > D TP) lays shares one after another: not in place.
        assert plan.in_place(0) == (p_tp <= d_tp)


def test_replicated_heads_are_sent_once_per_decode_rank_spread_over_their_holders():
    # GQA with 2 KV heads on 8 prefill ranks: each head lives on 4 of them.
    plan = plan_heads(layout(2, 8), layout(2, 2))
    assert [(s.dst_rank, s.src_rank, s.first_head) for s in plan.shares] == [(0, 0, 0), (1, 5, 1)]
    # An MLA latent: one "head", one cache part, on every rank of both engines.
    mla = plan_heads(layout(1, 2, parts=1), layout(1, 4, parts=1))
    assert [s.src_rank for s in mla.shares] == [0, 1, 0, 1]
    assert all(s.num_heads == 1 and mla.in_place(s.dst_rank) for s in mla.shares)


def test_a_plan_is_computed_once_per_pair_of_head_splits():
    a, b = layout(8, 2), layout(8, 4)
    assert plan_heads(a, b).shares is plan_heads(layout(8, 2, block=16), layout(8, 4)).shares


@pytest.mark.parametrize("field, other, message", [
    ("heads", dict(num_kv_heads=4), "num_kv_heads differs: 8 here, 4 on the peer"),
    ("dim", dict(head_dim=4), "head_dim differs"),
    ("dtype", dict(dtype="float16"), "dtype differs"),
    ("parts", dict(kv_parts=1), "kv_parts differs"),
])
def test_unmappable_pairs_are_refused_naming_both_layouts(field, other, message):
    import dataclasses
    src = layout(8, 2)
    dst = dataclasses.replace(layout(8, 4), **other)
    why = src.feed_error(dst)
    assert message in why and src.describe() in why and dst.describe() in why, why
    with pytest.raises(LayoutError, match=message):
        plan_heads(src, dst)
    assert src.feed_error(layout(8, 1, block=32)) is None  # TP and block size may differ


@pytest.mark.parametrize("heads, tp", [(6, 4), (3, 2), (8, 3), (12, 8)])
def test_a_tp_size_that_cannot_split_the_heads_is_a_layout_error(heads, tp):
    with pytest.raises(LayoutError, match=f"tp_size={tp} cannot split num_kv_heads={heads}"):
        layout(heads, tp)


def test_rank_heads_follow_vllm_and_byte_sizes_are_one_ranks():
    lo = layout(8, 4)
    assert [list(lo.rank_heads(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lo.token_part_bytes == 2 * WIDTH and lo.rank_layout() == layout(2, 1)
    rep = layout(2, 8)
    assert [rep.rank_heads(r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert rep.local_kv_heads == 1 and rep.replicated
    with pytest.raises(LayoutError, match="rank 4 outside tp_size=4"):
        lo.rank_heads(4)
    assert KvLayout.parse(lo.describe()) == lo
    assert KvLayout.from_proto(lo.to_proto()) == lo


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (4, 2), (3, 2)])
def test_merged_shares_are_put_in_place_in_a_landing_pool_on_the_host_and_as_a_tensor(p_tp, d_tp):
    # The decode rank's rearrangement before its load (engine/reblock.unshare_landing), on
    # host memory and on a torch tensor (what a device landing pool is: here on the CPU).
    import torch

    from kvpush.channel import reblock
    from kvpush.channel.pool import PoolDescription
    heads, n, units = 12, 37, 16
    dst = KvLayout(num_layers=2, block_size=8, num_kv_heads=heads, head_dim=WIDTH, dtype="uint8", tp_size=d_tp)
    plan = plan_heads(dataclasses.replace(dst, tp_size=p_tp, block_size=4), dst)
    rng = np.random.default_rng(p_tp)
    model_kv = [rng.integers(0, 256, size=(2, n, heads, WIDTH), dtype=np.uint8) for _ in range(dst.num_layers)]
    block_ids = [9, 3, 4, 12, 0]  # 37 tokens: 5 blocks of 8, scattered
    desc = PoolDescription("landing", "DRAM", "", dst.pool_bytes(units), units, dst.block_layer_bytes, dst)
    for d in range(d_tp):
        pool = np.zeros(dst.pool_bytes(units), np.uint8)
        stride = units * dst.block_layer_bytes
        for layer in range(dst.num_layers):  # what the prefill ranks' writes leave in the blocks
            landed, _ = push(dataclasses.replace(plan, src=dataclasses.replace(plan.src, num_layers=1),
                                                 dst=dataclasses.replace(dst, num_layers=1)),
                             model_kv[layer], [(0, n)])
            view = pool[layer * stride:(layer + 1) * stride].reshape(units, -1)
            view[block_ids] = landed[d].reshape(len(block_ids), -1)
        as_tensor = torch.from_numpy(pool.copy())
        reblock.unshare_landing(pool, desc, plan, d, block_ids, n)
        reblock.unshare_landing(as_tensor, desc, plan, d, block_ids, n)
        assert np.array_equal(as_tensor.numpy(), pool)
        for layer in range(dst.num_layers):
            view = pool[layer * stride:(layer + 1) * stride].reshape(units, 2, 8, dst.local_kv_heads, WIDTH)
            got = reblock.gather_tokens(view, block_ids, 0, n)
            np.testing.assert_array_equal(got, model_kv[layer][:, :, list(dst.rank_heads(d))])

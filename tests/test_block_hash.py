"""Block hashes computed from token ids equal vLLM's own (the installed vLLM is the reference)."""

from __future__ import annotations

import random
import types

import pytest

from kvpush.contract.block_hash import BlockHasher, BlockHashError, block_key

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils", reason="vLLM is the reference for block hashes")
hashing = pytest.importorskip("vllm.utils.hashing")


def vllm_hashes(fn, tokens, block_size):
    kv_cache_utils.init_none_hash(fn)
    parent, out = None, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[start:start + block_size], None)
        out.append(bytes(parent))
    return out


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("n, block_size", [(0, 16), (15, 16), (16, 16), (100, 32), (257, 32)])
def test_hashes_equal_vllms_for_full_blocks(monkeypatch, algorithm, n, block_size):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = [random.Random(n).randrange(50_000) for _ in range(n)]
    want = vllm_hashes(getattr(hashing, algorithm), tokens, block_size)
    got = BlockHasher(block_size, algorithm).hashes(tokens)
    assert got == want and len(got) == n // block_size


def test_the_seed_is_the_engines_pythonhashseed_when_set(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    tokens = list(range(64))
    want = vllm_hashes(hashing.sha256, tokens, 32)
    assert BlockHasher(32, "sha256", seed="1234").hashes(tokens) == want
    assert BlockHasher(32, "sha256").hashes(tokens) != want


def test_keys_are_what_vllm_publishes_as_int_hashes(monkeypatch):
    monkeypatch.setattr(kv_cache_utils.envs, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", True, raising=False)
    tokens = list(range(96))
    hasher = BlockHasher(32)
    for h, key in zip(hasher.hashes(tokens), hasher.keys(tokens)):
        assert kv_cache_utils.maybe_convert_block_hash(h) == key == block_key(h) == block_key(key)


def test_a_prefix_shares_its_leading_keys_and_a_change_breaks_the_chain():
    hasher = BlockHasher(16)
    a = list(range(64))
    b = a[:40] + [7] * 24
    ka, kb = hasher.keys(a), hasher.keys(b)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]  # block 3 differs though its tokens may not


@pytest.mark.parametrize("algorithm, block_size", [("xxhash", 16), ("md5", 16), ("sha256", 0)])
def test_settings_kvpush_cannot_reproduce_are_refused(algorithm, block_size):
    with pytest.raises(BlockHashError):
        BlockHasher(block_size, algorithm)


def salted_request(salt):
    """What vLLM's extra-key generator reads of a plain text request with a cache_salt."""
    return types.SimpleNamespace(mm_features=[], lora_request=None, cache_salt=salt, prompt_embeds=None)


def vllm_salted_hashes(fn, tokens, block_size, salt):
    kv_cache_utils.init_none_hash(fn)
    parent, out = None, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra, _ = kv_cache_utils.generate_block_hash_extra_keys(salted_request(salt), start, start + block_size, 0)
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[start:start + block_size], extra)
        out.append(bytes(parent))
    return out


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_a_salted_prompts_hashes_equal_vllms_and_share_no_key_with_another_salt(monkeypatch, algorithm):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = [random.Random(7).randrange(50_000) for _ in range(100)]
    hasher = BlockHasher(32, algorithm)
    salted = hasher.hashes(tokens, cache_salt="tenant-a")
    assert salted == vllm_salted_hashes(getattr(hashing, algorithm), tokens, 32, "tenant-a")
    # vLLM salts the first block only; the chain carries it: no key in common with the
    # unsalted prompt's, nor with another salt's
    plain, other = set(hasher.keys(tokens)), set(hasher.keys(tokens, cache_salt="tenant-b"))
    assert not plain & set(hasher.keys(tokens, "tenant-a")) and not other & set(hasher.keys(tokens, "tenant-a"))
    assert hasher.keys(tokens, cache_salt="") == hasher.keys(tokens)  # vLLM: an empty salt is none

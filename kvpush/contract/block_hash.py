"""Prefix-cache block hashes, computed from token ids as vLLM computes them.

vLLM names each full block of a request by a hash chained over the whole prefix:
``h_i = H((h_{i-1}, tuple(block_i_token_ids), extra_keys))`` with ``h_{-1}`` a fixed
``NONE_HASH`` (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``,
``init_none_hash``). Its KV events (``BlockStored``) carry those hashes, so a router
that computes them from a prompt's token ids can ask which engine already holds the
prompt's leading blocks, without asking the engine.

``H`` is the engine's ``--prefix-caching-hash-algo``: ``sha256`` (vLLM's default:
SHA-256 of the pickled tuple, so the hashing process must be CPython with the same
highest pickle protocol as the engines') or ``sha256_cbor`` (SHA-256 of canonical
CBOR: the same in any language). ``NONE_HASH`` is ``H(seed)``, the seed being the
engines' ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"``. The non-cryptographic
algorithms (``xxhash``) draw a random seed per process unless PYTHONHASHSEED is set;
they are refused here rather than silently never matching.

Everything kvpush stores or sends is the 64-bit *block key*: the low 64 bits of the
hash, read big-endian, which is exactly what vLLM publishes when its events use
integer hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so events of either form
map to the same key.

A request's ``cache_salt`` (tenants kept from each other's prefixes) is an extra key
of its first block, ``(("cache_salt", salt),)``, so every key of a salted prompt
differs from the unsalted one's: ``keys(ids, cache_salt=...)`` computes them. A
request with LoRA, multimodal inputs or prompt embeddings hashes extra keys this
module does not reproduce (a LoRA's adapter path, the media's hashes), and simply
never matches (no overlap, never a wrong one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from typing import Any, Sequence

DEFAULT_SEED = "vllm-none-hash"
ALGORITHMS = ("sha256", "sha256_cbor")
_KEY_MASK = (1 << 64) - 1


class BlockHashError(ValueError):
    """A hashing setting kvpush cannot reproduce."""


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # only engines configured for it need it
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def block_key(block_hash: bytes | int) -> int:
    """The 64-bit key of a vLLM block hash (bytes, or the int vLLM may publish instead)."""
    if isinstance(block_hash, int):
        return block_hash & _KEY_MASK
    return int.from_bytes(block_hash, "big") & _KEY_MASK


def leading_held(keys: Sequence[int], held) -> int:
    """How many leading blocks of a prompt (its keys, in order) are in ``held``: vLLM's own
    prefix lookup also stops at the first block it lacks (the sidecar's view of its engine
    and the control plane's view of every engine both count this way)."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


@dataclasses.dataclass(frozen=True)
class BlockHasher:
    """The block hashes of token sequences, for engines of one block size and algorithm."""

    block_size: int
    algorithm: str = "sha256"
    seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise BlockHashError(f"prefix hash algorithm {self.algorithm!r} is not reproducible across processes "
                                 f"(use one of {', '.join(ALGORITHMS)})")
        if self.block_size <= 0:
            raise BlockHashError(f"block_size must be positive, not {self.block_size}")
        object.__setattr__(self, "_fn", _sha256_pickle if self.algorithm == "sha256" else _sha256_cbor)
        object.__setattr__(self, "_none", self._fn(self.seed))

    def chain(self, parent: bytes | None, block_tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        """One block's hash, given its parent's (None for the first block) and its extra keys
        as vLLM tags them (``salted`` gives a first block's)."""
        return self._fn((parent or self._none, tuple(block_tokens), extra_keys))

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The hashes of every full block of ``token_ids``, in order (of a request with
        ``cache_salt``: vLLM salts its first block, and the chain carries it on)."""
        out: list[bytes] = []
        parent = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.chain(parent, token_ids[start:start + bs], salted(cache_salt) if start == 0 else None)
            out.append(parent)
        return out

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The 64-bit keys of every full block of ``token_ids``, in order."""
        return [block_key(h) for h in self.hashes(token_ids, cache_salt)]


def salted(cache_salt: str | None) -> tuple | None:
    """The extra keys of a request's first block for its ``cache_salt`` (None: no salt),
    as ``vllm/v1/core/kv_cache_utils.py``'s ``generate_block_hash_extra_keys`` tags it."""
    return (("cache_salt", cache_salt),) if cache_salt else None

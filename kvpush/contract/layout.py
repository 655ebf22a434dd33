"""The KV-layout record: how one engine's KV cache bytes are arranged.

Both sides of a transfer describe their memory with a ``KvLayout``; the control
plane stores it with each engine and refuses to pair engines whose layouts
cannot exchange bytes (different layer count, head geometry or dtype). Block
size alone may differ: the prefill side re-blocks while staging.

Memory order of a pool of ``num_blocks`` blocks is layer-major::

    [layer][block][K/V][token-in-block][kv_head][head_dim]

so the blocks of one layer sit side by side and a layer of a reservation whose
blocks are contiguous is a single NIXL descriptor (see docs/ARCHITECTURE.md).

Tensor parallelism: a layout describes the whole engine (``num_kv_heads`` is the
model's, ``tp_size`` its ranks) and every byte size below is of *one rank's* share,
its ``local_kv_heads``: each rank's pool is laid out alike. Prefill and decode may
differ in ``tp_size``; ``kvpush/channel/head_plan.py`` maps heads between their ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import struct
from typing import Sequence

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")  # quantised with per-layer K/V scales
_SCALES_RE = re.compile(r"^sha256:[0-9a-f]{16}$")


def scales_digest(k_scales: Sequence[float], v_scales: Sequence[float]) -> str:
    """The ``KvLayout.scales`` of an fp8 cache quantised with these per-layer scales: "" when
    every one is 1.0 (vLLM's default without checkpoint scales), else a digest of their
    float32 values, layer by layer. fp8 bytes mean the same on two engines only with equal
    scales, and they are moved as they are."""
    pairs = [(float(k), float(v)) for k, v in zip(k_scales, v_scales, strict=True)]
    if all(k == 1.0 and v == 1.0 for k, v in pairs):
        return ""
    raw = b"".join(struct.pack("<ff", k, v) for k, v in pairs)
    return "sha256:" + hashlib.sha256(raw).hexdigest()[:16]

# Sizes past these are not a KV cache but a typo or an attack.
MAX_LAYERS = 1024
MAX_BLOCK_SIZE = 4096
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_TP = 64


class LayoutError(ValueError):
    """A layout is malformed or incompatible; the message names the field."""


@dataclasses.dataclass(frozen=True)
class KvLayout:
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    kv_parts: int = 2  # K and V; 1 for MLA-style latent caches
    scales: str = ""  # fp8: ``scales_digest`` of the K/V scales ("" = all 1.0)
    tp_size: int = 1  # tensor-parallel ranks; each holds ``rank_heads(rank)``

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        bounds = {
            "num_layers": MAX_LAYERS,
            "block_size": MAX_BLOCK_SIZE,
            "num_kv_heads": MAX_KV_HEADS,
            "head_dim": MAX_HEAD_DIM,
            "tp_size": MAX_TP,
        }
        for field, upper in bounds.items():
            value = getattr(self, field)
            if not isinstance(value, int) or not 1 <= value <= upper:
                raise LayoutError(f"kv_layout.{field} must be an integer in [1, {upper}], got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise LayoutError(f"kv_layout.dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        if self.kv_parts not in (1, 2):
            raise LayoutError(f"kv_layout.kv_parts must be 1 or 2, got {self.kv_parts!r}")
        if self.scales and (self.dtype not in FP8_DTYPES or not _SCALES_RE.match(self.scales)):
            raise LayoutError(f"kv_layout.scales is for fp8 dtypes {FP8_DTYPES}, as sha256:<16 hex digits> "
                              f"(the connector names it), got {self.scales!r} with dtype {self.dtype!r}")
        heads, tp = self.num_kv_heads, self.tp_size
        if heads % tp and tp % heads:
            # vLLM's own rule: heads split evenly over ranks, or each head replicated on
            # an equal number of ranks.
            raise LayoutError(f"kv_layout.tp_size={tp} cannot split num_kv_heads={heads}: one must divide "
                              "the other")

    # -- ranks ----------------------------------------------------------------------------
    @property
    def local_kv_heads(self) -> int:
        """KV heads each rank holds: the byte sizes below are of one rank's share."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def replicated(self) -> bool:
        """Fewer heads than ranks: each head lives on ``tp_size // num_kv_heads`` ranks
        (an MLA latent, one "head", is on every rank)."""
        return self.num_kv_heads < self.tp_size

    def rank_heads(self, rank: int) -> range:
        """The model's KV heads that rank ``rank`` holds, in the order its cache stores them."""
        if not 0 <= rank < self.tp_size:
            raise LayoutError(f"rank {rank} outside tp_size={self.tp_size}")
        if self.replicated:
            head = rank * self.num_kv_heads // self.tp_size
            return range(head, head + 1)
        n = self.local_kv_heads
        return range(rank * n, (rank + 1) * n)

    def rank_layout(self) -> "KvLayout":
        """The layout of one rank's bytes: its local heads, no further split."""
        return dataclasses.replace(self, num_kv_heads=self.local_kv_heads, tp_size=1)

    def describe(self) -> str:
        """The CLI form (``parse``'s inverse): how errors name a layout."""
        text = (f"layers={self.num_layers},block={self.block_size},heads={self.num_kv_heads},"
                f"dim={self.head_dim},dtype={self.dtype}")
        if self.kv_parts != 2:
            text += f",parts={self.kv_parts}"
        if self.scales:
            text += f",scales={self.scales}"
        if self.tp_size != 1:
            text += f",tp={self.tp_size}"
        return text

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_part_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer, on one rank."""
        return self.local_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's KV over all layers."""
        return self.token_part_bytes * self.kv_parts * self.num_layers

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block in one layer (K and V)."""
        return self.token_part_bytes * self.kv_parts * self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        return self.block_layer_bytes * self.num_layers

    def pool_bytes(self, num_blocks: int) -> int:
        return self.block_bytes * num_blocks

    def offset(self, layer: int, block: int, num_blocks: int) -> int:
        """Byte offset of (layer, block) in a layer-major pool of ``num_blocks`` blocks."""
        return (layer * num_blocks + block) * self.block_layer_bytes

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def compatibility_error(self, other: "KvLayout") -> str | None:
        """Why bytes of ``self`` cannot be pushed into ``other`` (None when they can).
        Block size and tensor parallelism may differ: staging re-blocks, and the head
        plan maps any split of the same heads onto any other."""
        for field in ("num_layers", "num_kv_heads", "head_dim", "dtype", "kv_parts", "scales"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"kv_layout.{field} differs: {mine!r} here, {theirs!r} on the peer"
        return None

    def feed_error(self, decode: "KvLayout") -> str | None:
        """Why a prefill engine of this layout cannot feed a decode engine of ``decode``,
        naming both layouts (None when the head plan maps them): how a refused Reserve
        says it."""
        why = self.compatibility_error(decode)
        return None if why is None else (f"prefill layout {self.describe()} cannot feed decode layout "
                                         f"{decode.describe()}: {why}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "KvLayout":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise LayoutError(f"kv_layout has unknown fields: {sorted(unknown)}")
        return cls(**data)

    def to_proto(self):
        """As a ``kvpush.v1.KvLayout`` message: the one conversion, both ways."""
        from kvpush.contract.v1 import types_pb2
        return types_pb2.KvLayout(num_layers=self.num_layers, block_size=self.block_size,
                                  num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                                  kv_parts=self.kv_parts, scales=self.scales, tp_size=self.tp_size)

    @classmethod
    def from_proto(cls, msg, field: str = "kv_layout") -> "KvLayout":
        """From a ``kvpush.v1.KvLayout``; unset dtype, kv_parts and tp_size take their defaults.
        Raises ``LayoutError`` naming ``field`` on bad values."""
        try:
            return cls(num_layers=msg.num_layers, block_size=msg.block_size, num_kv_heads=msg.num_kv_heads,
                       head_dim=msg.head_dim, dtype=msg.dtype or "float32", kv_parts=msg.kv_parts or 2,
                       scales=msg.scales, tp_size=msg.tp_size or 1)
        except LayoutError as exc:
            raise LayoutError(str(exc).replace("kv_layout", field, 1)) from None

    @classmethod
    def parse(cls, text: str) -> "KvLayout":
        """Parse the CLI form ``layers=32,block=16,heads=8,dim=128,dtype=bfloat16[,tp=2]``."""
        aliases = {"layers": "num_layers", "block": "block_size", "heads": "num_kv_heads",
                   "dim": "head_dim", "dtype": "dtype", "parts": "kv_parts", "scales": "scales",
                   "tp": "tp_size"}
        values: dict = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in aliases:
                raise LayoutError(f"kv layout item {item!r}: expected one of {sorted(aliases)} as key=value")
            field = aliases[key]
            values[field] = raw if field in ("dtype", "scales") else int(raw)
        return cls(**values)

"""The KV-layout record: how one engine's KV cache bytes are arranged.

Both sides of a transfer describe their memory with a ``KvLayout``; the control
plane stores it with each engine and refuses to pair engines whose layouts
cannot exchange bytes (different layer count, head geometry or dtype). Block
size alone may differ: the prefill side re-blocks while staging.

Memory order of a pool of ``num_blocks`` blocks is layer-major::

    [layer][block][K/V][token-in-block][kv_head][head_dim]

so the blocks of one layer sit side by side and a layer of a reservation whose
blocks are contiguous is a single NIXL descriptor (see docs/ARCHITECTURE.md).
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

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        bounds = {
            "num_layers": MAX_LAYERS,
            "block_size": MAX_BLOCK_SIZE,
            "num_kv_heads": MAX_KV_HEADS,
            "head_dim": MAX_HEAD_DIM,
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

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def token_part_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

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
        """Why bytes of ``self`` cannot be pushed into ``other`` (None when they can)."""
        for field in ("num_layers", "num_kv_heads", "head_dim", "dtype", "kv_parts", "scales"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"kv_layout.{field} differs: {mine!r} here, {theirs!r} on the peer"
        return None

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
                                  kv_parts=self.kv_parts, scales=self.scales)

    @classmethod
    def from_proto(cls, msg, field: str = "kv_layout") -> "KvLayout":
        """From a ``kvpush.v1.KvLayout``; unset dtype and kv_parts take their defaults.
        Raises ``LayoutError`` naming ``field`` on bad values."""
        try:
            return cls(num_layers=msg.num_layers, block_size=msg.block_size, num_kv_heads=msg.num_kv_heads,
                       head_dim=msg.head_dim, dtype=msg.dtype or "float32", kv_parts=msg.kv_parts or 2,
                       scales=msg.scales)
        except LayoutError as exc:
            raise LayoutError(str(exc).replace("kv_layout", field, 1)) from None

    @classmethod
    def parse(cls, text: str) -> "KvLayout":
        """Parse the CLI form ``layers=32,block=16,heads=8,dim=128,dtype=bfloat16``."""
        aliases = {"layers": "num_layers", "block": "block_size", "heads": "num_kv_heads",
                   "dim": "head_dim", "dtype": "dtype", "parts": "kv_parts", "scales": "scales"}
        values: dict = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in aliases:
                raise LayoutError(f"kv layout item {item!r}: expected one of {sorted(aliases)} as key=value")
            field = aliases[key]
            values[field] = raw if field in ("dtype", "scales") else int(raw)
        return cls(**values)

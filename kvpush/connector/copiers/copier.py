"""The ``CacheCopier`` seam: the engine's paged KV cache <-> kvpush's canonical blocks.

kvpush moves KV between engines in one canonical layout (``kvpush.contract.layout``:
per block ``[K/V][token][kv_head][head_dim]``, layer-major pools). Each attention
backend keeps its cache its own way; a copier translates, inside vLLM's worker process.
Every call comes from the connector's worker side (``kvpush/connector/worker.py``) on
the thread that runs the model's forward pass:

==================  ========  ===============================================================
method              side      moment
==================  ========  ===============================================================
``bind_caches``     both      ``register_kv_caches``, once: the per-layer cache tensors
``bind_pool``       both      after the channel's HELLO, and again after a reconnect to a
                              restarted sidecar (a new pool)
``plan``            prefill   once per request piece per step, before its first layer: what
                              every layer's copy of that piece reuses (index tensors, say);
                              ``load`` plans for itself when given none
``stage``           prefill   ``save_kv_layer``, after each attention layer, for each request
                              pushing in the step; the PUSH frame follows at once
``load``            decode    ``start_load_kv``, before the forward pass, for each landed
                              request; CONSUMED follows
==================  ========  ===============================================================

Implementations: ``kvpush.connector.copiers.cpu_copier.CpuCopier`` (host memory; the probed block codec of
``kvpush/connector/copiers/cache_codec.py``, numpy copies) and ``kvpush.connector.copiers.torch_copier.TorchCopier`` (vLLM's
plain layouts, torch ops on the cache's device). On a GPU the caches are tensors on
their device and the pool is device memory from ``kvpush.channel.memory.attach_pool``; a copy
is then only enqueued when ``stage`` or ``load`` returns, and what they return is a
fence (``wait()`` returns once the copy is done) that the connector waits on before the
frame that lets the sidecar read the staged bytes (PUSH) or reuse the landing blocks
(CONSUMED). None means the copy is already complete (host memory).
"""

from __future__ import annotations

import abc
from typing import Protocol, Sequence

from kvpush.channel.geometry import DestGeometry
from kvpush.channel.memory import PoolMemory
from kvpush.channel.pool import PoolDescription, StagingAllocation
from kvpush.contract.layout import KvLayout


class Fence(Protocol):
    def wait(self) -> None:
        """Block the calling thread (asleep) until the copies it marks are complete."""


class CopyError(RuntimeError):
    """The engine's KV cache cannot be read or written this way (layout, dtype, device)."""


class CacheCopier(abc.ABC):
    @property
    @abc.abstractmethod
    def block_size(self) -> int:
        """Tokens per block of the engine's cache."""

    @property
    @abc.abstractmethod
    def token_layer_bytes(self) -> int:
        """Bytes of one token's K and V in one layer."""

    @abc.abstractmethod
    def bind_caches(self, caches: Sequence, layout: KvLayout) -> None:
        """The engine's cache tensors, layer 0..n-1; ``CopyError`` if they do not match
        ``layout`` (the sidecar's, which its peers were told)."""

    @abc.abstractmethod
    def bind_pool(self, memory: PoolMemory, desc: PoolDescription) -> None:
        """The sidecar's pool, mapped into this process."""

    @abc.abstractmethod
    def plan(self, cache_block_ids: Sequence[int], start: int, end: int) -> object:
        """What copying tokens ``[start, end)`` of a request whose cache blocks (token order)
        are ``cache_block_ids`` needs in every layer; passed back to ``stage``/``load``."""

    @abc.abstractmethod
    def stage(self, layer: int, cache_block_ids: Sequence[int], start: int, end: int, alloc: StagingAllocation,
              geom: DestGeometry, plan: object = None, offset: int = 0) -> Fence | None:
        """Prefill: tokens ``[start, end)`` of ``layer`` from the cache into the request's staging
        allocation, in the destination's block geometry ``geom``, as its tokens
        ``[start - offset, end - offset)`` (``offset``: the reservation's first prompt token):
        the allocation's heads (``alloc.first_head``, ``alloc.num_heads``: one head share of a
        tensor-parallel push; 0 heads: all). Returns a fence for the copy (None: done)."""

    @abc.abstractmethod
    def load(self, cache_block_ids: Sequence[int], start: int, end: int, landing_block_ids: Sequence[int],
             plan: object = None, offset: int = 0) -> Fence | None:
        """Decode: tokens ``[start, end)`` of every layer into the cache from the landing blocks
        (token order), where they are tokens ``[start - offset, end - offset)``. Returns a
        fence for the reads of the landing blocks (None: done); the forward pass is ordered
        after the copy by the copier (same stream)."""

    def fence(self) -> Fence | None:
        """A fence for every copy enqueued so far (None: nothing can be pending)."""
        return None

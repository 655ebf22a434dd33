"""Test stand-ins for the vLLM side: a prefill engine with a paged KV cache that
stages into its sidecar, and a decode engine that reads its landing pool. They
use the same channel client and copy helpers a real connector would."""

from __future__ import annotations

import numpy as np

from kvpush.contract.layout import KvLayout
from kvpush.channel import frames as F
from kvpush.contract.target import PushTarget
from kvpush.channel import reblock
from kvpush.connector.sidecar_client import SidecarClient
from kvpush.channel.geometry import DestGeometry
from kvpush.channel.attach import attach_pool
from kvpush.channel.pool import PoolDescription, StagingAllocation

SENTINEL = 0xA5


def layer_blocks(mem: np.ndarray, layout: KvLayout, num_blocks: int, layer: int) -> np.ndarray:
    stride = num_blocks * layout.block_layer_bytes
    flat = mem[layer * stride:(layer + 1) * stride]
    return flat.reshape(num_blocks, layout.kv_parts, layout.block_size, layout.num_kv_heads,
                        layout.head_dim * layout.itemsize)


class PrefillEngine:
    """Random KV in a paged cache of block size P; stages and pushes through the sidecar."""

    def __init__(self, client: SidecarClient, cache_blocks: int = 64, seed: int = 0):
        self.client = client
        hello = client.hello(name="test-prefill")
        self.info = PoolDescription.from_dict(hello["pool"])
        self.layout = self.info.layout
        self.staging = attach_pool(self.info)
        self.rng = np.random.default_rng(seed)
        lo = self.layout
        self.cache = self.rng.integers(0, 256, size=(lo.num_layers, cache_blocks, lo.kv_parts, lo.block_size,
                                                     lo.num_kv_heads, lo.head_dim * lo.itemsize), dtype=np.uint8)

    def cache_blocks_for(self, num_tokens: int) -> list[int]:
        """A scattered block table for a request, as a paged cache would have."""
        need = self.layout.blocks_for_tokens(num_tokens)
        return [int(b) for b in self.rng.permutation(self.cache.shape[1])[:need]]

    def tokens(self, cache_ids, layer: int, num_tokens: int) -> np.ndarray:
        return reblock.gather_tokens(self.cache[layer], cache_ids, 0, num_tokens)

    def begin(self, request_id: str, reservation_id: str, record: dict, block_ids, num_tokens: int,
              block_size: int | None = None, deadline_unix_ms: int = 0,
              prefill_incarnation: str = "") -> StagingAllocation:
        return self.client.begin_push(F.BeginRequest(request_id, PushTarget(
            reservation_id, record["engine_id"], record["incarnation"], tuple(block_ids),
            block_size or record["layout"]["block_size"], num_tokens, deadline_unix_ms=deadline_unix_ms,
            prefill_incarnation=prefill_incarnation)))

    def stage(self, alloc: StagingAllocation, dest_block_size: int, num_tokens: int, cache_ids, layer: int,
              start: int = 0, end: int | None = None) -> None:
        geom = DestGeometry.for_layout(self.layout, dest_block_size, num_tokens)
        end = num_tokens if end is None else end
        reblock.stage_from_cache(self.staging.host_view(), alloc, geom, layer, self.cache[layer], cache_ids,
                                 start, end)

    def push_all(self, request_id: str, alloc: StagingAllocation, dest_block_size: int, num_tokens: int,
                 cache_ids, chunks: int = 1) -> None:
        """Chunked-prefill order: for each chunk, every layer (stage, then push)."""
        bounds = np.linspace(0, num_tokens, chunks + 1).astype(int)
        for start, end in zip(bounds[:-1], bounds[1:]):
            for layer in range(self.layout.num_layers):
                self.stage(alloc, dest_block_size, num_tokens, cache_ids, layer, int(start), int(end))
                self.client.push(request_id, layer, int(start), int(end))

    def close(self) -> None:
        self.client.close()
        self.staging.close()


class DecodeEngine:
    """Reads (and fills with a sentinel) the landing pool of its sidecar."""

    def __init__(self, client: SidecarClient):
        self.client = client
        hello = client.hello(name="test-decode")
        self.info = PoolDescription.from_dict(hello["pool"])
        self.layout = self.info.layout
        self.landing = attach_pool(self.info)

    @property
    def mem(self) -> np.ndarray:
        return self.landing.host_view()

    def fill_sentinel(self) -> None:
        self.mem[:] = SENTINEL

    def layer(self, layer: int, mem: np.ndarray | None = None) -> np.ndarray:
        return layer_blocks(self.mem if mem is None else mem, self.layout, self.info.num_units, layer)

    def read_tokens(self, block_ids, layer: int, num_tokens: int) -> np.ndarray:
        return reblock.gather_tokens(self.layer(layer), block_ids, 0, num_tokens)

    def expected_image(self, pushes) -> np.ndarray:
        """The whole landing pool as it must be: sentinel everywhere except the
        token slots of ``pushes`` = [(block_ids, layer -> tokens array, num_tokens)]."""
        image = np.full_like(self.mem, SENTINEL)
        bs = self.layout.block_size
        for block_ids, tokens_of, num_tokens in pushes:
            for layer in range(self.layout.num_layers):
                tokens = tokens_of(layer)
                view = self.layer(layer, image)
                for j, b in enumerate(block_ids):
                    lo, hi = j * bs, min((j + 1) * bs, num_tokens)
                    if lo < hi:
                        view[b, :, :hi - lo] = tokens[:, lo:hi]
        return image

    def close(self) -> None:
        self.client.close()
        self.landing.close()


def wait_state(client: SidecarClient, reservation_id: str, timeout_s: float = 30.0) -> F.StateEvent:
    """The terminal event of ``reservation_id`` (subscribe first, or poll the event queue)."""
    return client.wait_event(lambda e: e.reservation_id == reservation_id, timeout_s)

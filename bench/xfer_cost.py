"""Measure what one layer's WRITE costs the host: prepped descriptor lists vs ``initialize_xfer``.

NIXL offers two ways to build a transfer: prepare both sides' descriptor
lists once (``prep_xfer_dlist``, every (layer, block) of the pool as one
entry) and pick entries by index per transfer (``make_prepped_xfer``, NIXL
merges adjacent ones), or build the descriptor lists per transfer
(``initialize_xfer``), which is what ``PushEngine`` does with its merged runs.
``measure`` times both, in one process with two agents, on the same bytes.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from kvpush.contract.layout import KvLayout
from kvpush.sidecar.transport.nixl import NixlConfig, NixlTransport
from kvpush.channel.geometry import DestGeometry
from kvpush.sidecar.descriptors import blocks_segment_map, pair_descriptors
from kvpush.channel.memory import ShmMemory


@dataclasses.dataclass(frozen=True)
class LayerCost:
    method: str  # "initialize_xfer" | "prepped"
    blocks: int
    contiguous: bool
    descriptors: int  # as passed to NIXL
    create_us: float  # building descriptors + creating the transfer handle (median)
    total_us: float  # create + post + wait DONE + release (median)


def _wait(initiator: NixlTransport, target: NixlTransport, handle, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        state = initiator.check(handle)
        if state == "DONE":
            break
        if state == "ERR" or time.monotonic() > deadline:
            raise RuntimeError(f"transfer {state}")
        target.poll_notifs()  # the target must progress on this transport
    initiator.release(handle)


def measure(layout: KvLayout, num_tokens: int, pool_blocks: int = 256, reps: int = 30,
            tag: str = "xfercost") -> list[LayerCost]:
    geom = DestGeometry.for_layout(layout, layout.block_size, num_tokens)
    nblocks = geom.num_blocks
    if nblocks * 2 > pool_blocks:
        raise ValueError("pool too small for a scattered reservation")
    src = ShmMemory.create(f"{tag}.src", layout.pool_bytes(pool_blocks))
    dst = ShmMemory.create(f"{tag}.dst", layout.pool_bytes(pool_blocks))
    a = NixlTransport(NixlConfig(f"{tag}-a"))
    b = NixlTransport(NixlConfig(f"{tag}-b"))
    results = []
    try:
        a.register(src), b.register(dst)
        a.add_remote(b.metadata())
        blb, stride = layout.block_layer_bytes, pool_blocks * layout.block_layer_bytes
        raw = a._agent  # the prepped API is not part of our wrapper: used only here

        def entries(base: int) -> np.ndarray:
            out = np.empty((layout.num_layers * pool_blocks, 3), dtype=np.uint64)
            out[:, 0] = base + np.arange(layout.num_layers * pool_blocks, dtype=np.uint64) * blb
            out[:, 1], out[:, 2] = blb, 0
            return out

        local_prep = raw.prep_xfer_dlist("NIXL_INIT_AGENT", entries(src.base_address), "DRAM")
        remote_prep = raw.prep_xfer_dlist(b.name, entries(dst.base_address), "DRAM")
        rng = np.random.default_rng(0)
        src.host_view()[:] = 1  # touch every page once: no first-touch faults in the timings
        dst.host_view()[:] = 0
        for contiguous in (True, False):
            ids = (np.arange(10, 10 + nblocks) if contiguous else
                   np.sort(rng.choice(np.arange(0, pool_blocks, 2), nblocks, replace=False)))
            local_ids = np.arange(nblocks)
            # As PushEngine does: layer-0 maps computed once per request, shifted per layer.
            local0 = blocks_segment_map(local_ids, blb, src.base_address)
            remote0 = blocks_segment_map(ids, blb, dst.base_address)
            ranges = geom.token_ranges(0, num_tokens)
            samples: dict[str, list] = {"initialize_xfer": [], "prepped": []}
            ndesc = {}
            for rep in range(reps + 3):
                layer = rep % layout.num_layers
                for method in (("initialize_xfer", "prepped") if rep % 2 else ("prepped", "initialize_xfer")):
                    t0 = time.perf_counter()
                    if method == "initialize_xfer":
                        loc, rem = pair_descriptors(ranges, local0.shifted(layer * stride),
                                                    remote0.shifted(layer * stride))
                        ndesc[method] = len(loc)
                        handle = raw.initialize_xfer("WRITE", raw.get_xfer_descs(loc, "DRAM"),
                                                     raw.get_xfer_descs(rem, "DRAM"), b.name)
                    else:
                        li = (layer * pool_blocks + local_ids).astype(np.int32)
                        ri = (layer * pool_blocks + ids).astype(np.int32)
                        ndesc[method] = len(li)
                        handle = raw.make_prepped_xfer("WRITE", local_prep, li, remote_prep, ri)
                    t1 = time.perf_counter()
                    raw.transfer(handle)
                    _wait(a, b, handle)
                    t2 = time.perf_counter()
                    if rep >= 3:  # warm-up excluded
                        samples[method].append((t1 - t0, t2 - t0))
            for method, got in samples.items():
                med = np.median(np.array(got), axis=0) * 1e6
                results.append(LayerCost(method, nblocks, contiguous, ndesc[method], float(med[0]), float(med[1])))
        local_prep.release(), remote_prep.release()
    finally:
        a.close(), b.close()
        src.close(), dst.close()
    return results

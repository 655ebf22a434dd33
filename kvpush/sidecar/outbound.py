"""One request's push as the pusher (``kvpush/sidecar/push.py``) tracks it, its settings and
its outcome.

A request is pushed as *slices*, one per head share of the head plan
(``kvpush/channel/head_plan.py``): each is staged by its source rank in the share's own
geometry and written into its decode rank's landing blocks. Without tensor
parallelism on either side there is one slice, every head, the whole request."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import numpy as np

from kvpush.channel.geometry import DestGeometry
from kvpush.channel.head_plan import HeadShare
from kvpush.channel.pool import StagingAllocation
from kvpush.contract.states import PushState
from kvpush.contract.target import PushTarget
from kvpush.sidecar.descriptors import SegmentMap
from kvpush.sidecar.peers import RemotePeer


class PushError(Exception):
    """A push was refused before anything was written (bad target, no staging, ...)."""


@dataclasses.dataclass(frozen=True)
class PushConfig:
    transfer_timeout_s: float = 2.0
    resolve_timeout_s: float = 2.0
    checksums: bool = False  # per-block CRC32 verified by the decode side (debug mode)
    tombstones: int = 4096  # ended request ids remembered, to drop their late pushes quietly
    # A final write expected to take at least this long is announced (FINAL notice
    # with its estimated duration) so the decode side polls fine as it ends; a
    # shorter one ends before the announcement would change anything.
    final_hint_min_s: float = 0.0003
    hold_s: float = 5.0  # how long staging is held for a decode failover after the push (0: freed at once)


@dataclasses.dataclass(frozen=True)
class PushOutcome:
    request_id: str
    reservation_id: str
    engine_id: str
    state: PushState
    reason: str = ""
    bytes_pushed: int = 0
    transfers: int = 0
    elapsed_s: float = 0.0
    exposed_s: float = 0.0  # from the last piece's PUSH (the end of prefill) to this outcome; 0: never got there


@dataclasses.dataclass
class Slice:
    """One head share of a request: where its source rank stages it, where it lands."""

    share: HeadShare
    geom: DestGeometry  # the share's own virtual layer space (its heads only)
    alloc: StagingAllocation  # in the source rank's staging pool
    landing_offset: int  # where that space starts in the decode rank's landing space
    local0: SegmentMap | None = None  # layer 0 of the staging
    remote0: SegmentMap | None = None  # layer 0 of the landing, this slice's window of it


@dataclasses.dataclass
class Outbound:
    request_id: str
    target: PushTarget
    geom: DestGeometry  # the request in one decode rank's landing blocks
    slices: tuple[Slice, ...]
    coverage: dict[int, list[int]]  # source rank -> tokens pushed so far, per layer (in order)
    remaining: int  # layer-tokens not yet pushed, over every source rank
    started: float
    state: PushState = PushState.PUSHING
    peer: RemotePeer | None = None
    owners: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> its connection, once it began
    ended_ranks: set = dataclasses.field(default_factory=set)  # ranks whose engine sent END
    queued: collections.deque = dataclasses.field(default_factory=collections.deque)
    final: tuple[np.ndarray, np.ndarray] | None = None  # held until the earlier writes are DONE
    inflight: int = 0
    begun: bool = False  # BEGIN hint sent
    staging_freed: bool = False
    final_at: float = 0.0  # when the last piece's PUSH arrived
    bytes_pushed: int = 0
    transfers: int = 0
    holdable: bool = False  # its reservation names this prefill engine: the control plane can move it
    held: bool = False  # the push to this target ended; staging kept for a relocation
    hold_timer: asyncio.TimerHandle | None = None
    engine_done: bool = False  # the engine sent END (every piece it will stage is staged)
    generation: int = 0  # bumped by each relocation: writes of an older one are stale
    stale_inflight: int = 0  # writes to an earlier target not yet released (they still read staging)

    def slices_of(self, rank: int) -> tuple[Slice, ...]:
        return tuple(s for s in self.slices if s.share.src_rank == rank)

    @property
    def num_units(self) -> int:
        return sum(s.alloc.num_units for s in self.slices)

    def rank_remaining(self, rank: int) -> int:
        cov = self.coverage.get(rank)
        return 0 if cov is None else sum(self.target.num_tokens - c for c in cov)

    @property
    def all_ended(self) -> bool:
        """Every rank that stages a share has sent END (every piece is staged)."""
        return set(self.coverage) <= self.ended_ranks

    def misfit(self, target: PushTarget) -> str:
        """Why ``target`` cannot take this request's staging ("" if it can): staging is
        laid out in the decode engine's block geometry."""
        if (target.block_size, target.num_tokens) != (self.target.block_size, self.target.num_tokens):
            return (f"reservation {target.reservation_id} ({target.num_tokens} tokens in blocks of "
                    f"{target.block_size}) does not match the staged {self.target.num_tokens} in "
                    f"{self.target.block_size}")
        if len(target.block_ids) < self.geom.num_blocks:
            return f"reservation {target.reservation_id} has {len(target.block_ids)} blocks, {self.geom.num_blocks} needed"
        if target.tp_size != self.target.tp_size:
            return (f"reservation {target.reservation_id} is on a decode engine of tp {target.tp_size}; the "
                    f"staging is split for tp {self.target.tp_size}")
        return ""

    def retarget(self, target: PushTarget) -> list[tuple[int, int, int, int, bool]]:
        """Point this request at ``target`` (a relocation): writes still in flight to the
        old one become stale. Returns the pieces to write now: every layer staged so far,
        the last one final if the whole request is staged."""
        self.generation += 1
        self.stale_inflight += self.inflight
        self.inflight, self.target, self.state, self.begun, self.final = 0, target, PushState.PUSHING, False, None
        self.bytes_pushed = self.transfers = 0
        self.started, self.final_at = time.monotonic(), 0.0
        self.queued.clear()
        pieces = [(rank, layer, 0, covered, False) for rank, cov in sorted(self.coverage.items())
                  for layer, covered in enumerate(cov) if covered]
        if not self.remaining:
            pieces[-1] = pieces[-1][:4] + (True,)
            self.state, self.final_at = PushState.FINALIZING, time.monotonic()
        return pieces

"""One request's push as the pusher (``sidecar/push.py``) tracks it, its settings and
its outcome."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

import numpy as np

from engine.geometry import DestGeometry
from engine.pool import StagingAllocation
from kvpush.contract.states import PushState
from kvpush.contract.target import PushTarget
from sidecar.descriptors import SegmentMap
from sidecar.peers import RemotePeer


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
class Outbound:
    request_id: str
    target: PushTarget
    owner: str
    geom: DestGeometry
    alloc: StagingAllocation
    coverage: list[int]  # tokens pushed so far, per layer (pieces arrive in order)
    remaining: int  # layer-tokens not yet pushed
    started: float
    state: PushState = PushState.PUSHING
    peer: RemotePeer | None = None
    local0: SegmentMap | None = None
    remote0: SegmentMap | None = None
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

    def misfit(self, target: PushTarget) -> str:
        """Why ``target`` cannot take this request's staging ("" if it can): staging is
        laid out in the decode engine's block geometry."""
        if (target.block_size, target.num_tokens) != (self.target.block_size, self.target.num_tokens):
            return (f"reservation {target.reservation_id} ({target.num_tokens} tokens in blocks of "
                    f"{target.block_size}) does not match the staged {self.target.num_tokens} in "
                    f"{self.target.block_size}")
        if len(target.block_ids) < self.geom.num_blocks:
            return f"reservation {target.reservation_id} has {len(target.block_ids)} blocks, {self.geom.num_blocks} needed"
        return ""

    def retarget(self, target: PushTarget) -> list[tuple[int, int, int, bool]]:
        """Point this request at ``target`` (a relocation): writes still in flight to the
        old one become stale. Returns the pieces to write now: every layer staged so far,
        the last one final if the whole request is staged."""
        self.generation += 1
        self.stale_inflight += self.inflight
        self.inflight, self.target, self.state, self.begun, self.final = 0, target, PushState.PUSHING, False, None
        self.bytes_pushed = self.transfers = 0
        self.started, self.final_at = time.monotonic(), 0.0
        self.queued.clear()
        pieces = [(layer, 0, covered, False) for layer, covered in enumerate(self.coverage) if covered]
        if not self.remaining:
            pieces[-1] = pieces[-1][:3] + (True,)
            self.state, self.final_at = PushState.FINALIZING, time.monotonic()
        return pieces

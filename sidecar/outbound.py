"""One request's push as the pusher (``sidecar/push.py``) tracks it, its settings and
its outcome."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

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

"""The prefill sidecar's push engine: staged KV -> a decode engine's landing blocks.

The engine (through the local channel) calls, per request:

1. ``begin(request_id, target)`` once: checks the destination (peer known and
   alive, KV layouts compatible, block ids inside its pool) *before anything
   is written*, allocates staging in the destination's geometry and returns
   the allocation so the engine knows where to copy.
2. ``push(request_id, layer, start, end)`` per staged layer or chunk: one
   NIXL WRITE of the merged descriptors for that piece, posted at once. The
   layer-by-layer writes overlap with the engine computing the next layer.
3. The piece that completes the request (every layer, every token) is the
   *final* write; it carries the ``LANDED`` notification and is posted only
   when every earlier write of the request is DONE, so the decode side can
   never see the notification before all the bytes.
4. When the final write is DONE the staging is freed and a ``PushOutcome``
   (PUSHED) is reported; any failure, timeout or cancellation reports FAILED
   or CANCELLED instead, stops the request's remaining pushes, frees its
   staging once no write still reads from it, and tells the decode side
   (best effort) with an ``ABORT`` notification.

Every wait is bounded: writes by ``transfer_timeout_s``, peer resolution by
``resolve_timeout_s``. A peer that disconnected is marked dead, so the next
request to it is refused at ``begin`` without touching the network.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from typing import Callable

import numpy as np

from kvpush.contract.layout import KvLayout
from kvpush.contract.states import PushState
from kvpush.contract.target import PushTarget
from kvpush.trace import Trace
from sidecar import notify
from sidecar.transport.base import TransferError, Transport
from engine.geometry import DestGeometry
from sidecar.descriptors import SegmentMap, blocks_segment_map, block_checksums, pair_descriptors, staging_segment_map
from sidecar.peers import PeerRegistry, PeerUnavailable, RemotePeer
from sidecar.pools import StagingFull, StagingPool
from engine.pool import StagingAllocation
from sidecar.progress import ProgressDriver

log = logging.getLogger(__name__)


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
class _Outbound:
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


class PushEngine:
    def __init__(self, transport: Transport, driver: ProgressDriver, staging: StagingPool, layout: KvLayout,
                 peers: PeerRegistry, config: PushConfig = PushConfig(),
                 on_outcome: Callable[[PushOutcome], None] | None = None,
                 on_start: Callable[[str, str], None] | None = None):
        self.transport = transport
        self.driver = driver
        self.staging = staging
        self.layout = layout
        self.peers = peers
        self.config = config
        self.on_outcome = on_outcome
        self.on_start = on_start  # (reservation_id, request_id) when its first write is posted
        self._requests: dict[str, _Outbound] = {}
        self._ended: collections.OrderedDict[str, PushState] = collections.OrderedDict()
        self.counters = collections.Counter()
        self.trace = Trace.off()
        self.write_rate = 0.0  # bytes/s of recent writes (moving average; 0 = not measured yet)

    # -- the engine's calls ------------------------------------------------------------
    def begin(self, request_id: str, target: PushTarget, owner: str = "") -> StagingAllocation:
        """Check the destination, allocate staging; ``PushError`` (and a FAILED outcome) if refused."""
        if request_id in self._requests:
            raise PushError(f"request {request_id} is already being pushed")
        try:
            geom = DestGeometry.for_layout(self.layout, target.block_size, target.num_tokens)
            if len(target.block_ids) < geom.num_blocks:
                raise PushError(f"reservation {target.reservation_id} has {len(target.block_ids)} blocks, "
                                f"{target.num_tokens} tokens need {geom.num_blocks}")
            peer = None
            if self.peers.cached(target.engine_id, target.incarnation) or self.peers.resolver is None:
                peer = self.peers.get(target.engine_id, target.incarnation)
                self._check_peer(peer, target, geom)
            alloc = self.staging.allocate(geom.block_layer_bytes, geom.num_blocks, owner)
        except (PushError, PeerUnavailable, StagingFull, ValueError) as exc:
            self.counters["refused"] += 1
            self._emit(PushOutcome(request_id, target.reservation_id, target.engine_id, PushState.FAILED,
                                   f"refused: {exc}"))
            raise PushError(str(exc)) from exc
        ob = _Outbound(request_id, target, owner, geom, alloc, [0] * self.layout.num_layers,
                       self.layout.num_layers * target.num_tokens, time.monotonic())
        self._requests[request_id] = ob
        if peer is not None:
            self._attach_peer(ob, peer)
        else:
            ob.state = PushState.RESOLVING
            asyncio.get_running_loop().create_task(self._resolve(ob), name=f"resolve-{target.engine_id}")
        return alloc

    def push(self, request_id: str, layer: int, start: int = 0, end: int | None = None) -> None:
        """Push tokens ``[start, end)`` of ``layer`` (already staged). Never raises:
        a bad push fails its reservation (reported through ``on_outcome``)."""
        ob = self._requests.get(request_id)
        if ob is None:
            if request_id not in self._ended:
                log.warning("push for unknown request %s ignored", request_id)
            return
        if ob.state.terminal:
            return
        end = ob.target.num_tokens if end is None else end
        if not 0 <= layer < self.layout.num_layers:
            return self._fail(ob, f"layer {layer} outside [0, {self.layout.num_layers})")
        if start != ob.coverage[layer] or not start < end <= ob.target.num_tokens:
            return self._fail(ob, f"layer {layer} piece [{start}, {end}) out of order "
                                  f"(next token is {ob.coverage[layer]} of {ob.target.num_tokens})")
        ob.coverage[layer] = end
        ob.remaining -= end - start
        final = ob.remaining == 0
        if final:
            ob.state = PushState.FINALIZING
            ob.final_at = time.monotonic()
            self.trace("final_piece", ob.target.reservation_id, f"inflight={ob.inflight}")
        if ob.peer is None:  # still resolving the peer: keep the order
            ob.queued.append((layer, start, end, final))
            return
        self._push_piece(ob, layer, start, end, final)

    def end(self, request_id: str, aborted: bool = False, reason: str = "") -> None:
        """The engine is done with the request (finished, or aborted: stop and free)."""
        ob = self._requests.get(request_id)
        if ob is None or ob.state.terminal:
            return
        if aborted:
            self._fail(ob, f"aborted by the engine: {reason}" if reason else "aborted by the engine",
                       state=PushState.CANCELLED)
        elif ob.remaining:
            self._fail(ob, f"engine finished the request with {ob.remaining} layer-tokens not pushed")

    def cancel_reservation(self, reservation_id: str, reason: str = "cancelled") -> bool:
        """Stop every pending push of a reservation (deadline, abort by the control plane)."""
        for ob in list(self._requests.values()):
            if ob.target.reservation_id == reservation_id and not ob.state.terminal:
                self._fail(ob, reason, state=PushState.CANCELLED)
                return True
        return False

    def drop_owner(self, owner: str) -> None:
        """The engine connection ``owner`` closed: its unfinished requests fail.
        A request whose every piece is already posted is complete in staging and finishes."""
        for ob in list(self._requests.values()):
            if ob.owner == owner and ob.state in (PushState.RESOLVING, PushState.PUSHING):
                self._fail(ob, "engine connection closed before the request was fully staged")

    def state(self, request_id: str) -> PushState | None:
        ob = self._requests.get(request_id)
        return ob.state if ob is not None else self._ended.get(request_id)

    @property
    def active(self) -> int:
        return len(self._requests)

    def live_reservations(self) -> list[str]:
        """Reservations with a push under way here (not yet ended)."""
        return [ob.target.reservation_id for ob in self._requests.values() if not ob.state.terminal]

    # -- internals -------------------------------------------------------------------------
    def _check_peer(self, peer: RemotePeer, target: PushTarget, geom: DestGeometry) -> None:
        why = self.layout.compatibility_error(peer.layout)
        if why:
            raise PushError(f"engine {target.engine_id} cannot take our KV: {why}")
        peer.check_blocks(list(target.block_ids[:geom.num_blocks]), target.block_size)

    def _attach_peer(self, ob: _Outbound, peer: RemotePeer) -> None:
        ob.peer = peer
        ob.local0 = staging_segment_map(ob.alloc, 0, self.staging.base_address)
        ob.remote0 = blocks_segment_map(ob.target.block_ids[:ob.geom.num_blocks], ob.geom.block_layer_bytes,
                                        peer.layer_base(0))

    async def _resolve(self, ob: _Outbound) -> None:
        t = ob.target
        try:
            peer = await asyncio.wait_for(self.peers.resolve(t.engine_id, t.incarnation),
                                          self.config.resolve_timeout_s)
            self._check_peer(peer, t, ob.geom)
        except asyncio.TimeoutError:
            return self._fail(ob, f"engine {t.engine_id} not resolved within {self.config.resolve_timeout_s} s")
        except Exception as exc:  # PeerUnavailable, PushError, resolver errors
            return self._fail(ob, f"engine {t.engine_id}: {exc}")
        if ob.state.terminal:
            return
        self._attach_peer(ob, peer)
        if ob.state == PushState.RESOLVING:
            ob.state = PushState.PUSHING
        while ob.queued and not ob.state.terminal:
            self._push_piece(ob, *ob.queued.popleft())

    def _push_piece(self, ob: _Outbound, layer: int, start: int, end: int, final: bool) -> None:
        ranges = ob.geom.token_ranges(start, end)
        local = ob.local0.shifted(layer * self.staging.layer_stride)
        remote = ob.remote0.shifted(layer * ob.peer.layer_stride)
        loc, rem = pair_descriptors(ranges, local, remote, self.staging.memory.device_id, ob.peer.record.device_id)
        if not ob.begun:
            ob.begun = True
            try:  # wake the decode side into hot polling: our writes need its progress
                self.transport.send_notif(ob.peer.agent_name, notify.encode(notify.PushNotice(
                    notify.BEGIN, ob.target.reservation_id, ob.target.incarnation)))
            except TransferError as exc:
                return self._fail(ob, f"engine {ob.target.engine_id}: {exc}", peer_gone=exc.peer_gone)
            if self.on_start is not None:  # reported later, off this path
                self._later(self.on_start, ob.target.reservation_id, ob.request_id)
        if not final:
            return self._post(ob, loc, rem, b"", final=False)
        ob.final = (loc, rem)
        self._maybe_post_final(ob)

    def _maybe_post_final(self, ob: _Outbound) -> None:
        if ob.final is None or ob.inflight or ob.state.terminal:
            return
        loc, rem = ob.final
        ob.final = None
        sums = None
        if self.config.checksums:
            sums = tuple(block_checksums(ob.geom, self.layout.num_layers, self.staging.memory.host_view(),
                                         self.staging.base_address,
                                         lambda layer: ob.local0.shifted(layer * self.staging.layer_stride)))
        t = ob.target
        # Announced short (x0.8): a write seen DONE only at a later poll measured
        # slower than it was, and a window opened late is a window missed.
        eta = 0.8 * float(loc[:, 1].sum()) / self.write_rate if self.write_rate else 0.0
        if eta >= self.config.final_hint_min_s:
            try:  # best effort: without it the decode side still sees LANDED at its next hot poll
                self.transport.send_notif(ob.peer.agent_name, notify.encode(notify.PushNotice(
                    notify.FINAL, t.reservation_id, t.incarnation, eta_s=eta)))
            except TransferError as exc:
                log.info("final-write notice for %s not sent: %s", t.reservation_id, exc)
        notice = notify.PushNotice(notify.LANDED, t.reservation_id, t.incarnation,
                                   tuple(t.block_ids[:ob.geom.num_blocks]), t.block_size, t.num_tokens, sums)
        self._post(ob, loc, rem, notify.encode(notice), final=True)
        self.trace("final_posted", t.reservation_id, ob.state.value)

    def _post(self, ob: _Outbound, loc: np.ndarray, rem: np.ndarray, notif: bytes, final: bool) -> None:
        peer = ob.peer
        nbytes = int(loc[:, 1].sum())
        posted = time.perf_counter()
        try:
            handle, done = self.transport.post_write(loc, rem, peer.agent_name, local_kind=self.staging.memory.mem_kind,
                                                 remote_kind=peer.record.memory_kind, notif=notif)
        except TransferError as exc:
            return self._fail(ob, f"engine {ob.target.engine_id}: {exc}", peer_gone=exc.peer_gone)
        ob.inflight += 1
        ob.transfers += 1
        ob.bytes_pushed += nbytes
        self.counters["transfers"] += 1
        self.counters["descriptors"] += len(loc)

        def on_done(ok: bool, error: str) -> None:
            if ok:
                self._measure_rate(nbytes, time.perf_counter() - posted)
            self._write_done(ob, ok, error, final)

        def on_released() -> None:
            self._write_released(ob)

        if done:
            self.transport.release(handle)
            on_done(True, "")
            on_released()
        else:
            self.driver.track(handle, self.config.transfer_timeout_s, on_done,
                              label=f"{ob.target.reservation_id}{'/final' if final else ''}",
                              on_released=on_released)

    def _measure_rate(self, nbytes: int, seconds: float) -> None:
        """Only writes of 1 MiB and more: small ones measure per-write overhead, not the rate."""
        if nbytes < (1 << 20) or seconds <= 0:
            return
        rate = nbytes / seconds
        self.write_rate = rate if not self.write_rate else 0.8 * self.write_rate + 0.2 * rate

    def _write_done(self, ob: _Outbound, ok: bool, error: str, final: bool) -> None:
        """A write's outcome: failures end the reservation at once."""
        if not ok:
            self._fail(ob, f"write to engine {ob.target.engine_id} failed: {error}")
        elif final and not ob.state.terminal:
            self.trace("final_done", ob.target.reservation_id)
            ob.state = PushState.PUSHED
            self.counters["pushed"] += 1
            self._finish(ob, "")

    def _write_released(self, ob: _Outbound) -> None:
        """NIXL let go of a write: it reads staging no more. Staging is freed only when
        no write of the request is left (a cancelled write NIXL cannot release yet
        keeps it, so a later request can never have its bytes sent by a zombie)."""
        ob.inflight -= 1
        if ob.state.terminal:
            if not ob.inflight:
                self._free_staging(ob)
        else:
            self._maybe_post_final(ob)

    def _fail(self, ob: _Outbound, reason: str, peer_gone: bool = False,
              state: PushState = PushState.FAILED) -> None:
        if ob.state.terminal:
            return
        ob.state = state
        ob.queued.clear()
        ob.final = None
        self.counters["failed" if state == PushState.FAILED else "cancelled"] += 1
        t = ob.target
        if peer_gone:
            self.peers.mark_dead(t.engine_id, t.incarnation, reason)
        elif ob.begun and ob.peer is not None:
            try:  # let a waiting decode connector know before the control plane's deadline
                self.transport.send_notif(ob.peer.agent_name, notify.encode(notify.PushNotice(
                    notify.ABORT, t.reservation_id, t.incarnation, reason=reason)))
            except TransferError as exc:
                log.info("abort notice for %s not sent: %s", t.reservation_id, exc)
        log.info("push of %s (reservation %s) %s: %s", ob.request_id, t.reservation_id, state.value, reason,
                 extra={"reservation_id": t.reservation_id, "request_id": ob.request_id, "engine_id": t.engine_id})
        self._finish(ob, reason)
        if not ob.inflight:  # otherwise freed when the last write stops reading staging
            self._free_staging(ob)

    def _finish(self, ob: _Outbound, reason: str) -> None:
        self._requests.pop(ob.request_id, None)
        self._ended[ob.request_id] = ob.state
        while len(self._ended) > self.config.tombstones:
            self._ended.popitem(last=False)
        now = time.monotonic()
        self._emit(PushOutcome(ob.request_id, ob.target.reservation_id, ob.target.engine_id, ob.state, reason,
                               ob.bytes_pushed, ob.transfers, now - ob.started,
                               now - ob.final_at if ob.final_at else 0.0))

    def _free_staging(self, ob: _Outbound) -> None:
        if not ob.staging_freed:
            ob.staging_freed = True
            self.staging.free(ob.alloc.alloc_id)

    def _emit(self, outcome: PushOutcome) -> None:
        if self.on_outcome is not None:
            # Off the critical path: the caller reports to the control plane later.
            self._later(self.on_outcome, outcome)

    @staticmethod
    def _later(fn, *args) -> None:
        try:
            asyncio.get_running_loop().call_soon(fn, *args)
        except RuntimeError:  # no loop (synchronous use in tests)
            fn(*args)

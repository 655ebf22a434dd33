"""The prefill sidecar's push engine: staged KV -> a decode engine's landing blocks.

The engine (through the local channel; each tensor-parallel rank on its own) calls,
per request:

1. ``begin(request_id, target, rank=)`` once per rank: the first checks the
   destination (peer known and alive, KV layouts compatible, block ids inside its
   pool) *before anything is written*, plans the heads' shares between the ranks
   (``kvpush/sidecar/slices.py``) and allocates every share's staging in the destination's
   geometry; each rank gets the allocations of the shares it sends, so it knows
   where to copy which heads.
2. ``push(request_id, layer, start, end, rank=)`` per staged layer or chunk: one
   NIXL WRITE of the merged descriptors of that rank's shares, posted at once. The
   layer-by-layer writes overlap with the engine computing the next layer.
3. The ``LANDED`` notification is carried by the *final* write, posted only when
   every earlier write of the request (every rank's) is DONE, so the decode side can
   never see it before all the bytes: the piece that completes the request when
   nothing else is in flight, else a rewrite of that piece's last bytes (the piece
   itself is written at once).
4. When the final write is DONE the staging is held (below) and a ``PushOutcome``
   (PUSHED) is reported; any failure, timeout or cancellation reports FAILED
   or CANCELLED instead, stops the request's remaining pushes, frees its
   staging once no write still reads from it, and tells the decode side
   (best effort) with an ``ABORT`` notification.

Every wait is bounded: writes by ``transfer_timeout_s``, peer resolution by
``resolve_timeout_s``. A peer that disconnected is marked dead, so the next
request to it is refused at ``begin`` without touching the network.

Decode failover (staging held after the push, pushed again into the reservation that
replaced a failed one) is the other half of the class: ``kvpush/sidecar/push_failover.py``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Callable

import numpy as np

from kvpush.contract.layout import KvLayout
from kvpush.contract.states import PushState
from kvpush.contract.target import PushTarget
from kvpush.trace import Trace
from kvpush.sidecar import notify
from kvpush.sidecar.transport.base import TransferError, Transport
from kvpush.sidecar import slices
from kvpush.sidecar.descriptors import block_checksums
from kvpush.sidecar.peers import PeerRegistry, PeerUnavailable, RemotePeer
from kvpush.sidecar.pools import StagingFull, StagingPool
from kvpush.channel.pool import StagingAllocation
from kvpush.sidecar.progress import ProgressDriver
from kvpush.sidecar.outbound import Outbound, PushConfig, PushError, PushOutcome
from kvpush.sidecar.push_failover import HeldPushes
from kvpush.sidecar.staging_hold import StagingHold

log = logging.getLogger(__name__)


class PushEngine(HeldPushes):
    def __init__(self, transport: Transport, driver: ProgressDriver, staging: list[StagingPool], layout: KvLayout,
                 peers: PeerRegistry, config: PushConfig = PushConfig(),
                 on_outcome: Callable[[PushOutcome], None] | None = None,
                 on_start: Callable[[str, str], None] | None = None):
        self.transport = transport
        self.driver = driver
        self.staging = staging  # one pool per rank
        self.layout = layout
        self.peers = peers
        self.config = config
        self.on_outcome = on_outcome
        self.on_start = on_start  # (reservation_id, request_id) when its first write is posted
        self._requests: dict[str, Outbound] = {}  # by the engine's request id, held ones included
        self.held = StagingHold(config.hold_s, self._hold_over)  # staging kept for decode failover
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # ended reservations: why
        self._ended: collections.OrderedDict[str, PushState] = collections.OrderedDict()
        self.counters = collections.Counter()
        self.trace = Trace.off()
        self.write_rate = 0.0  # bytes/s of recent writes (moving average; 0 = not measured yet)

    # -- the engine's calls ------------------------------------------------------------
    def begin(self, request_id: str, target: PushTarget, owner: str = "", holdable: bool = False,
              rank: int = 0) -> tuple[StagingAllocation, ...]:
        """Check the destination, allocate staging; ``PushError`` (and a FAILED outcome) if refused.
        Returns where ``rank`` stages its shares (none: it sends nothing). ``holdable``: the
        reservation names this prefill engine, so the control plane can move it (only then
        is its staging held after the push)."""
        ob = self._requests.get(request_id)
        if ob is not None:
            if rank in ob.owners or ob.state.terminal and not ob.held:
                raise PushError(f"request {request_id} is already being pushed")
            ob.owners[rank] = owner  # another rank of a request begun: its shares are staged
            return tuple(sl.alloc for sl in ob.slices_of(rank))
        try:
            # Its blocks may be free already, even another request's once their quarantine
            # is over: nothing is written into them.
            if target.deadline_unix_ms and time.time() * 1000 >= target.deadline_unix_ms:
                raise PushError(f"reservation {target.reservation_id} is past its deadline")
            if target.reservation_id in self._gone:
                raise PushError(f"reservation {target.reservation_id} has ended ({self._gone[target.reservation_id]})")
            plan, geom = slices.plan_request(self.layout, target)
            if self.config.checksums and len(plan.shares) > 1:
                raise PushError("--checksums covers pushes of one head share (no tensor parallelism) only")
            if len(target.block_ids) < geom.num_blocks:
                raise PushError(f"reservation {target.reservation_id} has {len(target.block_ids)} blocks, "
                                f"{target.num_tokens} tokens need {geom.num_blocks}")
            peer = None
            if self.peers.cached(target.engine_id, target.incarnation) or self.peers.resolver is None:
                peer = self.peers.get(target.engine_id, target.incarnation)
                self._check_peer(peer, target, geom.num_blocks)
            cut = slices.allocate(plan, target.num_tokens, self.staging, owner, self._make_room)
        except (PushError, PeerUnavailable, StagingFull, ValueError) as exc:
            self.counters["refused"] += 1
            self._emit(PushOutcome(request_id, target.reservation_id, target.engine_id, PushState.FAILED,
                                   f"refused: {exc}"))
            raise PushError(str(exc)) from exc
        layers = self.layout.num_layers
        coverage = {sl.share.src_rank: [0] * layers for sl in cut}
        ob = Outbound(request_id, target, geom, cut, coverage,
                       len(coverage) * layers * target.num_tokens, time.monotonic(), owners={rank: owner},
                       holdable=holdable)
        self._requests[request_id] = ob
        if peer is not None:
            self._attach_peer(ob, peer)
        else:
            ob.state = PushState.RESOLVING
            asyncio.get_running_loop().create_task(self._resolve(ob), name=f"resolve-{target.engine_id}")
        return tuple(sl.alloc for sl in ob.slices_of(rank))

    def push(self, request_id: str, layer: int, start: int = 0, end: int | None = None, rank: int = 0) -> None:
        """Push tokens ``[start, end)`` of ``layer`` (already staged by ``rank``). Never raises:
        a bad push fails its reservation (reported through ``on_outcome``)."""
        ob = self._requests.get(request_id)
        if ob is None:
            if request_id not in self._ended:
                log.warning("push for unknown request %s ignored", request_id)
            return
        if ob.state.terminal and not ob.held:
            return
        cov = ob.coverage.get(rank)
        if cov is None:  # a rank whose heads another rank sends: nothing staged, nothing to write
            return
        end = ob.target.num_tokens if end is None else end
        if ob.held:  # staged for a relocation: count it, write nothing
            if 0 <= layer < self.layout.num_layers and start == cov[layer] < end <= ob.target.num_tokens:
                cov[layer] = end
                ob.remaining -= end - start
                return
            return self._drop_held(ob, f"layer {layer} piece [{start}, {end}) out of order while held")
        if not 0 <= layer < self.layout.num_layers:
            return self._fail(ob, f"layer {layer} outside [0, {self.layout.num_layers})")
        if start != cov[layer] or not start < end <= ob.target.num_tokens:
            return self._fail(ob, f"rank {rank} layer {layer} piece [{start}, {end}) out of order "
                                  f"(next token is {cov[layer]} of {ob.target.num_tokens})")
        cov[layer] = end
        ob.remaining -= end - start
        final = ob.remaining == 0
        if final:
            ob.state = PushState.FINALIZING
            ob.final_at = time.monotonic()
            self.trace("final_piece", ob.target.reservation_id, f"inflight={ob.inflight}")
        if ob.peer is None:  # still resolving the peer: keep the order
            ob.queued.append((rank, layer, start, end, final))
            return
        self._push_piece(ob, rank, layer, start, end, final)

    def end(self, request_id: str, aborted: bool = False, reason: str = "", rank: int = 0) -> None:
        """The engine (``rank`` of it) is done with the request (finished, or aborted: stop and free)."""
        ob = self._requests.get(request_id)
        if ob is None:
            return
        ob.ended_ranks.add(rank)
        left = ob.rank_remaining(rank)
        if ob.held:
            ob.engine_done = ob.all_ended
            if aborted or left:
                return self._drop_held(ob, f"the engine ended it with {left} layer-tokens not staged")
            if ob.engine_done:
                self.held.arm(ob)  # the hold runs from the end of staging
            return
        if ob.state.terminal:
            return
        ob.engine_done = ob.all_ended
        if aborted:
            self._fail(ob, f"aborted by the engine: {reason}" if reason else "aborted by the engine",
                       state=PushState.CANCELLED)
        elif left:
            self._fail(ob, f"engine finished the request with {left} layer-tokens not pushed"
                           + (f" (rank {rank})" if len(ob.coverage) > 1 else ""))

    def cancel_reservation(self, reservation_id: str, reason: str = "cancelled", hold: bool = False) -> bool:
        """Stop every pending push of a reservation (deadline, abort by the control plane).
        ``hold``: it failed on the decode side (its engine died): keep its staging for a
        relocation; otherwise held staging of it is freed too."""
        self._gone[reservation_id] = reason  # a BEGIN for it from now on is refused
        while len(self._gone) > self.config.tombstones:
            self._gone.popitem(last=False)
        held = self.held.get(reservation_id)
        if held is not None:
            if not hold:
                self._drop_held(held, reason)
            return not hold
        ob = self._outbound_of(reservation_id)
        if ob is not None and not ob.state.terminal:
            self._fail(ob, reason, state=PushState.CANCELLED, hold=hold)
            return True
        return False

    def drop_owner(self, owner: str) -> None:
        """The engine connection ``owner`` closed: its unfinished requests fail.
        A request whose every piece is already posted is complete in staging and finishes."""
        for ob in list(self._requests.values()):
            if owner not in ob.owners.values():
                continue
            if ob.state in (PushState.RESOLVING, PushState.PUSHING):
                self._fail(ob, "engine connection closed before the request was fully staged")
            elif ob.held and not ob.engine_done:
                self._drop_held(ob, "engine connection closed before the request was fully staged")

    def state(self, request_id: str) -> PushState | None:
        ob = self._requests.get(request_id)
        return ob.state if ob is not None else self._ended.get(request_id)

    @property
    def active(self) -> int:
        """Pushes under way (held staging is not one)."""
        return len(self._requests) - len(self.held)

    def live_reservations(self) -> list[str]:
        """Reservations with a push under way here, or staging held for them."""
        return [ob.target.reservation_id for ob in self._requests.values() if not ob.state.terminal or ob.held]

    # -- internals -------------------------------------------------------------------------
    def _check_peer(self, peer: RemotePeer, target: PushTarget, num_blocks: int) -> None:
        why = self.layout.compatibility_error(peer.layout)
        if why:
            raise PushError(f"engine {target.engine_id} cannot take our KV: {why}")
        if peer.layout.tp_size != target.tp_size:
            raise PushError(f"reservation {target.reservation_id} says engine {target.engine_id} has tp "
                            f"{target.tp_size}, its record {peer.layout.tp_size}")
        peer.check_blocks(list(target.block_ids[:num_blocks]), target.block_size)

    def _attach_peer(self, ob: Outbound, peer: RemotePeer) -> None:
        ob.peer = peer
        slices.attach(ob.slices, self.staging, ob.target.block_ids, ob.geom, peer)

    async def _resolve(self, ob: Outbound, after: PushState = PushState.PUSHING) -> None:
        t, generation = ob.target, ob.generation
        try:
            peer = await asyncio.wait_for(self.peers.resolve(t.engine_id, t.incarnation),
                                          self.config.resolve_timeout_s)
            self._check_peer(peer, t, ob.geom.num_blocks)
        except asyncio.TimeoutError:
            if ob.generation == generation:
                self._fail(ob, f"engine {t.engine_id} not resolved within {self.config.resolve_timeout_s} s",
                           hold=True)
            return
        except Exception as exc:  # PeerUnavailable, PushError, resolver errors
            if ob.generation == generation:
                self._fail(ob, f"engine {t.engine_id}: {exc}", hold=True)
            return
        if ob.state.terminal or ob.generation != generation:  # ended, or moved meanwhile
            return
        self._attach_peer(ob, peer)
        if ob.state == PushState.RESOLVING:
            ob.state = after
        while ob.queued and not ob.state.terminal:
            self._push_piece(ob, *ob.queued.popleft())

    def _push_piece(self, ob: Outbound, rank: int, layer: int, start: int, end: int, final: bool) -> None:
        loc, rem = slices.piece(ob.slices_of(rank), self.staging[rank], ob.peer, layer, start, end)
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
        if ob.inflight:
            # Earlier writes are still in flight (another rank's last layer, typically): write
            # this piece now, and carry LANDED on a rewrite of its last few bytes, the same
            # bytes, once every write is DONE, rather than hold the whole piece behind them.
            self._hint_final(ob, loc)
            self._post(ob, loc, rem, b"", final=False)
            if ob.state.terminal:
                return
            loc, rem = _tail(loc), _tail(rem)
        ob.final = (loc, rem)
        self._maybe_post_final(ob)

    def _maybe_post_final(self, ob: Outbound) -> None:
        if ob.final is None or ob.inflight or ob.state.terminal:
            return
        loc, rem = ob.final
        ob.final = None
        sums = None
        if self.config.checksums:  # (one slice: refused at BEGIN otherwise)
            (sl,), pool = ob.slices, self.staging[0]
            sums = tuple(block_checksums(sl.geom, self.layout.num_layers, pool.memory.host_view(), pool.base_address,
                                         lambda layer: sl.local0.shifted(layer * pool.layer_stride)))
        t = ob.target
        self._hint_final(ob, loc)
        notice = notify.PushNotice(notify.LANDED, t.reservation_id, t.incarnation,
                                   tuple(t.block_ids[:ob.geom.num_blocks]), t.block_size, t.num_tokens, sums,
                                   src_tp=self.layout.tp_size)
        self._post(ob, loc, rem, notify.encode(notice), final=True)
        self.trace("final_posted", t.reservation_id, ob.state.value)

    def _hint_final(self, ob: Outbound, loc: np.ndarray) -> None:
        """FINAL notice before the last data write, with its expected duration, when that is
        long enough to matter. Announced short (x0.8): a write seen DONE only at a later
        poll measured slower than it was, and a window opened late is a window missed."""
        eta = 0.8 * float(loc[:, 1].sum()) / self.write_rate if self.write_rate else 0.0
        if eta < self.config.final_hint_min_s:
            return
        t = ob.target
        try:  # best effort: without it the decode side still sees LANDED at its next hot poll
            self.transport.send_notif(ob.peer.agent_name, notify.encode(notify.PushNotice(
                notify.FINAL, t.reservation_id, t.incarnation, eta_s=eta)))
        except TransferError as exc:
            log.info("final-write notice for %s not sent: %s", t.reservation_id, exc)

    def _post(self, ob: Outbound, loc: np.ndarray, rem: np.ndarray, notif: bytes, final: bool) -> None:
        peer, generation = ob.peer, ob.generation
        nbytes = int(loc[:, 1].sum())
        posted = time.perf_counter()
        try:
            handle, done = self.transport.post_write(loc, rem, peer.agent_name,
                                                     local_kind=self.staging[0].memory.mem_kind,
                                                 remote_kind=peer.record.memory_kind, notif=notif)
        except TransferError as exc:
            return self._fail(ob, f"engine {ob.target.engine_id}: {exc}", peer_gone=exc.peer_gone, hold=True)
        ob.inflight += 1
        ob.transfers += 1
        ob.bytes_pushed += nbytes
        self.counters["transfers"] += 1
        self.counters["descriptors"] += len(loc)

        def on_done(ok: bool, error: str) -> None:
            if ok:
                self._measure_rate(nbytes, time.perf_counter() - posted)
            if generation == ob.generation:  # (a write to a target since replaced decides nothing)
                self._write_done(ob, ok, error, final)

        def on_released() -> None:
            if generation == ob.generation:
                self._write_released(ob)
            else:
                ob.stale_inflight -= 1
                self._maybe_free(ob)

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

    def _write_done(self, ob: Outbound, ok: bool, error: str, final: bool) -> None:
        """A write's outcome: failures end the reservation at once."""
        if not ok:
            self._fail(ob, f"write to engine {ob.target.engine_id} failed: {error}", hold=True)
        elif final and not ob.state.terminal:
            self.trace("final_done", ob.target.reservation_id)
            ob.state = PushState.PUSHED
            self.counters["pushed"] += 1
            self._finish(ob, "", hold=True)

    def _write_released(self, ob: Outbound) -> None:
        """NIXL let go of a write: it reads staging no more. Staging is freed only when
        no write of the request is left (a cancelled write NIXL cannot release yet
        keeps it, so a later request can never have its bytes sent by a zombie)."""
        ob.inflight -= 1
        if ob.state.terminal:
            self._maybe_free(ob)
        else:
            self._maybe_post_final(ob)

    def _fail(self, ob: Outbound, reason: str, peer_gone: bool = False,
              state: PushState = PushState.FAILED, hold: bool = False) -> None:
        """``hold``: the failure is the decode side's, so staging may serve a relocation."""
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
        self._finish(ob, reason, hold=hold)
        self._maybe_free(ob)  # otherwise freed when the last write stops reading staging

    def _finish(self, ob: Outbound, reason: str, hold: bool = False) -> None:
        now = time.monotonic()
        self._emit(PushOutcome(ob.request_id, ob.target.reservation_id, ob.target.engine_id, ob.state, reason,
                               ob.bytes_pushed, ob.transfers, now - ob.started,
                               now - ob.final_at if ob.final_at else 0.0))
        if hold and ob.holdable and self.held.enabled:
            self.held.add(ob)
            return
        self._forget(ob)

    def _forget(self, ob: Outbound) -> None:
        self._requests.pop(ob.request_id, None)
        self._ended[ob.request_id] = ob.state
        while len(self._ended) > self.config.tombstones:
            self._ended.popitem(last=False)

    def _maybe_free(self, ob: Outbound) -> None:
        if ob.state.terminal and not ob.held and not ob.inflight and not ob.stale_inflight:
            self._free_staging(ob)

    def _free_staging(self, ob: Outbound) -> None:
        if not ob.staging_freed:
            ob.staging_freed = True
            slices.free(ob.slices, self.staging)

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


TAIL_BYTES = 64


def _tail(desc: np.ndarray) -> np.ndarray:
    """The last ``TAIL_BYTES`` of the last descriptor, as a descriptor of its own."""
    tail = desc[-1:].copy()
    n = min(TAIL_BYTES, int(tail[0, 1]))
    tail[0, 0] += tail[0, 1] - n
    tail[0, 1] = n
    return tail

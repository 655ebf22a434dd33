"""The prefill sidecar: stages its engine's KV and pushes it into decode engines.

Serves BEGIN (check the destination, allocate staging), PUSH (one write per staged
piece), END and AWAIT (a reservation the router named this engine for, from the
handover). The push itself is ``kvpush/sidecar/push.py``; decode peers are cached by
``kvpush/sidecar/peers.py``; reservations heard before their request are held by
``kvpush/sidecar/handover.py``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Callable

from kvpush.channel import frames as F
from kvpush.channel.pool import StagingAllocation
from kvpush.contract.engine import EngineRecord
from kvpush.contract.states import PushState
from kvpush.contract.target import PushTarget
from kvpush.sidecar.base import SidecarBase, SidecarConfig
from kvpush.sidecar.channel_server import Connection
from kvpush.sidecar.handover import Handover
from kvpush.sidecar.peers import PeerRegistry, RemotePeer, Resolver
from kvpush.sidecar.pools import StagingPool
from kvpush.sidecar.push import PushEngine, PushOutcome
from kvpush.sidecar.transport.base import Transport

log = logging.getLogger(__name__)
# A move heard before its push began waits this long for the engine's BEGIN, then fails
# (the decode engine waiting for the KV computes the prompt).
EARLY_MOVE_WAIT_S = 5.0


class PrefillSidecar(SidecarBase):
    def __init__(self, config: SidecarConfig,
                 on_push_outcome: Callable[[PushOutcome], None] | None = None,
                 resolver: Resolver | None = None,
                 on_push_start: Callable[[str, str], None] | None = None,
                 transport_factory: Callable[[SidecarConfig], Transport] | None = None):
        super().__init__(config, transport_factory)
        self.on_push_outcome = on_push_outcome
        self.on_push_start = on_push_start  # (reservation_id, request_id): first write posted
        self.resolver = resolver
        self.peers: PeerRegistry | None = None
        self.pusher: PushEngine | None = None
        self.handover = Handover()
        self._request_owner: dict[str, Connection] = {}
        # Reservations heard by watch as naming this engine, until their BEGIN (-> the
        # router's request id): only they can be moved (Scheduler.Relocate), so only their
        # staging is held after the push.
        self._named: collections.OrderedDict[str, str] = collections.OrderedDict()
        # Reservations moved before their push began: old id -> (the successor, its timer).
        self._moved_early: dict[str, tuple[PushTarget, asyncio.TimerHandle]] = {}

    def _make_pool(self, tag: str, rank: int) -> StagingPool:
        return StagingPool.create(tag, self.config.layout, self.config.num_blocks, self.rank_device(rank))

    def _start_role(self) -> None:
        c = self.config
        self.peers = PeerRegistry(self.transport, self.resolver)
        self.pusher = PushEngine(self.transport, self.driver, self.pools, c.layout, self.peers, c.push,
                                 self._push_outcome, self.on_push_start)
        self.pusher.trace = self.trace
        self.driver.on_notif = self._notif

    # -- what the process main needs ----------------------------------------------------------
    def add_peer(self, record: EngineRecord) -> RemotePeer:
        return self.peers.add(record)

    def cancel_reservation(self, reservation_id: str, reason: str = "cancelled", hold: bool = False) -> bool:
        return self.pusher.cancel_reservation(reservation_id, reason, hold)

    def release_held(self, reservation_id: str) -> bool:
        """Its decode engine consumed the KV: the staging held for a failover goes."""
        return self.pusher.release_held(reservation_id)

    def relocate(self, old_reservation_id: str, target: PushTarget) -> str:
        """The control plane moved a reservation this engine pushes or pushed (its decode
        engine failed): push the staged KV into ``target``. "" or why it cannot."""
        if old_reservation_id in self._named:
            # Heard, its push not begun: the push path, where the router moves it the moment
            # the decode engine refuses, often before vLLM has scheduled the prefill. The
            # push begins into the successor instead.
            timer = asyncio.get_running_loop().call_later(EARLY_MOVE_WAIT_S, self._early_move_expired,
                                                          old_reservation_id)
            self._moved_early[old_reservation_id] = (target, timer)
            return ""
        return self.pusher.relocate(old_reservation_id, target)

    def _early_move_expired(self, old_reservation_id: str) -> None:
        target, _ = self._moved_early.pop(old_reservation_id)
        self._named.pop(old_reservation_id, None)
        self._push_outcome(PushOutcome("", target.reservation_id, target.engine_id, PushState.FAILED,
                                       f"no staged KV for reservation {old_reservation_id}: its push did not "
                                       f"begin within {EARLY_MOVE_WAIT_S:g} s"))

    def live_reservations(self) -> list[str]:
        return self.pusher.live_reservations() if self.pusher is not None else []

    @property
    def active_pushes(self) -> int:
        return self.pusher.active if self.pusher is not None else 0

    def offer_reservation(self, params: dict, request_id: str, reservation_id: str, deadline_unix_ms: int) -> None:
        """The control plane granted a reservation naming this engine (the handover)."""
        self.handover.offer(request_id, params, deadline_unix_ms)
        self._named[reservation_id] = request_id
        while len(self._named) > self.handover.limit:
            self._named.popitem(last=False)
        self.trace("handover_heard", reservation_id, request_id)

    def stats(self) -> dict:
        out = super().stats()
        out.update(self.handover.stats())
        out.update(active=self.pusher.active, staging_held=len(self.pusher.held),
                   staging_held_units=self.pusher.held.units,
                   staging_free_units=sum(p.free_units for p in self.pools),
                   staging_units=sum(p.num_units for p in self.pools),
                   staging_allocations=sum(p.live_allocations for p in self.pools),
                   peer_loads=self.peers.loads, **dict(self.pusher.counters))
        return out

    # -- events -------------------------------------------------------------------------------
    def _push_outcome(self, outcome: PushOutcome) -> None:
        conn = self._request_owner.pop(outcome.request_id, None)
        if conn is not None:
            conn.send_event(F.StateEvent(outcome.reservation_id, outcome.state.value, outcome.reason,
                                         outcome.request_id))
        if self.on_push_outcome is not None:
            self.on_push_outcome(outcome)

    def _notif(self, sender: str, message: bytes) -> None:
        log.debug("prefill sidecar ignores a notification from %s", sender)

    # -- ChannelHandler -------------------------------------------------------------------------
    def on_begin(self, conn: Connection, req: F.BeginRequest) -> tuple[StagingAllocation, ...]:
        if not self.accepting:
            raise ValueError(f"sidecar {self.config.engine_id} is shutting down; not accepting pushes")
        # Each rank of a tensor-parallel engine begins the request, in any order: the first
        # decides its target; rank 0's connection hears its outcome.
        if conn.rank == 0:
            self._request_owner[req.request_id] = conn
        try:
            target = req.target
            if target.prefill_incarnation and target.prefill_incarnation != self.config.incarnation:
                # Named for an earlier life of this sidecar, whose death the control plane
                # answered by failing it: its landing blocks may be someone else's by now.
                raise ValueError(f"reservation {target.reservation_id} was to be pushed by incarnation "
                                 f"{target.prefill_incarnation} of {self.config.engine_id}, which ended (this is "
                                 f"{self.config.incarnation}): not pushing")
            moved = self._moved_early.pop(target.reservation_id, None)
            if moved is not None:
                moved[1].cancel()
                log.info("push of %s begins into reservation %s, which replaced %s before it began",
                         req.request_id, moved[0].reservation_id, target.reservation_id)
                target = moved[0]
            named = self._named.pop(req.target.reservation_id, None)
            if named is not None:
                # A push the router gave its target (the push path) asks for no handover:
                # the offer is not kept until the deadline.
                self.handover.withdraw(named)
            return self.pusher.begin(req.request_id, target, owner=conn.owner, holdable=named is not None,
                                     rank=conn.rank)
        except Exception:
            if conn.rank == 0:
                self._request_owner.pop(req.request_id, None)
            raise

    def on_push(self, conn: Connection, piece: F.PushPiece) -> None:
        self.pusher.push(piece.request_id, piece.layer, piece.start, piece.end or None, conn.rank)

    def on_end(self, conn: Connection, end: F.EndRequest) -> None:
        self.pusher.end(end.request_id, end.aborted, end.reason, conn.rank)

    def on_await(self, conn: Connection, request_id: str) -> dict | None:
        return self.handover.ask(request_id, conn)

    def on_admin(self, conn: Connection, request: dict):
        if request.get("op") == "add_peer":
            peer = self.add_peer(EngineRecord.from_dict(request["record"]))
            return {"agent": peer.agent_name, "loads": self.peers.loads}
        return super().on_admin(conn, request)

    def on_disconnect(self, conn: Connection) -> None:
        if self.pusher is not None:
            self.pusher.drop_owner(conn.owner)
        for rid in [r for r, c in self._request_owner.items() if c is conn]:
            del self._request_owner[rid]
        self.handover.forget(conn)

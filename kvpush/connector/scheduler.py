"""Scheduler side: which requests push, which load, and what each step must do.

Runs in vLLM's scheduler (the EngineCore process). It never touches KV bytes
and never talks to peers; it reads each request's ``kvpush`` transfer params
(``kvpush.contract.transfer_params``) and turns scheduler events into the step's
``KVPushConnectorMetadata`` for the worker side.

Prefill (the engine's sidecar has the prefill role, request role "prefill"):
    every step that computes prompt tokens of the request emits a ``PushSpec``
    for the tokens not pushed yet, ``[pushed, min(computed after the step,
    reserved))``: under chunked prefill each chunk is pushed as it is
    computed; after a preemption nothing already pushed is pushed again (the
    staging copy holds it). The first spec carries the reservation (BEGIN).
    A request the router sent before its Reserve answered (``AwaitParams``) is
    held ("not yet", nothing computed) until the sidecar hands over its
    reservation (``kvpush.connector.handover_watch``), or computed without a push after
    its wait. Either way its answer says whether it pushed (``push_report`` in
    the response's ``kv_transfer_params``): the router sends decode a load only
    when it did.
    Blocks are never held after the request ends (``request_finished`` returns
    False): the KV was copied into staging during the forward pass.

Decode (sidecar role decode, request role "decode"):
    a request is admitted only once its reservation has LANDED (the scheduler
    hears it from the sidecar through ``kvpush.connector.landing_watch``); until
    then ``get_num_new_matched_tokens`` answers "not yet" (None) and vLLM
    keeps it waiting without blocks. Landed, it is a *synchronous* external
    load of the reserved prompt tokens beyond the local prefix-cache hit: the
    worker copies them in before this very step's forward pass, which then
    computes the last prompt token and the first output token. So nothing
    waits a step for an asynchronous load to be reported, and no decode
    blocks are held while the prefill runs. At most ``prompt - 1`` tokens
    are loaded (vLLM must compute at least one). A reservation that ends
    FAILED or CANCELLED, or does not land by its deadline (plus grace), is
    recomputed locally: the request is admitted with nothing to load. One
    load per request: after a preemption the prompt is recomputed locally.
    An idle engine (its last step ran nothing) sleeps up to ``idle_wait_s``
    in that call for a landing rather than spin through empty steps.

Decode alone, guessed (``AloneParams``): the router sent a conversation's next turn
    to the decode engine that served the last one before its Reserve answered. If
    the engine's own prefix cache holds at least ``min_cached_tokens`` of the prompt
    the request is computed at once (the usual case: nothing waited for); otherwise it
    is held ("not yet", nothing computed, no blocks) for the router to take back when
    the Reserve answers otherwise, and computed here after ``hold_ms`` if it never
    does. The engine's cache is the authority: the control plane's view of it lags.

A request is served normally (no push, no load) when its params are missing or
malformed, name a role this engine does not serve, name another engine or
incarnation, or reserve more tokens than the prompt has (the push could never
complete). The counters say which.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from kvpush.connector.handover_watch import HandoverWatch
from kvpush.connector.landing_watch import LandingWatch
from kvpush.connector.metadata import KVPushConnectorMetadata, LoadSpec, PushSpec
from kvpush.connector.sidecar_link import SidecarInfo
from kvpush.contract.states import DECODE, PREFILL, LandingState
from kvpush.trace import Trace
from kvpush.contract.transfer_params import AloneParams, AwaitParams, PushParams, TransferParamsError, push_report
from kvpush.connector.sidecar_client import ChannelError

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers


@dataclasses.dataclass
class _Prefill:
    request: object
    params: PushParams
    target: int  # the prompt token after the last one to push (the reservation's end_token)
    pushed: int = 0  # prompt tokens [first_token, pushed) already handed to the worker
    begun: bool = False
    epoch: int = 0  # the handover channel it started under: another one means the sidecar went away


@dataclasses.dataclass
class _Awaiting:
    request: object
    key: str          # the router's request id: the reservation arrives under it
    give_up: float    # monotonic: compute without a push if it has not arrived by then
    since: float      # monotonic


def _us_since(t0: float, now: float | None = None) -> int:
    """Microseconds from monotonic ``t0`` to ``now`` (default: now), as the counters keep time."""
    return round(((time.monotonic() if now is None else now) - t0) * 1e6)


@dataclasses.dataclass
class _Alone:
    min_cached: int   # the prompt tokens this engine must hold to compute the rest at once
    give_up: float    # monotonic: compute it anyway if the router has not taken it back by then
    since: float      # monotonic: its arrival, when the hold began
    short: bool = False  # it held less: waiting for the router


@dataclasses.dataclass
class _Decode:
    request: object
    params: PushParams
    give_up: float  # monotonic: recompute locally if nothing landed by then
    waiting_since: float  # monotonic
    local: int = 0  # locally computed tokens at the last "landed" answer
    decided: bool = False  # loaded, recomputed or released: never again


@dataclasses.dataclass(frozen=True)
class DecodeTiming:
    load_timeout_s: float = 30.0  # longest wait for a landing
    deadline_grace_s: float = 0.5  # wait this long past the reservation's deadline
    idle_wait_s: float = 0.005  # an idle engine sleeps this long per step for a landing


def give_up_time(now: float, timeout_s: float, deadline_unix_ms: int, grace_s: float) -> float:
    """When to stop waiting for a landing: the load timeout, or the reservation's
    deadline (plus grace) if that comes first."""
    limit = now + timeout_s
    if deadline_unix_ms:
        limit = min(limit, now + (deadline_unix_ms / 1000.0 - time.time()) + grace_s)
    return limit


class KVPushScheduler:
    def __init__(self, sidecar: SidecarInfo, block_size: int, produce: bool, consume: bool,
                 block_ids_of: Callable[[str], list[int]], watch: LandingWatch | None = None, timing: DecodeTiming = DecodeTiming(),
                 trace: Trace | None = None, handover: HandoverWatch | None = None):
        self.sidecar = sidecar
        self.block_size = block_size
        self.produce = produce and sidecar.role == PREFILL
        self.consume = consume and sidecar.role == DECODE
        if self.consume and watch is None:
            raise ValueError("a decode scheduler needs a LandingWatch")
        self.watch = watch
        self.timing = timing
        self.trace = trace or Trace.off()
        self.block_ids_of = block_ids_of
        self.handover = handover
        self._epoch = watch.epoch if watch is not None else 0  # the watch's channel ``sidecar`` came from
        self._prefill: dict[str, _Prefill] = {}
        self._awaiting: dict[str, _Awaiting] = {}
        self._reports: dict[str, str] = {}  # prefill request -> its reservation ("" none yet): answered on finish
        self._decode: dict[str, _Decode] = {}
        self._alone: dict[str, _Alone] = {}
        self._meta = KVPushConnectorMetadata()
        self._last_step_tokens = 0  # tokens the last built step ran: 0 = the engine is idle
        self._waited = False  # this scheduling pass slept for a landing already
        # Idle waits are folded into the counters when a load is decided: a
        # counter change per empty step would rewrite the stats file every step.
        self._idle_waits, self._idle_wait_us = 0, 0

    # -- counters, shipped to the worker with the next metadata ---------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self._meta.counts[name] = self._meta.counts.get(name, 0) + n

    # -- request arrival ---------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        rid = request.request_id
        try:
            alone = AloneParams.from_request(request.kv_transfer_params)
            pending = None if alone is not None else AwaitParams.from_request(request.kv_transfer_params)
            params = None if alone or pending else PushParams.from_request(request.kv_transfer_params)
        except TransferParamsError as exc:
            log.warning("request %s: kvpush params ignored: %s", rid, exc)
            self._count("bad_params")
            return
        if alone is not None:
            if not self.consume:
                log.warning("request %s: a guessed decode-alone request on an engine that does not load "
                            "(sidecar role %s)", rid, self.sidecar.role)
                self._count("role_ignored")
                return
            now = time.monotonic()
            self._alone[rid] = _Alone(alone.min_cached_tokens, now + alone.hold_ms / 1000.0, now)
            self._count("alone_guessed")
            return
        if pending is not None and self.produce and self.handover is not None:
            self._reports[rid] = ""
            try:
                self.handover.expect(pending.request_id)
            except ChannelError as exc:
                log.warning("request %s: cannot ask the sidecar for its reservation (%s); not pushing", rid, exc)
                self._count("handover_channel")
                return
            now = time.monotonic()
            self._awaiting[rid] = _Awaiting(request, pending.request_id, now + pending.wait_ms / 1000.0, now)
            self._count("handover_awaited")
            self.trace("handover_awaited", pending.request_id, rid)  # keyed by the router's id: no reservation yet
            return
        if pending is not None:
            log.warning("request %s: a prefill request awaiting its reservation on an engine that does not push "
                        "(sidecar role %s)", rid, self.sidecar.role)
            self._count("role_ignored")
            return
        if params is None:
            self._count("requests_plain")
            return
        prompt = request.num_prompt_tokens
        if params.role == PREFILL and self.produce:
            self._start_prefill(request, params)
        elif params.role == DECODE and self.consume:
            why = self._decode_refusal(params, prompt)
            if why == "wrong_engine" and self._refreshed(params):
                why = self._decode_refusal(params, prompt)
            if why:
                log.warning("request %s: reservation %s not loaded (%s); computing the prompt locally",
                            rid, params.target.reservation_id, why)
                self._count(f"refused_{why}")
                return
            try:
                self.watch.watch(params.target.reservation_id)
            except ChannelError as exc:
                log.warning("request %s: cannot watch reservation %s (%s); computing the prompt locally",
                            rid, params.target.reservation_id, exc)
                self._count("refused_channel")
                return
            now = time.monotonic()
            t = self.timing
            self._decode[rid] = _Decode(request, params, give_up_time(now, t.load_timeout_s, params.target.deadline_unix_ms,
                                                                      t.deadline_grace_s), now)
            self._count("loads_started")
            self.trace("load_planned", params.target.reservation_id, rid)
        else:
            log.warning("request %s: kvpush role %r is not served by this engine (sidecar role %s)",
                        rid, params.role, self.sidecar.role)
            self._count("role_ignored")

    def _start_prefill(self, request, params: PushParams) -> None:
        rid = request.request_id
        self._reports[rid] = params.target.reservation_id
        t = params.target
        if request.num_prompt_tokens < t.end_token:
            log.warning("request %s: prompt of %d tokens cannot fill reservation %s of tokens [%d, %d); not pushing",
                        rid, request.num_prompt_tokens, t.reservation_id, t.first_token, t.end_token)
            self._count("refused_short_prompt")
            return
        # Decode holds the prompt's first first_token tokens: only the rest is pushed.
        self._prefill[rid] = _Prefill(request, params, t.end_token, pushed=t.first_token, epoch=self._handover_epoch())

    # -- prefill: a request sent before its reservation was granted ---------------------------
    def _await_reservation(self, aw: _Awaiting) -> int | None:
        """0 once the reservation is here (or given up on: computed without a push), None
        ("not yet": vLLM keeps the request waiting, nothing computed) until then."""
        rid = aw.request.request_id
        generation = self.handover.generation  # read first: an arrival after it ends the wait below
        data = self.handover.get(aw.key)
        if data is None and time.monotonic() < aw.give_up and self._may_wait():
            self._waited = True
            self.handover.wait_change(generation, min(self.timing.idle_wait_s, aw.give_up - time.monotonic()))
            data = self.handover.get(aw.key)
        if data is None and time.monotonic() < aw.give_up:
            return None
        del self._awaiting[rid]
        self.handover.forget(aw.key)
        self._count("handover_wait_us_total", _us_since(aw.since))
        if data is None:
            log.warning("request %s: no reservation arrived for %s; computing it without a push", rid, aw.key)
            self._count("handover_timeout")
            return 0
        try:
            params = PushParams.from_dict(data)
        except TransferParamsError as exc:
            log.warning("request %s: the sidecar's reservation is unusable (%s); not pushing", rid, exc)
            self._count("bad_params")
            return 0
        self._count("handover_received")
        self.trace("handover_received", params.target.reservation_id, rid)
        self._start_prefill(aw.request, params)
        return 0

    # -- decode: a guessed decode-alone request ------------------------------------------------
    def _alone_guessed(self, rid: str, al: _Alone, num_computed_tokens: int) -> int | None:
        """0 (compute the rest here) when this engine holds enough of the prompt, or once
        the hold is over; None ("not yet") while the router may still take it back."""
        if num_computed_tokens >= al.min_cached:
            del self._alone[rid]
            self._count("alone_held_prefix")
            return 0
        if not al.short:
            al.short = True
            self._count("alone_short")
        now = time.monotonic()
        if now < al.give_up and self._may_wait():
            # (nothing will wake it: the router's take-back arrives between steps)
            self._waited = True
            time.sleep(min(self.timing.idle_wait_s, al.give_up - now))
            now = time.monotonic()
        if now < al.give_up:
            return None
        del self._alone[rid]
        log.warning("request %s: holds %d prompt tokens, not the %d guessed, and was not taken back; "
                    "computing the rest here", rid, num_computed_tokens, al.min_cached)
        self._count("alone_hold_expired")
        self._count("alone_held_us_total", _us_since(al.since, now))
        return 0

    def _refreshed(self, params: PushParams) -> bool:
        """A reservation for this engine but another incarnation: our sidecar may have
        restarted, and its new channel may be up already (or come up with one attempt now,
        when the channel is down: at most one at a time, never a HELLO per stale reservation
        while a channel is up)."""
        if params.target.engine_id != self.sidecar.engine_id:
            return False
        before = self.sidecar.incarnation
        if self.watch.broken:
            self.watch.redial()
        return self._synced() and self.sidecar.incarnation != before

    def _decode_refusal(self, params: PushParams, prompt: int) -> str:
        if params.target.engine_id != self.sidecar.engine_id or params.target.incarnation != self.sidecar.incarnation:
            return "wrong_engine"
        if prompt < params.target.end_token:
            return "short_prompt"  # the prefill side refuses it too: it would never land
        return ""

    # -- decode: admitted once landed, then a synchronous load ----------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        aw = self._awaiting.get(request.request_id)
        if aw is not None:
            return self._await_reservation(aw), False
        al = self._alone.get(request.request_id)
        if al is not None:
            return self._alone_guessed(request.request_id, al, num_computed_tokens), False
        st = self._decode.get(request.request_id)
        if st is None or st.decided:
            return 0, False
        res = st.params.target.reservation_id
        if not self._synced():
            self._recompute(st, "channel", "the sidecar's channel is closed")
            return 0, False
        if st.params.target.incarnation != self.sidecar.incarnation:
            self._recompute(st, "restarted", f"the sidecar restarted: reservation {res} went with it")
            return 0, False
        generation = self.watch.generation
        state, landed = self.watch.state(res)
        if state != LandingState.LANDED and not state.ended and time.monotonic() < st.give_up and self._may_wait():
            self._waited = True
            t0 = time.monotonic()
            self.watch.wait_change(generation, min(self.timing.idle_wait_s, max(0.0, st.give_up - t0)))
            self._idle_waits += 1
            self._idle_wait_us += _us_since(t0)
            state, landed = self.watch.state(res)
        if state == LandingState.LANDED:
            first = st.params.target.first_token
            if num_computed_tokens < first:
                # The prefix the reservation counted on was evicted since the Reserve: the
                # landed tokens do not join what the engine holds. Given back (landed: at
                # once), and the prompt computed here.
                self.watch.release(res, time.monotonic() + self.timing.deadline_grace_s)
                self._recompute(st, "prefix_evicted", f"reservation {res} starts at token {first}, the engine "
                                                      f"holds {num_computed_tokens} of the prompt")
                return 0, False
            # vLLM computes at least the last prompt token itself (and samples from it).
            usable = min(request.num_prompt_tokens - 1, first + min(st.params.target.num_tokens, landed))
            st.local = num_computed_tokens
            return max(0, usable - num_computed_tokens), False
        if state.ended:
            self._recompute(st, state.value.lower(), f"reservation {res} is {state.value}")
            return 0, False
        if time.monotonic() >= st.give_up:
            self._recompute(st, "timeout", f"reservation {res} did not land in time (last state {state.value})")
            self.watch.release(res, time.monotonic() + self.timing.deadline_grace_s)
            return 0, False
        return None, False  # not landed yet: ask again at the next step

    def _synced(self) -> bool:
        """Whether the watch's channel (dialed again by itself when closed) is up, having
        caught up with a new one: a restarted sidecar is a new incarnation (requests waiting
        on the old one are recomputed, those on this one subscribed again on it)."""
        if self.watch.broken:
            return False
        if self.watch.epoch == self._epoch:
            return True
        epoch, info = self.watch.epoch, self.watch.info
        if info.incarnation != self.sidecar.incarnation:
            log.warning("kvpush sidecar %s is now incarnation %s (was %s)", info.engine_id, info.incarnation,
                        self.sidecar.incarnation)
        self.sidecar = info
        for st in self._decode.values():
            if not st.decided and st.params.target.incarnation == info.incarnation:
                try:
                    self.watch.watch(st.params.target.reservation_id)
                except ChannelError:
                    return False
        self._epoch = epoch
        return True

    def _handover_epoch(self) -> int:
        """The prefill sidecar's channel now (-1: closed). A sidecar that went away took the
        pushes handed to the worker with it: the router must not send decode a load then."""
        return 0 if self.handover is None else -1 if self.handover.broken else self.handover.epoch

    def _may_wait(self) -> bool:
        """Sleep for a landing only when the engine has nothing else to run, once a pass."""
        return self.timing.idle_wait_s > 0 and self._last_step_tokens == 0 and not self._waited

    def _recompute(self, st: _Decode, reason: str, detail: str) -> None:
        log.warning("kvpush load of %s failed (%s): %s; the prompt is computed locally",
                    st.request.request_id, reason, detail)
        st.decided = True
        self._count("load_errors")
        self._count(f"load_error_{reason}")
        self._fold_idle_waits()
        self.watch.recomputed(st.params.target.reservation_id, reason)
        self.watch.forget(st.params.target.reservation_id)

    def _fold_idle_waits(self) -> None:
        if self._idle_waits:
            self._count("idle_waits", self._idle_waits)
            self._count("idle_wait_us_total", self._idle_wait_us)
            self._idle_waits, self._idle_wait_us = 0, 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._decode.get(request.request_id)
        if st is None or st.decided:
            return
        st.decided = True
        p = st.params
        if num_external_tokens <= 0:
            # Nothing to load after all (the local prefix cache covers it): let it go.
            self._count("load_skipped_local_hit")
            self.watch.release(p.target.reservation_id, st.give_up)
            return
        src_tp = self.watch.src_tp(p.target.reservation_id)
        self.watch.forget(p.target.reservation_id)
        wait_ms = round((time.monotonic() - st.waiting_since) * 1e3)
        self._count("load_wait_ms_total", wait_ms)
        self._meta.maxima["load_wait_ms_max"] = max(wait_ms, self._meta.maxima.get("load_wait_ms_max", 0))
        self._fold_idle_waits()
        block_ids = tuple(blocks.get_block_ids()[0])
        self._meta.loads.append(LoadSpec(request.request_id, p.target, block_ids, st.local,
                                         st.local + num_external_tokens, src_tp))

    # -- the step's metadata ------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> KVPushConnectorMetadata:
        if self._prefill:
            for rid, n in scheduler_output.num_scheduled_tokens.items():
                st = self._prefill.get(rid)
                if st is None or st.pushed >= st.target:
                    continue
                computed = st.request.num_computed_tokens + n  # num_computed_tokens is the pre-step value
                end = min(computed, st.target)
                if end <= st.pushed:
                    continue  # recomputing tokens already pushed (after a preemption)
                begin = None
                if not st.begun:
                    p = st.params
                    begin = p.target
                    st.begun = True
                self._meta.pushes.append(PushSpec(rid, tuple(self.block_ids_of(rid)), st.pushed, end,
                                                  end == st.target, begin))
                st.pushed = end
        if self.watch is not None:
            self.watch.housekeeping()
            consumed = self.watch.take_consumed_releases()
            if consumed:
                self._count("releases_consumed", consumed)
        meta, self._meta = self._meta, KVPushConnectorMetadata()
        meta.scheduled_tokens = self._last_step_tokens = scheduler_output.total_num_scheduled_tokens
        self._waited = False
        return meta

    # -- the end of a request -----------------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, dict | None]:
        rid = request.request_id
        st = self._prefill.pop(rid, None)
        if st is not None and st.begun and st.pushed < st.target:
            reason = f"request ended ({request.status}) after {st.pushed} of {st.target} tokens"
            self._meta.push_aborts.append((rid, reason))
        aw = self._awaiting.pop(rid, None)
        if aw is not None:
            self.handover.forget(aw.key)
        report = None
        if rid in self._reports:
            # The router reads this from the prefill answer's kv_transfer_params: whether
            # decode can load the prompt or must compute it.
            pushed = st is not None and st.begun and st.pushed >= st.target and st.epoch == self._handover_epoch() != -1
            if st is not None and st.begun and not pushed:
                self._count("push_reported_lost")
            report = push_report(self._reports.pop(rid), pushed)
        al = self._alone.pop(rid, None)
        if al is not None:
            self._count("alone_taken_back")
            if al.short:  # (what a wrong guess cost it: the time until it was taken back)
                self._count("alone_held_us_total", _us_since(al.since))
        dst = self._decode.pop(rid, None)
        if dst is not None and not dst.decided:
            self._count("loads_abandoned")
            self.watch.release(dst.params.target.reservation_id, dst.give_up)  # consumed if it lands
        return False, report  # blocks are never held past the request

    @property
    def tracked(self) -> int:
        return len(self._prefill) + len(self._decode) + len(self._awaiting) + len(self._reports) + len(self._alone)

"""Scheduler side: which requests push, which load, and what each step must do.

Runs in vLLM's scheduler (the EngineCore process). It never touches KV bytes
and never talks to peers; it reads each request's ``kvpush`` transfer params
(``kvpush.transfer_params``) and turns scheduler events into the step's
``KVPushConnectorMetadata`` for the worker side.

Prefill (the engine's sidecar has the prefill role, request role "prefill"):
    every step that computes prompt tokens of the request emits a ``PushSpec``
    for the tokens not pushed yet, ``[pushed, min(computed after the step,
    reserved))``: under chunked prefill each chunk is pushed as it is
    computed; after a preemption nothing already pushed is pushed again (the
    staging copy holds it). The first spec carries the reservation (BEGIN).
    Blocks are never held after the request ends (``request_finished`` returns
    False): the KV was copied into staging during the forward pass.

Decode (sidecar role decode, request role "decode"):
    an asynchronous external load of the reserved prompt tokens beyond the
    local prefix-cache hit. vLLM itself recomputes the last prompt token after
    a full-prompt load (``_update_waiting_for_remote_kv``), so the count is
    simply ``min(prompt, reserved) - local``. One load per request: after a
    preemption the prompt is recomputed locally (the landing blocks are gone).

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

from connector.metadata import (
    KVPushConnectorMetadata,
    LoadSpec,
    PushSpec,
    Release,
    Target,
)
from connector.sidecar_link import DECODE, PREFILL, SidecarInfo
from kvpush.transfer_params import PushParams, TransferParamsError

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers


@dataclasses.dataclass
class _Prefill:
    request: object
    params: PushParams
    target: int  # tokens to push (= reserved tokens)
    pushed: int = 0  # tokens [0, pushed) already handed to the worker
    begun: bool = False


@dataclasses.dataclass
class _Decode:
    request: object
    params: PushParams
    local: int = 0  # locally computed tokens when the load was planned
    started: bool = False  # a load (or a release) was planned: never again
    loading: bool = False  # a load is in flight (not yet in finished_recving)


class KVPushScheduler:
    def __init__(self, sidecar: SidecarInfo, block_size: int, produce: bool, consume: bool,
                 block_ids_of: Callable[[str], list[int]], refresh: Callable[[], SidecarInfo] | None = None):
        self.sidecar = sidecar
        self.refresh = refresh  # HELLO again: the sidecar may have restarted (new incarnation)
        self._next_refresh = 0.0
        self.block_size = block_size
        self.produce = produce and sidecar.role == PREFILL
        self.consume = consume and sidecar.role == DECODE
        self.block_ids_of = block_ids_of
        self._prefill: dict[str, _Prefill] = {}
        self._decode: dict[str, _Decode] = {}
        self._meta = KVPushConnectorMetadata()

    # -- counters, shipped to the worker with the next metadata ---------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self._meta.counts[name] = self._meta.counts.get(name, 0) + n

    # -- request arrival ---------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        rid = request.request_id
        try:
            params = PushParams.from_request(request.kv_transfer_params)
        except TransferParamsError as exc:
            log.warning("request %s: kvpush params ignored: %s", rid, exc)
            self._count("bad_params")
            return
        if params is None:
            self._count("requests_plain")
            return
        prompt = request.num_prompt_tokens
        if params.role == PREFILL and self.produce:
            if prompt < params.num_tokens:
                log.warning("request %s: prompt of %d tokens cannot fill reservation %s of %d tokens; not pushing",
                            rid, prompt, params.reservation_id, params.num_tokens)
                self._count("refused_short_prompt")
                return
            self._prefill[rid] = _Prefill(request, params, params.num_tokens)
        elif params.role == DECODE and self.consume:
            why = self._decode_refusal(params, prompt)
            if why == "wrong_engine" and self._refreshed(params):
                why = self._decode_refusal(params, prompt)
            if why:
                log.warning("request %s: reservation %s not loaded (%s); computing the prompt locally",
                            rid, params.reservation_id, why)
                self._count(f"refused_{why}")
                return
            self._decode[rid] = _Decode(request, params)
        else:
            log.warning("request %s: kvpush role %r is not served by this engine (sidecar role %s)",
                        rid, params.role, self.sidecar.role)
            self._count("role_ignored")

    def _refreshed(self, params: PushParams) -> bool:
        """A reservation for this engine but another incarnation: has our sidecar restarted?
        (Asked at most once a second; a stale reservation must not cost a HELLO each.)"""
        if self.refresh is None or params.engine_id != self.sidecar.engine_id:
            return False
        now = time.monotonic()
        if now < self._next_refresh:
            return False
        self._next_refresh = now + 1.0
        try:
            info = self.refresh()
        except Exception as exc:
            log.warning("kvpush sidecar HELLO failed: %s", exc)
            return False
        changed = info.incarnation != self.sidecar.incarnation
        if changed:
            log.warning("kvpush sidecar %s is now incarnation %s (was %s)", info.engine_id, info.incarnation,
                        self.sidecar.incarnation)
            self.sidecar = info
        return changed

    def _decode_refusal(self, params: PushParams, prompt: int) -> str:
        if params.engine_id != self.sidecar.engine_id or params.engine_incarnation != self.sidecar.incarnation:
            return "wrong_engine"
        if prompt < params.num_tokens:
            return "short_prompt"  # the prefill side refuses it too: it would never land
        return ""

    # -- decode: the asynchronous load ------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._decode.get(request.request_id)
        if st is None or st.started:
            return 0, False
        count = min(request.num_prompt_tokens, st.params.num_tokens) - num_computed_tokens
        if count <= 0:
            return 0, False
        st.local = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._decode.get(request.request_id)
        if st is None or st.started:
            return
        st.started = True
        p = st.params
        if num_external_tokens <= 0:
            # Nothing to load after all (the local prefix cache covers it): let it go.
            self._count("load_skipped_local_hit")
            self._meta.releases.append(Release(p.reservation_id, p.deadline_unix_ms))
            return
        st.loading = True
        block_ids = tuple(blocks.get_block_ids()[0])
        self._meta.loads.append(LoadSpec(
            request.request_id, p.reservation_id, p.engine_id, p.engine_incarnation, tuple(p.block_ids),
            p.block_size, p.num_tokens, block_ids, st.local, st.local + num_external_tokens, p.deadline_unix_ms))

    def update_connector_output(self, finished_recving) -> None:
        for rid in finished_recving or ():
            st = self._decode.get(rid)
            if st is not None:
                st.loading = False

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
                    begin = Target(p.reservation_id, p.engine_id, p.engine_incarnation, tuple(p.block_ids),
                                   p.block_size, p.num_tokens)
                    st.begun = True
                self._meta.pushes.append(PushSpec(rid, tuple(self.block_ids_of(rid)), st.pushed, end,
                                                  end == st.target, begin))
                st.pushed = end
        meta, self._meta = self._meta, KVPushConnectorMetadata()
        meta.scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        return meta

    # -- the end of a request -----------------------------------------------------------------
    def request_finished(self, request) -> tuple[bool, None]:
        rid = request.request_id
        st = self._prefill.pop(rid, None)
        if st is not None and st.begun and st.pushed < st.target:
            reason = f"request ended ({request.status}) after {st.pushed} of {st.target} tokens"
            self._meta.push_aborts.append((rid, reason))
        dst = self._decode.pop(rid, None)
        if dst is not None:
            if dst.loading:
                self._meta.load_aborts.append(rid)  # stop waiting; report it finished, load nothing
            elif not dst.started:
                p = dst.params
                self._meta.releases.append(Release(p.reservation_id, p.deadline_unix_ms))
        return False, None  # blocks are never held past the request

    @property
    def tracked(self) -> int:
        return len(self._prefill) + len(self._decode)

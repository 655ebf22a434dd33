"""Worker side: the only part that touches KV bytes, and the only one on the channel.

Prefill (sidecar role prefill):
    ``bind`` (before the forward pass): BEGIN each new reservation (one round
    trip; the sidecar checks the destination and allocates staging in the
    destination's block geometry) and END-abort requests that stopped early.
    ``save_kv_layer`` (inside the forward, after each attention layer): copy
    that layer's tokens of each pushing request from the paged cache into
    staging and send PUSH - a fire-and-forget frame, so the forward never
    waits on the sidecar. ``wait_for_save``: END for requests whose last piece
    went out this step.

Decode (sidecar role decode):
    ``start_load_kv``: SUBSCRIBE to each new reservation (the reply is its
    state now; its end comes later as an event). ``get_transfer_results``
    (each step): LANDED -> copy landing blocks into the request's blocks,
    CONSUMED (landing blocks free again), report it received. FAILED,
    CANCELLED, a reservation of another engine, a short landing, a broken
    channel or no landing by the deadline -> report it received *and failed*:
    vLLM then recomputes the prompt (``kv_load_failure_policy="recompute"``).

Bytes move in kvpush's canonical block layout (``connector.cache_codec``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import numpy as np

from connector.cache_codec import BlockCodec, CodecError, flat_layer
from connector.config import ConnectorConfig
from connector.metadata import KVPushConnectorMetadata, LoadSpec, PushSpec
from kvpush.trace import Trace
from connector.sidecar_link import DECODE, PREFILL, SidecarInfo, connect
from connector.stats import Counters
from worker import frames as F
from worker import reblock
from worker.channel import ChannelError, SidecarClient
from worker.geometry import DestGeometry
from worker.memory import ShmMemory
from worker.pools import StagingAllocation

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers

LANDED, FAILED, CANCELLED, CONSUMED = "LANDED", "FAILED", "CANCELLED", "CONSUMED"
ENDED = (FAILED, CANCELLED, CONSUMED)


@dataclasses.dataclass
class _Outbound:
    alloc: StagingAllocation
    geom: DestGeometry
    reservation_id: str = ""


@dataclasses.dataclass
class _StepPush:
    spec: PushSpec
    out: _Outbound
    index: np.ndarray | None = None  # cache element positions of the piece's tokens
    layers: int = 0
    failed: bool = False


@dataclasses.dataclass
class _Pending:
    spec: LoadSpec
    deadline: float  # monotonic
    started: float = 0.0  # monotonic, when the load was planned (subscribed)


def _deadline(now: float, timeout_s: float, deadline_unix_ms: int, grace_s: float) -> float:
    limit = now + timeout_s
    if deadline_unix_ms:
        limit = min(limit, now + (deadline_unix_ms / 1000.0 - time.time()) + grace_s)
    return limit


class KVPushWorker:
    def __init__(self, config: ConnectorConfig, block_size: int, client: SidecarClient | None = None,
                 info: SidecarInfo | None = None, counters: Counters | None = None):
        self.config = config
        self.block_size = block_size
        if client is None:
            client, info = connect(config.sidecar_socket, config.connect_timeout_s, config.channel_timeout_s,
                                   name=f"vllm-worker-{os.getpid()}")
        self.client = client
        self.info = info
        self._lock = threading.Lock()
        self._states: dict[str, tuple[str, int]] = {}  # reservation -> (last state heard, tokens landed)
        client.on_event = self._on_event  # runs on the channel's reader thread
        self.role = info.role
        self.pool = ShmMemory.attach(info.pool.shm_name, info.pool.size_bytes)
        if counters is None:
            path = ""
            if config.stats_dir:
                os.makedirs(config.stats_dir, exist_ok=True)
                path = os.path.join(config.stats_dir, f"{config.engine_name or info.engine_id}.json")
            counters = Counters(path, {"engine_id": info.engine_id, "incarnation": info.incarnation,
                                       "role": info.role, "pid": os.getpid()})
        self.counters = counters
        self.trace = Trace(config.engine_name or info.engine_id)
        self.codec: BlockCodec | None = None
        self.layers: dict[str, int] = {}  # layer name -> index
        self.flat: list[np.ndarray] = []  # per layer index: flat view of vLLM's cache
        # prefill
        self._outbound: dict[str, _Outbound] = {}
        self._step: list[_StepPush] = []
        # decode
        self._pending: dict[str, _Pending] = {}
        self._releases: dict[str, float] = {}  # reservation -> give-up time
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._next_reconnect = 0.0
        self._next_health = 0.0
        self._idle = False  # this step runs no tokens (the scheduler says)
        # Idle waits are counted here and folded into the counters when a load ends:
        # a counter change per empty step would rewrite the stats file every step.
        self._idle_waits, self._idle_wait_us = 0, 0
        self._traced_step = False
        self._arrived = threading.Event()  # a reservation landed or ended: set by the reader thread
        self.counters.flush(force=True)

    # -- set-up ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, codec: BlockCodec, layer_index) -> None:
        """``kv_caches``: layer name -> cache tensor; ``layer_index(name) -> int``."""
        layout = self.info.layout
        indexed = sorted((layer_index(name), name) for name in kv_caches)
        if [i for i, _ in indexed] != list(range(len(indexed))):
            raise CodecError(f"KV cache layers are not numbered 0..n-1: {[i for i, _ in indexed]}")
        if len(indexed) != layout.num_layers:
            raise CodecError(f"the model has {len(indexed)} KV layers, the sidecar's layout {layout.num_layers}")
        if (codec.num_kv_heads, codec.head_dim) != (layout.num_kv_heads, layout.head_dim):
            raise CodecError(f"the model has {codec.num_kv_heads} KV heads of {codec.head_dim}, the sidecar's "
                             f"layout {layout.num_kv_heads} of {layout.head_dim}")
        if layout.dtype != str(codec.dtype) or layout.kv_parts != 2:
            raise CodecError(f"the sidecar's layout holds {layout.dtype} x{layout.kv_parts}, the cache "
                             f"{codec.dtype} x2")
        self.codec = codec
        self.layers = {name: i for i, name in indexed}
        first = kv_caches[indexed[0][1]]
        num_blocks = first.shape[0]
        self.flat = [flat_layer(kv_caches[name], num_blocks, codec) for _, name in indexed]
        self._map_landing()
        log.info("kvpush connector: %s engine %s (incarnation %s), %d layers, %d blocks of %d tokens",
                 self.role, self.info.engine_id, self.info.incarnation, len(self.flat), num_blocks,
                 codec.block_size)

    def _map_landing(self) -> None:
        self._landing = []
        if self.role == DECODE:
            lo, units = self.info.layout, self.info.pool.num_units
            stride = units * lo.block_layer_bytes
            mem = self.pool.host_view()
            self._landing = [mem[i * stride:(i + 1) * stride].reshape(
                units, lo.kv_parts, lo.block_size, lo.num_kv_heads, lo.head_dim * lo.itemsize)
                for i in range(lo.num_layers)]

    # -- the channel: a sidecar that restarted is reconnected ------------------------------------
    def _reconnect(self, why: Exception) -> bool:
        """The channel failed: connect again (at most once a second). A restarted sidecar is
        a new incarnation with a new pool: whatever was under way with the old one is over
        (pushes stop, loads fail and are recomputed). True when a new channel is up."""
        now = time.monotonic()
        if now < self._next_reconnect:
            return False
        self._next_reconnect = now + 1.0
        try:
            client, info = connect(self.config.sidecar_socket, 0.5, self.config.channel_timeout_s,
                                   name=f"vllm-worker-{os.getpid()}")
        except ChannelError as exc:
            log.warning("kvpush sidecar channel down (%s); reconnecting failed: %s", why, exc)
            return False
        if info.role != self.role or info.layout != self.info.layout:
            log.error("the kvpush sidecar at %s came back as %s with layout %s (was %s, %s); not using it",
                      self.config.sidecar_socket, info.role, info.layout, self.role, self.info.layout)
            client.close()
            return False
        old_client, old_pool = self.client, self.pool
        try:
            self.pool = ShmMemory.attach(info.pool.shm_name, info.pool.size_bytes)
        except OSError as exc:
            log.warning("kvpush sidecar pool %s not mappable: %s", info.pool.shm_name, exc)
            client.close()
            return False
        self.client, self.info = client, info
        client.on_event = self._on_event
        self._map_landing()
        for rid in list(self._outbound):
            del self._outbound[rid]  # its staging went with the old sidecar
        self._step = [sp for sp in self._step if sp.spec.req_id in self._outbound]
        for rid, p in list(self._pending.items()):
            if p.spec.incarnation != info.incarnation:
                self._fail(rid, "channel", "the sidecar restarted")
        self._releases.clear()
        self.counters.inc("sidecar_reconnects")
        self.counters.identity.update(incarnation=info.incarnation)
        log.warning("kvpush: reconnected to sidecar %s, incarnation %s", info.engine_id, info.incarnation)
        try:
            old_client.close()
        finally:
            old_pool.close()
        return True

    # -- every step: before the forward ----------------------------------------------------------
    def bind(self, meta: KVPushConnectorMetadata) -> None:
        self.counters.merge(meta.counts)
        self._step = []
        self._idle = meta.idle
        self._traced_step = self.trace.on and meta.scheduled_tokens > 0
        if self._traced_step:
            self.trace("step", "-", meta.scheduled_tokens)
        if self.role != PREFILL:
            return
        for rid, reason in meta.push_aborts:
            if self._outbound.pop(rid, None) is not None:
                self._end(rid, aborted=True, reason=reason)
        for spec in meta.pushes:
            out = self._outbound.get(spec.req_id)
            if spec.begin is not None:
                out = self._begin(spec)
            if out is not None:
                self._step.append(_StepPush(spec, out))

    def _begin(self, spec: PushSpec) -> _Outbound | None:
        t = spec.begin
        begin = F.BeginRequest(spec.req_id, t.reservation_id, t.engine_id, t.incarnation, t.block_size,
                               t.num_tokens, tuple(t.block_ids))
        try:
            alloc = self._call_reconnecting(lambda: self.client.begin_push(begin))
        except ChannelError as exc:
            log.warning("push of %s to reservation %s refused: %s; the decode engine will recompute",
                        spec.req_id, t.reservation_id, exc)
            self.counters.inc("push_refused")
            return None
        geom = DestGeometry.for_layout(self.info.layout, t.block_size, t.num_tokens)
        out = self._outbound[spec.req_id] = _Outbound(alloc, geom, t.reservation_id)
        self.trace("push_begin", t.reservation_id, spec.req_id)
        self.counters.inc("requests_begun")
        return out

    # -- inside the forward: after each attention layer ------------------------------------------
    def save_layer(self, layer_name: str) -> None:
        if not self._step:
            return
        layer = self.layers.get(layer_name)
        if layer is None:
            return
        staging = self.pool.host_view()
        cache = self.flat[layer]
        for sp in self._step:
            if sp.failed:
                continue
            spec = sp.spec
            try:
                if sp.index is None:
                    sp.index = self.codec.token_index(spec.block_ids, spec.start, spec.end)
                tokens = self.codec.read(cache, spec.block_ids, spec.start, spec.end, sp.index)
                reblock.stage_tokens(staging, sp.out.alloc, sp.out.geom, layer,
                                     tokens.view(np.uint8), spec.start, spec.end)
                self.client.push(spec.req_id, layer, spec.start, spec.end)
            except Exception as exc:  # never let a push break the forward pass
                log.error("push of %s layer %d failed: %s", spec.req_id, layer, exc)
                sp.failed = True
                if self._outbound.pop(spec.req_id, None) is not None:
                    self._end(spec.req_id, aborted=True, reason=f"staging failed: {exc}")
                continue
            sp.layers += 1
            self.counters.inc("layers_pushed")
            self.trace("layer_staged", sp.out.reservation_id, layer)
            self.counters.inc("bytes_staged", (spec.end - spec.start) * self.codec.token_layer_bytes)

    # -- after the forward --------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        if self._traced_step:
            self.trace("forward_done")
        for sp in self._step:
            rid = sp.spec.req_id
            if sp.failed or rid not in self._outbound:
                continue
            if sp.layers != len(self.flat):
                self._outbound.pop(rid, None)
                self._end(rid, aborted=True, reason=f"only {sp.layers} of {len(self.flat)} layers staged")
            elif sp.spec.final:
                self.trace("push_end", sp.out.reservation_id, rid)
                self._outbound.pop(rid, None)
                self._end(rid)
                self.counters.inc("requests_pushed")
        self._step = []

    def _end(self, rid: str, aborted: bool = False, reason: str = "") -> None:
        if aborted:
            self.counters.inc("requests_aborted")
        try:
            self.client.end_request(rid, aborted, reason)
        except ChannelError as exc:
            log.warning("END of %s not sent: %s", rid, exc)

    # -- decode: loads ----------------------------------------------------------------------------
    def start_loads(self, meta: KVPushConnectorMetadata) -> None:
        if self.role != DECODE:
            return
        now = time.monotonic()
        for rid in meta.load_aborts:
            pending = self._pending.pop(rid, None)
            if pending is not None:
                self.counters.inc("loads_abandoned")
                self._done.add(rid)  # blocks are freed when vLLM hears it finished; nothing is copied
                self._release(pending.spec.reservation_id, pending.deadline, subscribe=False)
        for rel in meta.releases:
            self._release(rel.reservation_id, _deadline(now, self.config.load_timeout_s, rel.deadline_unix_ms,
                                                        self.config.deadline_grace_s))
        for spec in meta.loads:
            self.counters.inc("loads_started")
            pending = self._pending[spec.req_id] = _Pending(
                spec, _deadline(now, self.config.load_timeout_s, spec.deadline_unix_ms, self.config.deadline_grace_s),
                now)
            if (spec.engine_id == self.info.engine_id and spec.incarnation != self.info.incarnation
                    and self._channel_broken()):
                self._reconnect(ChannelError("channel closed"))  # the sidecar restarted: a new incarnation
            if spec.engine_id != self.info.engine_id or spec.incarnation != self.info.incarnation:
                self._fail(spec.req_id, "wrong_engine", f"reservation is for {spec.engine_id}/{spec.incarnation}")
                continue
            self.trace("load_planned", spec.reservation_id, spec.req_id)
            self._subscribe(spec.reservation_id, pending)

    def _subscribe(self, reservation_id: str, pending: _Pending | None = None) -> None:
        def still_ours() -> None:
            if pending is not None and pending.spec.incarnation != self.info.incarnation:
                raise ChannelError("the sidecar restarted: the reservation is gone")

        try:
            event = self._call_reconnecting(lambda: self.client.subscribe(reservation_id), still_ours)
        except ChannelError as exc:
            if pending is not None:
                self._fail(pending.spec.req_id, "channel", str(exc))
            return
        self._set_state(event)

    def _call_reconnecting(self, call, after_reconnect=None):
        """``call()``; if the channel turns out to be broken and a fresh one to a
        restarted sidecar comes up, ``after_reconnect()`` (may raise) and once more."""
        try:
            return call()
        except ChannelError as exc:
            if not self._channel_broken() or not self._reconnect(exc):
                raise
            if after_reconnect is not None:
                after_reconnect()
            return call()

    def _set_state(self, event) -> None:
        with self._lock:
            current = self._states.get(event.reservation_id)
            if current is None or current[0] not in (LANDED, *ENDED) or event.state in ENDED:
                self._states[event.reservation_id] = (event.state, event.num_tokens)
        if event.state == LANDED or event.state in ENDED:
            self.trace(event.state.lower(), event.reservation_id)
            self._arrived.set()

    def _on_event(self, event) -> None:
        """Channel events, as they arrive: push outcomes (prefill), reservation ends (decode).
        The counters file is refreshed here too, so outcomes show even when the engine idles."""
        if event.request_id:
            self.counters.inc(f"push_{event.state}")
            self.counters.flush()
        else:
            self._set_state(event)

    def _state(self, reservation_id: str) -> tuple[str, int]:
        with self._lock:
            return self._states.get(reservation_id, ("", 0))

    def _release(self, reservation_id: str, give_up: float, subscribe: bool = True) -> None:
        self._releases[reservation_id] = give_up
        if subscribe:
            self._subscribe(reservation_id)

    def _channel_broken(self) -> bool:
        try:
            self.client.ping()
            return False
        except ChannelError:
            return True

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """(finished_recving, failed_recving) since the last call; also drains events."""
        self.client.events()  # handled by _on_event as they came; drop the client's copies
        if self._pending and time.monotonic() >= self._next_health:
            # Loads wait for events that a dead sidecar will never send: check once a second.
            self._next_health = time.monotonic() + 1.0
            if self._channel_broken():
                self._reconnect(ChannelError("channel closed"))
        if self.role == DECODE:
            self._wait_if_idle()
            self._poll_loads()
            if len(self._states) > 4096:
                live = {p.spec.reservation_id for p in self._pending.values()} | set(self._releases)
                with self._lock:
                    self._states = {r: s for r, s in self._states.items() if r in live}
        done, failed = self._done, self._failed
        self._done, self._failed = set(), set()
        self.counters.flush()
        return done, failed

    def _wait_if_idle(self) -> None:
        """A step with nothing to run while loads are in flight: sleep until one lands
        or ends (or idle_wait_s passes). Without it the engine spins through empty
        steps (vLLM sleeps 1 ms between them), taking CPU a co-located prefill needs,
        and notices a landing only at its next step."""
        self._arrived.clear()
        if not (self._idle and self._pending and self.config.idle_wait_s > 0):
            return
        if any(self._state(p.spec.reservation_id)[0] in (LANDED, *ENDED) for p in self._pending.values()):
            return  # arrived before the clear: nothing to wait for
        t0 = time.monotonic()
        self._arrived.wait(self.config.idle_wait_s)
        self._idle_waits += 1
        self._idle_wait_us += round((time.monotonic() - t0) * 1e6)

    def _fold_idle_waits(self) -> None:
        if self._idle_waits:
            self.counters.inc("idle_waits", self._idle_waits)
            self.counters.inc("idle_wait_us_total", self._idle_wait_us)
            self._idle_waits, self._idle_wait_us = 0, 0

    def _poll_loads(self) -> None:
        now = time.monotonic()
        for rid, p in list(self._pending.items()):
            state, landed = self._state(p.spec.reservation_id)
            if state == LANDED and landed < p.spec.end:
                self._fail(rid, "short", f"reservation {p.spec.reservation_id} landed {landed} tokens, "
                                         f"{p.spec.end} needed")
                self._consume(p.spec.reservation_id)
            elif state == LANDED:
                self._load(p)
            elif state in ENDED:
                self._fail(rid, state.lower(), f"reservation {p.spec.reservation_id} is {state}")
            elif now >= p.deadline:
                self._fail(rid, "timeout", f"reservation {p.spec.reservation_id} did not land in time "
                                           f"(last state {state or 'unknown'})")
        for res, give_up in list(self._releases.items()):
            state = self._state(res)[0]
            if state == LANDED:
                self._consume(res)
                self.counters.inc("releases_consumed")
            if state in ENDED or state == LANDED or now >= give_up:
                del self._releases[res]

    def _load(self, p: _Pending) -> None:
        spec = p.spec
        rid = spec.req_id
        del self._pending[rid]
        t0 = time.monotonic()
        try:
            layout = self.info.layout
            if spec.landing_block_size != layout.block_size:
                raise CodecError(f"landing blocks of {spec.landing_block_size} tokens, pool has {layout.block_size}")
            index = self.codec.token_index(spec.block_ids, spec.start, spec.end)
            for layer, cache in enumerate(self.flat):
                raw = reblock.gather_tokens(self._landing[layer], spec.landing_block_ids, spec.start, spec.end)
                self.codec.write(cache, spec.block_ids, raw.view(self.codec.dtype), spec.start, spec.end, index)
        except Exception as exc:
            log.error("loading reservation %s into %s failed: %s", spec.reservation_id, rid, exc)
            self._pending[rid] = p
            self._fail(rid, "copy", str(exc))
            self._consume(spec.reservation_id)
            return
        self._consume(spec.reservation_id)
        t1 = time.monotonic()
        wait_ms, copy_ms = (t0 - p.started) * 1e3, (t1 - t0) * 1e3
        log.debug("kvpush: %s loaded %d tokens from reservation %s: waited %.1f ms, copied in %.2f ms",
                 rid, spec.end - spec.start, spec.reservation_id, wait_ms, copy_ms)
        self.counters.inc("load_wait_ms_total", round(wait_ms))
        self.counters.inc("load_copy_us_total", round(copy_ms * 1e3))
        self.counters.maximum("load_wait_ms_max", round(wait_ms))
        n = spec.end - spec.start
        self.counters.inc("loads_landed")
        self._fold_idle_waits()
        self.trace("loaded", spec.reservation_id, rid)
        self.counters.inc("tokens_loaded", n)
        self.counters.inc("bytes_loaded", n * self.codec.token_layer_bytes * len(self.flat))
        self._done.add(rid)

    def _consume(self, reservation_id: str) -> None:
        try:
            self.client.consumed_nowait(reservation_id)  # a round trip less before the first token
        except ChannelError as exc:
            log.warning("CONSUMED for %s not sent: %s", reservation_id, exc)

    def _fail(self, rid: str, reason: str, detail: str) -> None:
        p = self._pending.pop(rid, None)
        log.warning("kvpush load of %s failed (%s): %s; vLLM recomputes the prompt", rid, reason, detail)
        self.counters.inc("load_errors")
        self._fold_idle_waits()
        self.counters.inc(f"load_error_{reason}")
        self._done.add(rid)
        self._failed.add(rid)
        if p is not None and reason == "timeout":
            # Stop caring about it; if it lands later, free its blocks at once.
            self._release(p.spec.reservation_id, time.monotonic() + self.config.load_timeout_s, subscribe=False)

    def close(self) -> None:
        self.counters.flush(force=True)
        self.trace.close()
        try:
            self.client.close()
        finally:
            self.pool.close()

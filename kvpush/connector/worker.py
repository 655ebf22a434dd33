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
    the scheduler admits a request only once its reservation has LANDED
    (``kvpush.connector.scheduler``), so each ``LoadSpec`` is a synchronous load:
    ``start_load_kv`` (before the forward pass) copies the landing blocks into
    the request's blocks and sends CONSUMED (fire-and-forget: the landing
    blocks are free again). A copy that fails (the sidecar restarted under
    it, a reservation of another incarnation, a bad geometry) reports the
    request's blocks as load errors: vLLM recomputes those tokens
    (``kv_load_failure_policy="recompute"``).

Bytes move in kvpush's canonical block layout, copied by a ``CacheCopier``
(``kvpush/connector/copiers/copier.py``; on the CPU ``kvpush.connector.copiers.cpu_copier.CpuCopier``, on a GPU
``kvpush.connector.copiers.torch_copier.TorchCopier``). A GPU copy is only enqueued when the copier
returns: the frames that let the sidecar touch the pool (PUSH, CONSUMED) wait for its
fence on a sender thread, in order with END (``kvpush/connector/ordered_sends.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time

from kvpush.connector.copiers.copier import CacheCopier, CopyError
from kvpush.connector.config import ConnectorConfig
from kvpush.connector.ordered_sends import OrderedSends
from kvpush.connector.metadata import KVPushConnectorMetadata, LoadSpec, PushSpec
from kvpush.connector.sidecar_link import Redialer, SidecarInfo, connect
from kvpush.contract.states import DECODE, PREFILL
from kvpush.connector.stats import Counters
from kvpush.trace import Trace
from kvpush.channel import frames as F
from kvpush.connector.sidecar_client import ChannelError, SidecarClient
from kvpush.channel import reblock
from kvpush.channel.geometry import DestGeometry
from kvpush.channel.head_plan import plan_heads
from kvpush.channel.device_memory import current_cuda_device
from kvpush.channel.attach import attach_pool
from kvpush.channel.pool import StagingAllocation

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers

@dataclasses.dataclass
class _Outbound:
    allocs: tuple[StagingAllocation, ...]  # one per head share this rank sends (none: it sends nothing)
    geoms: tuple[DestGeometry, ...]  # each one's geometry
    reservation_id: str = ""
    first_token: int = 0  # the prompt token staged as the push's token 0 (decode holds those before it)


@dataclasses.dataclass
class _StepPush:
    spec: PushSpec
    out: _Outbound
    plan: object = None  # the copier's plan for the piece, reused by every layer
    prepared: bool = False
    layers: int = 0
    failed: bool = False


class KVPushWorker:
    def __init__(self, config: ConnectorConfig, block_size: int, client: SidecarClient | None = None,
                 info: SidecarInfo | None = None, counters: Counters | None = None, rank: int = 0,
                 tp_size: int = 1):
        self.config = config
        self.block_size = block_size
        self.rank = rank  # this worker's tensor-parallel rank: it moves its own heads only
        self.device = current_cuda_device()  # vLLM set the worker's GPU before making its connector

        def dial(connect_timeout_s: float) -> tuple[SidecarClient, SidecarInfo]:
            return connect(config.sidecar_socket, connect_timeout_s, config.channel_timeout_s,
                           name=f"vllm-worker-{os.getpid()}", cuda_device=self.device, rank=rank)
        if client is None:
            client, info = dial(config.connect_timeout_s)
        if info.layout.tp_size != tp_size:
            client.close()
            raise CopyError(f"the engine runs tensor-parallel size {tp_size}, its kvpush sidecar's --kv-layout "
                            f"says tp={info.layout.tp_size}: start the sidecar with tp={tp_size}")
        self.client = client
        self.info = info
        client.on_event = self._on_event  # runs on the channel's reader thread
        self.role = info.role
        self.pool = attach_pool(info.pool, self.device)
        self._sends = OrderedSends()
        self._send_failed: dict[str, str] = {}  # request id -> why a PUSH could not be sent (sender thread)
        if counters is None:
            path = ""
            if config.stats_dir:
                os.makedirs(config.stats_dir, exist_ok=True)
                name = (config.engine_name or info.engine_id) + (f".rank{rank}" if rank else "")
                path = os.path.join(config.stats_dir, f"{name}.json")  # rank 0's: the engine's name alone
            counters = Counters(path, {"engine_id": info.engine_id, "incarnation": info.incarnation,
                                       "role": info.role, "pid": os.getpid(), "rank": rank})
        self.counters = counters
        self.trace = Trace(config.engine_name or info.engine_id)
        self.copier: CacheCopier | None = None
        self.layers: dict[str, int] = {}  # layer name -> index
        self.num_layers = 0
        # prefill
        self._outbound: dict[str, _Outbound] = {}
        self._step: list[_StepPush] = []
        # decode
        self._load_errors: set[int] = set()  # vLLM block ids whose load failed in this step
        self._parked: tuple[SidecarClient, SidecarInfo] | None = None  # dialed, not yet taken
        self._parked_lock = threading.Lock()
        self._redialer = Redialer(lambda: dial(0), self._vet, f"worker rank {rank}")  # one try per attempt
        self._redialer.follow(client)
        self._traced_step = False
        self.counters.flush(force=True)

    # -- set-up ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict, copier: CacheCopier, layer_index) -> None:
        """``kv_caches``: layer name -> cache tensor; ``layer_index(name) -> int``."""
        layout = self.info.layout
        indexed = sorted((layer_index(name), name) for name in kv_caches)
        if [i for i, _ in indexed] != list(range(len(indexed))):
            raise CopyError(f"KV cache layers are not numbered 0..n-1: {[i for i, _ in indexed]}")
        if len(indexed) != layout.num_layers:
            raise CopyError(f"the model has {len(indexed)} KV layers, the sidecar's layout {layout.num_layers}")
        copier.bind_caches([kv_caches[name] for _, name in indexed], layout)
        copier.bind_pool(self.pool, self.info.pool)
        self.copier = copier
        self.layers = {name: i for i, name in indexed}
        self.num_layers = len(indexed)
        log.info("kvpush connector: %s engine %s (incarnation %s), %d layers, %d blocks of %d tokens",
                 self.role, self.info.engine_id, self.info.incarnation, self.num_layers,
                 kv_caches[indexed[0][1]].shape[0], copier.block_size)

    # -- the channel: a sidecar that restarted is dialed again, and its channel taken between steps ----
    def _vet(self, client: SidecarClient, info: SidecarInfo) -> None:
        """The redialer's thread: a channel to a sidecar that answered HELLO again. Kept
        for the worker's own thread to take at its next step (the pool and the copier are
        the forward pass's); a sidecar that came back as something else is refused."""
        if info.role != self.role or info.layout != self.info.layout:
            raise ChannelError(f"it came back as {info.role} with layout {info.layout} (was {self.role}, "
                               f"{self.info.layout})")
        client.on_event = self._on_event
        with self._parked_lock:
            old, self._parked = self._parked, (client, info)
        if old is not None:
            old[0].close()

    def _take_new_channel(self) -> bool:
        """On the worker's thread: take the channel the redialer dialed (one attempt at once
        if the channel is down and none is waiting). A restarted sidecar is a new
        incarnation with a new pool: whatever was under way with the old one is over
        (pushes stop, loads fail and are recomputed). True when a new channel is in use."""
        if self._parked is None and self.client.broken:
            self._redialer.dial_now()
        with self._parked_lock:
            parked, self._parked = self._parked, None
        if parked is None:
            return False
        client, info = parked
        old_client, old_pool = self.client, self.pool
        try:
            self.pool = attach_pool(info.pool, self.device)
        except (OSError, ValueError) as exc:  # gone, resized, or a memory kind this side cannot map
            log.warning("kvpush sidecar pool %s not mappable: %s", info.pool.share_handle, exc)
            client.close()
            self._redialer.wake()
            return False
        self.client, self.info = client, info
        if self.copier is not None:
            self.copier.bind_pool(self.pool, info.pool)
        for rid in list(self._outbound):
            del self._outbound[rid]  # its staging went with the old sidecar
        self._step = [sp for sp in self._step if sp.spec.req_id in self._outbound]
        self.counters.inc("sidecar_reconnects")
        self.counters.identity.update(incarnation=info.incarnation)
        log.warning("kvpush: using sidecar %s again, incarnation %s", info.engine_id, info.incarnation)
        try:
            old_client.close()
        finally:
            old_pool.close()
        return True

    # -- every step: before the forward ----------------------------------------------------------
    def bind(self, meta: KVPushConnectorMetadata) -> None:
        if self._parked is not None:
            self._take_new_channel()  # the sidecar came back while the engine worked or idled
        self.counters.merge(meta.counts)
        for name, value in meta.maxima.items():
            self.counters.maximum(name, value)
        self._step = []
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
        begin = F.BeginRequest(spec.req_id, t)
        try:
            allocs = self._call_reconnecting(lambda: self.client.begin_shares(begin))
        except ChannelError as exc:
            log.warning("push of %s to reservation %s refused: %s; the decode engine will recompute",
                        spec.req_id, t.reservation_id, exc)
            self.counters.inc("push_refused")
            return None
        geoms = tuple(reblock.share_geometry(self.info.layout, a, t.block_size, t.num_tokens) for a in allocs)
        out = self._outbound[spec.req_id] = _Outbound(allocs, geoms, t.reservation_id, t.first_token)
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
        for sp in self._step:
            if sp.failed:
                continue
            spec = sp.spec
            try:
                unsent = self._send_failed.pop(spec.req_id, None)
                if unsent is not None:
                    raise ChannelError(unsent)
                if sp.out.allocs and not sp.prepared:
                    sp.plan, sp.prepared = self.copier.plan(spec.block_ids, spec.start, spec.end), True
                fence = None
                first = sp.out.first_token
                for alloc, geom in zip(sp.out.allocs, sp.out.geoms):  # (none: another rank sends our heads)
                    fence = self.copier.stage(layer, spec.block_ids, spec.start, spec.end, alloc, geom, sp.plan,
                                              offset=first)
                if sp.out.allocs:  # the sidecar counts the push's own tokens, from 0
                    self._sends.send(fence, functools.partial(self._push_frame, self.client, spec.req_id, layer,
                                                              spec.start - first, spec.end - first))
            except Exception as exc:  # never let a push break the forward pass
                log.error("push of %s layer %d failed: %s", spec.req_id, layer, exc)
                sp.failed = True
                if self._outbound.pop(spec.req_id, None) is not None:
                    self._end(spec.req_id, aborted=True, reason=f"staging failed: {exc}")
                continue
            sp.layers += 1
            self.counters.inc("layers_pushed")
            self.trace("layer_staged", sp.out.reservation_id, layer)
            self.counters.inc("bytes_staged", (spec.end - spec.start)
                              * sum(g.token_part_bytes * g.kv_parts for g in sp.out.geoms))

    # -- after the forward --------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        if self._traced_step:
            self.trace("forward_done")
        for sp in self._step:
            rid = sp.spec.req_id
            if sp.failed or rid not in self._outbound:
                continue
            unsent = self._send_failed.pop(rid, None)
            if unsent is not None:  # the sender thread could not send a PUSH of it this step
                self._outbound.pop(rid, None)
                self._end(rid, aborted=True, reason=unsent)
            elif sp.layers != self.num_layers:
                self._outbound.pop(rid, None)
                self._end(rid, aborted=True, reason=f"only {sp.layers} of {self.num_layers} layers staged")
            elif sp.spec.final:
                self.trace("push_end", sp.out.reservation_id, rid)
                self._outbound.pop(rid, None)
                self._end(rid)
                self.counters.inc("requests_pushed")
        self._step = []

    def _push_frame(self, client: SidecarClient, rid: str, layer: int, start: int, end: int) -> None:
        """PUSH, once the layer's staging copy is complete (the sender's thread, or inline)."""
        try:
            client.push(rid, layer, start, end)
        except ChannelError as exc:
            self._send_failed[rid] = f"PUSH of layer {layer} not sent: {exc}"

    def _end(self, rid: str, aborted: bool = False, reason: str = "") -> None:
        if aborted:
            self.counters.inc("requests_aborted")
        self._sends.send(None, functools.partial(self._end_frame, self.client, rid, aborted, reason))

    def _end_frame(self, client: SidecarClient, rid: str, aborted: bool, reason: str) -> None:
        self._send_failed.pop(rid, None)  # its END says it all
        try:
            client.end_request(rid, aborted, reason)
        except ChannelError as exc:
            log.warning("END of %s not sent: %s", rid, exc)

    # -- decode: synchronous loads, before the forward pass ----------------------------------------
    def start_loads(self, meta: KVPushConnectorMetadata) -> None:
        if self.role != DECODE:
            return
        for spec in meta.loads:
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        """Copy a landed reservation into the request's blocks; on any failure its blocks are
        reported as load errors (vLLM recomputes them), never half-copied silently."""
        t0 = time.monotonic()
        try:
            if spec.target.engine_id == self.info.engine_id and spec.target.incarnation != self.info.incarnation \
                    and self._channel_broken():
                self._take_new_channel()  # the sidecar restarted: a new incarnation
            if spec.target.engine_id != self.info.engine_id or spec.target.incarnation != self.info.incarnation:
                raise CopyError(f"the reservation is for {spec.target.engine_id}/{spec.target.incarnation}, this pool is "
                                 f"{self.info.engine_id}/{self.info.incarnation}")
            layout = self.info.layout
            if spec.target.block_size != layout.block_size:
                raise CopyError(f"landing blocks of {spec.target.block_size} tokens, pool has {layout.block_size}")
            if spec.src_tp != layout.tp_size:
                self._unshare(spec)
            fence = self.copier.load(spec.block_ids, spec.start, spec.end, spec.target.block_ids,
                                     offset=spec.target.first_token)
        except Exception as exc:
            log.error("kvpush: loading reservation %s into %s failed: %s; vLLM recomputes it",
                      spec.target.reservation_id, spec.req_id, exc)
            bs = self.copier.block_size if self.copier is not None else self.block_size
            self._load_errors.update(spec.block_ids[spec.start // bs:(spec.end - 1) // bs + 1])
            self.counters.inc("load_errors")
            self.counters.inc("load_error_copy")
            # copies enqueued before the failure may still read the landing blocks
            self._consume(spec.target.reservation_id, self.copier.fence() if self.copier is not None else None)
            return
        self._consume(spec.target.reservation_id, fence)
        n = spec.end - spec.start
        self.counters.inc("load_copy_us_total", round((time.monotonic() - t0) * 1e6))
        self.counters.inc("loads_landed")
        self.counters.inc("tokens_loaded", n)
        self.counters.inc("bytes_loaded", n * self.copier.token_layer_bytes * self.num_layers)
        self.trace("loaded", spec.target.reservation_id, spec.req_id)

    def _unshare(self, spec: LoadSpec) -> None:
        """Prefill ranks that each sent part of this rank's heads landed their shares one
        after another: put the heads in place first (``kvpush/channel/head_plan.py``)."""
        layout = self.info.layout
        plan = plan_heads(dataclasses.replace(layout, tp_size=spec.src_tp), layout)
        if plan.in_place(self.rank):
            return
        pool = self.pool.host_view() if self.pool.mem_kind == "DRAM" else self.pool.tensor()
        reblock.unshare_landing(pool, self.info.pool, plan, self.rank, spec.target.block_ids, spec.target.num_tokens)
        self.counters.inc("loads_unshared")

    def load_errors(self) -> set[int]:
        """vLLM block ids whose synchronous load failed in this step (then forgotten)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def end_step(self) -> None:
        """After each step: drop the channel's copies of events (handled as they came, by
        ``_on_event``) and write the counters if they changed. Nothing is received
        asynchronously: loads are synchronous."""
        self.client.events()
        self.counters.flush()

    def _call_reconnecting(self, call, after_reconnect=None):
        """``call()``; if the channel turns out to be broken and a fresh one to a
        restarted sidecar comes up, ``after_reconnect()`` (may raise) and once more."""
        try:
            return call()
        except ChannelError:
            if not self._channel_broken() or not self._take_new_channel():
                raise
            if after_reconnect is not None:
                after_reconnect()
            return call()

    def _on_event(self, event) -> None:
        """Channel events, as they arrive: push outcomes (prefill). The counters file is
        refreshed here too, so outcomes show even when the engine idles."""
        if event.request_id:
            self.counters.inc(f"push_{event.state}")
            self.counters.flush()

    def _channel_broken(self) -> bool:
        if self.client.broken:
            return True
        try:
            self.client.ping()
            return False
        except ChannelError:
            return True

    def _consume(self, reservation_id: str, fence=None) -> None:
        """CONSUMED (the landing blocks are free again), once the copies reading them are done."""
        self._sends.send(fence, functools.partial(self._consumed_frame, self.client, reservation_id))

    @staticmethod
    def _consumed_frame(client: SidecarClient, reservation_id: str) -> None:
        try:
            client.consumed_nowait(reservation_id)  # a round trip less before the first token
        except ChannelError as exc:
            log.warning("CONSUMED for %s not sent: %s", reservation_id, exc)

    def close(self) -> None:
        self._redialer.close()
        with self._parked_lock:
            parked, self._parked = self._parked, None
        if parked is not None:
            parked[0].close()
        self._sends.close()  # the frames still waiting on the GPU go out first
        self.counters.flush(force=True)
        self.trace.close()
        try:
            self.client.close()
        finally:
            self.pool.close()

"""``KVPushConnector``: vLLM's KV connector for kvpush (the class vLLM loads).

    --kv-transfer-config '{"kv_connector": "KVPushConnector",   # by name: kvpush's vLLM plugin registers it
                           "kv_role": "kv_producer",            # prefill engines; "kv_consumer" for decode
                           "kv_load_failure_policy": "recompute",  # required on decode engines
                           "kv_connector_extra_config": {"sidecar_socket": "/path/to/sidecar.sock",
                                                         "stats_dir": "/path/to/stats"}}'

A thin facade: scheduler-side calls go to ``kvpush.connector.scheduler.KVPushScheduler``,
worker-side calls to ``kvpush.connector.worker.KVPushWorker``. What each engine does is
decided by its sidecar's role (prefill sidecar: push; decode sidecar: load),
and per request by ``kv_transfer_params["kvpush"]``; requests without it are
served normally.
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpush.connector.copiers.cache_codec import BlockCodec
from kvpush.connector.copiers.copier import CacheCopier, CopyError
from kvpush.connector.copiers.cpu_copier import CpuCopier
from kvpush.connector.copiers.torch_copier import TorchCopier, describe_cache
from kvpush.connector.config import ConfigError, ConnectorConfig
from kvpush.connector.handover_watch import HandoverWatch
from kvpush.connector.landing_watch import LandingWatch
from kvpush.connector.metadata import KVPushConnectorMetadata
from kvpush.connector.scheduler import DecodeTiming, KVPushScheduler
from kvpush.connector.sidecar_link import connect, hello_once
from kvpush.contract.layout import FP8_DTYPES, KvLayout, scales_digest
from kvpush.contract.states import DECODE, PREFILL
from kvpush.connector.worker import KVPushWorker
from kvpush.trace import Trace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm": logged with the engine's own handlers


def choose_copier(backend: str, cache: torch.Tensor, block_size: int, cpu_copier,
                  cache_dtype: str = "auto") -> CacheCopier:
    """The ``CacheCopier`` for an attention backend's cache; a refusal (here, or when the
    copier binds the caches) names the backend, the cache's layout and its dtype. ``CPU_ATTN`` packs its blocks for its SIMD
    kernel: its codec is probed (``cpu_copier()``). Every other backend of the vLLM we pin
    hands a connector the logical per-layer view ``[blocks, kv_heads, block_size,
    2 * head_dim]`` (any stride order): ``TorchCopier``. MLA backends keep one latent
    vector per token, which kvpush does not move."""
    if backend == "CPU_ATTN":
        return cpu_copier()
    if "MLA" in backend.upper():
        raise CopyError(f"KVPushConnector cannot move {describe_cache(backend, cache)}: an MLA latent cache; "
                        "kvpush moves K/V caches")
    return TorchCopier(block_size, backend, cache_dtype)  # it checks the caches against the layout at bind_caches


def check_kv_scales(layout: KvLayout, attention_layers: list) -> None:
    """An fp8 cache is moved as its bytes, which mean the same on the decode engine only if
    it quantises with the same per-layer K/V scales. vLLM's are static (the checkpoint's, or
    1.0) and kept on each attention layer; the sidecar's layout names them (``scales``, ""
    for all 1.0) and engines pair only on equal layouts, so a mismatch is refused here, at
    start-up, with the setting that fixes it."""
    if layout.dtype not in FP8_DTYPES:
        return
    mine = scales_digest([getattr(a, "_k_scale_float", 1.0) for a in attention_layers],
                         [getattr(a, "_v_scale_float", 1.0) for a in attention_layers])
    if mine != layout.scales:
        fix = f",scales={mine}" if mine else " without scales="
        raise CopyError(f"KVPushConnector: the model's fp8 KV scales are {mine or 'all 1.0'}, the sidecar's layout "
                        f"says {layout.scales or 'all 1.0'}: start the sidecar with --kv-layout ...{fix} (every "
                        "engine of the model the same)")


def warn_module_path(module_path: str | None) -> None:
    """Loading the connector by ``kv_connector_module_path`` still works, for now; the
    plugin (``kvpush/connector/plugin.py``) registers it by name, which survives moves."""
    if module_path:
        message = (f"KVPushConnector: kv_connector_module_path ({module_path!r}) is deprecated: name the connector "
                   f'alone, {{"kv_connector": "KVPushConnector", ...}} (kvpush\'s vLLM plugin registers it)')
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        log.warning(message)


class KVPushConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        warn_module_path(getattr(ktc, "kv_connector_module_path", None))
        self.config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError("KVPushConnector supports models with one KV cache group (full attention only)")
        if ktc.is_kv_consumer and ktc.kv_load_failure_policy != "recompute":
            raise ConfigError('KVPushConnector on a decode engine needs kv_transfer_config '
                              '"kv_load_failure_policy": "recompute": a reservation that never lands must be '
                              'recomputed, not fail the request')
        self.block_size = vllm_config.cache_config.block_size
        self._sched: KVPushScheduler | None = None
        self._worker: KVPushWorker | None = None
        self._watch: LandingWatch | None = None
        self._handover: HandoverWatch | None = None
        if role == KVConnectorRole.SCHEDULER:
            c = self.config
            info = hello_once(c.sidecar_socket, c.connect_timeout_s, c.channel_timeout_s, name="vllm-scheduler")

            def channel():  # one try: the sidecar answered just now, and later a Redialer retries
                return connect(c.sidecar_socket, 0, c.channel_timeout_s, name="vllm-scheduler")
            if info.role == DECODE and ktc.is_kv_consumer:
                # The decode scheduler admits a request once its KV has landed: it listens itself.
                self._watch = LandingWatch(channel)
                info = self._watch.connect()
            elif info.role == PREFILL and ktc.is_kv_producer:
                # The prefill scheduler holds requests sent before their Reserve answered.
                self._handover = HandoverWatch(channel)
                info = self._handover.connect()
            self._sched = KVPushScheduler(
                info, self.block_size, ktc.is_kv_producer, ktc.is_kv_consumer, self._block_ids_of, watch=self._watch,
                timing=DecodeTiming(c.load_timeout_s, c.deadline_grace_s, c.idle_wait_s),
                trace=Trace(c.engine_name or info.engine_id), handover=self._handover)
            if self._watch is not None:
                self._watch.on_landed = lambda res: self._sched.trace("landed", res)
            log.info("KVPushConnector scheduler: sidecar %s (%s)", info.engine_id, info.role)
        else:
            # Each tensor-parallel rank's worker has its own channel and moves its own heads.
            from vllm.distributed import parallel_state as ps
            rank, tp = ((ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
                        if ps.model_parallel_is_initialized() else (0, 1))  # (a worker made outside vLLM)
            self._worker = KVPushWorker(self.config, self.block_size, rank=rank, tp_size=tp)

    # ==============================================================================================
    # Worker side
    # ==============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        forward = self._vllm_config.compilation_config.static_forward_context
        name = next(iter(kv_caches))
        layer = forward.get(name)
        backend = layer.attn_backend.get_name() if layer is not None else "?"
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        copier = choose_copier(backend, kv_caches[name], self.block_size,
                               lambda: CpuCopier(self._probe_codec(kv_caches, layer)), cache_dtype)
        check_kv_scales(self._worker.info.layout, [forward.get(n) for n in sorted(kv_caches, key=extract_layer_index)])
        self._worker.register_kv_caches(kv_caches, copier, extract_layer_index)

    def _probe_codec(self, kv_caches: dict[str, torch.Tensor], layer) -> BlockCodec:
        mc = self._vllm_config.model_config
        heads = mc.get_num_kv_heads(self._vllm_config.parallel_config)
        head_dim = mc.get_head_size()
        tensor = next(iter(kv_caches.values()))
        if tensor.dtype != torch.float32:
            raise CopyError(f"KVPushConnector supports float32 KV caches on the CPU, not {tensor.dtype}")
        expected = (heads, self.block_size, 2 * head_dim)
        if tuple(tensor.shape[1:]) != expected:
            raise CopyError(f"unexpected CPU KV cache shape {tuple(tensor.shape)}, expected (blocks, *{expected})")
        isa = getattr(layer, "isa", None)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
            isa = _get_attn_isa(tensor.dtype, self.block_size, head_dim, self._vllm_config.cache_config.cache_dtype)
        return BlockCodec.probe_cpu_attn(self.block_size, heads, head_dim, isa)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVPushConnectorMetadata):
            self._worker.bind(connector_metadata)  # BEGINs before the forward pass

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KVPushConnectorMetadata):
            self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv copied every layer already (the KV had landed before the step)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._worker.end_step()  # loads are synchronous: nothing finishes in the background
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=set(), failed_recving=set())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._handover is not None:
            self._handover.close()
            self._handover = None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between layers

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================
    def _block_ids_of(self, request_id: str) -> list[int]:
        return self._kv_cache_manager.get_block_ids(request_id)[0]

    def on_new_request(self, request: Request) -> None:
        self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids  # the request's own blocks, every group

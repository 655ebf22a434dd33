"""The connector's start-up on a GPU backend's cache description, as vLLM makes it: the
worker half against a real sidecar process, given what vLLM gives ``register_kv_caches``
(the per-layer logical views in the backend's stride order, the attention layers with
their backend and fp8 scales, ``--kv-cache-dtype``). It starts for FlashAttention's and
FlashInfer's layouts in bf16 and fp8, and refuses an MLA backend, a format it cannot move
and fp8 scales other than the sidecar's, each naming the backend, layout and dtype."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvpush.connector.copiers.copier import CopyError
from kvpush.connector.kvpush_connector import KVPushConnector
from kvpush.connector.copiers.torch_copier import TorchCopier
from kvpush.contract.layout import scales_digest

pytestmark = pytest.mark.timeout(120)

LAYERS, NB, HEADS, BS, DIM = 2, 8, 2, 16, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def layout_text(dtype: str, scales: str = "") -> str:
    return f"layers={LAYERS},block={BS},heads={HEADS},dim={DIM},dtype={dtype}" + (f",scales={scales}" if scales else "")


def caches(order, dtype) -> dict[str, torch.Tensor]:
    logical = (LAYERS, NB, HEADS, BS, 2 * DIM)
    physical = torch.zeros([logical[o] for o in order], dtype=dtype)
    view = physical.permute(*[order.index(i) for i in range(5)])
    return {name: view[i] for i, name in enumerate(NAMES)}


@contextlib.contextmanager
def connector(sidecar, backend: str, cache_dtype: str = "auto", k_scales=None, v_scales=None):
    """The connector's worker half as vLLM makes it, connected to ``sidecar``; shut down after."""
    k_scales = k_scales or [1.0] * LAYERS
    v_scales = v_scales or [1.0] * LAYERS
    layers = {name: types.SimpleNamespace(attn_backend=types.SimpleNamespace(get_name=lambda: backend),
                                          _k_scale_float=k_scales[i], _v_scale_float=v_scales[i])
              for i, name in enumerate(NAMES)}
    ktc = KVTransferConfig(kv_connector="KVPushConnector", kv_role="kv_producer",
                           kv_connector_extra_config={"sidecar_socket": sidecar.socket, "connect_timeout_s": 10})
    config = types.SimpleNamespace(kv_transfer_config=ktc,
                                   cache_config=types.SimpleNamespace(block_size=BS, cache_dtype=cache_dtype),
                                   compilation_config=types.SimpleNamespace(static_forward_context=layers))
    c = KVPushConnector(config, KVConnectorRole.WORKER, None)
    try:
        yield c
    finally:
        c.shutdown()


@pytest.mark.parametrize("backend,order", [("FLASH_ATTN", KVCacheLayout.LBNHC.stride_order),
                                           ("FLASHINFER", KVCacheLayout.BLHNC.stride_order)])
def test_the_connector_starts_on_a_gpu_backends_bf16_cache(sidecars, backend, order):
    _, pre = sidecars(layout_text("bfloat16"))
    with connector(pre, backend) as c:
        c.register_kv_caches(caches(order, torch.bfloat16))
        assert isinstance(c._worker.copier, TorchCopier) and c._worker.num_layers == LAYERS


def test_an_fp8_cache_starts_with_the_sidecars_scales_and_is_refused_with_others(sidecars):
    k, v = [0.5, 0.25], [1.0, 2.0]
    digest = scales_digest(k, v)
    _, pre = sidecars(layout_text("float8_e4m3fn", digest))
    fp8 = caches(KVCacheLayout.LBNHC.stride_order, torch.uint8)  # vLLM keeps fp8 caches in uint8 tensors
    with connector(pre, "FLASH_ATTN", "fp8", k, v) as ok:
        ok.register_kv_caches(fp8)
    with connector(pre, "FLASH_ATTN", "fp8", [0.5, 0.5], v) as other:
        with pytest.raises(CopyError, match=rf"fp8 KV scales are sha256:[0-9a-f]{{16}}, the sidecar's layout says "
                                            rf"{digest}: start the sidecar with --kv-layout \.\.\.,scales=sha256:"):
            other.register_kv_caches(fp8)
    with connector(pre, "FLASH_ATTN", "fp8") as unit:  # no checkpoint scales: all 1.0
        with pytest.raises(CopyError, match="fp8 KV scales are all 1.0"):
            unit.register_kv_caches(fp8)


def test_what_the_connector_cannot_move_is_refused_at_start_naming_backend_layout_and_dtype(sidecars):
    _, pre = sidecars(layout_text("bfloat16"))
    latent = {name: torch.zeros(NB, BS, 576, dtype=torch.bfloat16) for name in NAMES}
    with connector(pre, "FLASHMLA") as mla:
        with pytest.raises(CopyError, match=r"FLASHMLA attention backend's KV cache \(shape \(8, 16, 576\), strides "
                                            r"\(9216, 576, 1\), dtype torch.bfloat16\): an MLA latent cache"):
            mla.register_kv_caches(latent)
    with connector(pre, "FLASH_ATTN", "nvfp4") as packed:
        with pytest.raises(CopyError, match=r"FLASH_ATTN attention backend's KV cache \(shape \(8, 2, 16, 16\), "
                                            r"strides .*dtype torch.uint8\).*kv-cache-dtype 'nvfp4'"):
            packed.register_kv_caches(caches(KVCacheLayout.LBNHC.stride_order, torch.uint8))
    with connector(pre, "TRITON_ATTN") as wrong:
        with pytest.raises(CopyError, match=r"TRITON_ATTN .*a float16 KV cache \(kv-cache-dtype 'auto'\), the "
                                            r"sidecar's layout holds bfloat16"):
            wrong.register_kv_caches(caches(KVCacheLayout.LBNHC.stride_order, torch.float16))


def test_vllm_finds_the_connector_by_name_through_the_plugin():
    """The entry point pyproject.toml installs, loaded as vLLM loads its general plugins:
    the factory then knows KVPushConnector by name (twice loaded: still once registered)."""
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "kvpush"]
    register = plugin.load()
    register(), register()
    ktc = KVTransferConfig(kv_connector="KVPushConnector", kv_role="kv_consumer", kv_load_failure_policy="recompute")
    assert KVConnectorFactory.get_connector_class(ktc) is KVPushConnector


def test_a_module_path_still_loads_with_a_deprecation_naming_the_new_form(recwarn):
    from kvpush.connector.kvpush_connector import warn_module_path
    warn_module_path("kvpush.connector.kvpush_connector")
    (w,) = [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "KVPushConnector" in str(w.message)]
    assert '{"kv_connector": "KVPushConnector", ...}' in str(w.message)
    warn_module_path(None)
    assert len([w for w in recwarn if "kv_connector_module_path" in str(w.message)]) == 1

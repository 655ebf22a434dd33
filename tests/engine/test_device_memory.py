"""GPU pools: the description of both memory kinds, the CUDA IPC handle and every refusal
of the path that maps it, the sidecar refusing an engine on another GPU, and the torch
copier over a pool it reaches as a tensor. What needs a GPU is skipped where there is none,
with the reason; nothing here stands in for the CUDA mapping itself."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from kvpush.channel.device_memory import CudaIpcHandle, CudaPoolMemory, check_pool_device, parse_device
from kvpush.channel.geometry import DestGeometry
from kvpush.channel.memory import DeviceMemory, PoolMapError
from kvpush.channel.attach import attach_pool
from kvpush.channel.pool import PoolDescription
from kvpush.connector.copiers.torch_copier import TorchCopier
from kvpush.contract.layout import KvLayout
from kvpush.sidecar.pools import LandingPool, StagingPool

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYOUT = KvLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16")
NO_GPU = "no CUDA device on this machine: the VRAM pool's mapping and its IPC handle need one (bench/gpu_check.py)"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)


def handle(**over) -> CudaIpcHandle:
    fields = dict(device=0, handle=b"\x01" * 64, size=LAYOUT.pool_bytes(4), offset=512, ref_counter_handle=b"ref",
                  ref_counter_offset=3, event_handle=b"\x02" * 64, event_sync_required=True, pid=12345)
    return CudaIpcHandle(**{**fields, **over})


def vram_desc(h: CudaIpcHandle, device_id: int = 0, **over) -> PoolDescription:
    return PoolDescription(**{**dict(role="landing", memory_kind="VRAM", share_handle=h.encode(),
                                     size_bytes=LAYOUT.pool_bytes(4), num_units=4,
                                     unit_bytes=LAYOUT.block_layer_bytes, layout=LAYOUT, device_id=device_id),
                              **over})


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


class TensorMemory(DeviceMemory):
    """Device memory as the copier sees it (``tensor()``), on the CPU: for the copier's and
    the sidecar's checks of a VRAM pool, not for its mapping (which ``gpu`` tests cover)."""

    def __init__(self, size: int, device_id: int = 0):
        self._t = torch.zeros(size, dtype=torch.uint8)
        self._device_id = device_id

    name = property(lambda self: "tensor")
    base_address = property(lambda self: self._t.data_ptr())
    size = property(lambda self: self._t.numel())
    device_id = property(lambda self: self._device_id)

    def share_handle(self) -> str:
        return handle(device=self._device_id).encode()

    def tensor(self):
        return self._t

    def close(self) -> None:
        pass


def test_the_pool_description_round_trips_for_both_memory_kinds():
    dram = PoolDescription("staging", "DRAM", "kvpush-e.prefill.staging-1-ab", LAYOUT.pool_bytes(8), 8,
                           LAYOUT.block_layer_bytes, LAYOUT)
    vram = vram_desc(handle(device=3), device_id=3)
    for desc in (dram, vram):
        # as HELLO carries it: JSON over the channel
        assert PoolDescription.from_dict(json.loads(json.dumps(desc.to_dict()))) == desc
    assert CudaIpcHandle.decode(vram.share_handle) == handle(device=3)
    assert CudaIpcHandle.decode(handle(event_handle=None).encode()).event_handle is None


@pytest.mark.parametrize("text,field", [
    ("kvpush-segment", "not a CUDA IPC handle"),
    ("cuda-ipc:{not json", "not JSON"),
    ("cuda-ipc:" + json.dumps({"device": 0}), "exactly the fields"),
])
def test_a_malformed_handle_is_refused(text, field):
    with pytest.raises(PoolMapError, match=field):
        CudaIpcHandle.decode(text)


@pytest.mark.parametrize("key,value,message", [
    ("device", -1, "share_handle.device must be a non-negative integer"),
    ("size", "big", "share_handle.size must be a non-negative integer"),
    ("pid", True, "share_handle.pid must be a non-negative integer"),
    ("event_sync_required", 1, "share_handle.event_sync_required must be a boolean"),
    ("handle", "@@not base64@@", "share_handle.handle is not base64"),
    ("ref_counter_handle", None, "share_handle.ref_counter_handle is not base64"),
])
def test_a_handle_with_a_bad_field_is_refused_naming_it(key, value, message):
    d = json.loads(handle().encode()[len("cuda-ipc:"):])
    d[key] = value
    with pytest.raises(PoolMapError, match=message):
        CudaIpcHandle.decode("cuda-ipc:" + json.dumps(d))


def test_a_vram_pool_is_refused_to_an_engine_on_another_gpu_or_none():
    desc = vram_desc(handle(device=1), device_id=1)
    check_pool_device(desc, 1)  # its own GPU
    with pytest.raises(PoolMapError, match=r"landing pool is on cuda:1, this engine on cuda:0.*--pool-device cuda:0"):
        check_pool_device(desc, 0)
    with pytest.raises(PoolMapError, match=r"VRAM on cuda:1; this engine process has no CUDA device"):
        check_pool_device(desc, None)
    with pytest.raises(PoolMapError, match="on cuda:1, this engine on cuda:0"):  # before any CUDA call
        attach_pool(desc, 0)
    dram = dataclasses.replace(desc, memory_kind="DRAM")
    check_pool_device(dram, None) or check_pool_device(dram, 5)  # host memory serves any engine


def test_the_handle_path_refuses_a_pool_whose_sidecar_is_gone_or_inconsistent():
    gone = handle(pid=dead_pid())
    with pytest.raises(PoolMapError, match=rf"landing pool on cuda:0 is gone: its process {gone.pid} has exited"):
        attach_pool(vram_desc(gone), 0)
    with pytest.raises(PoolMapError, match="share_handle.device is 2, the pool's device_id 0"):
        attach_pool(vram_desc(handle(device=2)), 0)
    with pytest.raises(PoolMapError, match="share_handle.size is 10 bytes"):
        attach_pool(vram_desc(handle(size=10)), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_a_vram_pool_is_neither_made_nor_mapped():
    import os
    with pytest.raises(PoolMapError, match=r"pool device cuda:0: this process sees no CUDA device"):
        CudaPoolMemory.create("t", 1024, 0)
    with pytest.raises(PoolMapError, match="this process sees no CUDA device"):
        attach_pool(vram_desc(handle(pid=os.getpid())), 0)


def test_pool_device_settings():
    assert parse_device("cpu") is None and parse_device("cuda:3") == 3
    for bad in ("gpu", "cuda", "cuda:x", "cuda:-1", "CUDA:0"):
        with pytest.raises(ValueError, match="pool device must be 'cpu' or 'cuda:N'"):
            parse_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_sidecar_asked_for_a_gpu_pool_without_one_exits_with_the_reason(tmp_path):
    cmd = [sys.executable, "-m", "kvpush.sidecar.service", "--role", "decode", "--engine-id", "d-gpu", "--token", "t",
           "--controlplane", "127.0.0.1:9", "--kv-layout", "layers=2,block=16,heads=2,dim=8,dtype=bfloat16",
           "--num-blocks", "4", "--model", "m", "--socket", str(tmp_path / "s.sock"), "--pool-device", "cuda:0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--pool-device cuda:0 --num-blocks 4: pool device cuda:0: this process sees no CUDA device" in done.stderr
    done = subprocess.run([*cmd[:-1], "cuda:zero"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pool device must be 'cpu' or 'cuda:N'" in done.stderr


def test_the_sidecar_refuses_a_worker_on_another_gpu_at_hello():
    from kvpush.sidecar.base import SidecarConfig
    from kvpush.sidecar.decode import DecodeSidecar

    conn = types.SimpleNamespace(rank=0)  # the channel's connection, as HELLO sees it
    side = DecodeSidecar(SidecarConfig("d", "decode", LAYOUT, 4, "/nonexistent.sock", device=0))
    side.pools = [LandingPool(LAYOUT, 4, TensorMemory(LAYOUT.pool_bytes(4), device_id=0))]
    assert side.on_hello(conn, {"name": "w", "cuda_device": 0})["pool"]["memory_kind"] == "VRAM"
    assert side.on_hello(conn, {"name": "vllm-scheduler"})["role"] == "decode"  # maps no pool: not asked
    with pytest.raises(PoolMapError, match="on cuda:0, this engine on cuda:1"):
        side.on_hello(conn, {"name": "w", "cuda_device": 1})
    with pytest.raises(PoolMapError, match="has no CUDA device"):
        side.on_hello(conn, {"name": "w", "cuda_device": None})
    with pytest.raises(ValueError, match="--checksums reads the pool on the host"):
        from kvpush.sidecar.push import PushConfig
        SidecarConfig("d", "decode", LAYOUT, 4, "/x.sock", device=0, push=PushConfig(checksums=True))


def test_the_torch_copier_stages_and_loads_through_a_pool_it_reaches_as_a_tensor():
    """The device-pool path of ``bind_pool`` (``DeviceMemory.tensor``), on CPU tensors."""
    staging = StagingPool(LAYOUT, 8, TensorMemory(LAYOUT.pool_bytes(8)))
    landing = LandingPool(LAYOUT, 8, TensorMemory(LAYOUT.pool_bytes(8)))
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn(6, 2, 16, 16, generator=gen).to(torch.bfloat16) for _ in range(2)]
    dst = [torch.zeros(6, 2, 16, 16, dtype=torch.bfloat16) for _ in range(2)]
    n, p_ids, d_ids, landing_ids = 20, [4, 1], [2, 5], [6, 3]
    geom = DestGeometry.for_layout(LAYOUT, 16, n)
    alloc = staging.allocate(geom.block_layer_bytes, geom.num_blocks)
    prefill, decode = TorchCopier(16), TorchCopier(16)
    prefill.bind_caches(src, LAYOUT)
    prefill.bind_pool(staging.memory, staging.info())
    for layer in range(2):
        assert prefill.stage(layer, p_ids, 0, n, alloc, geom) is None  # CPU tensors: done on return
    s, d = staging.memory.tensor(), landing.memory.tensor()
    for layer in range(2):  # the push, block by block
        for j in range(geom.num_blocks):
            a = alloc.extent_offset(alloc.extents[0], layer) + j * geom.block_layer_bytes
            b = landing.unit_offset(layer, landing_ids[j])
            d[b:b + geom.block_layer_bytes] = s[a:a + geom.block_layer_bytes]
    decode.bind_caches(dst, LAYOUT)
    decode.bind_pool(landing.memory, landing.info())
    assert decode.load(d_ids, 0, n, landing_ids) is None and decode.fence() is None
    for layer in range(2):
        for t in range(n):
            assert torch.equal(dst[layer][d_ids[t // 16], :, t % 16], src[layer][p_ids[t // 16], :, t % 16])
        assert not dst[layer][[0, 1, 3, 4]].any()


@gpu
def test_a_vram_pool_is_mapped_by_a_second_process_byte_for_byte(tmp_path):
    pool = CudaPoolMemory.create("t-gpu", 1 << 20, 0)
    try:
        pool.tensor().copy_(torch.arange(1 << 20, device="cuda:0", dtype=torch.int64).to(torch.uint8))
        torch.cuda.synchronize()
        desc = PoolDescription("landing", "VRAM", pool.share_handle(), pool.size, 1, pool.size,
                               KvLayout(1, 16, 16, 2048, "uint8"), 0)
        script = ("import json,sys,torch; from kvpush.channel.attach import attach_pool; from kvpush.channel.pool import "
                  "PoolDescription as P; m=attach_pool(P.from_dict(json.loads(sys.argv[1])), 0); t=m.tensor(); "
                  "ok=bool((t==torch.arange(t.numel(),device='cuda:0').to(torch.uint8)).all()); t[:8]=7; "
                  "torch.cuda.synchronize(); print(ok)")
        done = subprocess.run([sys.executable, "-c", script, json.dumps(desc.to_dict())], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == "True", done.stderr
        assert bool((pool.tensor()[:8] == 7).all())  # the second process's writes are ours
    finally:
        pool.close()


@gpu
def test_a_vram_pool_whose_sidecar_exited_is_refused(tmp_path):
    script = ("import json,torch; from kvpush.channel.device_memory import CudaPoolMemory as C; p=C.create('t',4096,0); "
              "print(p.share_handle())")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    h = CudaIpcHandle.decode(done.stdout.strip())
    desc = PoolDescription("landing", "VRAM", h.encode(), 4096, 1, 4096, KvLayout(1, 16, 1, 128, "uint8"), 0)
    with pytest.raises(PoolMapError, match="is gone|cannot open"):
        attach_pool(desc, 0)


def test_cpu_memory_is_what_a_dram_pool_description_maps():
    pool = StagingPool.create_shm("t-dram-desc", LAYOUT, 2)
    try:
        mapped = attach_pool(pool.info(), None)
        assert mapped.mem_kind == "DRAM" and isinstance(mapped.host_view(), np.ndarray)
        mapped.close()
    finally:
        pool.close()

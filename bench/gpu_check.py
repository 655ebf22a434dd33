"""The GPU check of issue #11: one command, no vLLM, a few minutes on one GPU.

    python bench/gpu_check.py                 # on a GPU machine: cuda:0, writes docs/BENCHMARKS.md
    python bench/gpu_check.py --device cpu --tokens 64 --layers 4 --heads 2 --dim 16   # the smoke run here

Three parts, each with its reference and its limit in the same run:

1. **IPC.** A sidecar-owned pool (``kvpush.sidecar.pools.make_pool_memory``: VRAM on the GPU) is
   mapped by a second process from its description (``kvpush.channel.memory.attach_pool``, the
   CUDA IPC handle), which checks the bytes the first wrote and writes some back.
2. **Device copies.** ``TorchCopier`` stages a request of scattered blocks from caches in
   each of vLLM's six ``KVCacheLayout`` stride orders and four dtypes (float16, bfloat16,
   float32, fp8 as vLLM stores it) into a VRAM staging pool, the staged blocks are copied
   to a landing pool as a push would, and loaded into a second cache: byte for byte the
   request's tokens, every other block untouched. Timed (CUDA events) against a plain
   device-to-device copy of the same bytes, the limit.
3. **NIXL VRAM to VRAM.** Two agents in two processes (UCX); an 8B-class request (32
   layers, 8 KV heads x 128, bf16) at 1k and 8k tokens. Layer by layer as kvpush pushes:
   each layer's compute (a bf16 matmul with the FLOPs of one 8B layer's linear layers;
   attention's quadratic term is left out, so prefill is shorter than a real one and the
   exposed time an upper bound), its staging copy, an event, and the layer's WRITE once the
   event has passed, the last with the notification. Measured: the time from the end of
   the last layer's staging to the notification at the receiver (exposed), and the
   throughput; beside it the same bytes as one WRITE after prefill (the pull-style
   baseline), and the bytes checked by CRC on both ends.

Each part (``ipc``, ``copy``, ``nixl`` per request size) runs in its own process under its own
timeout; each row and each part's ``PART`` line is printed when done, so one part that raises,
hangs or dies is its line and the next still runs (``bench/gpu_check_run.py``). NIXL needs the
build for torch's CUDA: ``nixl-cu13`` for CUDA 13, ``nixl-cu12`` for CUDA 12.

On a CPU (``--device cpu``) the same code runs on host memory and DRAM registrations:
that is the smoke test of this script (``tests/test_gpu_check.py``), and its figures are
not GPU figures: it never writes them to the docs.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import pathlib
import statistics
import signal
import subprocess
import sys
import time
import zlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvpush.channel.device_memory import parse_device  # noqa: E402
from kvpush.channel.geometry import DestGeometry  # noqa: E402
from kvpush.channel.attach import attach_pool  # noqa: E402
from kvpush.channel.pool import PoolDescription  # noqa: E402
from kvpush.connector.copiers.torch_copier import TorchCopier  # noqa: E402
from kvpush.contract.layout import KvLayout  # noqa: E402
from kvpush.sidecar.pools import LandingPool, StagingPool, make_pool_memory  # noqa: E402
from bench.gpu_check_run import (PARTS, TIMEOUTS, _parts, _timeouts, docs_to_write,  # noqa: E402,F401
                                 run_all, write_docs)

# vLLM's KVCacheLayout stride orders over the logical [layer, block, head, slot, content]
# axes (vllm/v1/kv_cache_layout.py of the vLLM we pin); tests/test_gpu_check.py checks this
# table against the installed vLLM, so the check runs where vLLM is not installed.
STRIDE_ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                 "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
# (layout dtype, torch storage dtype, vLLM --kv-cache-dtype)
DTYPES = [("float16", torch.float16, "auto"), ("bfloat16", torch.bfloat16, "auto"),
          ("float32", torch.float32, "auto"), ("float8_e4m3fn", torch.uint8, "fp8")]
# Tests only, "PART=KIND,...": a part raises, hangs or dies (raise, hang, die), nixl's receiver exits (recv-die)
FAULT_ENV = "KVPUSH_GPU_CHECK_FAULT"


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    dim: int
    block: int = 16


class Clock:
    """Elapsed time of work on ``device``: CUDA events there, wall time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time(self, fn, reps: int = 5) -> float:
        """Median seconds of ``fn()`` over ``reps`` runs after one warm-up."""
        fn()
        samples = []
        for _ in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                samples.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)


def use_device(device: torch.device) -> None:
    """``device`` current for this thread (a new one starts on GPU 0, a context not its own)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pattern(n: int, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, device=device, dtype=torch.uint8)


def pool_tensor(memory) -> torch.Tensor:
    return memory.tensor() if memory.mem_kind == "VRAM" else torch.from_numpy(memory.host_view())


# -- 1. IPC -------------------------------------------------------------------------------------
def check_ipc(device: torch.device, size: int = 64 << 20) -> dict:
    memory = make_pool_memory("gpucheck.ipc", size, parse_device(str(device)))
    try:
        t = pool_tensor(memory)
        t.copy_(pattern(size, 1, device))
        sync(device)
        layout = KvLayout(num_layers=1, block_size=16, num_kv_heads=16, head_dim=1024, dtype="uint8")
        units = size // layout.block_layer_bytes
        desc = PoolDescription("landing", memory.mem_kind, memory.share_handle(), memory.size, units,
                               layout.block_layer_bytes, layout, memory.device_id)
        done = subprocess.run([sys.executable, __file__, "--child-ipc", json.dumps(desc.to_dict()), str(device)],
                              capture_output=True, text=True, timeout=180, cwd=ROOT)
        if done.returncode != 0:
            return {"ok": False, "why": done.stderr.strip()[-400:]}
        child = json.loads(done.stdout.strip().splitlines()[-1])
        back = bool(torch.equal(t[:1 << 20], pattern(1 << 20, 2, device)))
        return {"ok": child["ok"] and back, "mib": size >> 20, "kind": memory.mem_kind, "map_ms": child["map_ms"],
                "why": "" if back else "the second process's writes are not in the pool"}
    finally:
        memory.close()


def child_ipc(desc_json: str, device_name: str) -> None:
    device = torch.device(device_name)
    use_device(device)
    desc = PoolDescription.from_dict(json.loads(desc_json))
    t0 = time.perf_counter()
    memory = attach_pool(desc, device.index if device.type == "cuda" else None)
    map_ms = (time.perf_counter() - t0) * 1e3
    t = pool_tensor(memory)
    ok = bool(torch.equal(t, pattern(desc.size_bytes, 1, device)))
    t[:1 << 20].copy_(pattern(1 << 20, 2, device))
    sync(device)
    print(json.dumps({"ok": ok, "map_ms": map_ms}))
    memory.close()


# -- 2. device copies ------------------------------------------------------------------------------
def layer_views(order, shape: Shape, blocks: int, dtype, fill) -> list[torch.Tensor]:
    logical = (shape.layers, blocks, shape.heads, shape.block, 2 * shape.dim)
    physical = fill(torch.empty([logical[o] for o in order], dtype=dtype, device=fill.device))
    view = physical.permute(*[order.index(i) for i in range(5)])
    return [view[i] for i in range(shape.layers)]


def check_copies(device: torch.device, shape: Shape, tokens: int) -> list[dict]:
    return list(iter_copies(device, shape, tokens))


def iter_copies(device: torch.device, shape: Shape, tokens: int):
    """Each layout and dtype's row, as it is measured."""
    nb = -(-tokens // shape.block)
    blocks = 2 * nb + 3
    gen = torch.Generator().manual_seed(7)
    src_ids = torch.randperm(blocks, generator=gen)[:nb].tolist()  # scattered, both ends
    dst_ids = torch.randperm(blocks, generator=gen)[:nb].tolist()
    for dname, tdtype, cache_dtype in DTYPES:
        lo = KvLayout(num_layers=shape.layers, block_size=shape.block, num_kv_heads=shape.heads,
                      head_dim=shape.dim, dtype=dname)
        staging = StagingPool.create("gpucheck.copy", lo, nb, parse_device(str(device)))
        landing = LandingPool.create("gpucheck.copy", lo, nb, parse_device(str(device)))
        try:
            for lname, order in STRIDE_ORDERS.items():
                yield _one_copy(device, shape, lo, tokens, blocks, src_ids, dst_ids, staging, landing,
                                lname, order, tdtype, cache_dtype)
        finally:
            staging.close()
            landing.close()


class _Fill:
    def __init__(self, device, seed=None):
        self.device, self.seed = device, seed

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.view(torch.uint8).view(-1)
        flat.copy_(pattern(flat.numel(), self.seed, self.device) if self.seed is not None else
                   torch.full_like(flat, 0xAB))
        return t


def _one_copy(device, shape, lo, tokens, blocks, src_ids, dst_ids, staging, landing, lname, order, tdtype,
              cache_dtype) -> dict:
    src = layer_views(order, shape, blocks, tdtype, _Fill(device, 11))
    dst = layer_views(order, shape, blocks, tdtype, _Fill(device))
    geom = DestGeometry.for_layout(lo, shape.block, tokens)
    alloc = staging.allocate(geom.block_layer_bytes, geom.num_blocks)
    landing_ids = list(range(geom.num_blocks))
    try:
        pre, dec = TorchCopier(shape.block, lname, cache_dtype), TorchCopier(shape.block, lname, cache_dtype)
        pre.bind_caches(src, lo)
        pre.bind_pool(staging.memory, staging.info())
        dec.bind_caches(dst, lo)
        dec.bind_pool(landing.memory, landing.info())
        plan = pre.plan(src_ids, 0, tokens)
        s_rows, l_rows = pool_tensor(staging.memory), pool_tensor(landing.memory)
        span = geom.num_blocks * geom.block_layer_bytes

        def stage():
            for layer in range(shape.layers):
                pre.stage(layer, src_ids, 0, tokens, alloc, geom, plan)

        def push():  # what the sidecar's WRITE does, one contiguous run per layer here
            for layer in range(shape.layers):
                a = alloc.extent_offset(alloc.extents[0], layer)
                b = landing.unit_offset(layer, 0)
                l_rows[b:b + span].copy_(s_rows[a:a + span])

        def load():
            dec.load(dst_ids, 0, tokens, landing_ids)

        clock = Clock(device)
        stage_s = clock.time(stage)
        push()
        load_s = clock.time(load)
        sync(device)
        nbytes = tokens * pre.token_layer_bytes * shape.layers
        a_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        b_buf = torch.empty_like(a_buf)
        limit_s = clock.time(lambda: b_buf.copy_(a_buf))
        t = torch.arange(tokens)
        sb, db = torch.tensor(src_ids)[t // shape.block], torch.tensor(dst_ids)[t // shape.block]
        slots = t % shape.block
        exact = all(torch.equal(src[i][sb.to(device), :, slots.to(device), :].view(torch.uint8),
                                dst[i][db.to(device), :, slots.to(device), :].view(torch.uint8))
                    for i in range(shape.layers))
        others = [b for b in range(blocks) if b not in dst_ids]
        untouched = all(bool((dst[i][others].reshape(-1).view(torch.uint8) == 0xAB).all())
                        for i in range(shape.layers))
        return {"layout": lname, "dtype": lo.dtype, "mib": nbytes / 2**20, "stage_us": stage_s * 1e6,
                "load_us": load_s * 1e6, "limit_us": limit_s * 1e6, "exact": exact and untouched}
    finally:
        staging.free(alloc.alloc_id)


# -- 3. NIXL VRAM to VRAM ------------------------------------------------------------------------------
def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.cpu().numpy().tobytes())


def _from_receiver(recv: subprocess.Popen) -> dict:  # a receiver that exited is an error, not a hang
    line = recv.stdout.readline()
    if not line:
        raise RuntimeError(f"the NIXL receiver exited (rc {recv.wait(5)}) without answering")
    return json.loads(line)


def check_nixl(device: torch.device, shape: Shape, tokens: int, compute: bool = True,
               wait_s: float = 60.0) -> dict:
    from kvpush.sidecar.transport.nixl import NixlConfig, NixlTransport

    lo = KvLayout(num_layers=shape.layers, block_size=shape.block, num_kv_heads=shape.heads, head_dim=shape.dim,
                  dtype="bfloat16")
    nb = -(-tokens // shape.block)
    recv = subprocess.Popen([sys.executable, __file__, "--child-recv", json.dumps(lo.to_dict()), str(nb),
                             str(device)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    staging = agent = None
    try:  # from here on, whatever fails (a backend that cannot be created too) ends the receiver
        staging = StagingPool.create("gpucheck.nixl", lo, nb, parse_device(str(device)))
        agent = NixlTransport(NixlConfig(f"gpucheck-send-{os.getpid()}", ("UCX",)))
        hello = _from_receiver(recv)
        agent.register(staging.memory)
        peer = agent.add_remote(base64.b64decode(hello["metadata"]))
        blocks = 2 * nb
        caches = layer_views(STRIDE_ORDERS["LBNHC"], shape, blocks, torch.bfloat16, _Fill(device, 5))
        ids = list(range(1, 2 * nb, 2))[:nb]
        copier = TorchCopier(shape.block, "FLASH_ATTN")
        copier.bind_caches(caches, lo)
        copier.bind_pool(staging.memory, staging.info())
        geom = DestGeometry.for_layout(lo, shape.block, tokens)
        alloc = staging.allocate(geom.block_layer_bytes, geom.num_blocks)
        span = geom.num_blocks * geom.block_layer_bytes
        kind = staging.memory.mem_kind

        def descs(layer: int):
            a = staging.base_address + alloc.extent_offset(alloc.extents[0], layer)
            b = hello["base"] + layer * nb * lo.block_layer_bytes
            dev_l, dev_r = staging.memory.device_id, hello["device"]
            return (np.array([[a, span, dev_l]], dtype=np.uint64), np.array([[b, span, dev_r]], dtype=np.uint64))

        # an 8B layer's linear FLOPs per token ~ 2 * 0.22e9: (tokens x 4096) @ (4096 x n)
        hidden = 4096 if device.type == "cuda" else 64
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        w = torch.randn(hidden, 53_700 if device.type == "cuda" else 64, device=device, dtype=torch.bfloat16)
        results = {}
        agent.connect(peer)  # as the sidecar connects its peers: ahead of any request
        for mode in ("warm-up", "layered", "after"):  # the first transfer also warms UCX's paths: not counted
            plan = copier.plan(ids, 0, tokens)
            events = []
            sync(device)
            recv.stdin.write("wait\n")  # the receiver polls for the notification from now on
            recv.stdin.flush()
            for layer in range(shape.layers):  # the forward pass, enqueued at once (the GPU runs behind)
                if compute:
                    torch.matmul(x, w)
                copier.stage(layer, ids, 0, tokens, alloc, geom, plan)
                ev = torch.cuda.Event(blocking=True) if device.type == "cuda" else None
                if ev is not None:
                    ev.record()
                events.append(ev)
            handles = []
            t_first = None
            if mode != "after":  # the sender: each layer's WRITE once its copy is done
                for layer, ev in enumerate(events):
                    if ev is not None:
                        ev.synchronize()
                    if t_first is None:
                        t_first = time.time()
                    loc, rem = descs(layer)
                    last = layer == shape.layers - 1
                    handles.append(agent.post_write(loc, rem, peer, local_kind=kind, remote_kind=hello["kind"],
                                                    notif=b"landed" if last else b"")[0])
                t_ready = time.time()  # the last layer's copy had finished: prefill is over
            else:  # the baseline: everything after the forward pass, one WRITE
                sync(device)
                t_ready = t_first = time.time()
                pairs = [descs(layer) for layer in range(shape.layers)]
                loc = np.concatenate([p[0] for p in pairs])
                rem = np.concatenate([p[1] for p in pairs])
                handles.append(agent.post_write(loc, rem, peer, local_kind=kind, remote_kind=hello["kind"],
                                                notif=b"landed")[0])
            deadline = time.monotonic() + wait_s
            while any(agent.check(h) not in ("DONE", "ERR") for h in handles):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL WRITEs not done after {wait_s:.0f} s ({mode})")
                time.sleep(100e-6)
            states = {agent.check(h) for h in handles}
            for h in handles:
                agent.release(h)
            got = _from_receiver(recv)
            want = [crc(pool_tensor(staging.memory)[alloc.extent_offset(alloc.extents[0], layer):][:span])
                    for layer in range(shape.layers)]
            results[mode] = {"exposed_ms": (got["t"] - t_ready) * 1e3, "span_ms": (got["t"] - t_first) * 1e3,
                             "gbps": span * shape.layers / max(got["t"] - t_first, 1e-9) / 1e9,
                             "exact": got["crcs"] == want and states == {"DONE"}}
        recv.stdin.write("quit\n")
        recv.stdin.flush()
        recv.wait(30)
        results.pop("warm-up")
        return {"tokens": tokens, "mib": span * shape.layers / 2**20, "kind": kind, **results}
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(10)
        if agent is not None:
            agent.close()
        if staging is not None:
            staging.close()


def child_recv(layout_json: str, nb: str, device_name: str) -> None:
    from kvpush.sidecar.transport.nixl import NixlConfig, NixlTransport

    device = torch.device(device_name)
    use_device(device)
    lo = KvLayout.from_dict(json.loads(layout_json))
    landing = LandingPool.create("gpucheck.recv", lo, int(nb), parse_device(device_name))
    agent = NixlTransport(NixlConfig(f"gpucheck-recv-{os.getpid()}", ("UCX",)))
    agent.register(landing.memory)
    print(json.dumps({"metadata": base64.b64encode(agent.metadata()).decode(), "base": landing.base_address,
                      "device": landing.memory.device_id, "kind": landing.memory.mem_kind}), flush=True)
    if "recv-die" in _faults().get("nixl", ()):
        os._exit(3)
    span = int(nb) * lo.block_layer_bytes
    for line in sys.stdin:
        if line.strip() != "wait":
            break
        while True:  # the notification: polled as the sidecar's hot poll does
            notes = agent.poll_notifs()
            if any(b"landed" in m for msgs in notes.values() for m in msgs):
                t = time.time()
                break
            time.sleep(100e-6)
        sync(device)
        rows = pool_tensor(landing.memory)
        crcs = [crc(rows[layer * span:(layer + 1) * span]) for layer in range(lo.num_layers)]
        print(json.dumps({"t": t, "crcs": crcs}), flush=True)
    agent.close()
    landing.close()


# -- one part per process --------------------------------------------------------------------------------
def _faults() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        part, _, kind = item.partition("=")
        out.setdefault(part.strip(), set()).add(kind.strip())
    return out


def _emit(part: str, row: dict) -> None:
    print("ROW " + json.dumps({"part": part, **row}), flush=True)


def run_part(part: str, device: torch.device, shape: Shape, copy_tokens: int, tokens: int | None) -> None:
    """``--run-part``: one part, each row printed the moment it is measured."""
    use_device(device)
    faults = _faults().get(part, set())
    if "raise" in faults:
        raise RuntimeError(f"fault injected into {part} ({FAULT_ENV})")
    while "hang" in faults:
        time.sleep(1)
    if "die" in faults:
        os.kill(os.getpid(), signal.SIGKILL)
    if part == "ipc":
        _emit(part, check_ipc(device))
    elif part == "copy":
        for row in iter_copies(device, shape, copy_tokens):
            _emit(part, row)
    elif part == "nixl":
        try:
            _emit(part, check_nixl(device, shape, tokens))
        except ImportError as exc:
            _emit(part, {"tokens": tokens, "skipped": f"NIXL not importable ({exc})"})
    else:
        raise SystemExit(f"no part {part!r} (parts: {', '.join(PARTS)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", default="1024,8192", help="request sizes of the NIXL part")
    p.add_argument("--copy-tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--parts", help=f"the parts to run, comma-separated (default: all of {','.join(PARTS)})")
    p.add_argument("--skip", help="parts not to run, comma-separated")
    p.add_argument("--timeout", help="seconds per part's process: N for all, or PART=N,... (default: "
                   + ",".join(f"{k}={v:.0f}" for k, v in TIMEOUTS.items()) + "; nixl: per request size)")
    p.add_argument("--no-docs", action="store_true", help="print only (a CPU run, or one that runs only "
                   "some parts, never writes the docs)")
    p.add_argument("--run-part", help=argparse.SUPPRESS)
    p.add_argument("--child-ipc", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--child-recv", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_ipc or args.child_recv:
        child_ipc(*args.child_ipc) if args.child_ipc else child_recv(*args.child_recv)
        return 0
    device = torch.device(args.device)
    shape = Shape(args.layers, args.heads, args.dim)
    if args.run_part:
        run_part(args.run_part, device, shape, args.copy_tokens,
                 int(args.tokens) if args.run_part == "nixl" else None)
        return 0
    parts, timeouts = _parts(args.parts, args.skip), _timeouts(args.timeout)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing measured. "
              "Run it on a GPU machine, or --device cpu for the smoke run.", file=sys.stderr)
        return 2
    # the parent opens no CUDA context while the parts run: each part sets its own device
    child_argv = ["--device", args.device, "--copy-tokens", str(args.copy_tokens), "--layers", str(args.layers),
                  "--heads", str(args.heads), "--dim", str(args.dim)]
    text, failed = run_all(pathlib.Path(__file__).resolve(), device, child_argv, parts,
                           [int(x) for x in args.tokens.split(",")], timeouts)
    path = docs_to_write(device, args.no_docs, parts)
    if path is not None:
        write_docs(text, path)
        print(f"gpu_check: table written to {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

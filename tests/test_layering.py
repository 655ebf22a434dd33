"""The folders are the architecture: who may import whom, checked on every run.

Read from the code with ``ast`` (every import, at module level or inside a function),
so the map in docs/ARCHITECTURE.md cannot drift from what the code does."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kvpush", "client", "controlplane", "router", "sidecar", "engine", "app", "bench")
OURS = set(PACKAGES)

# package -> what of ours it may import (itself always). Ground floor: kvpush (its
# contract imports only itself); the processes sit on it; app and bench on top.
ALLOWED = {
    "kvpush": set(),
    "client": {"kvpush"},
    "controlplane": {"kvpush"},
    "router": {"kvpush", "client"},
    "engine": {"kvpush"},
    "sidecar": {"kvpush", "client", "engine"},
    "app": {"kvpush", "client", "controlplane", "router", "sidecar", "engine"},
    "bench": set(PACKAGES),
}
NEVER_IN = {"engine": {"nixl", "nixl_cu12"}}  # the engine side moves no bytes over the network


def modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        yield path


def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_sits_below_it(package):
    bad = []
    for path in modules(package):
        for name in imports(path):
            top = name.split(".")[0]
            if top in OURS and top != package and top not in ALLOWED[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if top in NEVER_IN.get(package, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_contract_depends_on_nothing_else_of_ours():
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in modules("kvpush/contract") for n in imports(p)
           if n.split(".")[0] in OURS and not n.startswith("kvpush.contract")]
    assert not bad, "\n".join(bad)


def test_no_module_is_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for pkg in PACKAGES for p in modules(pkg)
            if (n := len(p.read_text().splitlines())) > 500]
    assert not long, "\n".join(long)

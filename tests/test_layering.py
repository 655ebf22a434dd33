"""The folders are the architecture: who may import whom, checked on every run.

Read from the code with ``ast`` (every import, at module level or inside a function),
so the map in docs/ARCHITECTURE.md cannot drift from what the code does."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Everything installed is under kvpush/; each process's code is a package of its own there.
# "kvpush" alone is the ground floor: contract/ and the helper modules beside it.
SUBPACKAGES = ("client", "controlplane", "router", "sidecar", "connector", "channel", "app")
UNITS = ("kvpush", *(f"kvpush.{p}" for p in SUBPACKAGES), "bench")

# unit -> what of ours it may import (itself always). The processes sit on the ground
# floor; the local channel's shared half (channel) serves both the sidecar and the
# connector, which never import each other; app and bench on top.
ALLOWED = {
    "kvpush": set(),
    "kvpush.client": {"kvpush"},
    "kvpush.controlplane": {"kvpush", "kvpush.client"},  # a replica forwards to its peers as a client
    "kvpush.channel": {"kvpush"},
    "kvpush.router": {"kvpush", "kvpush.client"},
    "kvpush.connector": {"kvpush", "kvpush.channel"},
    "kvpush.sidecar": {"kvpush", "kvpush.client", "kvpush.channel"},
    "kvpush.app": set(UNITS) - {"bench"},
    "bench": set(UNITS),
}
# What runs inside vLLM, or maps the pools there, moves no bytes over the network.
NEVER_IN = {"kvpush.connector": {"nixl", "nixl_cu12", "nixl_cu13"},
            "kvpush.channel": {"nixl", "nixl_cu12", "nixl_cu13"}}


def unit_of(dotted: str) -> str:
    """The unit a module (``kvpush.sidecar.push``) or an import of it belongs to."""
    parts = dotted.split(".")
    if parts[0] == "kvpush":
        return f"kvpush.{parts[1]}" if len(parts) > 1 and parts[1] in SUBPACKAGES else "kvpush"
    return parts[0]


def modules(unit: str):
    """The unit's files (the ground floor: kvpush/ less its subpackages)."""
    base = ROOT / unit.replace(".", "/")
    for path in sorted(base.rglob("*.py")):
        if "_pb2" in path.name:
            continue
        if unit == "kvpush" and path.relative_to(base).parts[0] in SUBPACKAGES:
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


@pytest.mark.parametrize("unit", UNITS)
def test_each_package_imports_only_what_sits_below_it(unit):
    bad = []
    for path in modules(unit):
        for name in imports(path):
            to = unit_of(name)
            if to in UNITS and to != unit and to not in ALLOWED[unit]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
            if name.split(".")[0] in NEVER_IN.get(unit, ()):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_contract_depends_on_nothing_else_of_ours():
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in modules("kvpush/contract") for n in imports(p)
           if unit_of(n) in UNITS and not n.startswith("kvpush.contract")]
    assert not bad, "\n".join(bad)


def test_only_kvpush_is_a_top_level_package():
    """What a wheel installs: one import name."""
    tops = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert tops == ["bench", "kvpush", "tests"], tops  # bench and tests ship in no wheel (pyproject.toml)


def test_no_module_is_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in [*ROOT.joinpath("kvpush").rglob("*.py"), *ROOT.joinpath("bench").rglob("*.py")]
            if "_pb2" not in p.name and (n := len(p.read_text().splitlines())) > 500]
    assert not long, "\n".join(long)

#!/usr/bin/env python3
"""Write requirements/base.txt, the services' lock, from the venv that runs this: every
distribution ``kvpush[all]`` needs, its dependencies' dependencies included, pinned at the
version installed here, and grpcio-tools (with its own), which makes the gRPC stubs.

    .venv/bin/python scripts/lock.py           # rewrite requirements/base.txt
    .venv/bin/python scripts/lock.py --check   # exit 1, saying what differs, if it is stale

Run it in the dev venv (scripts/setup.sh: the lock, then vLLM's CPU build): its versions are
the ones every test ran with, and the ones vLLM's own pins agreed to. The services image
installs the lock with ``--no-deps`` and then asks pip, offline, whether kvpush[all] is
satisfied (deploy/docker/Dockerfile): a distribution missing here fails that build.
The markers are evaluated here (CPython 3.11 on Linux, what CI and the image run)."""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata as md
import pathlib
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = pathlib.Path(__file__).resolve().parent.parent / "requirements" / "base.txt"
ROOTS = (("kvpush", ("all",)), ("grpcio-tools", ()))
HEADER = """\
# The services' lock (control plane, sidecar, router, embedded etcd, the stubs' generator):
# every distribution kvpush[all] needs, transitively, at the version every test ran with.
# Written by scripts/lock.py from the dev venv (vLLM installed: its pins agree); do not
# edit by hand. NIXL is in nixl.txt (installed with --no-deps), test tools in dev.txt.
"""


def closure(roots=ROOTS) -> dict[str, str]:
    """Name -> installed version of the roots (kvpush not counted) and all they need, each
    requirement's extras followed and its markers evaluated for this interpreter."""
    extras: dict[str, set[str]] = {}
    todo = [(name, set(ex)) for name, ex in roots]
    while todo:
        name, asked = todo.pop()
        key = canonicalize_name(name)
        if key in extras and asked <= extras[key]:
            continue
        extras.setdefault(key, set()).update(asked)
        try:
            requires = md.distribution(key).requires or []
        except md.PackageNotFoundError:
            raise SystemExit(f"{key} is needed (by the closure of {roots[0][0]}) and not installed in "
                             f"{sys.prefix}: run scripts/setup.sh first") from None
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras[key] or {""}):
                todo.append((req.name, set(req.extras)))
    return {key: md.version(key) for key in sorted(extras) if key != "kvpush"}


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={version}\n" for name, version in pins.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 if stale")
    args = parser.parse_args()
    want, have = render(closure()), LOCK.read_text() if LOCK.exists() else ""
    if not args.check:
        LOCK.write_text(want)
        return 0
    if want == have:
        return 0
    sys.stdout.writelines(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                               str(LOCK), "this venv's closure of kvpush[all]"))
    print(f"\n{LOCK} is not what {sys.prefix} runs: rewrite it with scripts/lock.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

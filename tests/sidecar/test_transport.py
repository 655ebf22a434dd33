"""The NIXL transport's backend setting: what this build and host have is used, the rest
is refused at start with the reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpush.sidecar.transport.base import TransportUnavailable
from kvpush.sidecar.transport.nixl import NixlConfig, NixlTransport


def test_a_backend_kvpush_is_not_written_for_is_refused():
    with pytest.raises(TransportUnavailable, match="kvpush runs on one of"):
        NixlTransport(NixlConfig("t-gds", ("GDS",)))


def test_libfabric_is_used_where_the_host_has_it_and_refused_with_nixls_reason_where_not():
    try:
        transport = NixlTransport(NixlConfig("t-lf", ("LIBFABRIC",)))
    except TransportUnavailable as exc:
        assert "LIBFABRIC" in str(exc) and ("not in this NIXL build" in str(exc) or "cannot create" in str(exc))
    else:
        assert "LIBFABRIC" in transport._agent.backends
        transport.close()


def test_the_sidecar_command_refuses_a_backend_it_cannot_create(tmp_path):
    args = ["--role", "decode", "--engine-id", "d", "--token", "t", "--kv-layout",
            "layers=2,block=16,heads=2,dim=8,dtype=float32", "--num-blocks", "4", "--model", "m",
            "--socket", str(tmp_path / "s.sock"), "--controlplane", "127.0.0.1:1", "--backends", "GDS"]
    done = subprocess.run([sys.executable, "-m", "kvpush.sidecar.service", *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--backends GDS" in done.stderr and "kvpush runs on one of" in done.stderr

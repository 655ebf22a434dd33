"""The sidecar's hop to the control plane over mutual TLS, end to end: a ``kvpush sidecar``
process with a client certificate registers with a control plane that requires one; a
sidecar speaking plaintext to it never does."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import tempfile

import pytest

from tests.pki import make_pki
from tests.sidecar.conftest import ControlPlaneProc, Stack
from tests.sidecar.service_helpers import Etcd

pytestmark = pytest.mark.timeout(180)

LAYOUT = "layers=2,block=16,heads=2,dim=16,dtype=float16"


async def test_a_sidecar_registers_over_mutual_tls_and_plaintext_is_refused(etcd):
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="kvtls-", dir="/tmp"))  # socket paths stay short
    pki = make_pki(workdir, ("server", "sidecar"))
    st = Stack(etcd, workdir)
    st.cp = ControlPlaneProc(etcd.endpoint, workdir, extra=(
        "--tls-cert", pki("server.pem"), "--tls-key", pki("server.key"), "--tls-client-ca", pki("ca.pem")))
    registry = Etcd(etcd.endpoint)
    try:
        st.cp.start()
        tls = st.sidecar("decode", "dec-tls", LAYOUT, 16, "m", "--tls-ca", pki("ca.pem"),
                         "--tls-cert", pki("sidecar.pem"), "--tls-key", pki("sidecar.key"))
        plain = st.sidecar("decode", "dec-plain", LAYOUT, 16, "m")
        await asyncio.to_thread(tls.ready)  # its ready file: written once registered
        record = await registry.wait_engine("dec-tls", present=True)
        assert record.num_blocks == 16
        await asyncio.sleep(3)  # the plaintext one has been trying all along
        assert await registry.engine("dec-plain") is None
        assert not os.path.exists(plain.ready_path) and plain.proc.poll() is None
    finally:
        await registry.close()
        st.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)

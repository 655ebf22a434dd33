"""etcd as the distributed store it is, on a real 3-member cluster on loopback: every
endpoint of ``--etcd`` is used (names and addresses) and a dead member is skipped; the
leader killed under a steady Reserve load and brought back loses no reservation and
double-books none (checked in etcd); TLS with client certificates and user/password
authentication, plaintext refused where TLS is configured."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import grpc
import pytest

from kvpush.app.etcd_server import BINARY_ENV, EtcdCluster, EtcdTls, binary_version
from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.controlplane import etcd_versions
from kvpush.controlplane.etcd import EtcdClient, EtcdSecurity, EtcdUnavailable, parse_endpoints
from kvpush.controlplane.invariants import check
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import make_tenant, reserve, settle
from tests.pki import make_pki

pytestmark = pytest.mark.timeout(240)


async def soon(call, timeout_s: float = 15.0):
    """``call()`` until it succeeds: while a new leader is elected (about a second) etcd
    answers unavailable."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await call()
        except EtcdUnavailable:
            assert time.monotonic() < deadline, "etcd did not recover"
            await asyncio.sleep(0.1)


@pytest.fixture
def cluster():
    c = EtcdCluster(3).start()
    yield c
    c.stop()


async def test_every_endpoint_is_used_and_a_dead_member_is_skipped(cluster):
    m = cluster.members
    eps = f"{m[0].endpoint},localhost:{m[1].client_port},http://{m[2].endpoint}"  # addresses, a name, a URL
    client = EtcdClient(eps, timeout=2)
    try:
        await client.put(b"/t/k", b"v0")
        used = {client.current_endpoint}
        # Kill the member the client is on (two stay: a quorum), until all were used. (Which
        # member a read lands on while the killed one was the leader depends on when the
        # election ends, so a turn may revisit one: room for a few.)
        for turn in range(12):
            victim = client.endpoints.index(client.current_endpoint)
            m[victim].kill()
            kv = await soon(lambda: client.get(b"/t/k"))  # a read goes on to the next member at once
            assert kv is not None and kv.value.startswith(b"v")
            assert client.current_endpoint != client.endpoints[victim]
            used.add(client.current_endpoint)
            await soon(lambda: client.put(b"/t/k", f"v{turn}".encode()))  # and so do writes
            await asyncio.to_thread(cluster.restart, victim)
            if len(used) == 3:
                break
        assert used == set(client.endpoints) == {m[0].endpoint, f"localhost:{m[1].client_port}", m[2].endpoint}
        assert (await client.get(b"/t/k")).value == f"v{turn}".encode()
    finally:
        await client.close()


async def test_a_write_goes_on_only_where_etcd_certainly_did_not_apply_it(cluster):
    """No connection (a dead member): retried on the next one. No answer (a hung member):
    in doubt, so not retried; the caller hears it, and the next write goes elsewhere."""
    client = EtcdClient(cluster.endpoints, timeout=1.5)
    try:
        await client.put(b"/t/w", b"1")
        cluster.members[0].kill()
        await soon(lambda: client.put(b"/t/w", b"2"))  # never reached member 0: sent on to member 1
        assert client.current_endpoint != cluster.members[0].endpoint
        await asyncio.to_thread(cluster.restart, 0)
        hung = client.endpoints.index(client.current_endpoint)
        cluster.members[hung].proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(EtcdUnavailable, match="DEADLINE_EXCEEDED"):
                await client.put(b"/t/w", b"3")
            assert time.monotonic() - t0 < 2.5  # one timeout, not one per member
            assert client.current_endpoint != cluster.members[hung].endpoint
            await soon(lambda: client.put(b"/t/w", b"4"))
        finally:
            cluster.members[hung].proc.send_signal(signal.SIGCONT)
        # In doubt indeed: the hung member may still apply "3" once it runs again (seen in CI),
        # after "4". A retry of it would have been a second, unasked-for write.
        assert (await soon(lambda: client.get(b"/t/w"))).value in (b"3", b"4")
    finally:
        await client.close()


async def test_the_leader_killed_under_reserve_load_loses_and_double_books_nothing(cluster):
    # On etcd 3.5.0-3.5.2 the killed member can come back without writes it acknowledged and
    # serve a history frozen at the crash: this test found it (one restart in 14 on 3.5.1).
    # What is tested here is kvpush, on an etcd that keeps what it acknowledged.
    binary = cluster.members[0].binary
    version = binary_version(binary)
    if any("#13766" in d for d in etcd_versions.defects(version)):
        pytest.skip(f"etcd {version} ({binary}) loses acknowledged writes when a member is killed under "
                    f"load (etcd-io/etcd#13766): install etcd {etcd_versions.CRASH_SAFE_FROM} or newer "
                    f"(scripts/setup.sh takes Debian's etcd-server where it can) or set ${BINARY_ENV}")
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=cluster.endpoints, admin_token=ADMIN_TOKEN,
                                            engine_token=ENGINE_TOKEN, sweep_interval_s=0.5))
    await plane.start()
    await plane.view.ready.wait()
    address = f"127.0.0.1:{plane.port}"
    admin, engines = ControlPlaneClient(address, ADMIN_TOKEN), ControlPlaneClient(address, ENGINE_TOKEN)
    engine = SimulatedEngine(engines, "decode-0", num_blocks=8192, lease_ttl_s=30)
    await engine.register()
    tenant = await make_tenant(admin, address, "acme")
    answered: dict[str, object] = {}
    unavailable: list[float] = []
    latency: list[tuple[float, float]] = []  # (when asked, seconds to the answer, retries included)
    stop = asyncio.Event()

    async def load(worker: int) -> None:
        i = 0
        while not stop.is_set():
            rid, asked = f"w{worker}-{i}", time.monotonic()
            while True:  # asked again with the same request id until answered: Reserve is idempotent
                try:
                    answered[rid] = await reserve(tenant, rid, 16, deadline_ms=120_000)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
                    unavailable.append(time.monotonic())
                    await asyncio.sleep(0.05)
            latency.append((asked, time.monotonic() - asked))
            i += 1

    tasks = [asyncio.create_task(load(w)) for w in range(4)]
    try:
        await asyncio.sleep(2)
        leader = cluster.leader()
        killed = time.monotonic()
        cluster.members[leader].kill()
        await asyncio.sleep(4)
        await asyncio.to_thread(cluster.restart, leader)
        back = time.monotonic()
        await asyncio.sleep(2)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    try:
        report = await settle(cluster.endpoints)  # every invariant: no block in two reservations
        live = {r.request_id: r for r in report.live}
        assert set(live) == set(answered)  # none lost, none made twice for one request
        for rid, res in answered.items():
            assert live[rid].id == res.id and live[rid].blocks == list(res.block_ids)
        for member in cluster.members:  # every member holds them, the restarted one too
            held = {r.request_id for r in (await check(member.endpoint)).live}
            assert held == set(answered), f"member {member.name}: {len(set(answered) - held)} answered missing"
        during = [s for t, s in latency if killed <= t < back]
        after_kill = [t for t, _ in latency if t >= killed + 3]
        assert during and after_kill, "no Reserve was answered after the leader died"
        print(f"\n{len(answered)} reservations; leader {leader} killed: {len(unavailable)} UNAVAILABLE answers, "
              f"slowest Reserve while it was down {max(during) * 1e3:.0f} ms (retries included)")
    finally:
        await tenant.close()
        await engine.stop()
        await admin.close()
        await engines.close()
        await plane.stop(grace=0.1)


def test_endpoints_are_parsed_and_plaintext_is_refused_where_tls_is_configured():
    assert parse_endpoints("a:1, b:2", EtcdSecurity()) == (["a:1", "b:2"], False)
    assert parse_endpoints("https://a:1,https://b:2", EtcdSecurity()) == (["a:1", "b:2"], True)
    assert parse_endpoints("a:1", EtcdSecurity(ca="ca.pem")) == (["a:1"], True)
    for text, message in [("", "at least one"), ("a", "expected host:port"), ("ftp://a:1", "scheme"),
                          ("http://a:1,https://b:2", "mixes")]:
        with pytest.raises(ValueError, match=message):
            parse_endpoints(text, EtcdSecurity())
    with pytest.raises(ValueError, match="'http://a:1' is plaintext, and TLS to etcd is configured"):
        parse_endpoints("http://a:1", EtcdSecurity(ca="ca.pem"))


# -- TLS and authentication ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("etcd-certs"), ("etcd", "root", "stranger"))


async def test_tls_with_client_certificates_and_user_password_auth(certs):
    tls = EtcdTls(certs("etcd.pem"), certs("etcd.key"), certs("ca.pem"), client_cert_auth=True,
                  client_cert=certs("root.pem"), client_key=certs("root.key"))
    with EtcdCluster(3, tls=tls) as c:
        endpoints = ",".join(f"https://{m.endpoint}" for m in c.members)
        mtls = EtcdSecurity(ca=certs("ca.pem"), cert=certs("root.pem"), key=certs("root.key"))
        client = EtcdClient(endpoints, timeout=3, security=mtls)
        try:
            await client.put(b"/t/tls", b"yes")
            assert (await client.get(b"/t/tls")).value == b"yes"
            # Authentication on: a user with the root role; then a client needs the password.
            await _enable_auth(client, "kvpush", "s3cret")
            with_password = EtcdClient(endpoints, timeout=3, security=EtcdSecurity(
                ca=certs("ca.pem"), cert=certs("stranger.pem"), key=certs("stranger.key"), user="kvpush",
                password="s3cret"))
            try:
                assert (await with_password.get(b"/t/tls")).value == b"yes"
                await with_password.put(b"/t/auth", b"ok")
                c.members[0].kill()  # the next member's token is its own: authenticated again there
                assert (await soon(lambda: with_password.get(b"/t/auth"))).value == b"ok"
            finally:
                await with_password.close()
            await _control_plane_reserves(endpoints, EtcdSecurity(
                ca=certs("ca.pem"), cert=certs("stranger.pem"), key=certs("stranger.key"), user="kvpush",
                password="s3cret"))
            wrong = EtcdClient(endpoints, timeout=3, security=EtcdSecurity(
                ca=certs("ca.pem"), cert=certs("stranger.pem"), key=certs("stranger.key"), user="kvpush",
                password="wrong"))
            with pytest.raises(grpc.aio.AioRpcError, match="authentication failed"):
                await wrong.get(b"/t/tls")
            await wrong.close()
        finally:
            await client.close()
        # Without a client certificate, or in plaintext, etcd lets nobody in.
        anonymous = EtcdClient(endpoints, timeout=2, security=EtcdSecurity(ca=certs("ca.pem")))
        with pytest.raises(EtcdUnavailable):
            await anonymous.get(b"/t/tls")
        await anonymous.close()
        plain = EtcdClient(",".join(m.endpoint for m in c.members[1:]), timeout=2)
        with pytest.raises(EtcdUnavailable):
            await plain.get(b"/t/tls")
        await plain.close()


async def _enable_auth(client: EtcdClient, user: str, password: str) -> None:
    from aetcd import rpc
    stub = rpc.AuthStub(client._eps[client._current].channel)
    await stub.UserAdd(rpc.AuthUserAddRequest(name=user, password=password), timeout=5)
    await stub.UserAdd(rpc.AuthUserAddRequest(name="root", password=password), timeout=5)
    await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    await stub.RoleAdd(rpc.AuthRoleAddRequest(name="kvpush"), timeout=5)
    perm = rpc.Permission(permType=rpc.Permission.READWRITE, key=b"\0", range_end=b"\0")
    await stub.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="kvpush", perm=perm), timeout=5)
    await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role="kvpush"), timeout=5)
    await stub.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


async def _control_plane_reserves(endpoints: str, security: EtcdSecurity) -> None:
    """A control plane on etcd over TLS with a client certificate and a password, end to end."""
    plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=endpoints, etcd_security=security,
                                            admin_token=ADMIN_TOKEN, engine_token=ENGINE_TOKEN))
    await plane.start()
    try:
        await asyncio.wait_for(plane.view.ready.wait(), 20)
        address = f"127.0.0.1:{plane.port}"
        admin, engines = ControlPlaneClient(address, ADMIN_TOKEN), ControlPlaneClient(address, ENGINE_TOKEN)
        engine = SimulatedEngine(engines, "decode-tls", num_blocks=64)
        await engine.register()
        tenant = await make_tenant(admin, address, "tls")
        res = await reserve(tenant, "over-tls", 32)
        assert res.engine_id == "decode-tls" and len(res.block_ids) == 2
        for c in (tenant, admin, engines):
            await c.close()
        await engine.stop()
    finally:
        await plane.stop(grace=0.1)


def test_the_control_plane_refuses_a_plaintext_etcd_endpoint_where_tls_is_configured(tmp_path):
    import sys
    from tests.conftest import ROOT
    done = subprocess.run([sys.executable, "-m", "kvpush.app.cli", "controlplane", "--admin-token", ADMIN_TOKEN,
                           "--etcd", "https://127.0.0.1:1,http://127.0.0.1:2", "--etcd-ca", str(tmp_path / "ca.pem")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "'http://127.0.0.1:2' is plaintext, and TLS to etcd is configured" in done.stderr
    done = subprocess.run([sys.executable, "-m", "kvpush.app.cli", "controlplane", "--admin-token", ADMIN_TOKEN,
                           "--etcd-user", "kvpush"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "KVPUSH_ETCD_PASSWORD"})
    assert done.returncode != 0 and "--etcd-user needs a password" in done.stderr

"""A router over two registries (``--controlplane`` twice: two control planes, each on its
own real etcd, different tenant tokens): it finds each one's engines, reserves in both, and
when one has no room or is down its requests are reserved in the other and still pushed;
an engine id registered in both is served in neither."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest_asyncio
from aiohttp.test_utils import TestServer

from kvpush.app.etcd_server import EmbeddedEtcd
from kvpush.app.simulated import SimulatedEngine
from kvpush.client.control_plane import ControlPlaneClient
from kvpush.contract.v1 import registry_pb2, types_pb2
from kvpush.controlplane.server import ControlPlane, ControlPlaneConfig
from kvpush.router import metrics
from kvpush.router.app import build_app
from kvpush.router.config import RouterConfig
from tests.conftest import ADMIN_TOKEN, ENGINE_TOKEN
from tests.controlplane.helpers import check, make_tenant
from tests.router.fakes import FakeEngine, WordTokenizer


class Side:
    """One registry: its etcd, control plane, tenant, and a prefill and a decode engine
    (stand-ins behind simulated sidecars; the prefill one hears its reservations by watch,
    as its sidecar would)."""

    def __init__(self, name: str, decode_blocks: int) -> None:
        self.name, self.decode_blocks = name, decode_blocks
        self.stack = contextlib.AsyncExitStack()

    async def start(self) -> "Side":
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True).start()
        self.stack.callback(self.etcd.stop)
        self.plane = ControlPlane(ControlPlaneConfig(listen="127.0.0.1:0", etcd=self.etcd.endpoint,
                                                     admin_token=ADMIN_TOKEN, engine_token=ENGINE_TOKEN,
                                                     sweep_interval_s=0.5))
        await self.plane.start()
        await self.plane.view.ready.wait()
        self.stack.push_async_callback(self.plane.stop, 0.1)
        self.address = f"127.0.0.1:{self.plane.port}"
        admin = ControlPlaneClient(self.address, ADMIN_TOKEN)
        self.stack.push_async_callback(admin.close)
        tenant = await make_tenant(admin, self.address, "router")
        self.stack.push_async_callback(tenant.close)
        self.token = tenant.metadata[0][1].split()[1]
        self.engines = ControlPlaneClient(self.address, ENGINE_TOKEN)
        self.stack.push_async_callback(self.engines.close)
        self.prefill, self.decode = FakeEngine(f"P{self.name}"), FakeEngine(f"D{self.name}")
        urls = {}
        for fake in (self.prefill, self.decode):
            fake.mode = "token_ids"
            server = TestServer(fake.app(), handler_cancellation=True)
            await server.start_server()
            self.stack.push_async_callback(server.close)
            urls[fake] = str(server.make_url("")).rstrip("/")
        self.decode_url = urls[self.decode]
        for sim in (SimulatedEngine(self.engines, f"prefill-{self.name}", 64, model="tiny", role=types_pb2.PREFILL,
                                    serving_url=urls[self.prefill]),
                    SimulatedEngine(self.engines, f"decode-{self.name}", self.decode_blocks, model="tiny",
                                    serving_url=self.decode_url)):
            await sim.register()
            self.stack.push_async_callback(sim.stop)
        heard: dict[str, str] = {}
        watch = self.engines.registry.WatchEngineReservations(
            registry_pb2.WatchEngineReservationsRequest(engine_id=f"prefill-{self.name}"),
            metadata=self.engines.metadata)

        async def follow():
            async for event in watch:
                if event.reservation.id:
                    heard.setdefault(event.reservation.request_id, event.reservation.id)
        following = asyncio.ensure_future(follow())
        self.stack.push_async_callback(_cancelled, following, watch)

        async def handover(request_id: str) -> str:
            while request_id not in heard:
                await asyncio.sleep(0.01)
            return heard[request_id]
        self.prefill.handover = handover
        return self

    def pushed(self) -> list[str]:
        """The reservations this registry's decode engine was asked to load."""
        return [b["kv_transfer_params"]["kvpush"]["reservation_id"] for b in self.decode.bodies
                if "kv_transfer_params" in b]

    async def live(self) -> set[str]:
        return {r.id for r in (await check(self.etcd.endpoint, quiet=True)).live}


async def _cancelled(task, call) -> None:
    call.cancel()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def grants(side: Side, outcome: str = "granted") -> float:
    return metrics.REGISTRY.get_sample_value("kvpush_router_registry_reserves_total",
                                             {"registry": side.address, "outcome": outcome}) or 0.0


@pytest_asyncio.fixture
async def two():
    """Registry a (its decode engine holds one block: full after one reservation) and b."""
    sides = []
    try:
        for name, blocks in (("a", 1), ("b", 64)):
            sides.append(await Side(name, blocks).start())
        a, b = sides
        cfg = RouterConfig(controlplane=a.address, token=a.token, more_registries=((b.address, b.token),),
                           model="tiny", prefill_urls=(), decode=(), max_model_len=1000)
        app = build_app(cfg, WordTokenizer())
        router = TestServer(app, handler_cancellation=True)
        await router.start_server()
        session = aiohttp.ClientSession()
        try:
            yield a, b, str(router.make_url("")).rstrip("/"), session
        finally:
            await session.close()
            await router.close()
    finally:
        for side in reversed(sides):
            await side.stack.aclose()


async def _health(session, url: str, pred, timeout: float = 10.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with session.get(url + "/health") as r:
            health = await r.json()
        if pred(health):
            return health
        assert asyncio.get_running_loop().time() < deadline, health
        await asyncio.sleep(0.05)


async def _ask(session, url: str, n: int) -> None:
    for i in range(n):
        async with session.post(url + "/v1/completions",
                                json={"model": "tiny", "prompt": f"a b {i}", "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()


async def test_requests_are_reserved_in_both_registries_and_a_full_one_sends_them_to_the_other(two):
    a, b, url, session = two
    health = await _health(session, url, lambda h: len(h["decode"]) == 2 and len(h["prefill"]) == 2)
    assert health["decode"] == {"decode-a": a.decode_url, "decode-b": b.decode_url}
    assert set(health["registries"]) == {a.address, b.address} and health["engine_id_conflicts"] == []
    granted_a, granted_b, full_a = grants(a), grants(b), grants(a, "resource_exhausted")

    await _ask(session, url, 6)
    # Every request pushed (its decode engine loaded a reservation), each in the registry
    # of its engines: a holds one block, so once it is taken a's turns go to b.
    assert len(a.pushed()) == 1 and len(b.pushed()) == 5, (a.pushed(), b.pushed())
    assert all("kv_transfer_params" in body for body in a.decode.bodies + b.decode.bodies)
    assert set(a.pushed()) <= await a.live() and set(b.pushed()) <= await b.live()
    assert not set(b.pushed()) & await a.live()
    assert grants(a) - granted_a == 1 and grants(b) - granted_b == 5
    assert grants(a, "resource_exhausted") - full_a >= 1  # (a refused for room; the request moved to b)

    # An engine id registered in both registries is served in neither.
    dups = [SimulatedEngine(side.engines, "decode-dup", 64, model="tiny", serving_url=side.decode_url)
            for side in (a, b)]
    dups += [SimulatedEngine(side.engines, "prefill-dup", 64, model="tiny", role=types_pb2.PREFILL,
                             serving_url=f"http://127.0.0.1:1/{side.name}") for side in (a, b)]
    try:
        for sim in dups:
            await sim.register()
        health = await _health(session, url,
                               lambda h: h["engine_id_conflicts"] == ["decode-dup", "prefill-dup"])
        assert "decode-dup" not in health["decode"] and "prefill-dup" not in health["prefill"].values()
        assert len(health["decode"]) == 2 and len(health["prefill"]) == 2
    finally:
        for sim in dups:
            await sim.stop()


async def test_a_registry_down_sends_its_requests_to_the_other(two):
    a, b, url, session = two
    await _health(session, url, lambda h: len(h["decode"]) == 2 and len(h["prefill"]) == 2)
    await b.plane.stop(grace=0.1)  # b's control plane gone (its engines still known to the router)
    unanswered = grants(b, "unavailable") + grants(b, "deadline_exceeded")
    await _ask(session, url, 4)
    # a has room for one: the first request after b went is pushed through a; the rest fall
    # back (a full, b down) and are still answered.
    assert len(a.pushed()) == 1 and b.pushed() == []
    assert len(a.decode.bodies) + len(b.decode.bodies) == 4
    assert grants(b, "unavailable") + grants(b, "deadline_exceeded") > unanswered
    health = await _health(session, url, lambda h: h["registries"][b.address]["aside"])
    assert health["registries"][a.address]["ready"]


async def test_a_registry_that_does_not_know_the_routers_tenant_is_passed_over(two):
    """Registries keep their own tenants. A token unknown in one from the start: its engines
    are never seen there, and every request is served through the other, pushed. A tenant
    deleted in one while the router runs: its Reserves there are refused (UNAUTHENTICATED),
    moved to the other and still pushed, not served without push; that registry is then
    asked last for a while."""
    from kvpush.client import registries
    from kvpush.contract.v1 import admin_pb2
    a, b, url, session = two
    cfg = RouterConfig(controlplane=b.address, token=b.token,
                       more_registries=((a.address, "kvp_not_a_tenant_of_a_0123456789"),),
                       model="tiny", prefill_urls=(), decode=(), max_model_len=1000)
    other = TestServer(build_app(cfg, WordTokenizer()), handler_cancellation=True)
    await other.start_server()
    try:
        other_url = str(other.make_url("")).rstrip("/")
        health = await _health(session, other_url, lambda h: len(h["decode"]) == 1 and len(h["prefill"]) == 1)
        assert set(health["decode"]) == {"decode-b"} and not health["registries"][a.address]["ready"]
        await _ask(session, other_url, 3)
        assert len(b.pushed()) == 3 and a.pushed() == []
    finally:
        await other.close()

    await _health(session, url, lambda h: len(h["decode"]) == 2 and len(h["prefill"]) == 2)
    admin = ControlPlaneClient(a.address, ADMIN_TOKEN)
    try:
        await admin.admin.DeleteTenant(admin_pb2.DeleteTenantRequest(name="router"), metadata=admin.metadata,
                                       timeout=10)
    finally:
        await admin.close()
    refused = grants(a, "unauthenticated")
    fallbacks = metrics.REGISTRY.get_sample_value("kvpush_router_fallbacks_total", {"reason": "unauthenticated"})
    await _ask(session, url, 4)
    # Taken in turn, a is asked for one of them at least; each is pushed through b.
    assert len(b.pushed()) == 3 + 4 and a.pushed() == []
    assert grants(a, "unauthenticated") - refused >= 1
    assert metrics.REGISTRY.get_sample_value("kvpush_router_fallbacks_total", {"reason": "unauthenticated"}) \
        == fallbacks
    await _health(session, url, lambda h: h["registries"][a.address]["aside"])
    assert registries.REFUSED_S > registries.DOWN_S  # (asked last longer than one that did not answer)


async def test_a_turn_guessed_for_an_engine_of_a_registry_set_aside_is_not_sent_ahead_elsewhere(two):
    """A conversation's next turn, guessed decode alone on the engine that served the turn
    it extends, while that engine's registry is set aside: it is reserved in another
    registry, so it is not sent ahead to that engine nor named as preferred there (which the
    other registry would refuse, INVALID_ARGUMENT, and the turn be served without push)."""
    import time
    from kvpush.router.app import REGISTRIES
    a, b, _, session = two
    cfg = RouterConfig(controlplane=a.address, token=a.token, more_registries=((b.address, b.token),),
                       model="tiny", prefill_urls=(), decode=(), max_model_len=1000, prefix_block_size=16,
                       local_prefill_tokens=20)
    app = build_app(cfg, WordTokenizer())
    router = TestServer(app, handler_cancellation=True)
    await router.start_server()
    try:
        url = str(router.make_url("")).rstrip("/")
        await _health(session, url, lambda h: len(h["decode"]) == 2 and len(h["prefill"]) == 2)
        prompt = list(range(100, 164))  # 64 tokens: 4 blocks, more than a's decode engine holds
        async with session.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                              "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
        assert len(b.pushed()) == 1 and a.pushed() == []  # (a refused it for room: b served it)
        # The next turn adds 2 tokens to the prompt and its answer: guessed decode alone on
        # decode-b. b is set aside: the turn is reserved in a first.
        b_reg = next(r for r in app[REGISTRIES].all if r.name == b.address)
        b_reg.aside_until = time.monotonic() + 60
        invalid = metrics.REGISTRY.get_sample_value("kvpush_router_fallbacks_total",
                                                    {"reason": "invalid_argument"}) or 0.0
        decode_b = len(b.decode.bodies)
        async with session.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt + [7, 8, 9, 10, 11],
                                                              "max_tokens": 3}) as r:
            assert r.status == 200, await r.text()
        # a has no room: b, asked last, takes it, and it is pushed; nothing was sent ahead.
        assert (metrics.REGISTRY.get_sample_value("kvpush_router_fallbacks_total", {"reason": "invalid_argument"})
                or 0.0) == invalid
        assert len(b.pushed()) == 2 and a.pushed() == []
        assert len(b.decode.bodies) == decode_b + 1  # (its load, and no withdrawn request before it)
    finally:
        await router.close()


def test_the_cli_says_what_is_wrong_with_several_registries(monkeypatch):
    import pytest
    from kvpush.app import cli
    monkeypatch.delenv("KVPUSH_TENANT_TOKEN", raising=False)
    cases = {
        ("--controlplane", "a:1", "--controlplane", "b:2", "--token", "t", "--token", "u", "--token", "v"):
            "3 tokens for 2 registries",
        ("--controlplane", "a:1", "--controlplane", "b:2", "--token", "t", "--prefill", "http://p:1",
         "--decode", "d=http://d:1"): "--prefill and --decode name one registry's engines",
        ("--controlplane", "a:1", "--controlplane", "a:1", "--token", "t"): "names the same registry twice",
        ("--controlplane", "a:1", "--controlplane", "b:2"): "--token (or $KVPUSH_TENANT_TOKEN) is required",
    }
    for args, message in cases.items():
        with pytest.raises(SystemExit) as exited:
            cli.main(["router", "--model", "tiny", *args])
        assert message in str(exited.value.code), (args, exited.value.code)


async def test_the_fleet_chooses_the_conversations_registry_else_the_least_loaded_with_a_prefill_engine():
    import time
    from kvpush.client.registries import Registries, Registry
    from kvpush.router.config import DecodeEngine
    from kvpush.router.engines import Engines
    from kvpush.router.fleet import Fleet
    regs = Registries([Registry(name, cp=None, reserver=None) for name in ("a", "b", "c")])
    cfg = RouterConfig(controlplane="a", token="t", more_registries=(("b", "t"), ("c", "t")), model="tiny",
                       prefill_urls=(), decode=())
    outstanding: dict[str, int] = {}
    fleet = Fleet(cfg, regs, outstanding)
    a, b, c = regs.all
    for reg, prefill, decodes in ((a, True, ("d-a1", "d-a2")), (b, True, ("d-b",)), (c, False, ("d-c",))):
        fleet.directories[reg].engines = Engines(
            prefill=((f"http://p-{reg.name}", f"p-{reg.name}"),) if prefill else (),
            decode=tuple(DecodeEngine(d, f"http://{d}") for d in decodes))
    assert fleet.decode_url("d-b") == "http://d-b" and fleet.prefill_urls(b) == ["http://p-b"]
    assert fleet.registry_of_engine("d-a2") is a
    # Equal load: taken in turn, never the registry without a prefill engine.
    assert {fleet.choose() for _ in range(4)} == {a, b}
    # Load per decode engine: a has two, so 2 requests there weigh as 1 on b.
    outstanding.update({"http://d-a1": 2, "http://d-a2": 1, "http://d-b": 1})
    assert fleet.choose() is b and fleet.load(a) == 1.5
    # The conversation's registry first, however loaded, unless set aside or without a prefill engine.
    assert fleet.choose("d-a1") is a and fleet.choose("d-c") is b
    a.aside_until = time.monotonic() + 5
    assert fleet.choose("d-a1") is b
    b.aside_until = time.monotonic() + 5
    assert fleet.choose() is b  # (all set aside: the least loaded with a prefill engine all the same)

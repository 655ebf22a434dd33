"""The sidecar's long-lived control-plane loops (Membership, ReservationWatch) in
process, against a real control plane and etcd: a reconnect closes the channel
under their open streams, and both must carry on rather than die quietly."""

from __future__ import annotations

import asyncio

import pytest

from kvpush.app.simulated import SimulatedEngine
from tests.conftest import ENGINE_TOKEN
from kvpush.sidecar.membership import ChannelReplaced, ControlPlaneLink, Membership, ServiceConfig, guarded
from kvpush.sidecar.reservation_watch import ReservationWatch
from tests.polling import until

pytestmark = pytest.mark.timeout(60)




async def test_guarded_turns_a_closed_channel_into_an_error_but_keeps_real_cancels():
    never = asyncio.get_running_loop().create_future()

    async def call_cancelled_under_us():
        inner = asyncio.ensure_future(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, inner.cancel)  # as a channel close does
        return await guarded(inner)

    with pytest.raises(ChannelReplaced):
        await call_cancelled_under_us()
    task = asyncio.ensure_future(guarded(never))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_reconnect_under_open_streams_registers_and_subscribes_again(cp):
    config = ServiceConfig(controlplane=cp.address, token=ENGINE_TOKEN, model="sim-model", lease_ttl_s=6,
                           backoff_initial_s=0.05, backoff_max_s=0.5)
    engine = SimulatedEngine(None, "D1", num_blocks=16)
    link = ControlPlaneLink(config)
    membership = Membership(link, config, engine.record)
    watch = ReservationWatch(link, config, "D1", membership, live_reservations=list, on_ended=lambda *_: None)
    tasks = [asyncio.create_task(membership.run()), asyncio.create_task(watch.run())]
    try:
        await until(lambda: membership.connected.is_set() and watch.subscribed.is_set(), 20, "first subscription")
        for round_ in range(2, 5):
            # Closing the channel cancels both open streams locally: grpc.aio raises
            # CancelledError in the loops that own them, not an RPC error.
            link.reconnect(link.epoch)
            await until(lambda: watch.subscriptions >= round_ and watch.subscribed.is_set()
                        and membership.connected.is_set() or any(t.done() for t in tasks), 20,
                        f"subscription {round_}")
            assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
        assert membership.registrations >= 2
    finally:
        membership.stop()
        await watch.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await link.close()

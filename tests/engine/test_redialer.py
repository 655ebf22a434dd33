"""The connector's Redialer: a caller that needs the channel at once (a push beginning, a
load) while the redialer's own thread is part way through an attempt waits for that
attempt instead of giving up (it gave up at once, and a push after a sidecar restart was
refused with the new channel up a moment later), within a bound."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kvpush.connector.sidecar_link import Redialer


class Channel:
    def __init__(self, broken: bool = False) -> None:
        self.broken, self.on_closed = broken, None


def redialer_mid_attempt():
    """A redialer whose channel broke and whose own attempt is under way, held in its dial
    until ``release`` is set."""
    started, release, taken = threading.Event(), threading.Event(), []

    def dial():
        started.set()
        release.wait(10)
        return Channel(), SimpleNamespace(engine_id="P1", incarnation="new")
    redialer = Redialer(dial, lambda client, info: taken.append(client), "test", initial_s=0.01)
    redialer.follow(Channel(broken=True))  # (closed: its thread dials)
    assert started.wait(5)
    return redialer, release, taken


def test_a_caller_gets_the_channel_the_attempt_under_way_brings_up():
    redialer, release, taken = redialer_mid_attempt()
    try:
        threading.Timer(0.1, release.set).start()
        t0 = time.monotonic()
        assert redialer.dial_now()
        assert 0.05 < time.monotonic() - t0 < 0.5 and len(taken) == 1 and not redialer.down
    finally:
        release.set()
        redialer.close()


def test_a_caller_waits_no_longer_than_its_bound_for_an_attempt_that_hangs():
    redialer, release, taken = redialer_mid_attempt()
    try:
        t0 = time.monotonic()
        assert not redialer.dial_now(wait_s=0.2)
        assert 0.15 < time.monotonic() - t0 < 1.0 and not taken and redialer.down
    finally:
        release.set()
        redialer.close()

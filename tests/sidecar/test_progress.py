"""The progress driver's bookkeeping, with a scripted stand-in for the NIXL agent."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvpush.sidecar.progress import PollPolicy, ProgressDriver, Ticker


class ScriptedAgent:
    """check() answers from a script per handle; release() fails ``refuse`` times first."""

    def __init__(self, states: dict, refuse: int = 0):
        self.states = states
        self.refuse = refuse
        self.released = []
        self.notifs: dict = {}

    def check(self, handle):
        return self.states[handle]

    def release(self, handle):
        if self.refuse:
            self.refuse -= 1
            return False
        self.released.append(handle)
        return True

    def poll_notifs(self):
        out, self.notifs = self.notifs, {}
        return out


def test_failed_write_is_reported_at_once_but_released_only_when_nixl_lets_go():
    agent = ScriptedAgent({"w": "PROC"}, refuse=3)  # refused at the timeout, its retry, and once more
    driver = ProgressDriver(agent)
    events = []
    driver.track("w", 0.01, lambda ok, err: events.append(("done", ok, err)), "w",
                 on_released=lambda: events.append(("released",)))
    driver.poll_once()
    assert events == []  # not yet timed out
    time.sleep(0.02)
    driver.poll_once()  # timed out: outcome now, but NIXL refuses to release (still cancelling)
    assert events[0][:2] == ("done", False) and "not done after" in events[0][2] and len(events) == 1
    assert driver.next_interval() == driver.policy.hot_interval_s  # keeps polling to release it
    driver.poll_once()
    assert len(events) == 1
    driver.poll_once()
    assert events[-1] == ("released",) and agent.released == ["w"]


def test_done_write_releases_then_reports_and_notifications_are_dispatched():
    agent = ScriptedAgent({"a": "DONE", "b": "ERR"})
    got = []
    driver = ProgressDriver(agent, on_notif=lambda sender, msg: got.append((sender, msg)))
    for h in ("a", "b"):
        driver.track(h, 5, lambda ok, err, h=h: got.append((h, ok)), h, on_released=lambda h=h: got.append((h, "rel")))
    agent.notifs = {"peer": [b"x", b"y"]}
    assert driver.poll_once()
    assert got == [("a", True), ("a", "rel"), ("b", False), ("b", "rel"), ("peer", b"x"), ("peer", b"y")]
    assert driver.inflight == 0


def test_polling_policy_hot_warm_idle():
    policy = PollPolicy(hot_interval_s=0.001, warm_interval_s=0.01, warm_window_s=0.05, idle_interval_s=0.5)
    driver = ProgressDriver(ScriptedAgent({}), policy)
    assert driver.next_interval() == 0.5
    driver.expect("res", 0.03)
    assert driver.next_interval() == 0.001
    time.sleep(0.04)
    driver.poll_once()  # the expectation expired
    assert driver.next_interval() == 0.01  # warm right after activity
    time.sleep(0.06)
    assert driver.next_interval() == 0.5


def test_fine_window_opens_one_hot_period_before_the_expected_end_and_closes():
    policy = PollPolicy(hot_interval_s=0.01, fine_interval_s=0.001, fine_window_s=0.05, warm_interval_s=0.1,
                        idle_interval_s=0.5)
    driver = ProgressDriver(ScriptedAgent({}), policy)
    driver.expect_at("res", time.monotonic() + 0.04, timeout_s=5)
    assert driver.next_interval() == 0.01  # hot until one hot period before the expected end
    time.sleep(0.035)
    assert driver.next_interval() == 0.001
    driver.unexpect("res")  # LANDED: back to warm at once
    assert driver.next_interval() == 0.1
    # A wrong estimate costs a bounded window, then hot polling resumes.
    driver.expect_at("late", time.monotonic(), timeout_s=5)
    assert driver.next_interval() == 0.001
    time.sleep(0.06)
    driver.poll_once()
    assert driver.next_interval() == 0.01


@pytest.mark.timeout(10)
async def test_ticker_ticks_below_a_millisecond():
    ticks = []
    ticker = Ticker(asyncio.get_running_loop(), lambda: ticks.append(time.perf_counter()))
    try:
        if not ticker.fine:
            pytest.skip("no timerfd here")
        ticker.set_interval(0.0002, fire_soon=True)
        await asyncio.sleep(0.1)
    finally:
        ticker.close()
    # ~500 expected at 0.2 ms; asyncio's own timers could not do better than ~100.
    assert len(ticks) > 150, len(ticks)

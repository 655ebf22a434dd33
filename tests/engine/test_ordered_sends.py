"""The frames that wait for the GPU: sent only once their fence has passed, in the order
given (an END after its request's last PUSH), inline when nothing waits, and a frame
that fails does not stop the ones after it."""

from __future__ import annotations

import threading

from kvpush.connector.ordered_sends import OrderedSends


class Gate:
    """A fence that passes when the test opens it (a GPU copy finishing late)."""

    def __init__(self):
        self.opened = threading.Event()

    def wait(self) -> None:
        assert self.opened.wait(10), "gate never opened"


def test_frames_wait_for_their_fence_and_keep_their_order():
    sends, sent = OrderedSends(), []
    first, second = Gate(), Gate()
    try:
        sends.send(first, lambda: sent.append("push-0"))
        sends.send(second, lambda: sent.append("push-1"))
        sends.send(None, lambda: sent.append("end"))  # no fence, but frames wait ahead of it
        assert not sends.drain(0.2) and sent == [] and sends.pending == 3
        second.opened.set()  # the later copy finished first: still sent after the earlier one
        assert not sends.drain(0.2) and sent == []
        first.opened.set()
        assert sends.drain(5) and sent == ["push-0", "push-1", "end"]
    finally:
        sends.close()


def test_with_nothing_waiting_a_frame_goes_out_at_once_on_the_callers_thread():
    sends, where = OrderedSends(), []
    sends.send(None, lambda: where.append(threading.current_thread()))
    assert where == [threading.current_thread()] and sends.pending == 0
    sends.close()


def test_a_failing_frame_is_logged_and_the_rest_still_go(caplog):
    sends, sent = OrderedSends(), []
    gate = Gate()
    gate.opened.set()

    def boom():
        raise RuntimeError("channel down")

    sends.send(gate, boom)
    sends.send(gate, lambda: sent.append("next"))
    assert sends.drain(5) and sent == ["next"]
    assert "a channel frame failed" in caplog.text
    sends.close()


def test_close_sends_what_is_queued_first():
    sends, sent = OrderedSends(), []
    gate = Gate()
    sends.send(gate, lambda: sent.append("consumed"))
    threading.Timer(0.1, gate.opened.set).start()
    sends.close(timeout_s=5)
    assert sent == ["consumed"]

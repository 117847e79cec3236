"""CancelWatch: polling is_cancelled callbacks off the step loop, and the engine acting on it."""

import threading
import time

import pytest

from backend.cancel_watch import CancelWatch
from tests.test_engine import _prompts, make_engine


@pytest.fixture
def engine(demo_model_path):
    eng = make_engine(demo_model_path, num_kv_blocks=256, block_size=16)
    yield eng
    eng.shutdown()


def test_poll_returns_cancelled_keys_once_and_stops_watching_them():
    watch = CancelWatch(interval_s=1.0)
    flags = {"a": False, "b": True}
    watch.watch("a", lambda: flags["a"])
    watch.watch("b", lambda: flags["b"])
    watch.watch("c", lambda: True)
    watch.unwatch("c")
    assert watch.poll() == ["b"]
    assert watch.poll() == []
    flags["a"] = True
    assert watch.poll() == ["a"]
    assert len(watch) == 0


def test_a_failing_check_does_not_hide_the_others():
    watch = CancelWatch(interval_s=1.0)

    def broken() -> bool:
        raise RuntimeError("sender gone")

    watch.watch("broken", broken)
    watch.watch("ok", lambda: True)
    assert watch.poll() == ["ok"]
    assert len(watch) == 1  # still asked next time


def test_the_thread_reports_each_cancellation_to_the_callback():
    watch = CancelWatch(interval_s=0.01)
    seen: list[str] = []
    got = threading.Event()
    cancelled = threading.Event()
    watch.watch("r1", cancelled.is_set)
    watch.start(lambda key: (seen.append(key), got.set()))
    try:
        time.sleep(0.05)
        assert seen == []
        cancelled.set()
        assert got.wait(2)
        time.sleep(0.05)
        assert seen == ["r1"]
    finally:
        watch.stop()
    assert not watch.running


def test_a_started_engine_frees_a_cancelled_request_without_polling_in_its_step_loop(engine):
    """The engine thread never calls is_cancelled itself once started: the watch's thread does."""
    callers: set[str] = set()
    cancelled = threading.Event()

    def is_cancelled() -> bool:
        callers.add(threading.current_thread().name)
        return cancelled.is_set()

    done = threading.Event()
    outs = []

    def on_output(out):
        outs.append(out)
        if out.finished:
            done.set()

    params = engine.parse_params({"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
    engine.start()
    try:
        engine.add_request(_prompts(engine, 1, seed=11)[0], params, on_output, is_cancelled=is_cancelled)
        deadline = time.monotonic() + 10
        while not outs and time.monotonic() < deadline:
            time.sleep(0.01)
        cancelled.set()
        assert done.wait(10)
        assert outs[-1].finish_reason == "abort"
        assert callers == {"llm-cancel-watch"}
        deadline = time.monotonic() + 5
        while engine.block_manager.num_free_blocks != engine.block_manager.num_blocks:
            assert time.monotonic() < deadline, "the cancelled request's KV blocks were not freed"
            time.sleep(0.01)
        assert len(engine._cancel_watch) == 0
    finally:
        engine.shutdown()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


class _FakeSender:
    """Records calls; is_cancelled can be made slow to hold a poll in flight."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.final_sent = False
        self.in_poll = threading.Event()
        self.release_poll = threading.Event()
        self.release_poll.set()

    def is_cancelled(self) -> bool:
        assert not self.final_sent, "is_cancelled after the final response (use after free in Triton)"
        self.calls.append("poll")
        self.in_poll.set()
        self.release_poll.wait(5)
        return False

    def send(self, response, flags=0) -> None:
        self.calls.append(f"send:{flags}")
        if flags:
            self.final_sent = True


def test_guarded_sender_never_polls_after_the_final_send():
    from backend.triton_utils import GuardedSender

    fake = _FakeSender()
    guarded = GuardedSender(fake, final_flag=1)
    assert guarded.is_cancelled() is False
    guarded.send("r1", final=False)
    guarded.send("r2", final=True)
    assert guarded.is_cancelled() is False  # answered without asking the server
    assert fake.calls == ["poll", "send:0", "send:1"]
    # Review: a request ended twice (its engine process died during add_request) sent a second
    # final response, which raised in the stub. Nothing goes out after the final one.
    guarded.send("r3", final=True)
    guarded.send("r4", final=False)
    assert fake.calls == ["poll", "send:0", "send:1"]


def test_guarded_sender_final_send_waits_for_a_poll_in_flight():
    from backend.triton_utils import GuardedSender

    fake = _FakeSender()
    guarded = GuardedSender(fake, final_flag=1)
    fake.release_poll.clear()
    poller = threading.Thread(target=guarded.is_cancelled)
    poller.start()
    assert fake.in_poll.wait(5)
    sender = threading.Thread(target=guarded.send, args=("last",), kwargs={"final": True})
    sender.start()
    time.sleep(0.05)
    assert fake.calls == ["poll"]  # the final send is held until the poll returns
    fake.release_poll.set()
    poller.join(5)
    sender.join(5)
    assert fake.calls == ["poll", "send:1"]


def test_many_watched_requests_stretch_the_interval_to_the_check_budget():
    watch = CancelWatch(interval_s=0.1, checks_per_s=100)
    assert watch.next_interval() == 0.1
    for i in range(64):
        watch.watch(i, lambda: False)
    assert watch.next_interval() == pytest.approx(0.64)
    for i in range(60):
        watch.unwatch(i)
    assert watch.next_interval() == 0.1
    assert CancelWatch(interval_s=0.1).next_interval() == 0.1  # no budget: the interval alone

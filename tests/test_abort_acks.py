"""backend/abort_acks.py: an abort's reply waits for the last responses of what it ended."""

import threading
import time

from backend.abort_acks import AbortAcks


def test_a_reply_waits_for_every_open_request_it_names():
    acks, replies = AbortAcks(timeout_s=5), []
    acks.opened("a")
    acks.opened("b")
    acks.reply_after({"a", "b", "never-opened"}, lambda: replies.append("ab"))
    assert replies == []
    acks.sent("a")
    assert replies == []
    acks.sent("b")
    assert replies == ["ab"]
    acks.sent("b")  # settled twice: replied once
    assert replies == ["ab"] and len(acks) == 0


def test_nothing_open_replies_at_once_and_two_aborts_of_one_request_both_wait():
    acks, replies = AbortAcks(timeout_s=5), []
    acks.reply_after(set(), lambda: replies.append("empty"))
    acks.reply_after({"gone"}, lambda: replies.append("gone"))  # finished before its abort
    assert replies == ["empty", "gone"]
    acks.opened("a")
    acks.reply_after({"a"}, lambda: replies.append(1))
    acks.reply_after({"a"}, lambda: replies.append(2))
    acks.sent("a")
    assert replies[2:] == [1, 2]


def test_a_reply_goes_out_after_the_timeout_and_only_once():
    acks, replies = AbortAcks(timeout_s=0.05), []
    acks.opened("stuck")
    t0 = time.monotonic()
    done = threading.Event()
    acks.reply_after({"stuck"}, lambda: (replies.append(time.monotonic() - t0), done.set()))
    assert done.wait(2) and 0.04 < replies[0] < 1.0
    acks.sent("stuck")
    time.sleep(0.05)
    assert len(replies) == 1 and len(acks) == 0


def test_a_failing_reply_does_not_reach_the_sender_that_settled_it(caplog):
    acks = AbortAcks(timeout_s=5)
    acks.opened("a")

    def broken():
        raise RuntimeError("abort stream gone")

    acks.reply_after({"a"}, broken)
    acks.sent("a")  # must not raise into the outbox's sender thread
    assert "replying to an abort failed" in caplog.text

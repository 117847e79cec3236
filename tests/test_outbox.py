"""backend/outbox.py: responses leave on the sender thread, merged when they pile up, in order."""

import threading
import time

import pytest

from backend.outbox import Outbox, StreamResponder
from backend.outputs import RequestOutput


def _out(tokens, start, index=0, finish=None, error=None):
    return RequestOutput(
        request_id="r",
        new_token_ids=list(tokens),
        window_ids=list(tokens),
        window_start=start,
        prefix_len=0,
        text="".join(f"<{t}>" for t in tokens),
        prompt_tokens=3,
        completion_tokens=start + len(tokens),
        finish_reason=finish,
        error=error,
        index=index,
    )


class _Recorder:
    def __init__(self, block: threading.Event | None = None):
        self.sent: list[tuple[RequestOutput, bool]] = []
        self.errors: list[RequestOutput] = []
        self.block = block
        self.threads: set[str] = set()

    def output(self, out, last):
        if self.block is not None:
            self.block.wait(5)
        self.threads.add(threading.current_thread().name)
        self.sent.append((out, last))

    def error(self, out):
        self.errors.append(out)


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_streams_each_output_from_the_sender_thread_when_it_keeps_up():
    box, rec = Outbox("test-outbox"), _Recorder()
    finals = []
    r = StreamResponder(box, 1, True, rec.output, rec.error, on_final=lambda: finals.append(1))
    for i in range(5):
        r(_out([i], i, finish="length" if i == 4 else None))
        _wait(lambda: len(rec.sent) == i + 1)
    assert [o.new_token_ids for o, _ in rec.sent] == [[0], [1], [2], [3], [4]]
    assert [last for _, last in rec.sent] == [False] * 4 + [True]
    assert rec.threads == {"test-outbox"} and finals == [1]
    box.close()


@pytest.mark.parametrize("cap", [None, 64])
def test_outputs_that_pile_up_behind_a_busy_sender_go_out_as_one_response(cap):
    # The sender is blocked in its first send; of the nine outputs after it, the first waits as
    # it is and the rest merge into one response (the cap holds nothing back here: the backlog
    # alone merges them).
    gate = threading.Event()
    box, rec = Outbox(responses_per_step=cap), _Recorder(block=gate)
    r = StreamResponder(box, 1, True, rec.output, rec.error)
    r(_out([0], 0))
    _wait(lambda: r._outgoing == [])  # taken by the sender, which now waits at the gate
    for i in range(1, 10):
        r(_out([i], i, finish="stop" if i == 9 else None))
    gate.set()
    _wait(lambda: len(rec.sent) == 3)
    assert [o.new_token_ids for o, _ in rec.sent] == [[0], [1], list(range(2, 10))]
    assert [o.text for o, _ in rec.sent] == ["<0>", "<1>", "".join(f"<{i}>" for i in range(2, 10))]
    assert [last for _, last in rec.sent] == [False, False, True]
    assert rec.sent[2][0].finish_reason == "stop" and rec.sent[2][0].completion_tokens == 10
    box.close()


def test_samples_merge_apart():
    gate = threading.Event()
    box, rec = Outbox(), _Recorder(block=gate)
    r = StreamResponder(box, 2, True, rec.output, rec.error)
    r(_out([0], 0, index=0))
    _wait(lambda: r._outgoing == [])
    for i in range(1, 4):
        r(_out([i], i, index=0, finish="stop" if i == 3 else None))
        r(_out([10 + i], i, index=1, finish="stop" if i == 3 else None))
    gate.set()
    _wait(lambda: len(rec.sent) == 5)
    by_sample = {}
    for o, _ in rec.sent:
        by_sample.setdefault(o.index, []).append(o.new_token_ids)
    assert by_sample == {0: [[0], [1], [2, 3]], 1: [[11], [12, 13]]}
    assert [last for _, last in rec.sent] == [False] * 4 + [True]
    box.close()


def test_stats_count_responses_and_the_senders_time():
    box, rec = Outbox(senders=2), _Recorder()
    assert box.stats() == (0, 0.0, 0.0)
    for rid in range(3):
        r = StreamResponder(box, 1, True, rec.output, rec.error)
        for i in range(4):
            r(_out([i], i, finish="stop" if i == 3 else None))
    err = StreamResponder(box, 1, True, rec.output, rec.error)
    err(_out([], 0, error="boom"))
    # outputs queued faster than they are sent merge: 3 to 12 responses, and the error
    _wait(lambda: sum(last for _, last in rec.sent) == 3 and len(rec.errors) == 1)
    _wait(lambda: box.stats().responses == len(rec.sent) + 1)
    stats = box.stats()
    assert sum(len(o.new_token_ids) for o, _ in rec.sent) == 12
    assert 0 < stats.send_cpu_s and 0 < stats.send_wall_s
    box.close()


def test_stream_interval_non_streaming_and_n_samples():
    box, rec = Outbox(), _Recorder()
    r = StreamResponder(box, 1, True, rec.output, rec.error, stream_interval=3)
    for i in range(7):
        r(_out([i], i, finish="length" if i == 6 else None))
    _wait(lambda: rec.sent and rec.sent[-1][1])
    assert all(len(o.new_token_ids) >= 3 for o, _ in rec.sent[:-1])
    assert sum((o.new_token_ids for o, _ in rec.sent), []) == list(range(7))

    rec2 = _Recorder()
    r2 = StreamResponder(box, 2, False, rec2.output, rec2.error)
    for i in range(4):
        r2(_out([i], i, index=0, finish="length" if i == 3 else None))
        r2(_out([10 + i], i, index=1, finish="stop" if i == 3 else None))
    _wait(lambda: len(rec2.sent) == 2)
    assert [(o.index, o.new_token_ids, last) for o, last in rec2.sent] == [
        (0, [0, 1, 2, 3], False), (1, [10, 11, 12, 13], True)]
    assert [last for _, last in rec2.sent] == [False, True]  # exactly the last response is final
    box.close()


def test_an_error_is_sent_once_and_nothing_after_it():
    box, rec = Outbox(), _Recorder()
    finals = []
    r = StreamResponder(box, 2, True, rec.output, rec.error, on_final=lambda: finals.append(1))
    r(_out([1], 0))
    _wait(lambda: len(rec.sent) == 1)
    r(_out([], 1, index=1, error="boom"))
    r(_out([2], 1))
    _wait(lambda: rec.errors)
    time.sleep(0.05)
    assert [e.error for e in rec.errors] == ["boom"] and len(rec.sent) == 1 and finals == [1]
    box.close()


def test_a_failing_send_does_not_stop_the_sender():
    box, rec = Outbox(), _Recorder()

    def broken(out, last):
        raise RuntimeError("stream gone")

    bad = StreamResponder(box, 1, True, broken, rec.error)
    good = StreamResponder(box, 1, True, rec.output, rec.error)
    bad(_out([1], 0))
    good(_out([2], 0, finish="stop"))
    _wait(lambda: len(rec.sent) == 1)
    box.close()


def test_on_sent_follows_the_last_send_even_a_failed_one():
    # on_final when the last response is taken (before its send), on_sent after it: what an
    # abort's reply waits for (backend/abort_acks.py). A failed last send still settles it.
    box, rec, events = Outbox(), _Recorder(), []

    def output(out, last):
        events.append(("send", last))
        rec.output(out, last)

    r = StreamResponder(box, 2, True, output, rec.error, on_final=lambda: events.append("final"),
                        on_sent=lambda: events.append("sent"))
    r(_out([1], 0))
    r(_out([2], 1, finish="stop"))
    _wait(lambda: len(rec.sent) == 2)
    r(_out([3], 0, index=1, finish="length"))
    _wait(lambda: "sent" in events)
    assert events == [("send", False), ("send", False), "final", ("send", True), "sent"], events

    def broken(out, last):
        raise RuntimeError("stream gone")

    sent = []
    StreamResponder(box, 1, True, broken, rec.error, on_sent=lambda: sent.append(1))(_out([1], 0, finish="stop"))
    errored = StreamResponder(box, 1, True, rec.output, rec.error, on_sent=lambda: sent.append(2))
    errored(_out([], 0, error="boom"))
    _wait(lambda: len(sent) == 2)
    assert sorted(sent) == [1, 2]
    box.close()


def test_responses_per_step_caps_flushes_per_tick_and_waiting_streams_merge():
    box = Outbox(responses_per_step=2, idle_release_s=30)
    recs = [_Recorder() for _ in range(6)]
    rs = [StreamResponder(box, 1, True, rec.output, rec.error) for rec in recs]
    sent = lambda: sum(len(rec.sent) for rec in recs)  # noqa: E731
    for r in rs:
        r(_out([0], 0))
    _wait(lambda: sent() == 2)
    time.sleep(0.05)
    assert sent() == 2  # the other four wait for the next step
    for r in rs:
        r(_out([1], 1, finish="length"))  # the two sent ones queue again, behind the waiting four
    box.tick()
    _wait(lambda: sent() == 4)
    time.sleep(0.05)
    assert sent() == 4
    # the oldest waiting ones went out, each with both tokens in one response
    assert [rec.sent[0][0].new_token_ids for rec in recs[2:4]] == [[0, 1], [0, 1]]
    box.tick()
    _wait(lambda: sent() == 6)
    box.close()  # close sends what is still queued
    for rec in recs:
        assert sum((o.new_token_ids for o, _ in rec.sent), []) == [0, 1]
        assert [last for _, last in rec.sent][-1] is True


def test_queued_responses_are_released_when_no_step_comes():
    box, rec = Outbox(responses_per_step=1, idle_release_s=0.05), _Recorder()
    rs = [StreamResponder(box, 1, True, rec.output, rec.error) for _ in range(3)]
    for r in rs:
        r(_out([0], 0, finish="stop"))
    _wait(lambda: len(rec.sent) == 3, timeout=2)  # no tick at all: the engine is idle
    assert all(last for _, last in rec.sent)
    box.close()


def test_a_slow_send_holds_up_only_its_own_lane():
    # Triton's send blocks until the server takes the response: a second lane keeps sending.
    gate = threading.Event()
    box = Outbox("lanes", senders=2)
    slow, fast = _Recorder(block=gate), _Recorder()
    r_slow = StreamResponder(box, 1, True, slow.output, slow.error)
    r_fast = StreamResponder(box, 1, True, fast.output, fast.error)
    assert r_slow.lane != r_fast.lane
    r_slow(_out([0], 0))
    for i in range(5):
        r_fast(_out([i], i, finish="length" if i == 4 else None))
        _wait(lambda: len(fast.sent) == i + 1)
    assert slow.sent == []  # still blocked in its send
    for i in range(1, 4):
        r_slow(_out([i], i, finish="stop" if i == 3 else None))
    gate.set()
    _wait(lambda: sum(len(o.new_token_ids) for o, _ in slow.sent) == 4)
    box.close()
    assert sum((o.new_token_ids for o, _ in slow.sent), []) == [0, 1, 2, 3]  # in order, none lost
    assert [last for _, last in slow.sent][-1] is True
    assert [o.new_token_ids for o, _ in fast.sent] == [[0], [1], [2], [3], [4]]
    assert len(slow.threads | fast.threads) == 2


def test_responses_per_step_is_shared_between_lanes():
    box = Outbox(responses_per_step=4, idle_release_s=30, senders=2)
    recs = [_Recorder() for _ in range(8)]
    rs = [StreamResponder(box, 1, True, rec.output, rec.error) for rec in recs]
    for r in rs:
        r(_out([0], 0, finish="length"))
    sent = lambda: sum(len(rec.sent) for rec in recs)  # noqa: E731
    _wait(lambda: sent() == 4)
    time.sleep(0.05)
    assert sent() == 4  # two per lane until the next step
    box.tick()
    _wait(lambda: sent() == 8)
    box.close()


@pytest.mark.parametrize("per_step,interval", [(1, 1), (2, 3)])
def test_merged_responses_decode_to_the_engines_text(demo_model_path, per_step, interval):
    """The real path of a streamed response outside Triton: engine outputs -> StreamResponder
    under a tight per-step cap (so responses pile up and merge) -> the llm model's tensors ->
    postprocessing's decode. Random-weight sampling writes stray UTF-8 bytes, CJK and emoji
    prompts leave partial characters at the start, stop strings trim: the concatenated text of
    the responses equals the text of the same request run alone, for every sample."""
    import random

    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.triton_io import llm_output_arrays
    from backend.triton_utils import postprocess_arrays

    engine = LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", num_kv_blocks=128, max_model_len=256))
    box = Outbox(responses_per_step=per_step, idle_release_s=30)
    engine.on_step = lambda stats: box.tick()
    rng = random.Random(per_step)
    texts = ["日本語の文章 🙂 と", "Ünïcödé — ëmoji 🎉🎉 end", "plain words then 中文", "🙂"]
    cases = []
    for i in range(12):
        prompt = engine.tokenizer(rng.choice(texts)).input_ids
        if rng.random() < 0.5:
            prompt = prompt[:-1] or prompt  # often ends inside a character
        p = {"max_new_tokens": rng.randint(1, 30), "temperature": 1.0, "seed": i, "n": rng.choice([1, 2]),
             "stop": [rng.choice(["a", "の", "🙂", " t"])] if rng.random() < 0.4 else []}
        cases.append((prompt, p))
    done = threading.Event()
    got: dict[tuple[int, int], list[str]] = {}
    finals = []

    def sender(i, params):
        def send(out, last):
            text = postprocess_arrays(engine.tokenizer, llm_output_arrays(out, params))["text_output"][0]
            got.setdefault((i, out.index), []).append(text.decode())
            if last:
                finals.append(i)
                if len(finals) == len(cases):
                    done.set()
        return send

    try:
        engine.start()
        for i, (prompt, p) in enumerate(cases):
            params = engine.parse_params(p)
            responder = StreamResponder(box, params.n, True, sender(i, params), lambda out: None,
                                        stream_interval=interval)
            engine.add_request(prompt, params, responder)
        assert done.wait(120)
        engine.shutdown()
        box.close()
        merged = sum(len(v) for v in got.values())
        alone = LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", num_kv_blocks=128, max_model_len=256))
        tokens = 0
        try:
            for i, (prompt, p) in enumerate(cases):
                outs = alone.generate([prompt], alone.parse_params(p))
                for index, out in enumerate(outs):
                    assert "".join(got[i, index]) == out.text, (i, index, p, got[i, index], out.text)
                    tokens += out.completion_tokens
        finally:
            alone.shutdown()
        assert merged < tokens / 2  # most responses carried several tokens
    finally:
        engine.shutdown()
        box.close()

"""backend/engine_process.py: the engine in a child process behaves as the engine in process."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine, RequestError
from backend.engine_process import EngineProcessError, EngineProxy
from backend.sampling_params import SamplingParams, SamplingParamsError

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def config(demo_model_path):
    return EngineConfig(model_path=demo_model_path, device="cpu", num_kv_blocks=64, max_model_len=256,
                        torch_threads=1)


@pytest.fixture(scope="module")
def proxy(config):
    steps = []
    p = EngineProxy(config, on_step=steps.append)
    p.steps_seen = steps
    yield p
    p.shutdown()
    assert not p.alive


class _Collect:
    def __init__(self):
        self.outs = []
        self.done = threading.Event()

    def __call__(self, out):
        self.outs.append(out)
        if out.finished:
            self.done.set()

    def tokens(self):
        return [t for o in self.outs for t in o.new_token_ids]


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 4000, size=int(rng.integers(5, 40))).tolist() for _ in range(n)]


def test_outputs_equal_the_in_process_engine(proxy, config):
    # One at a time on both sides: a batch's composition can flip a near-tie of the random model.
    prompts = _prompts(6)
    params = SamplingParams(max_new_tokens=12, **GREEDY)
    engine = LLMEngine(config)
    ref = [engine.generate([ids], params)[0] for ids in prompts]
    got = []
    for ids in prompts:
        c = _Collect()
        proxy.add_request(ids, params, c)
        assert c.done.wait(30)
        got.append(c)
    for c, r in zip(got, ref):
        assert c.tokens() == r.new_token_ids
        assert "".join(o.text for o in c.outs) == r.text
        assert c.outs[-1].finish_reason == "length"
    assert proxy.steps_seen and proxy.stats().num_kv_blocks == 64
    # parse_params runs in the stub, with the generation defaults the child read from the model
    assert proxy.parse_params({"max_new_tokens": 12, **GREEDY}) == engine.parse_params({"max_new_tokens": 12, **GREEDY})


def test_errors_cross_as_themselves(proxy):
    with pytest.raises(SamplingParamsError, match="temperature"):
        proxy.parse_params({"temperature": -1})
    with pytest.raises(RequestError, match="out of range"):
        proxy.add_request([10**6], SamplingParams(max_new_tokens=2), _Collect())
    # and the proxy keeps serving
    c = _Collect()
    proxy.add_request([11, 12, 13], SamplingParams(max_new_tokens=3, **GREEDY), c)
    assert c.done.wait(30) and len(c.tokens()) == 3


def test_n_samples_abort_cancel_and_control(proxy):
    c = _Collect()
    n = _Collect()
    proxy.add_request([21, 22, 23], SamplingParams(max_new_tokens=4, n=2, temperature=0.7, seed=3), n)
    rid = proxy.add_request([31, 32, 33], SamplingParams(max_new_tokens=200, **GREEDY), c)
    proxy.abort(rid)
    assert c.done.wait(30) and c.outs[-1].finish_reason == "abort"
    deadline = time.monotonic() + 30
    while sum(o.finished for o in n.outs) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sorted({o.index for o in n.outs}) == [0, 1]
    cancelled = threading.Event()
    k = _Collect()
    proxy.add_request([41, 42], SamplingParams(max_new_tokens=200, **GREEDY), k, is_cancelled=cancelled.is_set)
    cancelled.set()
    assert k.done.wait(30) and k.outs[-1].finish_reason == "abort"
    info = json.loads(proxy.control("engine_info", {}, {"engine_process": "separate"}, {"open_requests": 0})[0])
    assert info["config"]["engine_process"] == "separate" and info["stats"]["open_requests"] == 0
    deadline = time.monotonic() + 10
    while proxy.stats().num_kv_blocks != proxy.stats().num_free_kv_blocks:  # every block back
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_request_that_ends_before_its_call_returns_leaves_no_cancel_watch(proxy, monkeypatch):
    """Review: add_request watched is_cancelled after the call's result, but the request's final
    output can reach the reader first (max_new_tokens 0 ends at once); its unwatch then found
    nothing, and the watch stayed, polled for ever, stretching every other request's poll."""
    call = proxy._call

    def result_after_the_output(op, *args, **kwargs):
        value = call(op, *args, **kwargs)
        if op == "add_request":
            time.sleep(0.3)
        return value

    monkeypatch.setattr(proxy, "_call", result_after_the_output)
    for tokens in (0, 1):
        c = _Collect()
        proxy.add_request([5, 6, 7], SamplingParams(max_new_tokens=tokens, **GREEDY), c, is_cancelled=lambda: False)
        assert c.done.wait(30)
        assert len(proxy._cancel_watch) == 0


def test_a_request_whose_call_timed_out_is_aborted_in_the_child(config, monkeypatch):
    # QA: a stalled child took the request after its caller had the error (a 500) and ran it to
    # max_new_tokens, blocks held. The abort follows the call on the channel.
    p = EngineProxy(config)
    try:
        monkeypatch.setattr(p, "call_timeout_s", 0.5)
        c = _Collect()
        os.kill(p.pid, signal.SIGSTOP)
        try:
            with pytest.raises(EngineProcessError, match="did not answer add_request"):
                p.add_request([51, 52], SamplingParams(max_new_tokens=200, **GREEDY), c)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        ok = _Collect()
        p.add_request([61, 62], SamplingParams(max_new_tokens=3, **GREEDY), ok)
        assert ok.done.wait(30) and len(ok.tokens()) == 3
        info = json.loads(p.control("engine_info", {}, {}, {})[0])
        assert info["stats"]["num_running"] == 0 and info["stats"]["generation_tokens_total"] <= 3 + 1, info["stats"]
        assert c.outs == []  # its caller had its error; nothing more reaches it
    finally:
        p.shutdown()


def test_a_dead_engine_process_ends_open_requests_with_an_error(config):
    p = EngineProxy(config)
    try:
        c = _Collect()
        p.add_request([51, 52], SamplingParams(max_new_tokens=250, **GREEDY), c)
        os.kill(p.pid, signal.SIGKILL)
        assert c.done.wait(30)
        assert c.outs[-1].error and "stopped" in c.outs[-1].error
        with pytest.raises(EngineProcessError):
            p.add_request([1, 2], SamplingParams(max_new_tokens=2), _Collect())
        assert not p.alive
    finally:
        p.shutdown()


def test_a_bad_config_fails_the_start(demo_model_path, tmp_path):
    with pytest.raises(EngineProcessError, match="failed to start"):
        EngineProxy(EngineConfig(model_path=tmp_path, device="cpu"))


def test_a_child_that_dies_before_ready_fails_the_start_at_once(config, monkeypatch):
    import backend.engine_process as ep

    monkeypatch.setattr(ep, "_python", lambda: "/bin/false")  # exits at once, says nothing
    t0 = time.monotonic()
    with pytest.raises(EngineProcessError, match="exited"):
        EngineProxy(config, start_timeout_s=60)
    assert time.monotonic() - t0 < 15


def test_speculative_decoding_in_the_engine_process(config, tmp_path):
    """speculative_config crosses to the child as part of the config: on a model whose greedy
    output repeats, its drafts hold (counted in the stats the stub sees) and the tokens are the
    in-process engine's without drafts."""
    from bench.spec_decode import repeating_model

    model = repeating_model(config.model_path, tmp_path / "repeating")
    plain = config.model_copy(update={"model_path": model})
    spec = EngineConfig(**{**plain.model_dump(), "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "prompt_lookup_min": 1}})
    params = SamplingParams(max_new_tokens=30, repetition_penalty=1.0, **GREEDY)
    prompts = _prompts(2, seed=5)
    engine = LLMEngine(plain)
    ref = [engine.generate([ids], params)[0].new_token_ids for ids in prompts]
    engine.shutdown()
    p = EngineProxy(spec)
    try:
        for ids, want in zip(prompts, ref):
            c = _Collect()
            p.add_request(ids, params, c)
            assert c.done.wait(30)
            assert c.tokens() == want
        deadline = time.monotonic() + 10
        while p.stats().spec_accepted_tokens_total < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.stats().spec_accepted_tokens_total >= 40
    finally:
        p.shutdown()

"""The engine against Hugging Face generate, on the demo model, through the real step loop."""

from __future__ import annotations

import os

import random
import threading
import time

import pytest

# LLM_TEST_DEVICE=cuda runs the same checks on a GPU (the reference stays on the CPU).
TEST_DEVICE = os.environ.get("LLM_TEST_DEVICE", "cpu")
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine, RequestError, default_torch_threads
from backend.outputs import RequestOutput
from backend.sampling_params import SamplingParamsError

MAX_NEW = 24


@pytest.fixture(scope="module")
def hf_model(demo_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()


def _prompts(engine: LLMEngine, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = engine.vocab_size
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 60))] for _ in range(n)]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        min_new_tokens=max_new,  # the engine ignores EOS below; so does this
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


def make_engine(path, **kw) -> LLMEngine:
    if TEST_DEVICE.startswith("cuda") and "num_kv_blocks" not in kw:
        # The CPU's default pool (1 GiB), not 0.85 of the GPU: the CUDA kernel tests run beside these.
        kw.setdefault("kv_cache_memory_mb", 1024)
    return LLMEngine(EngineConfig(model_path=path, device=TEST_DEVICE, dtype="float32", **kw))


@pytest.fixture
def engine(demo_model_path):
    eng = make_engine(demo_model_path, num_kv_blocks=512, block_size=16, max_num_batched_tokens=256)
    yield eng
    eng.shutdown()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


# HF generate applies the model's default repetition penalty (generation_config.json: 1.05) to
# the prompt's tokens too: vLLM's rule, not the engine's own (SGLang's, output tokens only).
HF_REPETITION = {"repetition_penalty_counts_prompt": True}


def greedy(engine: LLMEngine, **extra):
    return engine.parse_params({"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True, **HF_REPETITION,
                                **extra})


def test_staggered_mixed_batch_equals_hf_generate(engine, hf_model):
    prompts = _prompts(engine, 6)
    results: dict[int, RequestOutput] = {}
    # Step-driven staggering: a new request joins the running batch every few steps.
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending and engine.stats().num_steps % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(p, greedy(engine), lambda out, i=i: _collect(results, i, out))
        engine.step()
    assert engine.stats().num_running == 0
    for i, p in enumerate(prompts):
        assert results[i].new_token_ids == hf_greedy(hf_model, p, MAX_NEW), f"prompt {i}"
        assert results[i].finish_reason == "length"


def test_step_time_counters(engine):
    before = engine.stats()
    engine.generate(_prompts(engine, 2), greedy(engine))
    after = engine.stats()
    steps = after.num_steps - before.num_steps
    wall = after.step_seconds_total - before.step_seconds_total
    cpu = after.step_thread_cpu_seconds_total - before.step_thread_cpu_seconds_total
    assert steps >= MAX_NEW
    assert 0 < cpu and 0 < wall
    # The loop thread's CPU time within a step cannot exceed the step's wall time (clock
    # granularity aside).
    assert cpu <= wall + 1e-3 * steps


@pytest.mark.parametrize("decode_attention", ["triton", "triton/3", "triton/auto", "cpu", "gather"])
def test_decode_attention_paths_equal_hf_generate(demo_model_path, hf_model, decode_attention, monkeypatch):
    """Every decode-attention path gives HF's greedy tokens on prompts of mixed lengths: the
    Triton kernel reading the paged cache in place (the CUDA path, here in Triton's
    interpreter), with each context split in 3 or as many parts as the GPU wants
    (LLM_DECODE_SPLITS; CUDA graphs capture them on a GPU), the C++ CPU kernel doing the same,
    and the gathered padded batch."""
    import kernels.triton_ops as ops

    path, _, splits = decode_attention.partition("/")
    if path == "triton" and ops.interpreted() == (TEST_DEVICE == "cuda"):
        pytest.skip("Triton mode does not match the device")
    if path != "triton" and TEST_DEVICE != "cpu":
        pytest.skip("CPU paths")
    if splits == "auto" and TEST_DEVICE == "cpu":
        pytest.skip("auto is one split off a GPU")
    monkeypatch.setenv("LLM_DECODE_SPLITS", splits or "1")  # read at build: the graphs capture it
    eng = make_engine(demo_model_path, num_kv_blocks=128, block_size=16, max_num_batched_tokens=256, max_model_len=512)
    eng.model.decode_attention = path
    if splits == "3":
        assert eng.model._splits(4, 32) == 3
    try:
        prompts = _prompts(eng, 4, seed=7)
        outs = eng.generate(prompts, greedy(eng, max_new_tokens=6))
        for p, out in zip(prompts, outs):
            assert out.new_token_ids == hf_greedy(hf_model, p, 6)
    finally:
        eng.shutdown()


def _mixed_step_prompts() -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(11)
    a, b, c = ([rng.randrange(100, 4000) for _ in range(n)] for n in (37, 70, 29))
    return a, b, c


def mixed_step(runner):
    """One forward step holding a prompt's first chunk (a), a later chunk of another prompt (b,
    45 tokens already cached) and the last token of a third (c, 28 cached): (batch, logits)."""
    a, b, c = _mixed_step_prompts()
    tables = [[1, 2, 3], [10, 11, 12, 13, 14], [20, 21]]
    runner.forward(runner.prepare([(b[:45], 0, tables[1], False), (c[:28], 0, tables[2], False)]))
    chunks = [(a, 0, tables[0], list(range(37))), (b[45:], 45, tables[1], list(range(25))), (c[28:], 28, tables[2], True)]
    batch = runner.prepare(chunks)
    return batch, runner.forward(batch).cpu()


def mixed_step_hf_logits(hf_model) -> torch.Tensor:
    """HF's logits at every position mixed_step computes."""
    a, b, c = _mixed_step_prompts()
    with torch.no_grad():
        return torch.cat([hf_model(torch.tensor([a])).logits[0], hf_model(torch.tensor([b])).logits[0, 45:],
                          hf_model(torch.tensor([c])).logits[0, 28:]]).float()


def test_one_step_of_fresh_continuing_and_decoding_sequences_gives_hf_logits(demo_model_path, hf_model):
    """One forward step holding a prompt's first chunk, a later chunk of another prompt (its
    start in the cache) and a decode gives HF's logits at every position. On the CPU the two
    prefill chunks take the one-sequence-at-a-time attention (causal from position 0, and a
    bottom-right-aligned bias after cached context); on CUDA the padded SDPA group."""
    from backend.model_runner import ModelRunner

    runner = ModelRunner(demo_model_path, 64, 16, device=TEST_DEVICE, dtype=torch.float32)
    batch, logits = mixed_step(runner)
    if TEST_DEVICE == "cpu":
        assert sum(len(g.seqs or []) for g in batch.groups) == 2
    torch.testing.assert_close(logits, mixed_step_hf_logits(hf_model), atol=2e-4, rtol=1e-4)


def test_concurrent_threads_with_background_loop(engine, hf_model):
    prompts = _prompts(engine, 5, seed=1)
    results: dict[int, RequestOutput] = {}
    engine.start()

    def submit(i: int, p: list[int]) -> None:
        time.sleep(0.01 * i)
        engine.add_request(p, greedy(engine), lambda out: _collect(results, i, out))

    threads = [threading.Thread(target=submit, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 120
    while (len(results) < len(prompts) or not all(r.finished for r in results.values())) and time.monotonic() < deadline:
        time.sleep(0.02)
    for i, p in enumerate(prompts):
        assert results[i].new_token_ids == hf_greedy(hf_model, p, MAX_NEW)


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(demo_model_path, hf_model):
    # 6 sequences of up to ~80 tokens need far more than 12 blocks of 8: preemption must happen.
    eng = make_engine(demo_model_path, num_kv_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=64)
    try:
        prompts = _prompts(eng, 6, seed=2)
        outs = eng.generate(prompts, greedy(eng))
        assert eng.stats().num_preemptions > 0
        for p, out in zip(prompts, outs):
            assert out.new_token_ids == hf_greedy(hf_model, p, MAX_NEW)
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_priority_scheduling_serves_urgent_requests_first(demo_model_path):
    eng = make_engine(demo_model_path, max_num_seqs=1, scheduling_policy="priority")
    try:
        done: list[str] = []
        params = lambda prio: eng.parse_params({"temperature": 0, "max_new_tokens": 3, "ignore_eos": True,
                                                 "priority": prio})
        for rid, prio in [("first", 0), ("low", 9), ("mid", 3), ("urgent", -2)]:
            eng.add_request([5, 6, 7], params(prio), lambda out: out.finished and done.append(out.request_id),
                            request_id=rid)
        while len(done) < 4:
            eng.step()
        # All four arrive before the first step and run one at a time: priority order, not arrival.
        assert done == ["urgent", "first", "mid", "low"]
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()
    fcfs = make_engine(demo_model_path)
    try:
        with pytest.raises(RequestError, match="scheduling_policy=priority"):
            fcfs.add_request([1, 2], fcfs.parse_params({"priority": 1}), lambda out: None)
    finally:
        fcfs.shutdown()


def test_abort_and_cancel_free_blocks(engine):
    prompts = _prompts(engine, 3, seed=3)
    outs: dict[int, RequestOutput] = {}
    cancelled = threading.Event()
    long_params = engine.parse_params({"temperature": 0, "max_new_tokens": 500, "ignore_eos": True})
    rid = engine.add_request(prompts[0], long_params, lambda o: _collect(outs, 0, o))
    engine.add_request(prompts[1], long_params, lambda o: _collect(outs, 1, o), is_cancelled=cancelled.is_set)
    engine.add_request(prompts[2], greedy(engine), lambda o: _collect(outs, 2, o))
    for _ in range(4):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort(rid)
    cancelled.set()
    while engine.has_unfinished():
        engine.step()
    assert outs[0].finish_reason == "abort" and outs[1].finish_reason == "abort"
    assert outs[2].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_are_refused_with_reasons(engine):
    with pytest.raises(RequestError, match="empty"):
        engine.add_request([], greedy(engine), lambda o: None)
    with pytest.raises(RequestError, match="out of range"):
        engine.add_request([engine.vocab_size + 5], greedy(engine), lambda o: None)
    with pytest.raises(RequestError, match="context"):
        engine.add_request([1] * engine.max_model_len, greedy(engine), lambda o: None)
    # A limit asked for that the context cannot hold is refused; the default one is cut to fit,
    # and an explicit null one is the whole context.
    room = engine.max_model_len - 3
    with pytest.raises(RequestError, match=f"max_new_tokens must be at most {room}: .*got {room + 1}"):
        engine.add_request([1, 2, 3], greedy(engine, max_new_tokens=room + 1), lambda o: None)
    long_prompt = [1] * (engine.max_model_len - 5)
    (out,) = engine.generate([long_prompt], engine.parse_params({"temperature": 0, "ignore_eos": True}))
    assert len(out.new_token_ids) == 5 and out.finish_reason == "length"  # 128 by default, cut to 5
    (out,) = engine.generate([long_prompt], engine.parse_params({"max_new_tokens": None, "ignore_eos": True}))
    assert len(out.new_token_ids) == 5
    # The engine still serves the next request.
    (out,) = engine.generate([[1, 2, 3]], greedy(engine))
    assert len(out.new_token_ids) == MAX_NEW


def test_stop_token_ids_and_eos(engine):
    prompt = _prompts(engine, 1, seed=4)[0]
    (ref,) = engine.generate([prompt], greedy(engine))
    stop_at = ref.new_token_ids[5]
    (out,) = engine.generate([prompt], greedy(engine, stop_token_ids=[stop_at]))
    first = ref.new_token_ids.index(stop_at)
    assert out.new_token_ids == ref.new_token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at and not out.matched_eos
    # The model's EOS ends it too, marked as such (vLLM then reports no stop_reason). vLLM's
    # model EOS is the tokenizer's; generation_config.json's others are stop token ids to it,
    # reported as the stop_reason (QA: null for them).
    eos = engine.tokenizer.eos_token_id
    others = sorted(engine.eos_ids - {eos})
    assert eos in engine.eos_ids and others  # the demo model's generation_config lists two
    for token, matched in ((eos, True), (others[0], False)):
        (out,) = engine.generate([prompt], engine.parse_params({"temperature": 0, "max_new_tokens": 5,
                                                                 "logit_bias": {str(token): 100}}))
        assert (out.new_token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", token)
        assert out.matched_eos is matched


def test_stop_strings_are_matched_on_text_and_trimmed(engine):
    prompt = _prompts(engine, 1, seed=5)[0]
    (ref,) = engine.generate([prompt], greedy(engine))
    text = ref.text
    assert len(text) > 12
    stop = text[6:10]
    (out,) = engine.generate([prompt], greedy(engine, stop=[stop]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    (kept,) = engine.generate([prompt], greedy(engine, stop=[stop], include_stop_str_in_output=True))
    assert kept.text == text[: text.index(stop) + len(stop)]
    # As vLLM v1: stop strings count only after min_tokens; a match must end in the text of
    # the tokens after those.
    stop = text[1]
    m = 12
    before = len(engine.tokenizer.decode(ref.new_token_ids[:m]))
    assert text.index(stop) < before  # the first match is too early
    (late,) = engine.generate([prompt], greedy(engine, stop=[stop], min_tokens=m))
    j = text.find(stop, before - len(stop) + 1)
    assert late.new_token_ids[:m] == ref.new_token_ids[:m] and len(late.new_token_ids) > m
    assert late.text == (text[:j] if j >= 0 else text), (late.text, text, before)
    # SGLang's min_new_tokens holds back EOS and stop tokens only: the first match ends it.
    (early,) = engine.generate([prompt], greedy(engine, stop=[stop], min_new_tokens=m))
    assert early.text == text[: text.index(stop)] and len(early.new_token_ids) < m


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    prompts = _prompts(engine, 3, seed=6)
    params = engine.parse_params({"temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "max_new_tokens": 16})
    alone = engine.generate([prompts[0]], params)[0].new_token_ids
    together = engine.generate(prompts, params)[0].new_token_ids
    assert alone == together


def test_a_failed_step_ends_its_requests_as_the_servers_fault(engine, monkeypatch):
    """A step that raises (a model directory whose shapes the config does not describe, CUDA out
    of memory) fails the requests in it with "internal error: ...", which the frontend answers
    with 500 (map_stream_error, tests/test_frontend_unit.py: the engine tests also run on a GPU
    host without the frontend's packages), not a 400 that tells the client its request was
    wrong; their blocks are freed and the engine goes on."""
    prompt = _prompts(engine, 1, seed=9)[0]

    def boom(scheduled):
        raise RuntimeError("shape '[-1, 32, 16]' is invalid")

    monkeypatch.setattr(engine, "_run", boom)
    (out,) = engine.generate([prompt], greedy(engine))
    assert out.error.startswith("internal error: engine step failed: shape") and out.error_code == "internal"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    monkeypatch.undo()
    (ok,) = engine.generate([prompt], greedy(engine))
    assert ok.error is None and ok.finish_reason == "length"


def test_sample_i_of_a_seeded_request_draws_as_seed_plus_i(engine):
    """As vLLM (ParentRequest: child seed = seed + index): sample i of `n` with seed s equals the
    request alone with seed s + i; any int64 seed works, wrapping at the ends as int64 does."""
    prompt = _prompts(engine, 1, seed=8)[0]
    base = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    for seed in (1234, -1, 2**63 - 2):
        samples = engine.generate([prompt], engine.parse_params({**base, "seed": seed, "n": 3}))
        for i, sample in enumerate(samples):
            alone_seed = (seed + i + 2**63) % 2**64 - 2**63
            (alone,) = engine.generate([prompt], engine.parse_params({**base, "seed": alone_seed}))
            assert sample.new_token_ids == alone.new_token_ids, (seed, i)
        assert len({tuple(s.new_token_ids) for s in samples}) == 3
    with pytest.raises(SamplingParamsError, match="64-bit"):
        engine.parse_params({**base, "seed": 2**63})


def _collect(results: dict, key, out: RequestOutput) -> None:
    prev = results.get(key)
    results[key] = out if prev is None else prev.merge(out)


def test_random_traffic_with_aborts_preemption_and_sharing_stays_exact(demo_model_path, hf_model):
    """Requests arrive over time with shared prefixes (prefix caching), some with n = 2, into a
    pool small enough that preemption is routine, and a quarter are aborted mid-flight. Every
    sample equals HF's greedy continuation (an aborted one, a prefix of it), and the pool is
    whole at the end."""
    eng = make_engine(demo_model_path, num_kv_blocks=24, block_size=8, max_model_len=128,
                      max_num_batched_tokens=64, enable_prefix_caching=True)
    rng = random.Random(7)
    prefixes = [[rng.randrange(eng.vocab_size) for _ in range(rng.randint(10, 40))] for _ in range(3)]
    plan = []  # (arrival step, prompt, n, abort step or None, max_new)
    for i in range(20):
        prompt = rng.choice(prefixes) + [rng.randrange(eng.vocab_size) for _ in range(rng.randint(1, 20))]
        arrive = rng.randint(0, 40)
        plan.append((arrive, prompt, rng.choice([1, 1, 2]),
                     arrive + rng.randint(1, 30) if rng.random() < 0.25 else None, rng.randint(4, MAX_NEW)))
    outs: dict[tuple[int, int], RequestOutput] = {}
    ids: dict[int, str] = {}
    try:
        step = 0
        while step <= 80 or eng.has_unfinished():
            for i, (arrive, prompt, n, abort_at, max_new) in enumerate(plan):
                if arrive == step:
                    params = eng.parse_params({"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, "n": n,
                                               **HF_REPETITION})
                    ids[i] = eng.add_request(prompt, params, lambda o, i=i: _collect(outs, (i, o.index), o))
                if abort_at == step:
                    eng.abort(ids[i])
            eng.step()
            step += 1
            assert step < 2000, "the engine stopped making progress"
        stats = eng.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()
    aborted = 0
    for i, (_, prompt, n, abort_at, max_new) in enumerate(plan):
        want = hf_greedy(hf_model, prompt, max_new)
        for s in range(n):
            out = outs[(i, s)]
            assert out.finished
            if out.finish_reason == "abort":
                aborted += 1
                assert out.new_token_ids == want[: len(out.new_token_ids)], (i, s)
            else:
                assert out.finish_reason == "length" and out.new_token_ids == want, (i, s)
    assert aborted > 0


def test_the_models_default_max_tokens_for_requests_that_ask_for_it(demo_model_path, tmp_path):
    # generation_config.json's max_new_tokens, for the frontend to apply as vLLM does; not with
    # sampling_defaults=openai, which ignores the file's defaults.
    import json
    from pathlib import Path

    for f in Path(demo_model_path).iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f.resolve())
    cfg = json.loads((Path(demo_model_path) / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**cfg, "max_new_tokens": 7}))
    for defaults, want in (("model", 7), ("openai", None)):
        eng = make_engine(str(tmp_path), num_kv_blocks=16, block_size=16, max_model_len=128, sampling_defaults=defaults)
        try:
            assert eng.info()["default_max_tokens"] == want
            # /generate keeps SGLang's default: the file's value is for requests that ask for it
            assert eng.parse_params({}).max_new_tokens == 128
            asked = eng.parse_params({"max_new_tokens": None, "max_new_tokens_from_model": True, "ignore_eos": True,
                                      "temperature": 0})
            null = eng.parse_params({"max_new_tokens": None, "ignore_eos": True, "temperature": 0})
            short, capped, whole = eng.generate([[5, 6, 7], [5] * 124, [5] * 120], [asked, asked, null])
            assert len(short.new_token_ids) == (7 if want else 125)
            # a default the prompt leaves no room for is cut to the room, never refused (review)
            assert len(capped.new_token_ids) == 4 and capped.error is None
            assert len(whole.new_token_ids) == 8  # null alone: the whole room
        finally:
            eng.shutdown()


def test_requests_waiting_for_their_grammar_count_as_waiting(demo_model_path):
    """QA: a request whose grammar was still compiling showed neither running nor waiting (an
    idle engine to a monitor), and did not count toward max_waiting_requests. vLLM v1 queues such
    a request as waiting (WAITING_FOR_FSM)."""
    import concurrent.futures

    from backend.engine import EngineOverloaded

    eng = make_engine(demo_model_path, num_kv_blocks=64, block_size=16, max_model_len=512, max_num_seqs=2,
                      max_waiting_requests=2)
    try:
        # A grammar compiles for ever.
        eng._submit_grammar = lambda params: None if params.constraint is None else concurrent.futures.Future()
        prompts = _prompts(eng, 5, seed=4)
        schema = eng.parse_params({"json_schema": '{"type": "object"}', "max_new_tokens": 4})
        ids = [eng.add_request(p, schema, lambda out: None) for p in prompts[:3]]
        eng.step()
        stats = eng.stats()
        assert (stats.num_running, stats.num_waiting) == (0, 3)
        eng.add_request(prompts[3], greedy(eng), lambda out: None)  # 3 + 1 queued, 2 free slots: 2 wait
        with pytest.raises(EngineOverloaded, match="2 sequences are already waiting"):
            eng.add_request(prompts[4], greedy(eng), lambda out: None)
        for rid in ids:
            eng.abort(rid)
        while eng.step():
            pass
        assert eng.stats().num_waiting == 0 and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_a_burst_between_steps_fills_the_running_slots_before_it_is_refused(demo_model_path):
    """max_waiting_requests counts only what the next step cannot start: with 2 running slots and
    2 waiting places, 4 requests arriving before the engine steps are all taken, the 5th refused."""
    from backend.engine import EngineOverloaded

    eng = make_engine(demo_model_path, num_kv_blocks=64, block_size=16, max_model_len=512, max_num_seqs=2,
                      max_waiting_requests=2)
    try:
        prompts = _prompts(eng, 5, seed=3)
        done: dict[int, RequestOutput] = {}
        for i, p in enumerate(prompts[:4]):  # the loop is not running: all four sit in the inbox
            eng.add_request(p, greedy(eng), lambda out, i=i: _collect(done, i, out))
        with pytest.raises(EngineOverloaded, match="2 sequences are already waiting"):
            eng.add_request(prompts[4], greedy(eng), lambda out: None)
        eng.step()  # two start, two wait: still full
        assert len(eng.scheduler.running) == 2 and len(eng.scheduler.waiting) == 2
        with pytest.raises(EngineOverloaded, match="2 sequences are already waiting"):  # the same count
            eng.add_request(prompts[4], greedy(eng), lambda out: None)
        while eng.step():
            pass
        assert sorted(i for i, r in done.items() if r.finished) == [0, 1, 2, 3]
        # A request's n samples count as n sequences whether still in the inbox or scheduled
        # (QA: one n=8 request counted 1 before its first step and 6 after it).
        eng.add_request(prompts[0], eng.parse_params({"max_new_tokens": 4, "n": 5, "temperature": 0}), lambda out: None)
        with pytest.raises(EngineOverloaded, match="3 sequences are already waiting"):
            eng.add_request(prompts[4], greedy(eng), lambda out: None)
        eng.step()
        with pytest.raises(EngineOverloaded, match="3 sequences are already waiting"):
            eng.add_request(prompts[4], greedy(eng), lambda out: None)
        while eng.step():
            pass
    finally:
        eng.shutdown()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                                   "max_model_len", "kv_cache_memory_mb"])
def test_sizes_below_one_are_refused_at_start_up(demo_model_path, field):
    # max_num_seqs 0 started a server that admitted nothing: every request waited forever.
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        EngineConfig(model_path=demo_model_path, device="cpu", **{field: 0})


def test_a_context_past_the_models_is_refused(demo_model_path):
    # It was cut to max_position_embeddings without a word (vLLM refuses it too).
    with pytest.raises(ValueError, match="max_model_len 999999 is more than the model's context"):
        LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", max_model_len=999999))


def test_default_torch_threads_is_one_on_cuda():
    # On CUDA the step loop's host work is small; more OpenMP threads only spin between steps
    # (measured: 2.5 cores of an H100 host taken from the server's response path).
    assert default_torch_threads("cuda") == 1
    assert default_torch_threads("cuda:1") == 1
    assert default_torch_threads("cpu") == torch.get_num_threads()


def test_the_fused_cpu_rms_norm_is_hugging_faces_arithmetic_bit_for_bit():
    """model_runner._rms_norm takes torch's fused op for float32 on the CPU: it must equal
    Hugging Face's Qwen2/Llama RMSNorm exactly (to float32, normalize, back, times the weight),
    at every scale and shape the runner uses (rows of hidden states, per-head q/k norms)."""
    from backend.model_runner import _rms_norm

    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        for shape in [(1, 128), (7, 896), (33, 4096), (5, 14, 64), (300, 3584)]:
            x = torch.randn(shape, generator=g) * 10.0 ** (seed % 5 - 2)
            w = torch.randn(shape[-1], generator=g)
            x32 = x.float()
            want = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
            assert torch.equal(_rms_norm(x, w, 1e-6), want), (seed, shape)

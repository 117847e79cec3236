"""Speculative decoding on the real tritonserver: `speculative_config` set through the llm model's
environment, the ensemble and the llm model streaming several tokens a step, the text and ids of
decoding one token at a time, and the draft counters on the metrics endpoint."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from client.triton_stream import TritonStreamClient
from tests.test_metrics import delta, scrape
from tests.test_speculative import repeating_model  # noqa: F401  (the fixture)

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
GREEDY = {"temperature": 0, "ignore_eos": True, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def server(start_triton, repeating_model):  # noqa: F811
    with start_triton(num_kv_blocks=128, max_model_len=512, name="spec",
                      env={"LLM_MODEL_PATH": str(repeating_model), "LLM_SPECULATIVE_CONFIG": json.dumps(SPEC)}) as srv:
        yield srv


def test_streams_through_the_server_equal_decoding_one_token_at_a_time(server, repeating_model):  # noqa: F811
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 4000) for _ in range(n)] for n in (9, 30, 52)]
    eng = LLMEngine(EngineConfig(model_path=repeating_model, device="cpu", num_kv_blocks=128, max_model_len=512))
    try:
        want = eng.generate(prompts, eng.parse_params({**GREEDY, "max_new_tokens": 40}))
    finally:
        eng.shutdown()
    client = TritonStreamClient(server.grpc_url)
    before = scrape(server)
    for prompt, ref in zip(prompts, want):
        chunks = list(client.stream_generate("llm", {
            "input_ids": prompt, "max_tokens": 40, "stream": True, "sampling_parameters": json.dumps(GREEDY)}))
        ids = np.concatenate([np.asarray(c["output_ids"]).reshape(-1) for c in chunks]).tolist()
        assert ids == ref.new_token_ids
        assert chunks[-1]["finish_reason"] == "length"
        text = "".join(c["text_output"] for c in client.stream_generate("ensemble", {
            "input_ids": prompt, "max_tokens": 40, "stream": True, "sampling_parameters": json.dumps(GREEDY)}))
        assert text == ref.text
    # The counters are published after the step, beside the responses, one increment at a time, so
    # a scrape can land between two of them: read until two scrapes in a row agree.
    deadline, last = time.monotonic() + 30, None
    while True:
        after = scrape(server)
        accepted = delta(after, before, "llm_spec_decode_num_accepted_tokens_total")
        drafted = delta(after, before, "llm_spec_decode_num_draft_tokens_total")
        drafts = delta(after, before, "llm_spec_decode_num_drafts_total")
        per_position = [delta(after, before, "llm_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                        for i in range(5)]
        now = (accepted, drafted, drafts, per_position)
        if (now == last and accepted >= 0.9 * 6 * 39 * 5 / 6) or time.monotonic() > deadline:
            break
        last = now
        time.sleep(0.2)
    assert sum(per_position) == accepted and per_position[0] == drafts
    assert 0 < drafts and accepted / drafts + 1 > 4  # most verifying steps yield 6 tokens
    # Every draft holds on this model: of each request's 39 tokens after the first, 5 of 6 come
    # from drafts (6 requests).
    assert drafted > 0 and accepted == drafted
    assert accepted >= 0.9 * 6 * 39 * 5 / 6
    steps = delta(after, before, "llm_engine_steps_total")
    assert steps < 6 * 40 / 3


@pytest.fixture(scope="module")
def draft_server(start_triton, demo_model_path):
    # The target as its own draft: its drafts are drawn as it draws, so they hold (another draft
    # model's outputs are checked in tests/test_draft_model.py).
    spec = {"method": "draft_model", "model": str(demo_model_path), "num_speculative_tokens": 4}
    with start_triton(num_kv_blocks=128, max_model_len=512, name="draft",
                      env={"LLM_SPECULATIVE_CONFIG": json.dumps(spec)}) as srv:
        yield srv


def test_a_draft_model_on_the_server_keeps_the_targets_output(draft_server, demo_model_path):
    """vLLM's draft_model method set through the llm model's environment: the ensemble streams
    the target's own text, greedy and seeded, and the draft counters move."""
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 4000) for _ in range(n)] for n in (12, 40)]
    seeded = {"temperature": 0.9, "top_k": 50, "seed": 7, "ignore_eos": True}
    eng = LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", num_kv_blocks=128, max_model_len=512))
    try:
        want = {name: eng.generate(prompts, eng.parse_params({**raw, "max_new_tokens": 32}))
                for name, raw in (("greedy", GREEDY), ("seeded", seeded))}
    finally:
        eng.shutdown()
    client = TritonStreamClient(draft_server.grpc_url)
    before = scrape(draft_server)
    for name, raw in (("greedy", GREEDY), ("seeded", seeded)):
        for prompt, ref in zip(prompts, want[name]):
            chunks = list(client.stream_generate("ensemble", {
                "input_ids": prompt, "max_tokens": 32, "stream": True, "sampling_parameters": json.dumps(raw)}))
            ids = np.concatenate([np.asarray(c["output_ids"]).reshape(-1) for c in chunks]).tolist()
            assert ids == ref.new_token_ids, name
            assert "".join(c["text_output"] for c in chunks) == ref.text
            # SGLang's per-request speculative meta_info, on the last response.
            meta = json.loads(chunks[-1]["meta_info"][0] if isinstance(chunks[-1]["meta_info"], list)
                              else chunks[-1]["meta_info"])
            assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 3
    deadline = time.monotonic() + 30
    while delta(scrape(draft_server), before, "llm_spec_decode_num_draft_tokens_total") <= 0:
        assert time.monotonic() < deadline, "no draft tokens counted"
        time.sleep(0.2)

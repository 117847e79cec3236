"""SGLang's return_hidden_states through the engine's real step loop, against the Hugging Face
model's own last hidden states (`output_hidden_states=True`, whose last entry is after the final
norm): chunked prefill, prefix caching, preemption, n > 1 and prompt logprobs alongside."""

from __future__ import annotations

import math

import pytest
import torch

# The engine-test helpers, and its autouse check that every test leaves the KV pool free.
from test_engine_sampling import _pool_free, _prompt, hf_model, make_engine  # noqa: F401

ATOL = 1e-3  # the rows run to |30|: float32 rounding of a different summation order


@pytest.fixture(scope="module")
def engine(demo_model_path):
    # A 16-token budget: a 40-token prompt is prefilled in three chunks.
    eng = make_engine(demo_model_path, max_num_batched_tokens=16, enable_prefix_caching=True)
    yield eng
    eng.shutdown()


def _greedy(max_new: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, "return_hidden_states": True, **extra}


@torch.inference_mode()
def hf_last_hidden(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()


def check_layout_and_values(hf_model, prompt: list[int], out) -> None:
    """SGLang's layout: the prompt's rows as one entry, then one row per generated token that
    was fed back (all but the last); together HF's hidden states of prompt + output[:-1]."""
    entries = out.logprobs["hidden_states"]
    assert len(entries) == len(out.new_token_ids)
    assert len(entries[0]) == len(prompt) and all(isinstance(r, list) for r in entries[0])
    assert all(isinstance(v, float) for row in entries[1:] for v in row)
    got = torch.tensor(entries[0] + entries[1:])
    want = hf_last_hidden(hf_model, prompt + out.new_token_ids[:-1])
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=ATOL, rtol=0), float((got - want).abs().max())


def test_hidden_states_match_hf_over_chunked_prefill(engine, hf_model):
    prompt = _prompt(40, 1)
    (out,) = engine.generate([prompt], [engine.parse_params(_greedy(6))])
    check_layout_and_values(hf_model, prompt, out)


def test_off_by_default_and_mixed_batches(engine, hf_model):
    prompts = [_prompt(33, 2), _prompt(18, 3), _prompt(25, 4)]
    params = [engine.parse_params(_greedy(5)), engine.parse_params({**_greedy(5), "return_hidden_states": False}),
              engine.parse_params(_greedy(4))]
    outs = engine.generate(prompts, params)
    check_layout_and_values(hf_model, prompts[0], outs[0])
    check_layout_and_values(hf_model, prompts[2], outs[2])
    assert "hidden_states" not in (outs[1].logprobs or {})
    # The same tokens as without hidden states: asking for them changes nothing else.
    plain = engine.generate(prompts, [engine.parse_params({**_greedy(5), "return_hidden_states": False})] * 3)
    assert [o.new_token_ids for o in plain[:2]] == [o.new_token_ids for o in outs[:2]]


def test_a_cached_prefix_is_computed_again_for_hidden_states(engine, hf_model):
    prompt = _prompt(48, 5)  # three full blocks
    engine.generate([prompt], [engine.parse_params({"temperature": 0, "max_new_tokens": 2})])
    (warm,) = engine.generate([prompt], [engine.parse_params({"temperature": 0, "max_new_tokens": 2})])
    assert warm.cached_tokens > 0  # the prefix is in the cache ...
    (out,) = engine.generate([prompt], [engine.parse_params(_greedy(3))])
    assert out.cached_tokens == 0  # ... and not taken: every prompt position needs its row
    check_layout_and_values(hf_model, prompt, out)


def test_n_samples_each_report_the_whole_layout(engine, hf_model):
    prompt = _prompt(20, 6)
    outs = engine.generate([prompt], [engine.parse_params({**_greedy(4), "n": 2})])
    assert [o.index for o in outs] == [0, 1]
    for out in outs:
        check_layout_and_values(hf_model, prompt, out)


def test_with_prompt_logprobs_both_are_right(engine, hf_model):
    prompt = _prompt(30, 7)
    extra = {"return_logprob": True, "logprob_start_len": 3, "top_logprobs_num": 2}
    (both,) = engine.generate([prompt], [engine.parse_params(_greedy(4, **extra))])
    (alone,) = engine.generate([prompt], [engine.parse_params({**_greedy(4, **extra), "return_hidden_states": False})])
    check_layout_and_values(hf_model, prompt, both)
    for key in ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs"):
        a, b = both.logprobs[key], alone.logprobs[key]
        assert len(a) == len(b), key
    assert [t for _, t, _ in both.logprobs["input_token_logprobs"]] == prompt[3:]
    first_a, first_b = both.logprobs["input_token_logprobs"][0], alone.logprobs["input_token_logprobs"][0]
    assert first_a == first_b and first_a[0] is None  # SGLang's: token logprob_start_len unscored
    for (lp_a, t_a, _), (lp_b, t_b, _) in zip(both.logprobs["input_token_logprobs"][1:],
                                              alone.logprobs["input_token_logprobs"][1:]):
        assert t_a == t_b and math.isclose(lp_a, lp_b, abs_tol=1e-4)


def test_max_new_tokens_0_returns_the_prompt_rows(engine, hf_model):
    prompt = _prompt(21, 8)
    (out,) = engine.generate([prompt], [engine.parse_params(_greedy(0))])
    assert out.new_token_ids == [] and out.finish_reason == "length"
    (rows,) = out.logprobs["hidden_states"]
    assert torch.allclose(torch.tensor(rows), hf_last_hidden(hf_model, prompt), atol=ATOL, rtol=0)


def test_each_position_once_after_a_preemption(demo_model_path, hf_model):
    # Decoding neighbours outgrow a small pool: the hidden-states request is preempted and
    # recomputed, and still reports each position once, equal to HF's.
    small = make_engine(demo_model_path, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=32)
    try:
        gen = small.parse_params({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        prompt = _prompt(30, 9)
        outs = small.generate([_prompt(20, 21 + i) for i in range(3)] + [prompt],
                              [gen] * 3 + [small.parse_params(_greedy(20))])
        assert outs[3].num_preemptions > 0
        check_layout_and_values(hf_model, prompt, outs[3])
        assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
    finally:
        small.shutdown()

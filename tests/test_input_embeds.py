"""SGLang's input_embeds through the engine's real step loop: a prompt given as embeddings
generates what Hugging Face's `generate(inputs_embeds=...)` does, and what the same prompt as
token ids does when the embeddings are the model's own; over chunked prefill, preemption,
n > 1 and mixed batches; never prefix-cached; bad input refused with the reason."""

from __future__ import annotations

import re

import pytest
import torch

from backend.engine import RequestError
from backend.sampler import SamplingRow, TokenCounts

# The engine-test helpers, and its autouse check that every test leaves the KV pool free.
from test_engine_sampling import _pool_free, _prompt, hf_model, make_engine  # noqa: F401
# The same engine as the hidden-states tests: a 16-token budget prefills a 40-token prompt in three chunks.
from test_hidden_states import ATOL, engine  # noqa: F401

# HF's generate says it penalizes only new tokens with inputs_embeds: what is compared here.
pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`:UserWarning")


def _greedy(max_new: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, **extra}


def _embed(engine, ids: list[int]) -> torch.Tensor:
    return engine.model.embed[torch.tensor(ids)].clone()


def _random_embeds(n: int, seed: int, hidden: int = 128) -> torch.Tensor:
    # The demo model's embedding rows have a norm of ~0.2; rows off the table, at that scale.
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.02


@torch.inference_mode()
def _hf_greedy(model, embeds: torch.Tensor, max_new: int) -> list[int]:
    out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long),
                         max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0].tolist()  # with inputs_embeds alone, generate returns the new tokens only


# The demo model's generation_config asks for a repetition penalty, which counts the prompt's
# tokens; an embedded prompt has none (as in HF's generate with inputs_embeds), so comparisons
# with the same prompt as ids turn it off.
NO_PENALTY = {"repetition_penalty": 1.0}


def test_the_models_own_embeddings_generate_what_the_ids_do(engine):
    prompts = [_prompt(40, 1), _prompt(7, 2)]
    params = engine.parse_params(_greedy(12, **NO_PENALTY))
    by_ids = engine.generate(prompts, params)
    by_embeds = engine.generate([[], []], params, input_embeds=[_embed(engine, p) for p in prompts])
    for a, b in zip(by_ids, by_embeds):
        assert b.new_token_ids == a.new_token_ids
        assert b.text == a.text
        assert b.prompt_tokens == a.prompt_tokens


def test_rows_off_the_table_match_hf_generate(engine, hf_model):
    embeds = _random_embeds(37, 3)
    (out,) = engine.generate([[]], engine.parse_params(_greedy(10)), input_embeds=[embeds])
    assert out.new_token_ids == _hf_greedy(hf_model, embeds, 10)
    assert out.prompt_tokens == 37 and out.cached_tokens == 0


def test_mixed_with_id_prompts_in_one_batch(engine, hf_model):
    embeds = _random_embeds(21, 4)
    prompts = [_prompt(30, 5), [], _prompt(12, 6)]
    params = engine.parse_params(_greedy(8))
    outs = engine.generate(prompts, params, input_embeds=[None, embeds, None])
    alone = engine.generate([prompts[0], prompts[2]], params)
    assert [outs[0].new_token_ids, outs[2].new_token_ids] == [a.new_token_ids for a in alone]
    assert outs[1].new_token_ids == _hf_greedy(hf_model, embeds, 8)


def test_never_prefix_cached(engine):
    # Embedded prompts' placeholder ids are all alike: reusing their blocks would hand one
    # prompt's K/V to another. Neither an equal embedded prompt nor a prompt of the
    # placeholder id itself may find them.
    embeds = _random_embeds(48, 7)
    params = engine.parse_params(_greedy(4))
    first = engine.generate([[]], params, input_embeds=[embeds])[0]
    again = engine.generate([[]], params, input_embeds=[embeds])[0]
    other = engine.generate([[]], params, input_embeds=[_random_embeds(48, 8)])[0]
    same_ids = engine.generate([[engine._embeds_placeholder] * 48], params)[0]
    assert again.new_token_ids == first.new_token_ids
    assert first.cached_tokens == again.cached_tokens == other.cached_tokens == same_ids.cached_tokens == 0
    assert other.new_token_ids != first.new_token_ids


def test_n_samples_and_seeds_as_with_ids(engine):
    prompt = _prompt(20, 9)
    params = engine.parse_params({"temperature": 1.0, "max_new_tokens": 10, "n": 3, "seed": 11, "ignore_eos": True,
                                  **NO_PENALTY})
    by_ids = engine.generate([prompt], params)
    by_embeds = engine.generate([[]], params, input_embeds=[_embed(engine, prompt)])
    assert [o.new_token_ids for o in by_embeds] == [o.new_token_ids for o in by_ids]
    assert len({tuple(o.new_token_ids) for o in by_embeds}) > 1


def test_preempted_and_recomputed_from_the_embeddings(demo_model_path, hf_model):
    small = make_engine(demo_model_path, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=32)
    try:
        embeds = _random_embeds(30, 10)
        gen = small.parse_params(_greedy(40))
        outs = small.generate([_prompt(20, 21 + i) for i in range(3)] + [[]], [gen] * 3 + [small.parse_params(_greedy(20))],
                              input_embeds=[None, None, None, embeds])
        assert outs[3].num_preemptions > 0
        assert outs[3].new_token_ids == _hf_greedy(hf_model, embeds, 20)
        assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
    finally:
        small.shutdown()


def test_a_draft_after_the_last_prompt_row_keeps_that_row(engine, demo_model_path, hf_model):
    # 33 rows under a 16-token budget: the last chunk is one prompt token, and a draft (the
    # request's prediction; the server's n-gram one) rides with it. QA: that token was computed
    # from the placeholder id, not its row, and every output token after differed.
    embeds = _random_embeds(33, 14)
    want = _hf_greedy(hf_model, embeds, 6)
    (out,) = engine.generate([[]], engine.parse_params(_greedy(6, prediction=want[:3])), input_embeds=[embeds])
    assert out.new_token_ids == want
    assert out.accepted_prediction_tokens == 3 and out.rejected_prediction_tokens == 0
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    spec = make_engine(demo_model_path, max_num_batched_tokens=16, speculative_config=ngram)
    try:
        # The prompt is one placeholder id repeated: the n-gram drafts at its last token.
        (out,) = spec.generate([[]], spec.parse_params(_greedy(6)), input_embeds=[embeds])
        assert out.new_token_ids == want and spec.stats().spec_draft_tokens_total > 0
    finally:
        spec.shutdown()


def test_truncate_prompt_tokens_keeps_the_last_rows(engine, hf_model):
    embeds = _random_embeds(30, 12)
    (out,) = engine.generate([[]], engine.parse_params(_greedy(6, truncate_prompt_tokens=18)), input_embeds=[embeds])
    assert out.prompt_tokens == 18
    assert out.new_token_ids == _hf_greedy(hf_model, embeds[-18:], 6)


def test_hidden_states_and_output_logprobs_work(engine, hf_model):
    embeds = _random_embeds(25, 13)
    params = engine.parse_params(_greedy(5, return_hidden_states=True, return_logprob=True))
    (out,) = engine.generate([[]], params, input_embeds=[embeds])
    prompt_rows = torch.tensor(out.logprobs["hidden_states"][0])
    with torch.inference_mode():
        want = hf_model(inputs_embeds=embeds[None], output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(prompt_rows, want, atol=ATOL, rtol=0)
    assert len(out.logprobs["output_token_logprobs"]) == 5


def test_penalties_and_processors_see_no_prompt_tokens():
    # The placeholders are not the prompt's tokens: a repetition penalty must not push them down.
    counts = TokenCounts(16)
    params = type("P", (), {"repetition_penalty_counts_prompt": True})()  # vLLM's rule: the prompt would count
    row = SamplingRow(params=params, seed=0, step=0, seq_id=1, token_ids=[3, 3, 3, 5], num_prompt_tokens=3,
                      prompt_is_placeholder=True)
    plain = SamplingRow(params=params, seed=0, step=0, seq_id=2, token_ids=[3, 3, 3, 5], num_prompt_tokens=3)
    counts_rows, mask = counts.rows([row, plain], torch.device("cpu"))
    assert not mask[0].any() and mask[1, 3]
    assert counts_rows[0, 5] == 1 and counts_rows[0, 3] == 0
    counts.release(1)
    counts.release(2)


@pytest.mark.parametrize(
    "embeds, extra, message",
    [
        (torch.zeros(4, 64), {}, "shape [num_tokens, 128]"),
        (torch.zeros(128), {}, "shape [num_tokens, 128]"),
        (torch.zeros(0, 128), {}, "shape [num_tokens, 128]"),
        (torch.full((3, 128), float("nan")), {}, "not a finite number"),
        ([[0.1, 0.2], [0.3]], {}, "rows of 128 numbers"),
        (torch.zeros(3, 128), {"return_logprob": True, "logprob_start_len": 0}, "prompt logprobs"),
        (torch.zeros(3, 128), {"return_prompt_token_ids": True}, "has no token ids"),
        (torch.zeros(5000, 128), {}, "the context is"),
    ],
)
def test_bad_embeddings_are_refused(engine, embeds, extra, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        engine.add_request([], engine.parse_params(_greedy(4, **extra)), lambda out: None, input_embeds=embeds)


def test_ids_and_embeddings_together_are_refused(engine):
    with pytest.raises(RequestError, match="not both"):
        engine.add_request([1, 2, 3], engine.parse_params(_greedy(4)), lambda out: None,
                           input_embeds=torch.zeros(3, 128))

"""The sampling surface through the engine's real step loop: penalties, min_new_tokens, logprobs,
n > 1, prefix caching, stop_regex, custom logit processors — each checked against a reference
built from the Hugging Face model's own logits and the kernels' torch references."""

from __future__ import annotations

import os

import math
import random
import time

import pytest

# LLM_TEST_DEVICE=cuda runs the same checks on a GPU (the reference stays on the CPU).
TEST_DEVICE = os.environ.get("LLM_TEST_DEVICE", "cpu")
import torch

import kernels.reference as ref
from backend.config import EngineConfig
from backend.custom_logit_processor import CustomLogitProcessor
from backend.engine import LLMEngine, RequestError
from backend.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def hf_model(demo_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()


def make_engine(path, **kw) -> LLMEngine:
    kw = {"num_kv_blocks": 512, "max_num_batched_tokens": 256, "block_size": 16, **kw}
    return LLMEngine(EngineConfig(model_path=path, device=TEST_DEVICE, dtype="float32", **kw))


@pytest.fixture(scope="module")
def engine(demo_model_path):
    eng = make_engine(demo_model_path)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _pool_free(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        assert eng.sampler.token_counts.num_tracked == 0  # penalty counts released with their sequences


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4000) for _ in range(n)]


@torch.inference_mode()
def reference_greedy(model, prompt, max_new, *, freq=0.0, pres=0.0, rep=1.0, rep_prompt=False, min_new=0, eos=(),
                     bias=None, allowed=None):
    """Greedy decoding on HF logits with the kernels' torch references, full forward each step.
    rep_prompt: the repetition penalty counts prompt tokens too (vLLM's), not only output (SGLang's)."""
    ids = list(prompt)
    out, lps = [], []
    V = model.config.vocab_size
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[:, -1].float()
        for t, b in (bias or {}).items():
            logits[0, t] += b
        if allowed is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[allowed] = True
            logits[0, ~keep] = float("-inf")
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V)[None].to(torch.int32) if out else torch.zeros(1, V, dtype=torch.int32)
        pmask = torch.zeros(1, V, dtype=torch.bool)
        if rep_prompt:
            pmask[0, prompt] = True
        logits = ref.apply_penalties(logits, counts, pmask, torch.tensor([freq]), torch.tensor([pres]), torch.tensor([rep]))
        if len(out) < min_new:
            logits[0, list(eos)] = float("-inf")
        tok = int(logits.argmax())
        lps.append(torch.log_softmax(logits, -1)[0])
        out.append(tok)
        ids.append(tok)
    return out, lps


def test_penalties_and_min_new_tokens_match_reference(engine, hf_model):
    # repetition_penalty_counts_prompt: vLLM's repetition penalty (prompt and output tokens); the
    # engine's own is SGLang's (output tokens only).
    cases = [
        dict(frequency_penalty=1.5, presence_penalty=0.0, repetition_penalty=1.0),
        dict(frequency_penalty=0.0, presence_penalty=1.2, repetition_penalty=1.3),
        dict(frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=0.8),
        dict(frequency_penalty=0.0, presence_penalty=1.2, repetition_penalty=1.3, repetition_penalty_counts_prompt=True),
        dict(frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=0.8, repetition_penalty_counts_prompt=True),
    ]
    # Each prompt ends in its own greedy continuation: the tokens the model would repeat are in
    # the prompt, so the two repetition rules draw different tokens.
    bases = [_prompt(20 + 7 * i, i) for i in (2, 1, 0, 4, 5)]
    prompts = [base + reference_greedy(hf_model, base, 8)[0] for base in bases]
    params = [engine.parse_params({"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, **c}) for c in cases]
    outs = engine.generate(prompts, params)  # one batch, each row with its own penalties
    for prompt, c, out in zip(prompts, cases, outs):
        want, _ = reference_greedy(hf_model, prompt, 12, freq=c["frequency_penalty"], pres=c["presence_penalty"],
                                   rep=c["repetition_penalty"], rep_prompt=c.get("repetition_penalty_counts_prompt", False))
        assert out.new_token_ids == want, c
        other, _ = reference_greedy(hf_model, prompt, 12, freq=c["frequency_penalty"], pres=c["presence_penalty"],
                                    rep=c["repetition_penalty"], rep_prompt=not c.get("repetition_penalty_counts_prompt", False))
        if c["repetition_penalty"] != 1.0:
            assert other != want, f"the two rules draw the same tokens for {c}: the case proves nothing"

    # min_new_tokens: EOS is masked until reached, then allowed again.
    eos = sorted(engine.eos_ids)
    prompt = _prompt(10, 9)
    p = engine.parse_params({"temperature": 0, "max_new_tokens": 8, "min_new_tokens": 8, "repetition_penalty": 1.0,
                             "custom_logit_processor": None})
    (out,) = engine.generate([prompt], [p])
    want, _ = reference_greedy(hf_model, prompt, 8, min_new=8, eos=eos)
    assert out.new_token_ids == want and out.completion_tokens == 8


def test_logit_bias_and_allowed_token_ids_match_reference(engine, hf_model):
    prompts = [_prompt(16 + 5 * i, 40 + i) for i in range(4)]
    base = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "repetition_penalty": 1.1}
    plain, _ = reference_greedy(hf_model, prompts[0], 10, rep=1.1)
    # Push the plain output's favourites down and two others up; restrict a row to a few ids.
    bias = {plain[0]: -100.0, plain[1]: -5.0, 7: 3.0, 1234: 4.5}
    allowed = sorted({plain[2], plain[3], 11, 300, 2048})
    cases = [{"logit_bias": {str(k): v for k, v in bias.items()}}, {"allowed_token_ids": allowed},
             {"logit_bias": {"7": 100}}, {}]
    params = [engine.parse_params({**base, **c}) for c in cases]
    outs = engine.generate(prompts, params)  # one batch: rows with and without their own edits
    assert outs[0].new_token_ids == reference_greedy(hf_model, prompts[0], 10, rep=1.1, bias=bias)[0]
    assert outs[0].new_token_ids != plain
    assert outs[1].new_token_ids == reference_greedy(hf_model, prompts[1], 10, rep=1.1, allowed=allowed)[0]
    assert set(outs[1].new_token_ids) <= set(allowed)
    assert outs[2].new_token_ids == [7] * 10
    assert outs[3].new_token_ids == reference_greedy(hf_model, prompts[3], 10, rep=1.1)[0]

    # Sampled rows keep to allowed_token_ids too.
    sampled = engine.parse_params({"temperature": 1.0, "top_k": -1, "top_p": 1.0, "max_new_tokens": 40, "seed": 1,
                                   "ignore_eos": True, "allowed_token_ids": [3, 5, 8, 13]})
    (out,) = engine.generate([prompts[0]], [sampled])
    assert set(out.new_token_ids) <= {3, 5, 8, 13} and len(set(out.new_token_ids)) > 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    prompt = _prompt(50, 12)
    base = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    cut, tail = engine.generate([prompt, prompt[-10:]], [engine.parse_params({**base, "truncate_prompt_tokens": 10}),
                                                          engine.parse_params(base)])
    assert cut.prompt_tokens == 10 and cut.new_token_ids == tail.new_token_ids
    (whole,) = engine.generate([prompt], [engine.parse_params({**base, "truncate_prompt_tokens": 500})])
    assert whole.prompt_tokens == 50
    with pytest.raises(Exception, match="truncate_prompt_tokens must be >= 1"):
        engine.parse_params({"truncate_prompt_tokens": 0})


def test_logit_bias_and_allowed_token_ids_are_validated(engine):
    for raw, message in [
        ({"logit_bias": {"5": 101}}, "logit_bias values"),
        ({"logit_bias": {"-1": 1}}, "logit_bias keys"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [-3]}, "allowed_token_ids"),
    ]:
        with pytest.raises(Exception, match=message):
            engine.parse_params(raw)
    for raw in ({"logit_bias": {"4096": 1}}, {"allowed_token_ids": [1, 4096]}, {"stop_token_ids": [99999]}):
        with pytest.raises(RequestError, match="vocabulary size"):
            engine.add_request([1, 2, 3], engine.parse_params(raw), lambda out: None)


@pytest.mark.parametrize("mode", ["processed", "raw_logprobs"])
def test_logprobs_mode_picks_the_distribution_reported(demo_model_path, hf_model, mode):
    """processed (SGLang's): the drawn-from distribution, after penalties, logit_bias and
    temperature; raw_logprobs (vLLM's default): the model's own, whatever the request asks.
    SGLang's repetition_penalty counts output tokens only: the prompt ends with the tokens the
    model finds most likely next, so a penalty that counted it would show (QA: random prompt
    tokens carried too little probability to tell the two rules apart)."""
    base = _prompt(20, 4)
    with torch.inference_mode():
        likely = hf_model(torch.tensor([base])).logits[0, -1].float().topk(8).indices.tolist()
    prompt = base + likely
    eng = make_engine(demo_model_path, logprobs_mode=mode)
    try:
        p = eng.parse_params({"temperature": 0.5, "seed": 3, "max_new_tokens": 5, "ignore_eos": True,
                              "repetition_penalty": 1.3, "logit_bias": {"7": 5.0}, "return_logprob": True,
                              "top_logprobs_num": 2})
        (out,) = eng.generate([prompt], [p])
    finally:
        eng.shutdown()
    def processed(logits: torch.Tensor, seen_ids: list[int]) -> torch.Tensor:
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[seen_ids] = True
        logits = logits.clone()
        logits[7] += 5.0
        return torch.log_softmax(torch.where(seen, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits) / 0.5, -1)

    ids = list(prompt)
    rules_differ = 0.0
    with torch.inference_mode():
        for (lp, tok, _), top in zip(out.logprobs["output_token_logprobs"], out.logprobs["output_top_logprobs"]):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
            want = torch.log_softmax(logits, -1)
            if mode == "processed":
                want = processed(logits, ids[len(prompt):])
                rules_differ = max(rules_differ, abs(float(processed(logits, ids)[tok]) - float(want[tok])))
            assert math.isclose(lp, float(want[tok]), abs_tol=1e-4), (mode, lp, float(want[tok]))
            assert [t for _, t, _ in top] == want.topk(2).indices.tolist()
            ids.append(tok)
    if mode == "processed":
        assert rules_differ > 1e-3  # 10 x the tolerance: the test can tell a penalty that counted the prompt


def test_output_and_prompt_logprobs_match_hf(engine, hf_model):
    prompt = _prompt(30, 3)
    p = engine.parse_params({
        "temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.0,
        "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [5, 17], "logprob_start_len": 2,
    })
    (out,) = engine.generate([prompt], [p])
    want, lps = reference_greedy(hf_model, prompt, 6)
    assert out.new_token_ids == want
    got = out.logprobs["output_token_logprobs"]
    assert [t for _, t, _ in got] == want
    for (lp, tok, _), ref_lp, top in zip(got, lps, out.logprobs["output_top_logprobs"]):
        assert math.isclose(lp, float(ref_lp[tok]), abs_tol=1e-4)
        ref_top = ref_lp.topk(3)
        assert [t for _, t, _ in top] == ref_top.indices.tolist()
    for entry, ref_lp in zip(out.logprobs["output_token_ids_logprobs"], lps):
        assert [t for _, t, _ in entry] == [5, 17]
        assert all(math.isclose(lp, float(ref_lp[t]), abs_tol=1e-4) for lp, t, _ in entry)
    # Prompt logprobs from position 2: token t's logprob given tokens < t. As SGLang, the entry
    # of token 2 itself has none (QA s19_sampling: it had one, and a sum over the entries
    # counted one token more than SGLang's).
    with torch.inference_mode():
        full = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    inp = out.logprobs["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[2:]
    assert inp[0][0] is None and out.logprobs["input_top_logprobs"][0] is None
    for (lp, tok, _), pos in zip(inp[1:], range(3, len(prompt))):
        assert math.isclose(lp, float(full[pos - 1, tok]), abs_tol=1e-4)
    assert len(out.logprobs["input_top_logprobs"]) == len(inp)
    # The default, -1: SGLang starts at the last prompt token, so one entry, without a logprob.
    p = engine.parse_params({"temperature": 0, "max_new_tokens": 2, "return_logprob": True, "top_logprobs_num": 2})
    (out,) = engine.generate([prompt], [p])
    assert out.logprobs["input_token_logprobs"] == [[None, prompt[-1], None]]
    assert out.logprobs["input_top_logprobs"] == [None] and out.cached_tokens is not None


def test_max_new_tokens_0_scores_the_prompt(engine, hf_model):
    # SGLang's scoring request (and the frontend's echo + logprobs with max_tokens 0): the prompt
    # is prefilled for its logprobs, nothing is sampled.
    prompt = _prompt(40, 6)  # more than one 16-token block, in chunks under a small budget too
    p = engine.parse_params({"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0,
                             "top_logprobs_num": 2})
    (out,) = engine.generate([prompt], [p])
    assert out.finish_reason == "length" and out.completion_tokens == 0 and out.new_token_ids == []
    inp = out.logprobs["input_token_logprobs"]
    assert inp[0] == [None, prompt[0], None] and out.logprobs["input_top_logprobs"][0] is None
    with torch.inference_mode():
        full = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert [t for _, t, _ in inp] == prompt
    ranks = out.logprobs["input_token_ranks"]
    assert ranks[0] is None
    for pos in range(1, len(prompt)):
        assert math.isclose(inp[pos][0], float(full[pos - 1, prompt[pos]]), abs_tol=1e-4)
        assert [t for _, t, _ in out.logprobs["input_top_logprobs"][pos]] == full[pos - 1].topk(2).indices.tolist()
        assert ranks[pos] == 1 + int((full[pos - 1] > full[pos - 1, prompt[pos]]).sum())
    # A one-token prompt has no logits rows of its own, and still reports its token (with None).
    for max_new in (0, 2):
        one_p = {"max_new_tokens": max_new, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
        (one,) = engine.generate([prompt[:1]], [engine.parse_params(one_p)])
        assert one.logprobs["input_token_logprobs"] == [[None, prompt[0], None]]
        assert one.logprobs["input_top_logprobs"] == [None] and one.logprobs["input_token_ranks"] == [None]
        assert len(one.logprobs.get("output_token_logprobs", [])) == max_new
    # A prompt that fills the context can be scored (QA: refused, "at least one must be left").
    full_prompt = _prompt(engine.max_model_len, 8)
    (out,) = engine.generate([full_prompt], [p])
    assert out.error is None and len(out.logprobs["input_token_logprobs"]) == engine.max_model_len
    assert out.logprobs["input_token_logprobs"][-1][0] is not None
    with pytest.raises(RequestError, match="at least one must be left"):
        engine.add_request(full_prompt, engine.parse_params({"max_new_tokens": 1}), lambda out: None)
    # Without prompt logprobs, max_new_tokens 0 ends at once, without running the prompt.
    steps = engine.stats().num_steps
    (out,) = engine.generate([prompt], [engine.parse_params({"max_new_tokens": 0})])
    assert out.finish_reason == "length" and engine.stats().num_steps == steps


def test_impossible_tokens_report_a_finite_logprob_floor(engine):
    # allowed_token_ids leaves one token: every other one is -inf, which JSON cannot carry
    # (Python writes -Infinity; strict parsers reject it). They are reported at the floor.
    import json

    from backend.sampler import LOGPROB_FLOOR

    p = engine.parse_params({"max_new_tokens": 3, "temperature": 0.7, "seed": 1, "allowed_token_ids": [300],
                             "return_logprob": True, "top_logprobs_num": 3, "token_ids_logprob": [301],
                             "ignore_eos": True})
    (out,) = engine.generate([_prompt(8, 1)], [p])
    assert out.new_token_ids == [300] * 3
    lps = out.logprobs
    for (lp, token, _), top, asked in zip(lps["output_token_logprobs"], lps["output_top_logprobs"],
                                          lps["output_token_ids_logprobs"]):
        assert (lp, token) == (0.0, 300) and top[0][:2] == [0.0, 300]
        assert [e[0] for e in top[1:]] == [LOGPROB_FLOOR] * 2 and asked[0][:2] == [LOGPROB_FLOOR, 301]
    json.dumps(lps, allow_nan=False)


def test_a_stop_string_in_the_text_flushed_at_the_end_still_stops(engine):
    # The last token ends inside a character: its text (U+FFFD) is held back until the
    # sequence ends, and the stop strings must see it (QA: "ab \ufffd" came out, stop " " unseen).
    ids = engine.tokenizer.encode("Hi", add_special_tokens=False)
    params = engine.parse_params({"max_new_tokens": 2, "temperature": 0, "regex": "ab 😀", "stop": [" "]})
    (out,) = engine.generate([ids], [params])
    assert engine.tokenizer.decode(out.new_token_ids) == "ab \ufffd"  # the cut is inside the emoji
    assert (out.text, out.finish_reason, out.stop_reason) == ("ab", "stop", " ")


def test_a_stop_string_that_is_a_special_token_stops_where_the_text_skips_it(engine):
    # QA: stop ["<|im_start|>"] never matched under skip_special_tokens (the default): the text
    # never shows the token. It is matched on the token, as its text would be without skipping.
    tok = engine.tokenizer
    (special,) = tok.encode("<|im_start|>", add_special_tokens=False)
    ids = tok.encode("Hi", add_special_tokens=False)
    for skip in (True, False):
        for keep in ({}, {"no_stop_trim": True}, {"include_stop_str_in_output": True}):
            params = engine.parse_params({"max_new_tokens": 4, "temperature": 0, "logit_bias": {str(special): 100},
                                          "stop": ["zz", "<|im_start|>"], "skip_special_tokens": skip, **keep})
            (out,) = engine.generate([ids], [params])
            assert (out.new_token_ids, out.finish_reason, out.stop_reason) == ([special], "stop", "<|im_start|>")
            assert out.text == ("<|im_start|>" if keep and not skip else "")
    # Under vLLM's min_tokens it waits, as any stop string does; SGLang's min_new_tokens does not hold it.
    params = engine.parse_params({"max_new_tokens": 4, "temperature": 0, "logit_bias": {str(special): 100},
                                  "stop": ["<|im_start|>"], "min_tokens": 2})
    (out,) = engine.generate([ids], [params])
    assert (out.new_token_ids, out.finish_reason) == ([special] * 3, "stop")
    params = engine.parse_params({"max_new_tokens": 4, "temperature": 0, "logit_bias": {str(special): 100},
                                  "stop": ["<|im_start|>"], "min_new_tokens": 2})
    (out,) = engine.generate([ids], [params])
    assert (out.new_token_ids, out.finish_reason) == ([special], "stop")
    # Text that spells a special token without being it is no special stop.
    assert engine._special_stops(engine.parse_params({"stop": ["<|im_start|>x", "<|im_start"]})) == {}


def test_a_minimum_past_the_contexts_room_is_refused(engine):
    # QA: with max_tokens null the limit is the context's room, and min_tokens past it was
    # silently cut to it; vLLM refuses it, as it refuses one past an explicit max_tokens.
    prompt = _prompt(engine.max_model_len - 6, 1)
    for params in ({"max_new_tokens": None, "min_tokens": 50}, {"min_new_tokens": 7}):
        with pytest.raises(RequestError, match=r"must be at most 6: the context is \d+ tokens and the prompt has"):
            engine.add_request(prompt, engine.parse_params(params), lambda out: None)
    with pytest.raises(Exception, match="give min_new_tokens .* or min_tokens .*, not both"):
        engine.parse_params({"min_new_tokens": 1, "min_tokens": 1})


def test_min_new_tokens_never_leaves_a_row_with_nothing_to_draw(engine):
    # A row where every token is masked would draw token 0 with a NaN logprob (invalid JSON).
    import json

    eos = sorted(engine.eos_ids)
    # allowed_token_ids that only an end token satisfies, under min_new_tokens: refused up front
    with pytest.raises(RequestError, match="allowed_token_ids holds only stop/EOS tokens"):
        engine.add_request([1, 2, 3], engine.parse_params({"min_new_tokens": 2, "allowed_token_ids": eos[:1]}),
                           lambda out: None)
    with pytest.raises(RequestError, match="only stop/EOS"):
        engine.add_request([1, 2, 3], engine.parse_params({"min_new_tokens": 2, "allowed_token_ids": [7],
                                                           "stop_token_ids": [7]}), lambda out: None)
    # A grammar that is done before min_new_tokens: its end (EOS) wins, as the constraint is hard.
    for temperature in (0.0, 0.8):
        p = engine.parse_params({"max_new_tokens": 20, "min_new_tokens": 5, "regex": "a", "temperature": temperature,
                                 "seed": 3, "return_logprob": True, "top_logprobs_num": 2})
        (out,) = engine.generate([_prompt(8, 2)], [p])
        assert out.error is None and out.finish_reason is not None
        assert engine.tokenizer.decode(out.new_token_ids, skip_special_tokens=True) == "a"
        assert out.new_token_ids[-1] in engine.eos_ids
        json.dumps(out.logprobs, allow_nan=False)
    # Two hard constraints that exclude each other: the request ends with the reason.
    p = engine.parse_params({"max_new_tokens": 5, "regex": "yes", "allowed_token_ids": [7], "temperature": 0})
    (out,) = engine.generate([_prompt(8, 2)], [p])
    assert out.new_token_ids == [] and "no token can be drawn" in out.error


def test_prompt_logprobs_survive_preemption_mid_prompt(demo_model_path, engine):
    # A scored prompt prefilled in chunks next to decoding sequences that outgrow a small pool:
    # it is preempted part-way, computed again, and reports each position once, as alone.
    scored = _prompt(60, 20)
    p = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0}
    (ref,) = engine.generate([scored], [engine.parse_params(p)])
    small = make_engine(demo_model_path, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=32)
    try:
        gen = small.parse_params({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        outs = small.generate([_prompt(20, 21 + i) for i in range(3)] + [scored], [gen] * 3 + [small.parse_params(p)])
        assert outs[3].num_preemptions > 0
        lps, want = outs[3].logprobs["input_token_logprobs"], ref.logprobs["input_token_logprobs"]
        assert [t for _, t, _ in lps] == [t for _, t, _ in want] == scored
        assert lps[0][0] is None and all(math.isclose(a[0], b[0], abs_tol=1e-4) for a, b in zip(lps[1:], want[1:]))
        assert len(outs[3].logprobs["input_token_ranks"]) == len(scored)
        assert small.block_manager.num_free_blocks == small.block_manager.num_blocks
    finally:
        small.shutdown()


def test_sampled_logprobs_are_after_temperature_and_text_can_be_returned(engine, hf_model):
    prompt = _prompt(12, 4)
    p = engine.parse_params({"temperature": 0.7, "seed": 11, "max_new_tokens": 5, "ignore_eos": True,
                             "repetition_penalty": 1.0, "return_logprob": True, "return_text_in_logprobs": True})
    (out,) = engine.generate([prompt], [p])
    ids = prompt + out.new_token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    for i, (lp, tok, text) in enumerate(out.logprobs["output_token_logprobs"]):
        ref_lp = torch.log_softmax(logits[len(prompt) - 1 + i] / 0.7, -1)[tok]
        assert math.isclose(lp, float(ref_lp), abs_tol=1e-4)
        assert text == engine.tokenizer.decode([tok], skip_special_tokens=False)


def test_n_samples_share_prompt_blocks_and_are_reproducible(demo_model_path, hf_model):
    eng = make_engine(demo_model_path)
    try:
        prompt = _prompt(70, 5)  # 4 full blocks of 16
        p = eng.parse_params({"temperature": 1.0, "seed": 123, "n": 3, "max_new_tokens": 10, "ignore_eos": True})
        outs = eng.generate([prompt], [p])
        assert [o.index for o in outs] == [0, 1, 2]
        assert len({tuple(o.new_token_ids) for o in outs}) > 1  # different samples
        assert [o.cached_tokens for o in outs] == [0, 64, 64]  # siblings reuse the prompt's blocks
        again = eng.generate([prompt], [p])
        assert [o.new_token_ids for o in again] == [o.new_token_ids for o in outs]
        # n greedy samples are all the greedy output.
        g = eng.parse_params({"temperature": 0, "n": 2, "max_new_tokens": 8, "ignore_eos": True, "repetition_penalty": 1.0})
        outs = eng.generate([prompt], [g])
        want, _ = reference_greedy(hf_model, prompt, 8)
        assert [o.new_token_ids for o in outs] == [want, want]
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_prefix_caching_gives_identical_outputs(demo_model_path):
    shared = _prompt(100, 6)
    prompts = [shared + _prompt(5 + i, 100 + i) for i in range(4)]
    results = {}
    for caching in (False, True):
        eng = make_engine(demo_model_path, enable_prefix_caching=caching)
        try:
            p = eng.parse_params({"temperature": 0.8, "seed": 7, "max_new_tokens": 10, "ignore_eos": True})
            first = eng.generate(prompts[:1], [p])
            rest = eng.generate(prompts[1:], [p] * 3)
            results[caching] = [o.new_token_ids for o in first + rest]
            cached = [o.cached_tokens for o in first + rest]
            if caching:
                assert cached[0] == 0 and all(c == 96 for c in cached[1:])
                stats = eng.stats()
                assert stats.prefix_cache_hits == 3 * 96 and stats.prefix_cache_queries == sum(map(len, prompts))
            else:
                assert cached == [0, 0, 0, 0]
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        finally:
            eng.shutdown()
    assert results[True] == results[False]


def test_cache_salt_shares_cached_blocks_only_between_requests_with_the_same_salt(engine):
    """vLLM's cache_salt: a prompt sent under another salt (or none) finds nothing cached, so
    a tenant cannot learn by timing which prompts another sent; the outputs do not change."""
    prompt = _prompt(70, 31)  # 4 full blocks of 16

    def run(salt=None):
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        if salt is not None:
            params["cache_salt"] = salt
        (out,) = engine.generate([prompt], [engine.parse_params(params)])
        return out.cached_tokens, out.new_token_ids

    engine.block_manager.reset_prefix_cache()  # the engine steps only inside generate()
    (cold, want), (warm, same) = run("tenant-a"), run("tenant-a")
    assert (cold, warm) == (0, 64) and same == want
    assert run("tenant-b") == (0, want)
    assert run() == (0, want)  # no salt is a cache of its own too
    assert run() == (64, want)
    assert run("tenant-b") == (64, want)
    for bad in ("", 7):
        with pytest.raises(SamplingParamsError, match="cache_salt"):
            engine.parse_params({"cache_salt": bad})


def test_return_prompt_token_ids_comes_once_per_sample(engine):
    prompt = _prompt(20, 32)
    p = engine.parse_params({"temperature": 0, "max_new_tokens": 3, "ignore_eos": True, "n": 2,
                             "return_prompt_token_ids": True, "truncate_prompt_tokens": 15})
    streamed: list = []
    engine.add_request(prompt, p, streamed.append)
    while engine.has_unfinished():
        engine.step()
    by_sample = {i: [o for o in streamed if o.index == i] for i in (0, 1)}
    for outs in by_sample.values():  # the ids the model saw (truncated), on the first output only
        assert outs[0].prompt_token_ids == prompt[-15:] and all(o.prompt_token_ids is None for o in outs[1:])
        merged = outs[0]
        for o in outs[1:]:
            merged = merged.merge(o)
        assert merged.prompt_token_ids == prompt[-15:]
    (plain,) = engine.generate([prompt], [engine.parse_params({"max_new_tokens": 2})])
    assert plain.prompt_token_ids is None


def _contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[k:k + len(word)] == word for k in range(len(ids) - len(word) + 1))


def test_bad_words_are_never_completed_and_change_nothing_before(engine):
    """vLLM's bad_words: the greedy output equals the unconstrained one up to where that one
    completed a bad word, and then never completes one; a multi-token word's first token alone
    stays allowed."""
    tok = engine.tokenizer
    prompt = _prompt(12, 33)
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, "repetition_penalty": 1.0}
    (base,) = engine.generate([prompt], [engine.parse_params(greedy)])
    ids = base.new_token_ids
    # a two-token word the model wrote, spelled so that it tokenizes back into those two tokens
    k = next(k for k in range(2, len(ids) - 1)
             if tok.encode(tok.decode(ids[k:k + 2]), add_special_tokens=False) == ids[k:k + 2]
             and tok.decode(ids[k:k + 2]).strip())
    two = tok.decode(ids[k:k + 2])
    one = tok.decode([ids[1]])
    for words, first in (([two], k + 1), ([one], 1)):
        p = engine.parse_params({**greedy, "bad_words": words})
        (out,) = engine.generate([prompt], [p])
        got = out.new_token_ids
        assert got[:first] == ids[:first] and got[first] != ids[first], (words, got, ids)
        assert p.bad_word_ids and not any(_contains(got, w) for w in p.bad_word_ids), (words, p.bad_word_ids)
    with pytest.raises(SamplingParamsError, match="bad_words"):
        engine.parse_params({"bad_words": [" "]})


def test_n_samples_of_a_grammar_request_never_wait_on_each_other(engine, monkeypatch):
    """Fuzz QA: the n samples share one grammar future; a compile that ended between the engine's
    looks at sample 0 and sample 1 queued sample 1 (which waits for sample 0's prompt blocks)
    ahead of sample 0, and the FCFS queue stopped at it for good."""
    from concurrent.futures import Future

    class EndsBetweenLooks(Future):
        def __init__(self, inner: Future) -> None:
            super().__init__()
            self.inner, self.looks = inner, 0

        def done(self) -> bool:  # not done at the first look, done from the second on
            self.looks += 1
            return self.looks > 1 and self.inner.done()

        def result(self, timeout=None):
            return self.inner.result(timeout)

    submit = engine._submit_grammar

    def flipping(params):
        inner = submit(params)
        inner.result(timeout=60)
        return EndsBetweenLooks(inner)

    monkeypatch.setattr(engine, "_submit_grammar", flipping)
    p = engine.parse_params({"max_new_tokens": 4, "temperature": 0, "n": 2, "regex": "[a-z ]{1,30}"})
    outs: list = []
    engine.add_request(_prompt(40, 34), p, outs.append)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), [(q.request_id, q.wait_for and q.wait_for.request_id)
                                         for q in engine.scheduler.waiting]
    assert sorted({o.index for o in outs if o.finish_reason}) == [0, 1]


def test_stop_regex_trims_and_streams_the_same(engine):
    prompt = _prompt(15, 8)
    base = engine.parse_params({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
    (full,) = engine.generate([prompt], [base])
    text = full.text
    assert len(text) > 12
    # A regex that first matches in the middle of the output, across tokens.
    target = text[8:12]
    pattern = "".join("\\" + c if not c.isalnum() else c for c in target)
    p = engine.parse_params({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True, "stop_regex": [pattern]})
    pieces = []
    engine.start()
    try:
        done = __import__("threading").Event()

        def on_out(out):
            pieces.append(out)
            if out.finished:
                done.set()

        engine.add_request(prompt, p, on_out)
        assert done.wait(60)
    finally:
        engine.shutdown()
    streamed = "".join(o.text for o in pieces)
    final = pieces[-1]
    # The finish reason names the pattern, as SGLang's FINISHED_MATCHED_REGEX(matched=pattern).
    assert final.finish_reason == "stop" and final.stop_reason == pattern
    assert streamed == text[: text.index(target)]
    with pytest.raises(Exception, match="stop_regex"):
        engine.parse_params({"stop_regex": ["("]})


class ForceToken(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list):
            logits[i, :] = float("-inf")
            logits[i, params["token_id"]] = 0.0
        return logits


class ForceOutputLength(CustomLogitProcessor):
    """Reads SGLang's `__req__`: forces token 100 + the output's length so far, while the prompt it
    sees is the one given in custom_params (else token 0)."""

    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list):
            req = params["__req__"]
            logits[i, :] = float("-inf")
            ok = list(req.origin_input_ids) == params["prompt"]
            logits[i, 100 + len(req.output_ids) if ok else 0] = 0.0
        return logits


def test_custom_logit_processors_see_the_request_as_in_sglang(demo_model_path):
    # SGLang passes each row's Req as custom_params["__req__"]; its thinking-budget and n-gram
    # processors read origin_input_ids and output_ids (QA: they failed here, no such key).
    eng = make_engine(demo_model_path, enable_custom_logit_processor=True)
    try:
        p = eng.parse_params({"temperature": 0, "max_new_tokens": 6, "ignore_eos": True,
                              "custom_logit_processor": ForceOutputLength.to_str(),
                              "custom_params": {"prompt": [5, 6, 7]}})
        (out,) = eng.generate([[5, 6, 7]], [p])
        assert out.new_token_ids == [100, 101, 102, 103, 104, 105] and out.error is None
    finally:
        eng.shutdown()


def test_custom_logit_processor_needs_the_flag(demo_model_path, engine):
    serialized = ForceToken.to_str()
    with pytest.raises(RequestError, match="disabled"):
        engine.add_request([1, 2, 3], engine.parse_params({"custom_logit_processor": serialized}), lambda o: None)
    eng = make_engine(demo_model_path, enable_custom_logit_processor=True)
    try:
        p = eng.parse_params({"temperature": 0, "max_new_tokens": 5, "ignore_eos": True,
                              "custom_logit_processor": serialized, "custom_params": {"token_id": 42}})
        plain = eng.parse_params({"temperature": 0, "max_new_tokens": 5, "ignore_eos": True})
        forced, free = eng.generate([[5, 6, 7], [5, 6, 7]], [p, plain])
        assert forced.new_token_ids == [42] * 5 and free.new_token_ids != [42] * 5
        # Without custom_params the processor raises (KeyError): only its own request fails.
        broken = eng.parse_params({"temperature": 0, "max_new_tokens": 5, "ignore_eos": True,
                                   "custom_logit_processor": serialized})
        failed, ok = eng.generate([[5, 6, 7], [5, 6, 7]], [broken, plain])
        assert failed.finish_reason == "abort" and "custom_logit_processor failed: KeyError" in failed.error
        assert ok.new_token_ids == free.new_token_ids and ok.error is None
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        with pytest.raises(RequestError, match="to_str"):
            eng.add_request([1], eng.parse_params({"custom_logit_processor": "not json"}), lambda o: None)
    finally:
        eng.shutdown()


def test_a_processor_that_unmasks_a_grammar_token_is_the_requests_error(demo_model_path):
    # The processor runs after the grammar's mask (as in SGLang); forcing a masked token ends
    # the request as the request's fault (QA: "internal error", a 500), the pool free.
    pytest.importorskip("xgrammar")
    eng = make_engine(demo_model_path, enable_custom_logit_processor=True)
    try:
        digit = eng.tokenizer.encode("7", add_special_tokens=False)[0]
        letter = eng.tokenizer.encode("x", add_special_tokens=False)[0]
        p = eng.parse_params({"temperature": 0, "max_new_tokens": 5, "regex": "[0-9]+",
                              "custom_logit_processor": ForceToken.to_str(), "custom_params": {"token_id": letter}})
        (out,) = eng.generate([[5, 6, 7]], [p])
        assert out.finish_reason == "abort" and out.error_code == "invalid_arg"
        assert out.error.startswith(f"custom_logit_processor: token {letter} was drawn after it raised")
        ok = eng.parse_params({"temperature": 0, "max_new_tokens": 3, "regex": "[0-9]+",
                               "custom_logit_processor": ForceToken.to_str(), "custom_params": {"token_id": digit}})
        (out,) = eng.generate([[5, 6, 7]], [ok])
        assert out.error is None and out.new_token_ids == [digit] * 3
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_no_tokens_asked_still_refuses_an_invalid_grammar(demo_model_path):
    # fuzz QA: max_new_tokens 0 ended the request before its grammar compiled, as a success.
    pytest.importorskip("xgrammar")
    eng = make_engine(demo_model_path)  # the module's engine has been shut down by an earlier test
    try:
        for grammar, error in (({"regex": "(ab"}, "invalid regex"), ({"regex": "[0-9]+"}, None)):
            (out,) = eng.generate([[5, 6, 7]], [eng.parse_params({"max_new_tokens": 0, **grammar})])
            assert (out.error or "").startswith(error or "") and (out.error is None) == (error is None)
            assert out.finish_reason == ("abort" if error else "length") and out.new_token_ids == []
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_a_grammar_too_ambiguous_to_match_in_time_ends_its_request_only(demo_model_path, monkeypatch):
    # Nested repetitions in EBNF (the regex check cannot see them): every split of a run of
    # spaces is a parse, and the matcher's time grows to seconds a token on the step every
    # request shares (fuzz QA). Past the limit (lowered here to keep the test short) the request
    # ends as its own error; the other request's output is unchanged.
    pytest.importorskip("xgrammar")
    import backend.engine as engine_module

    eng = make_engine(demo_model_path)
    try:
        spaces = eng.tokenizer.encode(" " * 11, add_special_tokens=False)
        assert len(spaces) == 1
        plain = eng.parse_params({"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        (alone,) = eng.generate([[4, 5, 6]], [plain])
        monkeypatch.setattr(engine_module, "MATCH_TIME_LIMIT_S", 0.005)
        nested = eng.parse_params({"temperature": 0, "max_new_tokens": 40, "logit_bias": {str(spaces[0]): 50},
                                   "ebnf": 'root ::= a "x"\na ::= b*\nb ::= c*\nc ::= " "*'})
        t0 = time.monotonic()
        slow, other = eng.generate([[1, 2, 3], [4, 5, 6]], [nested, plain])
        assert slow.finish_reason == "abort" and slow.error_code == "invalid_arg", slow.error
        assert slow.error.startswith("the request's grammar took") and "simplify it" in slow.error
        assert other.new_token_ids == alone.new_token_ids and other.error is None
        assert time.monotonic() - t0 < 30
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


@pytest.mark.parametrize("native", [False, True])
def test_greedy_penalized_argmax_equals_the_full_pass(monkeypatch, native):
    """Greedy rows whose penalties only lower logits take their token from the top candidates
    (Sampler._penalized_argmax; or, on the CPU, from the C++ kernel's one pass over the row);
    it must be the full pass's argmax, ties included, and the full pass must take over when
    the candidates do not settle it."""
    from backend.sampler import Sampler, SamplingRow
    from backend.sampling_params import SamplingParams

    if not native:
        monkeypatch.setenv("LLM_CPU_SAMPLING", "0")  # the torch candidates, as on CUDA
    else:
        from kernels import cpu_sampling

        if cpu_sampling.load() is None:  # a host without a compiler (setup builds it here)
            pytest.skip(f"the C++ CPU sampling kernels are not built: {cpu_sampling.error()}")

    V, B = 64, 6
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    outcomes = []
    orig = Sampler._penalized_argmax
    monkeypatch.setattr(Sampler, "_penalized_argmax",
                        lambda self, lg, rs: outcomes.append(orig(self, lg, rs)) or outcomes[-1])
    for trial in range(150):
        logits = torch.randn(B, V, generator=gen)
        if trial % 3 == 0:
            logits = (logits * 2).round()  # many ties
        sampler, rows, want = Sampler(V), [], []
        for b in range(B):
            params = SamplingParams(temperature=0, repetition_penalty=rng.choice([1.0, 1.05, 1.5, 2.0]),
                                    frequency_penalty=rng.choice([0.0, 0.0, 0.7]), presence_penalty=rng.choice([0.0, 1.0]),
                                    repetition_penalty_counts_prompt=rng.random() < 0.5)
            prompt = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
            output = [rng.randrange(V) for _ in range(rng.randint(0, 30))]
            rows.append(SamplingRow(params=params, seed=0, step=len(output), seq_id=b, num_prompt_tokens=len(prompt),
                                    token_ids=prompt + output if params.has_penalties else ()))
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).to(torch.int32)[None]
            pmask = (torch.bincount(torch.tensor(prompt), minlength=V) > 0)[None] & params.repetition_penalty_counts_prompt
            penalized = ref.apply_penalties(logits[b : b + 1].clone(), counts, pmask, torch.tensor([params.frequency_penalty]),
                                            torch.tensor([params.presence_penalty]), torch.tensor([params.repetition_penalty]))
            want.append(int(penalized.argmax()))
        assert sampler(logits, rows).token_ids == want, trial
    taken = sum(o is not None for o in outcomes)
    if native:
        assert taken == len(outcomes)  # one pass over the whole row always settles it
    else:
        assert taken > len(outcomes) // 2 and taken < len(outcomes)  # mostly settled, sometimes the full pass


def test_token_counts_stay_equal_to_a_full_recount():
    """Penalty counts are kept incrementally (only new tokens scattered each step); slots are
    reused after release and grown past their initial size."""
    from backend.sampler import SamplingRow, TokenCounts
    from backend.sampling_params import SamplingParams

    V = 50
    counts = TokenCounts(V)
    rng = random.Random(3)
    # Even sequences count their prompt for the repetition penalty (vLLM's), odd ones do not (SGLang's).
    vllm, sglang = SamplingParams(repetition_penalty_counts_prompt=True), SamplingParams()
    seqs = {i: ([rng.randrange(V) for _ in range(rng.randint(1, 9))], []) for i in range(20)}
    for step in range(12):
        live = [i for i in seqs if (i + step) % 5]  # not every sequence samples every step
        for i in live:
            seqs[i][1].extend(rng.randrange(V) for _ in range(rng.choice([1, 1, 3])))
        rows = [SamplingRow(params=sglang if i % 2 else vllm, seed=0, step=0, seq_id=i,
                            token_ids=seqs[i][0] + seqs[i][1], num_prompt_tokens=len(seqs[i][0])) for i in live]
        got_counts, got_prompt = counts.rows(rows, torch.device("cpu"))
        slots = counts.update(rows, torch.device("cpu")).tolist()  # nothing new: just their slots
        for r, i in enumerate(live):
            want = torch.bincount(torch.tensor(seqs[i][1], dtype=torch.long), minlength=V).to(torch.int32)
            assert torch.equal(got_counts[r], want)
            prompt = seqs[i][0] if i % 2 == 0 else []
            assert torch.equal(got_prompt[r], torch.bincount(torch.tensor(prompt, dtype=torch.long), minlength=V) > 0)
            # The slot's seen list (for the C++ penalties' sparse pass): every token with a count
            # or in a counted prompt, once.
            seen = counts.seen[slots[r], : counts.seen_len[slots[r]]].tolist()
            assert len(seen) == len(set(seen))
            assert sorted(seen) == sorted(set(prompt) | set(seqs[i][1]))
        if step == 6:  # finished sequences give their rows back; new ones must start from zero
            for i in list(seqs)[:5]:
                counts.release(i)
                del seqs[i]
            for i in range(100, 105):
                seqs[i] = ([rng.randrange(V)], [])
    assert counts.num_tracked == len(seqs)
    assert counts.counts.shape[0] >= 20
    # A prompt with more distinct tokens than the seen table's width widens it for every slot.
    wide = list(range(0, 3000, 7))
    row = SamplingRow(params=vllm, seed=0, step=0, seq_id=999, token_ids=wide + [5, 5], num_prompt_tokens=len(wide))
    big = TokenCounts(4000)
    (slot,) = big.update([row], torch.device("cpu")).tolist()
    assert sorted(big.seen[slot, : big.seen_len[slot]].tolist()) == sorted(set(wide) | {5})


EXAMPLES = "tests.logits_processor_examples"


def test_logits_processors_by_qualified_name(demo_model_path, engine):
    """vLLM's logits_processors: both signatures, constructor objects, one instance per sample,
    and a processor that fails ends only its own request."""
    with pytest.raises(RequestError, match="invalid parameter 'logits_processors': logits processors are disabled"):
        engine.add_request([1, 2], engine.parse_params({"logits_processors": [f"{EXAMPLES}.ban_previous"]}),
                           lambda o: None)
    eng = make_engine(demo_model_path, logits_processor_pattern=r"tests\.logits_processor_examples\.")
    try:
        greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        prompt = [11, 12, 13, 14]
        replay = eng.parse_params({**greedy, "logits_processors": [f"{EXAMPLES}.replay_prompt"]})
        count = eng.parse_params({**greedy, "temperature": 1.0, "n": 3, "seed": 1,
                                  "logits_processors": [{"qualname": f"{EXAMPLES}.CountUp", "args": [100],
                                                         "kwargs": {"step": 2}}]})
        banned = eng.parse_params({**greedy, "max_new_tokens": 24, "repetition_penalty": 0.5,
                                   "logits_processors": [f"{EXAMPLES}.ban_previous"]})
        # in order: the replay forces the prompt's second 5, then ban_previous removes it
        chained = eng.parse_params({**greedy, "logits_processors": [f"{EXAMPLES}.replay_prompt",
                                                                     f"{EXAMPLES}.ban_previous"]})
        failing = eng.parse_params({**greedy, "logits_processors": [f"{EXAMPLES}.fail_after_two"]})
        outs = eng.generate([prompt, prompt, prompt, [5, 5, 6], prompt], [replay, count, banned, chained, failing])
        assert len(outs) == 7  # one output per sample: count has three
        replayed, counted, banned_out, chained_out, failed = outs[0], outs[1:4], outs[4], outs[5], outs[6]
        assert replayed.new_token_ids == [11, 12, 13, 14, 11, 12]
        for out in counted:  # each sample's own CountUp (a shared one raises on the second sample)
            assert out.error is None and out.new_token_ids == [100, 102, 104, 106, 108, 110]
        seqs = banned_out.new_token_ids
        assert len(seqs) == 24 and all(a != b for a, b in zip(seqs, seqs[1:]))
        assert chained_out.new_token_ids == [5] and "left no token that can be drawn" in chained_out.error
        assert failed.finish_reason == "abort" and "fail_after_two' failed: boom" in failed.error
        assert len(failed.new_token_ids) == 2

        for spec, message in [
            ("os.system", "does not match the server's logits_processor_pattern"),
            (f"{EXAMPLES}.missing", "cannot be loaded"),
            (f"{EXAMPLES}.not_callable", "is not callable"),
            ({"qualname": f"{EXAMPLES}.CountUp", "args": []}, "could not be constructed: TypeError"),
            ({"qualname": f"{EXAMPLES}.CountUp", "argz": []}, "only qualname, args and kwargs"),
        ]:
            with pytest.raises((RequestError, ValueError), match=message):
                eng.add_request([1, 2], eng.parse_params({"logits_processors": [spec]}), lambda o: None)
        bad = eng.generate([prompt], eng.parse_params({**greedy, "logits_processors": [f"{EXAMPLES}.wrong_shape"]}))
        assert "must return a tensor shaped like its input logits" in bad[0].error
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


class ForceIds(CustomLogitProcessor):
    """Forces custom_params["ids"], one per step (SGLang's `__req__` gives the output so far)."""

    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list):
            ids = params["ids"]
            logits[i, :] = float("-inf")
            logits[i, ids[min(len(params["__req__"].output_ids), len(ids) - 1)]] = 0.0
        return logits


def test_a_kept_stop_tokens_own_text_does_not_match_a_stop_string(demo_model_path):
    """QA: with the stop token's text kept (no_stop_trim, include_stop_str_in_output), a stop
    string inside it ("|i" in "<|im_end|>") won: the text was cut inside the token and the stop
    reported was the string. The token is the stop, as vLLM and SGLang check stop tokens first."""
    eng = make_engine(demo_model_path, enable_custom_logit_processor=True)
    try:
        tok = eng.tokenizer
        (im_end,) = tok.encode("<|im_end|>", add_special_tokens=False)
        hello = tok.encode("Hello world", add_special_tokens=False)
        for keep in ({"no_stop_trim": True}, {"include_stop_str_in_output": True}):
            # "|i" inside "<|im_end|>" (EOS); "orl" inside " world" when that token is a stop token
            for stop, stop_ids, ids, last in ((["|i"], {}, hello + [im_end], im_end),
                                              (["orl"], {"stop_token_ids": [hello[-1]]}, hello, hello[-1])):
                p = eng.parse_params({"temperature": 0, "max_new_tokens": 20, "skip_special_tokens": False,
                                      "stop": stop, **keep, **stop_ids,
                                      "custom_logit_processor": ForceIds.to_str(), "custom_params": {"ids": ids}})
                (out,) = eng.generate([[5, 6, 7]], [p])
                assert out.new_token_ids == ids, (keep, stop_ids)
                assert (out.text, out.finish_reason, out.stop_reason) == (tok.decode(ids), "stop", last), (keep, stop_ids)
    finally:
        eng.shutdown()

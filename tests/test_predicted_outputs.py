"""Predicted Outputs (OpenAI's `prediction`): drafts from the text a client expects back.

The output must be the one decoding without a prediction gives, for greedy and seeded sampling
and whatever the prediction holds (the output exactly, an edited copy, something unrelated); a
good prediction must cut the steps; the accepted / rejected prediction tokens each response
reports must be what its steps kept and threw away; and the pool must be free after each test.
The follower is tested on its own, the engine with predictions as token ids (the demo model's
random outputs are rarely the tokenizer's own spelling of their text, which a trained model's
are) and as text, as the frontend sends it.
"""

from __future__ import annotations

import random

import pytest

from backend.engine import LLMEngine, RequestError
from backend.predicted_outputs import Prediction, PredictionProposer
from backend.sampling_params import (MAX_PREDICTION_CHARS, MAX_PREDICTION_TOKENS, SamplingParams, SamplingParamsError,
                                     parse_sampling_params)
from tests.test_speculative import NGRAM, _engine, _prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 96}
SEEDED = {"temperature": 0.8, "top_k": 50, "seed": 11, "ignore_eos": True, "max_new_tokens": 96}


# ---------------------------------------------------------------------------------- follower
def test_the_follower_drafts_what_follows_while_the_output_keeps_to_the_prediction():
    p = PredictionProposer(k=3)
    pred = Prediction([10, 11, 12, 13, 14, 15, 16])
    prompt = [1, 2, 3]
    assert p.propose(0, pred, prompt + [10], 3, limit=9) == [11, 12, 13]
    assert p.propose(0, pred, prompt + [10, 11, 12], 3, limit=9) == [13, 14, 15]
    assert p.propose(0, pred, prompt + [10, 11, 12, 13, 14], 3, limit=1) == [15]  # the limit
    assert p.propose(0, pred, prompt + [10, 11, 12, 13, 14, 15, 16], 3, limit=9) == []  # its end


def test_a_parted_output_drafts_again_where_its_tail_rejoins_the_prediction():
    p = PredictionProposer(k=3)
    pred = Prediction([10, 11, 12, 13, 14, 15, 16, 17])
    out = [10, 11, 99]  # an edit: the output leaves the prediction
    assert p.propose(0, pred, out, 0, limit=9) == []
    out += [98]
    assert p.propose(0, pred, out, 0, limit=9) == []
    out += [14, 15]  # back: "14 15" occurs in the prediction, followed by 16
    assert p.propose(0, pred, out, 0, limit=9) == [16, 17]
    # A deletion: the output skips 12..14 and goes on from 15 (its tail "11 15" occurs nowhere,
    # "15 16" does).
    q = PredictionProposer(k=2)
    assert q.propose(1, pred, [10, 11, 15], 0, limit=9) == []
    assert q.propose(1, pred, [10, 11, 15, 16], 0, limit=9) == [17]


def test_taken_counts_the_prediction_tokens_the_output_took_once_each():
    """OpenAI's accepted_prediction_tokens: output tokens that continued the prediction, and the
    tail that rejoined it after an edit, without the tail's tokens taken before the edit."""
    pred = Prediction([1, 2, 3, 4, 5, 6, 7, 8, 4, 5, 9, 10, 11])
    p = PredictionProposer(k=2)
    prompt = [50, 51]
    out = list(prompt)
    for token in [1, 2, 3, 4, 5, 9, 10, 11, 60]:
        out.append(token)
        taken = p.taken(0, pred, out, len(prompt))
        p.propose(0, pred, out, len(prompt), limit=9)
    # 1..5 followed, 9 parted (the prediction goes on with 6); the tail "4 5 9" rejoins it at 9,
    # whose 4 and 5 were taken already; 10 and 11 followed; 60 is not the prediction's.
    assert taken == p.taken(0, pred, out, len(prompt)) == 5 + 1 + 2
    # Nothing of an unrelated prediction; never more than the prediction holds.
    q = PredictionProposer(k=2)
    assert q.taken(1, Prediction([7, 8]), [50, 1, 2, 3], 1) == 0
    assert q.taken(2, Prediction([1, 2]), [50, 1, 2, 1, 2], 1) == 2


def test_a_rejoin_prefers_the_nearest_occurrence_after_where_the_output_parted():
    # "5 6" occurs three times; the output parted after position 4, so the occurrence ending at 8
    # is taken, not the first (ending at 2) nor the last (ending at 12).
    pred = Prediction([5, 6, 1, 2, 7, 8, 5, 6, 20, 21, 5, 6, 30, 31])
    p = PredictionProposer(k=2)
    assert p.propose(0, pred, [5, 6, 1, 2, 40, 5, 6], 0, limit=9) == [20, 21]
    # Only occurrences before it: the latest of them.
    p = PredictionProposer(k=2)
    assert p.propose(1, pred, [5, 6, 1, 2, 7, 8, 5, 6, 20, 21, 5, 6, 30, 31, 41, 1, 2], 0, limit=9) == [7, 8]


def test_the_rejoin_matches_the_output_not_the_prompt():
    pred = Prediction([7, 8, 9, 10])
    p = PredictionProposer(k=2)
    # The prompt ends with "7 8", the output's first token parts: nothing to rejoin by yet.
    assert p.propose(0, pred, [1, 7, 8, 50], 3, limit=9) == []
    # One output token never rejoins (single tokens recur by chance).
    assert p.propose(2, pred, [1, 2, 3, 50, 9], 3, limit=9) == []
    assert p.propose(2, pred, [1, 2, 3, 50, 9, 10], 3, limit=9) == []  # at the prediction's end
    assert p.propose(3, pred, [1, 2, 3, 50, 8, 9], 3, limit=9) == [10]


def test_a_rejected_draft_backs_off_and_an_accepted_one_resets():
    pred = Prediction(list(range(100, 140)))
    p = PredictionProposer(k=4)
    out = [100, 101]
    assert p.propose(0, pred, out, 0, limit=99) == [102, 103, 104, 105]
    p.verified(0, len(out) + 1, accepted=0)  # rejected outright: the next waits two tokens
    out += [102]
    assert p.propose(0, pred, out, 0, limit=99) == []
    out += [103]
    assert p.propose(0, pred, out, 0, limit=99) == []
    out += [104]
    assert p.propose(0, pred, out, 0, limit=99) == [105, 106, 107, 108]
    p.verified(0, len(out) + 3, accepted=2)
    out += [105, 106, 107]
    assert p.propose(0, pred, out, 0, limit=99) == [108, 109, 110, 111]
    p.forget(0)
    assert p.propose(0, pred, [100], 0, limit=99) == [101, 102, 103, 104]  # a new sequence


def test_where_the_output_rejoins_does_not_depend_on_when_drafts_could_be_made():
    """Under KV pressure a step drafts nothing (limit 0), and a verified draft adds several
    tokens at once: the follower must come out at the same place and the same
    accepted_prediction_tokens whatever steps the tokens came in (a QA run: 366 alone, 367-368
    beside other requests, the same output)."""
    rng = random.Random(3)
    base = [rng.randrange(10, 60) for _ in range(300)]
    pred = Prediction(base[:120] + [900, 901, 902] + base[120:200] + base[205:])
    prompt = [1, 2, 3]
    results = set()
    for trial in range(20):
        p = PredictionProposer(k=4)
        out = list(prompt)
        pick = random.Random(trial)
        while len(out) < len(prompt) + len(base):
            n = pick.choice([1, 1, 1, 2, 5])
            out += base[len(out) - len(prompt) : len(out) - len(prompt) + n]
            p.propose(0, pred, out, len(prompt), limit=pick.choice([0, 0, 9]))
        results.add((p.taken(0, pred, out, len(prompt)), tuple(p.propose(0, pred, out, len(prompt), limit=9))))
    assert len(results) == 1, results


# ---------------------------------------------------------------------------------- engine
def _edited(ids: list[int], seed: int) -> list[int]:
    """The output with a substitution, a deletion and an insertion."""
    rng = random.Random(seed)
    out = list(ids)
    i = rng.randrange(5, len(out) // 3)
    out[i : i + 3] = [rng.randrange(100, 4000) for _ in range(5)]
    i = rng.randrange(len(out) // 3, 2 * len(out) // 3)
    del out[i : i + 4]
    i = rng.randrange(2 * len(out) // 3, len(out))
    out[i:i] = [rng.randrange(100, 4000) for _ in range(4)]
    return out


def _generate_with(eng: LLMEngine, prompts, raw: dict, predictions: list[list[int]]):
    """Each prompt with its prediction as token ids; the steps they took."""
    outs, steps = [], eng.stats().num_steps
    for prompt, ids in zip(prompts, predictions):
        outs += eng.generate([prompt], eng.parse_params({**raw, "prediction": list(ids)}))
    return outs, eng.stats().num_steps - steps


@pytest.mark.parametrize("raw", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["predictions_only", "with_ngram"])
def test_outputs_equal_decoding_without_a_prediction(demo_model_path, raw, spec):
    prompts = _prompts(4, seed=5)
    eng = _engine(demo_model_path, spec=None)
    try:
        base, base_steps = [], eng.stats().num_steps
        for prompt in prompts:
            base += eng.generate([prompt], eng.parse_params(raw))
        base_steps = eng.stats().num_steps - base_steps
    finally:
        eng.shutdown()
    eng = _engine(demo_model_path, spec=spec)
    try:
        exact = [o.new_token_ids for o in base]
        cases = {
            "exact": exact,
            "edited": [_edited(ids, i) for i, ids in enumerate(exact)],
            "unrelated": [[5, 6, 7, 8] * 30] * len(prompts),
        }
        steps = {}
        for name, predictions in cases.items():
            outs, steps[name] = _generate_with(eng, prompts, raw, predictions)
            assert [o.new_token_ids for o in outs] == exact, name
            assert [o.text for o in outs] == [o.text for o in base], name
            for o, prediction in zip(outs, predictions):
                # OpenAI's counts: the prediction's tokens the output took, and the rest of them.
                taken, rest = o.accepted_prediction_tokens, o.rejected_prediction_tokens
                assert taken + rest == len(prediction) and 0 <= taken <= o.completion_tokens
                if spec is None:  # SGLang's spec_* meta counts the drafts: all the prediction's here
                    assert o.spec["spec_accept_token_num"] <= taken
                if name == "exact":  # the prediction is the output: all of it taken
                    assert (taken, rest) == (o.completion_tokens, 0)
                    # and every draft held: k of each k + 1 tokens came from one
                    k = eng.predictions.k
                    assert o.spec["spec_accept_token_num"] >= (o.completion_tokens - 1) * k // (k + 1) - k
                if name == "edited":
                    # 7 output tokens are not the prediction's and 9 of its are not the output's
                    # (_edited), give or take a chance match where the output rejoins it.
                    assert o.completion_tokens - 9 <= taken <= o.completion_tokens - 5 and rest >= 7
                if name == "unrelated":
                    assert (taken, rest) == (0, len(prediction))
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        # k=8 (or the n-gram config's 4) tokens a verifying step: the exact prediction takes a
        # fraction of the steps; an edited one still saves.
        assert steps["exact"] <= base_steps / 3
        assert steps["edited"] <= base_steps * 0.7
    finally:
        eng.shutdown()


def test_counts_stop_where_the_output_stops_inside_an_accepted_run(demo_model_path):
    """A stop token, a stop string or max_new_tokens inside a run of accepted draft tokens: the
    output took the prediction up to there, and the rest of it counts as rejected (OpenAI's
    counts); SGLang's spec_* meta counts the drafts verified past it as drafted, not kept."""
    prompts = _prompts(3, seed=9)
    eng = _engine(demo_model_path)
    try:
        base = [eng.generate([p], eng.parse_params(GREEDY))[0] for p in prompts]
        for cut in (5, 14, 23):
            for kind in ("stop_token_ids", "stop", "max_new_tokens"):
                for prompt, ref in zip(prompts, base):
                    ids = ref.new_token_ids
                    if kind == "stop_token_ids" and ids[cut] in ids[:cut]:
                        continue
                    raw = {**GREEDY, "stop_token_ids": [ids[cut]]} if kind == "stop_token_ids" else (
                        {**GREEDY, "max_new_tokens": cut + 1} if kind == "max_new_tokens" else GREEDY)
                    if kind == "stop":
                        stop = eng.tokenizer.decode(ids[cut : cut + 1])
                        if not stop.strip() or stop in eng.tokenizer.decode(ids[:cut]):
                            continue
                        raw = {**GREEDY, "stop": [stop]}
                    want = eng.generate([prompt], eng.parse_params(raw))[0]
                    stats0 = eng.stats()
                    got, _ = _generate_with(eng, [prompt], raw, [ids])
                    stats = eng.stats()
                    out = got[0]
                    assert out.new_token_ids == want.new_token_ids and out.text == want.text
                    assert (out.accepted_prediction_tokens, out.rejected_prediction_tokens) == (
                        out.completion_tokens, len(ids) - out.completion_tokens)
                    drafted = stats.spec_draft_tokens_total - stats0.spec_draft_tokens_total
                    assert out.spec["spec_draft_token_num"] == drafted
                    # Every kept token but the first (prefill's) and one a verifying step came
                    # from a draft.
                    verifies = stats.spec_drafts_total - stats0.spec_drafts_total
                    assert out.completion_tokens - 1 - verifies <= out.spec["spec_accept_token_num"] <= out.completion_tokens - 1
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_n_samples_follow_the_prediction_each_and_report_their_own(demo_model_path):
    prompt = _prompts(1, seed=2)[0]
    eng = _engine(demo_model_path)
    try:
        raw = {**SEEDED, "n": 3}
        base = eng.generate([prompt], eng.parse_params(raw))
        got, _ = _generate_with(eng, [prompt], raw, [base[1].new_token_ids])
        assert [o.new_token_ids for o in got] == [o.new_token_ids for o in base]
        assert (got[1].accepted_prediction_tokens, got[1].rejected_prediction_tokens) == (got[1].completion_tokens, 0)
        for other in (got[0], got[2]):  # the other samples took less of it: the rest is rejected
            assert other.accepted_prediction_tokens + other.rejected_prediction_tokens == got[1].completion_tokens
            assert other.accepted_prediction_tokens < other.completion_tokens
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_a_text_prediction_is_tokenized_by_the_engine(demo_model_path):
    prompts = _prompts(3, seed=4)
    eng = _engine(demo_model_path)
    try:
        base = [eng.generate([p], eng.parse_params(GREEDY))[0] for p in prompts]
        for prompt, ref in zip(prompts, base):
            out = eng.generate([prompt], eng.parse_params({**GREEDY, "prediction": ref.text}))[0]
            assert out.new_token_ids == ref.new_token_ids
            assert out.accepted_prediction_tokens > 0
        # No prediction: nothing reported; an empty one: nothing to draft.
        assert eng.generate([prompts[0]], eng.parse_params(GREEDY))[0].accepted_prediction_tokens is None
        out = eng.generate([prompts[0]], eng.parse_params({**GREEDY, "prediction": ""}))[0]
        assert out.accepted_prediction_tokens is None and out.new_token_ids == base[0].new_token_ids
        # No output at all (max_new_tokens 0): all of the prediction is rejected, as OpenAI counts.
        out = eng.generate([prompts[0]], eng.parse_params({**GREEDY, "max_new_tokens": 0, "prediction": [1, 2]}))[0]
        assert (out.accepted_prediction_tokens, out.rejected_prediction_tokens) == (0, 2) and not out.new_token_ids
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_an_aborted_predicting_request_frees_everything(demo_model_path):
    eng = _engine(demo_model_path)
    try:
        prompt = _prompts(1, seed=6)[0]
        ref = eng.generate([prompt], eng.parse_params(GREEDY))[0]
        outs = []
        rid = eng.add_request(prompt, eng.parse_params({**GREEDY, "prediction": ref.new_token_ids}), outs.append)
        for _ in range(4):
            eng.step()
        eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        eng.step()
        assert outs[-1].finish_reason == "abort"
        assert eng._num_predicting == 0 and not eng.predictions._follows
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_a_prediction_is_bounded(demo_model_path):
    SamplingParams(prediction="x" * MAX_PREDICTION_CHARS)
    SamplingParams(prediction=[7] * MAX_PREDICTION_TOKENS)
    for bad, words in [("x" * (MAX_PREDICTION_CHARS + 1), "longer than"), ([7] * (MAX_PREDICTION_TOKENS + 1), "more than"),
                       ([3, -1], "non-negative")]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(prediction=bad)
    # OpenAI's object, as /generate passes sampling_params through: its text, from parts too.
    assert parse_sampling_params({"prediction": {"type": "content", "content": "ab"}}).prediction == "ab"
    parts = {"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert parse_sampling_params({"prediction": parts}).prediction == "ab"
    # Every other shape gets one message (not pydantic's pair, one per branch of the union).
    for bad in (["not", "ids"], 3, True, [True], [1.5], {"type": "text", "content": "x"},
                {"type": "content", "content": [{"type": "text", "text": 5}]}, {"type": "content", "content": "x", "x": 1},
                {"type": "content", "content": [5, 6]}, {"type": "content", "content": None}):
        with pytest.raises(SamplingParamsError) as err:
            parse_sampling_params({"prediction": bad})
        assert str(err.value) == ('invalid sampling parameter prediction: must be text, a list of token ids, or '
                                  '{"type": "content", "content": text or text parts}'), (bad, str(err.value))
    eng = _engine(demo_model_path, max_model_len=256)
    try:
        with pytest.raises(RequestError, match="prediction token ids must be < the vocabulary size"):
            eng.add_request([1, 2, 3], eng.parse_params({**GREEDY, "prediction": [5, eng.vocab_size]}), print)
        # Cut to the context: no output is longer.
        captured = []
        real = eng._prediction
        eng._prediction = lambda params: captured.append(real(params)) or captured[-1]
        out = eng.generate([[1, 2, 3]], eng.parse_params({**GREEDY, "max_new_tokens": 4, "prediction": [9] * 1000}))[0]
        assert len(captured[0].tokens) == 256
        # ... yet all of it counts (QA: a 26k-token prediction reported max_model_len tokens in all)
        assert out.accepted_prediction_tokens + out.rejected_prediction_tokens == 1000
        text = "bene " * 400
        out = eng.generate([[1, 2, 3]], eng.parse_params({**GREEDY, "max_new_tokens": 4, "prediction": text}))[0]
        whole = len(eng.tokenizer.encode(text, add_special_tokens=False))
        assert whole > 256 and out.accepted_prediction_tokens + out.rejected_prediction_tokens == whole
    finally:
        eng.shutdown()

"""Speculative decoding: n-gram drafts (prompt lookup), verified several tokens a step.

A run with drafts must give the tokens a run without them gives, for greedy and seeded sampling,
whatever is drafted: the verification is tested with an oracle that drafts the true continuation,
spoiled at chosen positions, so runs of accepted tokens end at stop strings, stop tokens and
max_new_tokens; the n-gram proposer is tested on its own, and end to end on a model whose output
repeats.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.speculative import NgramProposer, SpeculativeConfig, speculates
from tests.test_engine import TEST_DEVICE

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _engine(path, spec=None, **kw) -> LLMEngine:
    kw = {"num_kv_blocks": 256, "max_num_batched_tokens": 512, "max_model_len": 1024, "enable_prefix_caching": False,
          **kw}
    return LLMEngine(EngineConfig(model_path=path, device=TEST_DEVICE, dtype="float32", speculative_config=spec, **kw))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 4000) for _ in range(rng.randint(5, 60))] for _ in range(n)]


# ---------------------------------------------------------------------------------- proposer
def _brute_force(tokens: list[int], k: int, sizes: range) -> list[int]:
    for n in sizes:
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for e in range(len(tokens) - 1, n - 1, -1):  # latest earlier occurrence first
            if tokens[e - n : e] == suffix:
                out = []
                for i in range(k):
                    out.append(tokens[e + i] if e + i < len(tokens) else out[e + i - len(tokens)])
                return out
    return []


def test_the_proposer_continues_the_latest_longest_match():
    p = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                                        prompt_lookup_min=1))
    # "2 3" occurred twice; the latest occurrence (followed by 9) wins over the first (followed by 4).
    assert p.propose(0, [1, 2, 3, 4, 5, 2, 3, 9, 7, 2, 3], limit=10) == [9, 7, 2]
    # The longest size that matches wins: "1 2 3" (-> 4) before "2 3" (-> 8).
    assert p.propose(1, [1, 2, 3, 4, 6, 2, 3, 8, 1, 2, 3], limit=10) == [4, 6, 2]
    assert p.propose(2, [1, 2, 3, 4], limit=10) == []  # nothing repeats
    assert p.propose(3, [5, 6, 5, 6, 5], limit=2) == [6, 5]  # limit
    assert p.propose(4, [5, 6, 5], limit=0) == []


def test_a_repeat_that_reaches_the_end_goes_on_repeating():
    p = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_max=2,
                                        prompt_lookup_min=1))
    assert p.propose(0, [8, 7, 7, 7], limit=10) == [7, 7, 7, 7, 7]
    assert p.propose(1, [9, 1, 2, 1, 2], limit=10) == [1, 2, 1, 2, 1]


def test_the_incremental_index_matches_a_full_search_as_a_sequence_grows():
    rng = random.Random(3)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    p = NgramProposer(cfg)
    tokens = [rng.randrange(6) for _ in range(20)]
    for _ in range(200):
        assert p.propose(7, tokens, limit=4) == _brute_force(tokens, 4, range(4, 1, -1))
        tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))
    p.forget(7)
    assert not p._histories


def test_a_sequence_whose_drafts_fail_drafts_less_often():
    from backend.speculative import BACKOFF_CAP

    p = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=1))
    tokens = [1, 2] * 10
    assert p.propose(0, tokens, 5) == [1, 2]
    waits = []
    for _ in range(8):  # each draft rejected outright: the next one waits twice as long
        p.verified(0, len(tokens) + 1, accepted=0)
        tokens.append(9)
        start = len(tokens)
        while not p.propose(0, tokens, 5):
            tokens.append(1 if tokens[-1] != 1 else 2)
        waits.append(len(tokens) - start)
    assert waits == [2, 4, 8, 16, 32, 64, 64, 64] and BACKOFF_CAP == 64
    p.verified(0, len(tokens), accepted=1)  # a draft that kept a token resets the wait
    p.verified(0, len(tokens), accepted=0)
    assert p.propose(0, tokens + [1], 5) == [] and p.propose(0, tokens + [1, 2], 5)


def test_speculative_config_follows_vllm():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=5).prompt_lookup_min == 5
    c = SpeculativeConfig.model_validate('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2)
    assert c.prompt_lookup_max == 2
    for bad, match in (({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min 4 is more than"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model")):
        with pytest.raises(ValidationError, match=match):
            SpeculativeConfig.model_validate(bad)


def test_requests_whose_state_follows_each_token_do_not_speculate(demo_model_path):
    from backend.sampling_params import parse_sampling_params

    assert speculates(parse_sampling_params({"temperature": 0.7, "top_p": 0.9, "logit_bias": {"5": 2.0},
                                             "return_logprob": True, "stop": ["x"], "min_new_tokens": 3,
                                             "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                                             "presence_penalty": 0.5}))
    assert speculates(parse_sampling_params({"regex": "[ab]+"}))
    assert speculates(parse_sampling_params({"json_schema": '{"type": "object"}'}))
    assert not speculates(parse_sampling_params({"regex": "[ab]+"}), jump_forward=True)
    for raw in ({"return_hidden_states": True}, {"logits_processors": ["tests.logits_processor_examples.ban_previous"]}):
        assert not speculates(parse_sampling_params(raw)), raw
        assert not speculates(parse_sampling_params(raw), jump_forward=True), raw


# ---------------------------------------------------------------------------------- verification
class OracleProposer:
    """Drafts the reference continuation of each prompt (from a run without drafts), with the
    draft token at every `spoil`-th proposal's position `spoil % k` replaced by a wrong one, and
    junk past the reference's end."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], k: int, spoil: int) -> None:
        self.references = references
        self.k = k
        self.spoil = spoil
        self.calls = 0

    def propose(self, seq_id: int, tokens: list[int], limit: int) -> list[int]:
        for prompt, ref in self.references.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                draft = (ref[done:] + [7] * self.k)[: min(self.k, limit)]
                self.calls += 1
                if draft and self.spoil and self.calls % self.spoil == 0:
                    at = self.calls % len(draft)
                    draft[at] = (draft[at] + 1) % 4000
                return draft
        return []

    def verified(self, seq_id: int, length: int, accepted: int) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass


def _run(path, prompts, raw: dict, spec=None, oracle=None, **kw):
    eng = _engine(path, spec, **kw)
    try:
        if oracle is not None:
            eng.proposer = oracle
        outs = eng.generate(prompts, eng.parse_params(raw))
        stats = eng.stats()
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        return outs, stats
    finally:
        eng.shutdown()


SAMPLINGS = [
    {"temperature": 0, "repetition_penalty": 1.0},
    {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "seed": 11, "repetition_penalty": 1.0},
    {"temperature": 1.0, "repetition_penalty": 1.0, "logit_bias": {"500": 3.0}, "seed": 4},
]


@pytest.mark.parametrize("raw", SAMPLINGS, ids=["greedy", "top_k_top_p_min_p", "logit_bias"])
@pytest.mark.parametrize("spoil", [0, 3])
def test_verified_drafts_give_the_tokens_of_decoding_one_at_a_time(demo_model_path, raw, spoil):
    prompts = _prompts(5, seed=1)
    raw = {**raw, "max_new_tokens": 40, "ignore_eos": True}
    ref, _ = _run(demo_model_path, prompts, raw)
    oracle = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=4, spoil=spoil)
    outs, stats = _run(demo_model_path, prompts, raw, spec=NGRAM, oracle=oracle)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert [o.text for o in outs] == [o.text for o in ref]
    assert stats.spec_draft_tokens_total > 0
    per_position = stats.spec_accepted_per_position
    assert sum(per_position) == stats.spec_accepted_tokens_total
    assert list(per_position) == sorted(per_position, reverse=True) and len(per_position) <= 4
    if spoil == 0:  # every draft token is the reference: all accepted, 5 tokens a step
        assert stats.spec_accepted_tokens_total == stats.spec_draft_tokens_total
        assert stats.spec_draft_tokens_total <= 4 * stats.spec_drafts_total
        assert stats.num_steps <= 1 + 40 // 5 + 2
    else:
        assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total


def test_logprobs_of_accepted_tokens_are_their_own_positions(demo_model_path):
    prompts = _prompts(3, seed=2)
    raw = {"temperature": 0.8, "seed": 3, "repetition_penalty": 1.0, "max_new_tokens": 24, "ignore_eos": True,
           "return_logprob": True, "top_logprobs_num": 3}
    ref, _ = _run(demo_model_path, prompts, raw)
    oracle = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=4, spoil=4)
    outs, _ = _run(demo_model_path, prompts, raw, spec=NGRAM, oracle=oracle)
    for a, b in zip(outs, ref):
        assert a.new_token_ids == b.new_token_ids
        got, want = a.logprobs["output_token_logprobs"], b.logprobs["output_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want] and len(got) == 24
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in got]), torch.tensor([lp for lp, _, _ in want]),
                                   atol=1e-4, rtol=1e-4)
        assert [[t for _, t, _ in top] for top in a.logprobs["output_top_logprobs"]] == \
            [[t for _, t, _ in top] for top in b.logprobs["output_top_logprobs"]]


@pytest.mark.parametrize("stop", ["stop_token", "stop_string", "max_new_tokens", "min_new_tokens"])
def test_a_run_of_accepted_tokens_ends_where_decoding_would(demo_model_path, stop):
    """The oracle drafts past the end: a stop token, a stop string or max_new_tokens inside an
    accepted run ends the request there, with the text and finish reason of the plain run."""
    prompts = _prompts(4, seed=5)
    base = {"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 30, "ignore_eos": True}
    free, _ = _run(demo_model_path, prompts, base)
    raws = []
    for o in free:  # each request stops at its own 11th token
        if stop == "stop_token":
            raws.append({**base, "stop_token_ids": [o.new_token_ids[10]]})
        elif stop == "stop_string":
            text = o.text
            raws.append({**base, "stop": [text[len(text) // 3 : len(text) // 3 + 3]]} if len(text) > 8 else base)
        elif stop == "max_new_tokens":
            raws.append({**base, "max_new_tokens": 11})
        else:
            # The stop token is position 13's draw (the third row of the step verifying positions
            # 11-15) and appears nowhere before it: min_new_tokens 13 suppresses it through
            # position 12 and not at 13, within one step's rows.
            ids = o.new_token_ids
            assert ids[13] not in ids[:13]
            raws.append({**base, "stop_token_ids": [ids[13]], "min_new_tokens": 13})
    for prompt, raw, full in zip(prompts, raws, free):
        ref, _ = _run(demo_model_path, [prompt], raw)
        oracle = OracleProposer({tuple(prompt): full.new_token_ids}, k=4, spoil=0)
        outs, _ = _run(demo_model_path, [prompt], raw, spec=NGRAM, oracle=oracle)
        assert outs[0].new_token_ids == ref[0].new_token_ids
        assert outs[0].text == ref[0].text
        assert outs[0].finish_reason == ref[0].finish_reason


def test_drafts_with_prefix_caching_n_samples_and_the_gathered_path(demo_model_path):
    """n=2 seeded samples, prefix caching on (a second round hits the blocks the first registered
    after verifying), and the general layout (gathered decode attention) as well as the flat one."""
    rng = random.Random(9)
    shared = [rng.randrange(100, 4000) for _ in range(40)]
    prompts = [shared + [rng.randrange(100, 4000) for _ in range(3 + i)] for i in range(3)]
    raw = {"temperature": 0.9, "seed": 21, "n": 2, "repetition_penalty": 1.0, "max_new_tokens": 30, "ignore_eos": True}
    ref, _ = _run(demo_model_path, prompts, raw, enable_prefix_caching=True)
    refs = {}
    for o in ref:
        refs.setdefault(tuple(prompts[len(refs) // 2]), o.new_token_ids)
    for path in ("flat", "gather"):
        eng = _engine(demo_model_path, NGRAM, enable_prefix_caching=True)
        if path == "gather":
            eng.model.decode_attention = "gather"
        try:
            params = eng.parse_params(raw)
            for _ in range(2):  # the second round is served from the cache
                eng.proposer = _SampleOracle(prompts, ref)
                outs = eng.generate(prompts, params)
                assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
            assert outs[0].cached_tokens >= 32
            assert eng.stats().spec_accepted_tokens_total > 0
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        finally:
            eng.shutdown()


class _SampleOracle(OracleProposer):
    """The oracle for n > 1: a sample is told apart by its draws so far."""

    def __init__(self, prompts, outs) -> None:
        super().__init__({}, k=3, spoil=5)
        self.cands = [(tuple(prompts[i // 2]), o.new_token_ids) for i, o in enumerate(outs)]

    def propose(self, seq_id, tokens, limit):
        for prompt, ref in self.cands:
            done = len(tokens) - len(prompt)
            if tuple(tokens[: len(prompt)]) == prompt and ref[:done] == tokens[len(prompt):]:
                self.references = {prompt: ref}
                return super().propose(seq_id, tokens, limit)
        return []


def test_drafts_never_preempt_and_a_tight_pool_gives_the_same_tokens(demo_model_path):
    prompts = _prompts(6, seed=13)
    raw = {"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 60, "ignore_eos": True}
    kw = {"num_kv_blocks": 24, "max_model_len": 128}
    ref, ref_stats = _run(demo_model_path, prompts, raw, **kw)
    oracle = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=4, spoil=0)
    outs, stats = _run(demo_model_path, prompts, raw, spec=NGRAM, oracle=oracle, **kw)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert ref_stats.num_preemptions > 0  # the pool is tight for this batch
    assert stats.num_preemptions <= ref_stats.num_preemptions
    # Drafts that never hold take blocks the real tokens then need, unless they leave a block
    # for every running sequence.
    junk = OracleProposer({}, k=4, spoil=0)
    junk.propose = lambda seq_id, tokens, limit: [5] * min(4, limit)
    outs, stats = _run(demo_model_path, prompts, raw, spec=NGRAM, oracle=junk, **kw)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert stats.spec_draft_tokens_total > 0
    assert stats.num_preemptions <= ref_stats.num_preemptions


PENALTIES = [
    {"temperature": 0, "repetition_penalty": 1.3},
    {"temperature": 0, "frequency_penalty": 0.8, "presence_penalty": 0.6, "repetition_penalty": 1.0},
    {"temperature": 0.9, "seed": 8, "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": -0.4},
]


@pytest.mark.parametrize("raw", PENALTIES, ids=["repetition", "frequency_presence", "all_sampled"])
def test_penalties_count_the_draft_tokens_before_each_position(demo_model_path, raw):
    """A draft position's penalties count the draft tokens before it as output, as its own decode
    step would: the tokens of decoding one at a time. The oracle drafts the penalized reference,
    which repeats tokens of the prompt and of itself only where the penalties allow."""
    prompts = _prompts(4, seed=17)
    raw = {**raw, "max_new_tokens": 40, "ignore_eos": True}
    ref, _ = _run(demo_model_path, prompts, raw)
    # Tokens that repeat within a draft are where the counts matter most: drafts run 6 long.
    oracle = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=6, spoil=4)
    outs, stats = _run(demo_model_path, prompts, raw, spec={**NGRAM, "num_speculative_tokens": 6}, oracle=oracle)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert stats.spec_accepted_tokens_total > stats.spec_draft_tokens_total // 2


def test_a_repeated_draft_token_is_penalized_where_it_repeats(demo_model_path):
    """Drafts of one token repeated: with a strong frequency penalty the model's own choice moves
    off it after a few repeats, so the later positions must see the earlier ones counted."""
    prompts = _prompts(3, seed=41)
    raw = {"temperature": 0, "frequency_penalty": 2.0, "repetition_penalty": 1.0, "max_new_tokens": 24,
           "ignore_eos": True, "logit_bias": {"1234": 15.0}}
    ref, _ = _run(demo_model_path, prompts, raw)
    assert all(1234 in o.new_token_ids for o in ref)
    repeat = OracleProposer({}, k=5, spoil=0)
    repeat.propose = lambda seq_id, tokens, limit: [1234] * min(5, limit)
    outs, stats = _run(demo_model_path, prompts, raw, spec=NGRAM, oracle=repeat)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert 0 < stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total


GRAMMARS = [
    {"regex": "(ab|cd|[0-9]{2,4}-)+x?"},
    {"json_schema": json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                "tags": {"type": "array", "items": {"enum": ["a", "bb"]},
                                                                         "maxItems": 4}},
                                "required": ["name", "tags"]})},
]


@pytest.mark.parametrize("grammar", GRAMMARS, ids=["regex", "json_schema"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 12}], ids=["greedy", "sampled"])
def test_grammar_masks_each_draft_position_as_it_stands_after_the_draft_before_it(demo_model_path, grammar, sampling):
    """Structured output with drafts: each position's mask is the grammar's after the draft tokens
    before it (rolled back after), so the output is decoding's, grammar-valid, and the matcher
    ends where decoding leaves it. The oracle spoils some drafts with tokens the grammar refuses."""
    prompts = _prompts(3, seed=43)
    raw = {**sampling, **grammar, "repetition_penalty": 1.0, "max_new_tokens": 40}
    ref, _ = _run(demo_model_path, prompts, raw)
    assert all(o.finish_reason in ("stop", "length") and o.error is None for o in ref)
    oracle = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=5, spoil=3)
    outs, stats = _run(demo_model_path, prompts, raw, spec={**NGRAM, "num_speculative_tokens": 5}, oracle=oracle)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert [o.text for o in outs] == [o.text for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
    assert stats.spec_accepted_tokens_total > stats.spec_draft_tokens_total // 3


def test_grammar_requests_do_not_speculate_under_jump_forward(demo_model_path):
    prompts = _prompts(2, seed=43)
    plain = {"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 20, "ignore_eos": True}
    constrained = {"temperature": 0, "max_new_tokens": 20, **GRAMMARS[0]}
    eng = _engine(demo_model_path, NGRAM, enable_jump_forward=True)
    try:
        want_plain = _run(demo_model_path, prompts[:1], plain)[0][0].new_token_ids
        want_regex = _run(demo_model_path, prompts[1:], constrained, enable_jump_forward=True)[0][0].text
        oracle = OracleProposer({tuple(prompts[0]): want_plain}, k=4, spoil=0)
        asked = []
        propose = oracle.propose
        oracle.propose = lambda seq_id, tokens, limit: asked.append(tuple(tokens[:len(prompts[1])])) or propose(
            seq_id, tokens, limit)
        eng.proposer = oracle
        outs = eng.generate(prompts, [eng.parse_params(plain), eng.parse_params(constrained)])
        assert outs[0].new_token_ids == want_plain and outs[1].text == want_regex
        assert tuple(prompts[1]) not in asked  # the grammar request was never drafted for
        assert eng.stats().spec_accepted_tokens_total > 0
    finally:
        eng.shutdown()


def test_draft_masks_leave_the_grammar_as_it_was(demo_model_path):
    from backend.grammar import GrammarCompiler
    from backend.tokenizer import load_tokenizer

    tok = load_tokenizer(demo_model_path)
    gc = GrammarCompiler(tok, 4096)
    try:
        state = gc.matcher(gc.compile("regex", "(ab|cd)+"))
        ab, cd = tok.encode("ab", add_special_tokens=False), tok.encode("cd", add_special_tokens=False)
        assert all(state.accept(t) for t in ab)
        before = torch.full((1, 128), -1, dtype=torch.int32)
        state.fill_bitmask(before, 0)
        refused = tok.encode("zz", add_special_tokens=False)[0]
        masks = state.draft_masks(cd + [refused, cd[0]])
        assert torch.equal(masks[0], before[0]) and state.num_accepted == len(ab)
        assert torch.equal(masks[len(cd) + 1], masks[len(cd)])  # past the refused token: repeated
        after = torch.full((1, 128), -1, dtype=torch.int32)
        state.fill_bitmask(after, 0)
        assert torch.equal(after, before) and all(state.accept(t) for t in cd)
    finally:
        gc.shutdown()


def test_an_aborted_request_frees_its_draft_blocks(demo_model_path):
    eng = _engine(demo_model_path, NGRAM)
    try:
        prompts = _prompts(3, seed=19)
        eng.proposer = OracleProposer({}, k=4, spoil=0)
        eng.proposer.propose = lambda seq_id, tokens, limit: [5] * min(4, limit)  # drafts that never hold
        params = eng.parse_params({"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 200,
                                   "ignore_eos": True})
        ids = [eng.add_request(p, params, lambda out: None) for p in prompts]
        for _ in range(12):
            eng.step()
        assert eng.stats().spec_draft_tokens_total > 0
        for rid in ids:
            eng.abort(rid)
        while eng.step():
            pass
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


# ---------------------------------------------------------------------------------- n-gram end to end
@pytest.fixture(scope="module")
def repeating_model(demo_model_path, tmp_path_factory):
    """The demo model with its final norm zeroed: every logit is 0, so its greedy output is one
    token repeated, which the n-gram proposer drafts and the model then accepts in full."""
    out = tmp_path_factory.mktemp("repeating")
    for f in demo_model_path.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    raw = load_file(str(out / "model.safetensors"))
    raw["model.norm.weight"] = torch.zeros_like(raw["model.norm.weight"])
    save_file(raw, str(out / "model.safetensors"))
    json.loads((out / "config.json").read_text())
    return out


def test_ngram_drafts_of_a_repeating_output_are_accepted(repeating_model):
    prompts = _prompts(3, seed=23)
    raw = {"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 48, "ignore_eos": True}
    ref, ref_stats = _run(repeating_model, prompts, raw)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    outs, stats = _run(repeating_model, prompts, raw, spec=spec)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert stats.spec_accepted_tokens_total >= 0.9 * stats.spec_draft_tokens_total > 0
    assert stats.num_steps * 3 < ref_stats.num_steps


def test_disable_by_batch_size_turns_drafts_off_for_a_large_batch(repeating_model):
    prompts = _prompts(3, seed=29)
    raw = {"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    _, stats = _run(repeating_model, prompts, raw, spec={**spec, "disable_by_batch_size": 2})
    assert stats.spec_draft_tokens_total == 0
    _, stats = _run(repeating_model, prompts, raw, spec={**spec, "disable_by_batch_size": 3})
    assert stats.spec_draft_tokens_total > 0


# ---------------------------------------------------------------------------------- scheduling
def _decoding(sched, bm, computed: int) -> "Sequence":  # noqa: F821
    from backend.sampling_params import SamplingParams
    from backend.sequence import Sequence, SequenceStatus

    seq = Sequence(request_id=f"r{len(sched.running)}", token_ids=list(range(computed + 1)), params=SamplingParams(),
                   max_new_tokens=100)
    seq.num_computed_tokens = computed
    seq.status = SequenceStatus.RUNNING
    bm.allocate(seq, computed + 1)
    sched.running.append(seq)
    return seq


def test_a_draft_runs_in_the_budget_and_takes_a_block_only_beside_one_for_every_sequence():
    from backend.block_manager import BlockManager
    from backend.scheduler import Scheduler

    bm = BlockManager(num_blocks=6, block_size=16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    a = _decoding(sched, bm, 14)  # 1 block: room for this token and one more
    b = _decoding(sched, bm, 30)  # 2 blocks: room for this token and one more
    a.draft_tokens, b.draft_tokens = [1, 2, 3, 4], [5, 6]
    step = sched.schedule()
    # a's draft fits the budget of 6 and takes a block (three were free: one per running
    # sequence stays); b is left one token of the budget: no draft.
    assert [(s.seq, s.num_new_tokens, s.draft) for s in step] == [(a, 5, [1, 2, 3, 4]), (b, 1, [])]
    assert all(s.samples for s in step)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 2
    # Two free blocks, two running: a's draft would need one and waits; b's fits its own block.
    a.num_computed_tokens, a.token_ids = 31, list(range(32))
    a.draft_tokens, b.draft_tokens = [7], [7]
    step = sched.schedule()
    assert [(s.seq, s.num_new_tokens, s.draft) for s in step] == [(a, 1, []), (b, 2, [7])]
    assert bm.num_free_blocks == 2 and sched.num_preemptions == 0


def test_verify_steps_replay_decode_graphs(demo_model_path):
    """Decodes with drafts are laid out flat and replayed from the decode graphs (eager_replay
    stands in for CUDA's capture here), which hand back every draft position's logits: the tokens
    of a graphed run without drafts."""
    from backend.decode_graphs import eager_replay
    from backend.model_runner import ModelRunner

    prompts = _prompts(4, seed=31)
    raw = {"temperature": 0.8, "seed": 2, "repetition_penalty": 1.0, "max_new_tokens": 30, "ignore_eos": True}
    ref, _ = _run(demo_model_path, prompts, raw)
    eng = _engine(demo_model_path, NGRAM, num_kv_blocks=128, max_num_seqs=8)
    eng.model = ModelRunner(demo_model_path, 128, 16, device="cpu", dtype=torch.float32, graph_batch=32)
    try:
        assert eng.model.enable_decode_graphs(capture=eager_replay) is None
        eng.proposer = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=4, spoil=3)
        outs = eng.generate(prompts, eng.parse_params(raw))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
        assert eng.model.graphs.replays > 5 and eng.stats().spec_accepted_tokens_total > 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel on CPU tensors: the interpreter only")
def test_verify_steps_in_query_tiles_give_the_tokens_of_decoding_one_at_a_time(demo_model_path):
    """LLM_QUERY_TILE: a verify step's rows of one sequence (its last token and 4 drafts) are
    consecutive positions under one table, scored in tiles of 3 and 2 by the Triton kernel
    (interpreted, eagerly): the tokens of decoding one at a time."""
    prompts = _prompts(3, seed=37)
    raw = {"temperature": 0.8, "seed": 3, "repetition_penalty": 1.0, "max_new_tokens": 16, "ignore_eos": True}
    ref, _ = _run(demo_model_path, prompts, raw)
    eng = _engine(demo_model_path, NGRAM, num_kv_blocks=128, max_num_seqs=8)
    eng.model.decode_attention, eng.model.query_tile = "triton", 3
    tiled = []
    real = eng.model._paged_batch
    eng.model._paged_batch = lambda *a: tiled.append(len(a) > 5 and a[5] is not None and max(a[5]) > 1) or real(*a)
    try:
        eng.proposer = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=4, spoil=3)
        outs = eng.generate(prompts, eng.parse_params(raw))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
        assert any(tiled) and eng.stats().spec_accepted_tokens_total > 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graphs: CUDA only")
def test_cuda_verify_steps_equal_decoding_one_at_a_time(demo_model_path):
    prompts = _prompts(6, seed=37)
    raw = {"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 40, "ignore_eos": True}

    def run(spec, oracle=None):
        eng = LLMEngine(EngineConfig(model_path=demo_model_path, device="cuda", dtype="float32", num_kv_blocks=256,
                                     max_model_len=1024, max_num_seqs=16, speculative_config=spec))
        try:
            if oracle is not None:
                eng.proposer = oracle
            outs = eng.generate(prompts, eng.parse_params(raw))
            return [o.new_token_ids for o in outs], eng.model.graphs.replays, eng.stats()
        finally:
            eng.shutdown()

    want, _, _ = run(None)
    got, replays, stats = run(NGRAM, OracleProposer({tuple(p): o for p, o in zip(prompts, want)}, k=4, spoil=3))
    assert got == want and replays > 5 and stats.spec_accepted_tokens_total > 0


@pytest.mark.parametrize("kind", ["mistral_swa", "qwen2_mixed_swa"])
def test_verified_drafts_under_sliding_windows(demo_model_path, tmp_path, kind):
    """Sliding windows (every layer, or mixed with full layers) in the flat verify layout: the
    tokens of decoding one at a time, past the window (32) as well."""
    from tests.test_architectures import _build

    _build(kind, demo_model_path, tmp_path)
    prompts = _prompts(3, seed=47)
    raw = {"temperature": 0.8, "seed": 6, "repetition_penalty": 1.0, "max_new_tokens": 48, "ignore_eos": True}
    kw = {"max_model_len": 256, "block_size": 8}
    ref, _ = _run(tmp_path, prompts, raw, **kw)
    oracle = OracleProposer({tuple(p): o.new_token_ids for p, o in zip(prompts, ref)}, k=4, spoil=3)
    outs, stats = _run(tmp_path, prompts, raw, spec=NGRAM, oracle=oracle, **kw)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert stats.spec_accepted_tokens_total > stats.spec_draft_tokens_total // 2


def test_a_long_prompt_is_indexed_over_several_calls():
    from backend.speculative import INDEX_PER_CALL

    p = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2))
    tokens = [1, 2, 3] + list(range(10, 10 + 2 * INDEX_PER_CALL)) + [1, 2]
    calls = 0
    while not (draft := p.propose(0, tokens, 5)):
        calls += 1
        assert calls < 10
    assert calls == 2 and draft == [3, 10, 11]


def test_a_failing_proposer_costs_only_its_drafts(demo_model_path):
    prompts = _prompts(2, seed=53)
    raw = {"temperature": 0, "repetition_penalty": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    ref, _ = _run(demo_model_path, prompts, raw)
    broken = OracleProposer({}, k=4, spoil=0)

    def propose(seq_id, tokens, limit):
        if len(tokens) % 3 == 0:
            raise RuntimeError("proposer bug")
        return [5] * min(4, limit)

    broken.propose = propose
    outs, stats = _run(demo_model_path, prompts, raw, spec=NGRAM, oracle=broken)
    assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in ref]
    assert all(o.error is None for o in outs)

"""Draft-model speculative decoding: a smaller model drafts, the target verifies.

The target's output must be the one decoding without drafts gives, for greedy and seeded sampling,
whatever the draft model is: the target itself (drafts are drawn as the target draws, with its
sampling parameters, penalties and noise, so they all hold), the target cut to its first layers (a different model of the same vocabulary,
as LayerSkip's self-speculation builds one), n samples, a pool tight enough to preempt, and long
prompts caught up over several steps. Both pools must be free after each test.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from backend import draft_model
from backend.draft_model import DraftModelProposer
from backend.speculative import SpeculativeConfig
from bench.spec_decode import first_layers
from tests.test_engine import TEST_DEVICE
from tests.test_speculative import GRAMMARS, _engine, _prompts

GREEDY = {"temperature": 0.0, "repetition_penalty": 1.0, "ignore_eos": True, "max_new_tokens": 48}
SEEDED = {"temperature": 0.8, "top_k": 40, "seed": 5, "ignore_eos": True, "max_new_tokens": 48}
# The demo model's own defaults (temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.05),
# with penalties on top.
PENALIZED = {"seed": 9, "presence_penalty": 0.5, "frequency_penalty": 0.3, "ignore_eos": True, "max_new_tokens": 48}


@pytest.fixture(scope="module")
def short_draft(demo_model_path, tmp_path_factory):
    return first_layers(demo_model_path, tmp_path_factory.mktemp("draft"), layers=2)


def _draft(path, k: int = 4) -> dict:
    return {"model": str(path), "num_speculative_tokens": k}


def _reference(path, prompts, raw: dict, **kw) -> list:
    """The outputs of decoding one token a step, without drafts."""
    eng = _engine(path, **kw)
    try:
        return eng.generate(prompts, eng.parse_params(raw))
    finally:
        eng.shutdown()


def _all_free(eng) -> bool:
    return (eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
            and eng.proposer.num_free_blocks == eng.block_manager.num_blocks)


def test_the_config_follows_vllm():
    cfg = SpeculativeConfig.model_validate('{"model": "/m", "num_speculative_tokens": 3}')
    assert cfg.method == "draft_model" and cfg.model == "/m"
    for bad, words in [({"method": "draft_model", "num_speculative_tokens": 3}, "needs a \"model\""),
                       ({"num_speculative_tokens": 3}, "method is required"),
                       ({"model": "/m", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, "ngram method"),
                       ({"method": "ngram", "model": "/m", "num_speculative_tokens": 3}, "draft_model method"),
                       ({"model": "/m", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}, "Extra inputs")]:
        with pytest.raises(ValidationError, match=words):
            SpeculativeConfig.model_validate(bad)


@pytest.mark.parametrize("raw", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"])
@pytest.mark.parametrize("which", ["itself", "first_two_layers"])
def test_outputs_equal_decoding_without_drafts(demo_model_path, short_draft, raw, which):
    prompts = _prompts(5, seed=8)
    base = _reference(demo_model_path, prompts, raw)
    eng = _engine(demo_model_path, spec=_draft(demo_model_path if which == "itself" else short_draft))
    try:
        outs = eng.generate(prompts, eng.parse_params(raw))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in base]
        assert [o.text for o in outs] == [o.text for o in base]
        assert all(o.spec is None for o in base)
        stats = eng.stats()
        # SGLang's per-request spec_* meta_info adds up to the engine's counters.
        assert sum(o.spec["spec_verify_ct"] for o in outs) == stats.spec_drafts_total
        assert sum(o.spec["spec_draft_token_num"] for o in outs) == stats.spec_draft_tokens_total
        for o in outs:
            steps = o.spec["spec_verify_ct"]
            kept = o.spec["spec_accept_token_num"]
            assert 0 <= kept <= o.spec["spec_draft_token_num"]
            assert o.spec["spec_accept_rate"] == pytest.approx(kept / o.spec["spec_draft_token_num"])
            # Each verifying step gives its kept draft tokens and one more; every other step one.
            plain = o.completion_tokens - kept - steps
            assert o.spec["spec_accept_length"] == pytest.approx(o.completion_tokens / (steps + plain))
        assert stats.spec_draft_tokens_total > 0
        if which == "itself":  # its own draw, at any temperature, up to batch-shape rounding
            assert stats.spec_accepted_tokens_total >= 0.95 * stats.spec_draft_tokens_total
            assert stats.num_steps <= 5 + 48 * 5 / 4
        assert _all_free(eng)
    finally:
        eng.shutdown()


def test_n_samples_prefix_caching_and_preemption(demo_model_path, short_draft):
    prompts = _prompts(4, seed=12)
    raw = {**SEEDED, "n": 3, "max_new_tokens": 64}
    kw = {"num_kv_blocks": 40, "max_model_len": 256, "enable_prefix_caching": True}
    base = _reference(demo_model_path, prompts, raw, **kw)
    eng = _engine(demo_model_path, spec=_draft(short_draft), **kw)
    try:
        outs = eng.generate(prompts, eng.parse_params(raw))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in base]
        assert eng.scheduler.num_preemptions > 0 and eng.stats().spec_draft_tokens_total > 0
        assert _all_free(eng)
    finally:
        eng.shutdown()


def test_a_long_prompt_is_caught_up_over_several_steps(demo_model_path, monkeypatch):
    monkeypatch.setattr(draft_model, "CATCH_UP_PER_STEP", 16)
    prompts = _prompts(3, seed=30)
    base = _reference(demo_model_path, prompts, GREEDY)
    eng = _engine(demo_model_path, spec=_draft(demo_model_path))
    try:
        outs = eng.generate(prompts, eng.parse_params(GREEDY))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in base]
        stats = eng.stats()
        assert stats.spec_accepted_tokens_total >= 0.9 * stats.spec_draft_tokens_total > 0
        assert _all_free(eng)
    finally:
        eng.shutdown()


def test_an_aborted_request_frees_its_draft_blocks(demo_model_path, short_draft):
    eng = _engine(demo_model_path, spec=_draft(short_draft))
    try:
        ids = [eng.add_request(p, eng.parse_params({**GREEDY, "max_new_tokens": 200}), lambda out: None)
               for p in _prompts(3, seed=4)]
        for _ in range(6):
            eng.step()
        assert eng.proposer.num_free_blocks < eng.block_manager.num_blocks
        for rid in ids:
            eng.abort(rid)
        while eng.step():
            pass
        assert _all_free(eng)
    finally:
        eng.shutdown()


def test_a_short_draft_pool_drafts_less_and_gives_room_back(demo_model_path):
    """The proposer alone: a sequence that does not fit gets no draft; the blocks of sequences
    no longer running are taken back when the pool runs short."""
    import torch

    p = DraftModelProposer(demo_model_path, k=3, num_blocks=4, block_size=16, target_vocab=4096,
                           max_model_len=1024, device=torch.device("cpu"), dtype=torch.float32, kv_dtype=torch.float32)
    a, b = list(range(100, 140)), list(range(200, 230))
    assert len(p.propose_batch([(0, a, 9)], running={0})[0]) == 3  # 42 positions: 3 blocks
    assert p.num_free_blocks == 1
    assert p.propose_batch([(1, b, 9)], running={0, 1}) == {}  # 32 positions need 2
    assert len(p.propose_batch([(1, b, 9)], running={1})[1]) == 3  # sequence 0 left: its blocks return
    p.forget(1)
    assert p.num_free_blocks == 4


def test_a_draft_rejected_outright_backs_off_and_an_accepted_one_resets(demo_model_path):
    import torch

    p = DraftModelProposer(demo_model_path, k=3, num_blocks=16, block_size=16, target_vocab=4096,
                           max_model_len=1024, device=torch.device("cpu"), dtype=torch.float32, kv_dtype=torch.float32)
    tokens = list(range(100, 130))
    assert len(p.propose_batch([(0, tokens, 9)], running={0})[0]) == 3
    p.verified(0, len(tokens) + 1, accepted=0)  # rejected outright: the step's token, then two more
    tokens.append(7)
    assert p.propose_batch([(0, tokens, 9)], running={0}) == {}
    tokens.append(8)
    assert p.propose_batch([(0, tokens, 9)], running={0}) == {}
    tokens.append(9)
    assert len(p.propose_batch([(0, tokens, 9)], running={0})[0]) == 3  # caught up on all three
    assert p._seqs[0].computed == len(tokens)
    p.verified(0, len(tokens) + 1, accepted=0)  # again: the step's token, then four more
    tokens += [0, 1, 2, 3, 4]
    assert p.propose_batch([(0, tokens[:-1], 9)], running={0}) == {}
    assert len(p.propose_batch([(0, tokens, 9)], running={0})[0]) == 3
    p.verified(0, len(tokens) + 2, accepted=1)  # kept one: no wait
    tokens += [5, 6]
    assert len(p.propose_batch([(0, tokens, 9)], running={0})[0]) == 3


def test_ids_past_the_targets_vocabulary_are_never_drafted(demo_model_path):
    import torch

    p = DraftModelProposer(demo_model_path, k=3, num_blocks=8, block_size=16, target_vocab=4000,
                           max_model_len=1024, device=torch.device("cpu"), dtype=torch.float32, kv_dtype=torch.float32)

    def forward(batch):  # the draft model's favourite is an id the target does not have
        logits = torch.zeros(len(batch.logits_index), 4096)
        logits[:, 4050] = 9.0
        logits[:, 17] = 1.0
        return logits

    p.runner.forward = forward
    assert p.propose_batch([(0, list(range(100, 120)), 9)], running={0}) == {0: [17, 17, 17]}


def test_a_draft_model_must_cover_the_context_and_may_have_a_larger_vocabulary(demo_model_path, tmp_path):
    short = first_layers(demo_model_path, tmp_path / "short", layers=1)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 256}))
    with pytest.raises(ValueError, match="context"):
        _engine(demo_model_path, spec=_draft(short), max_model_len=512)
    # A draft vocabulary padded past the target's (as between model sizes of one family): its
    # extra ids are never drafted.
    wide = first_layers(demo_model_path, tmp_path / "wide", layers=2)
    cfg = json.loads((wide / "config.json").read_text())
    raw = load_file(str(wide / "model.safetensors"))
    import torch

    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in raw:
            pad = torch.full((64, raw[name].shape[1]), 0.0)
            if name == "lm_head.weight":
                pad[:, 0] = 1e4  # huge logits for the padded ids (on hidden dim 0): they would win
            raw[name] = torch.cat([raw[name], pad])
    cfg["vocab_size"] += 64
    (wide / "config.json").write_text(json.dumps(cfg))
    save_file(raw, str(wide / "model.safetensors"))
    prompts = _prompts(2, seed=3)
    base = _reference(demo_model_path, prompts, GREEDY)
    eng = _engine(demo_model_path, spec=_draft(wide))
    try:
        assert eng.proposer.vocab == eng.vocab_size
        outs = eng.generate(prompts, eng.parse_params(GREEDY))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in base]
        assert _all_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("grammar", GRAMMARS, ids=["regex", "json_schema"])
def test_structured_output_with_a_draft_model(demo_model_path, grammar):
    """The draft's first position is drawn under the grammar's mask as it stands; later ones
    without (the matcher stands before the draft), and verification masks each as it should."""
    prompts = _prompts(3, seed=17)
    raw = {**SEEDED, **grammar, "max_new_tokens": 40}
    base = _reference(demo_model_path, prompts, raw)
    assert all(o.error is None for o in base)
    eng = _engine(demo_model_path, spec=_draft(demo_model_path))
    try:
        outs = eng.generate(prompts, eng.parse_params(raw))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in base]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in base]
        stats = eng.stats()
        assert stats.spec_accepted_tokens_total >= 0.9 * stats.spec_draft_tokens_total
        assert _all_free(eng)
    finally:
        eng.shutdown()


def test_the_drafts_decode_passes_replay_graphs(demo_model_path):
    """The draft runner's decode graphs (on CUDA when the target's are on), with `eager_replay`
    standing in for the capture: drafts are unchanged, so the target drafting itself keeps them
    all; the draft's one-token passes came from the graphs, and so did its catch-up passes after
    each sequence's first (a few tokens each, laid out as a decode step)."""
    import torch

    from backend.decode_graphs import eager_replay
    from backend.model_runner import ModelRunner

    prompts = _prompts(5, seed=21)
    base = _reference(demo_model_path, prompts, SEEDED)
    eng = _engine(demo_model_path, spec=_draft(demo_model_path))
    try:
        runner = ModelRunner(demo_model_path, eng.block_manager.num_blocks, eng.config.block_size,
                             device=eng.model.device, dtype=torch.float32, graph_batch=32)
        assert runner.enable_decode_graphs(capture=eager_replay) is None
        eng.proposer.runner = runner
        passes = {"general": 0, "all": 0}
        prepare_general, forward = runner._prepare_general, runner.forward

        def counted_general(*args, **kw):
            passes["general"] += 1
            return prepare_general(*args, **kw)

        def counted_forward(batch):
            passes["all"] += 1
            return forward(batch)

        runner._prepare_general, runner.forward = counted_general, counted_forward
        outs = eng.generate(prompts, eng.parse_params(SEEDED))
        assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in base]
        stats = eng.stats()
        assert stats.spec_accepted_tokens_total >= 0.95 * stats.spec_draft_tokens_total > 0
        assert runner.graphs is not None and runner.graphs.replays > 10
        # Eager (general) passes: only the prompts' catch-ups.
        assert passes["general"] <= len(prompts) and runner.graphs.replays == passes["all"] - passes["general"]
        assert _all_free(eng)
    finally:
        eng.shutdown()


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="real CUDA graphs: LLM_TEST_DEVICE=cuda only")
@pytest.mark.parametrize("raw", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_cuda_draft_graphs_keep_the_outputs(demo_model_path, short_draft, raw):
    """On a GPU the engine captures the draft model's decode graphs beside the target's; the
    outputs are those of decoding without drafts (on the same GPU), and the target drafting
    itself keeps its drafts through the graphs."""
    prompts = _prompts(6, seed=23)
    kw = {"max_num_seqs": 16}
    base = _reference(demo_model_path, prompts, raw, **kw)
    for draft, least in ((demo_model_path, 0.95), (short_draft, 0.0)):
        eng = _engine(demo_model_path, spec=_draft(draft), **kw)
        try:
            assert eng.model.graphs is not None and eng.proposer.runner.graphs is not None
            outs = eng.generate(prompts, eng.parse_params(raw))
            assert [o.new_token_ids for o in outs] == [o.new_token_ids for o in base]
            stats = eng.stats()
            assert stats.spec_accepted_tokens_total >= least * stats.spec_draft_tokens_total
            assert stats.spec_draft_tokens_total > 0 and eng.proposer.runner.graphs.replays > 10
            assert _all_free(eng)
        finally:
            eng.shutdown()

"""Decode graphs (backend/decode_graphs.py): bucketing, padding and the capture check, on the CPU.

The CUDA capture itself needs a GPU; here `eager_replay` stands in for it (a replay runs the
forward pass again over the same static buffers), which exercises everything around it: the
buffers, the padding rows and their scratch blocks, the fallbacks, and equality with the
eager engine token for token.
"""

from __future__ import annotations

import random

import pytest
import torch

from backend.config import EngineConfig
from backend.decode_graphs import eager_replay, graph_buckets
from backend.engine import LLMEngine
from backend.model_runner import ModelRunner
from backend.sampling_params import SamplingParams
from backend.triton_io import engine_config_overrides

BLOCKS, BS = 256, 16


def test_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(12) == [1, 2, 4, 8, 16]
    assert graph_buckets(128) == [1, 2, 4, 8] + list(range(16, 129, 16))


def test_config_flag():
    assert engine_config_overrides({"cuda_graphs": "false"}, {}) == {"cuda_graphs": False}
    assert engine_config_overrides({}, {"LLM_CUDA_GRAPHS": "1"}) == {"cuda_graphs": True}
    assert not EngineConfig(model_path="x", device="cpu", cuda_graphs=True).use_cuda_graphs()
    assert EngineConfig(model_path="x", device="cuda").use_cuda_graphs()
    assert not EngineConfig(model_path="x", device="cuda", cuda_graphs=False).use_cuda_graphs()


def test_flat_prefill_default_is_on_for_cuda_only():
    assert EngineConfig(model_path="x", device="cuda").flat_tokens() == 128
    # Only as many tokens as the largest decode graph holds, and none without graphs.
    assert EngineConfig(model_path="x", device="cuda", max_num_seqs=48).flat_tokens() == 48
    assert EngineConfig(model_path="x", device="cuda", cuda_graphs=False).flat_tokens() == 0
    assert EngineConfig(model_path="x", device="cpu").flat_tokens() == 0
    assert EngineConfig(model_path="x", device="cuda", flat_prefill_tokens=0).flat_tokens() == 0
    assert EngineConfig(model_path="x", device="cpu", flat_prefill_tokens=64).flat_tokens() == 64
    assert engine_config_overrides({"flat_prefill_tokens": "auto"}, {}) == {}
    assert engine_config_overrides({"flat_prefill_tokens": "auto"}, {"LLM_FLAT_PREFILL_TOKENS": "0"}) == {
        "flat_prefill_tokens": 0}


def _engine(path, graphs: bool) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model_path=path, device="cpu", dtype="float32", num_kv_blocks=BLOCKS,
                                 block_size=BS, max_num_seqs=8, enable_prefix_caching=False))
    if graphs:
        eng.model = ModelRunner(path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=8)
        assert eng.model.enable_decode_graphs(capture=eager_replay) is None
    return eng


def test_engine_with_graphs_equals_eager(demo_model_path):
    rng = random.Random(3)
    eager, graphed = _engine(demo_model_path, False), _engine(demo_model_path, True)
    vocab = eager.vocab_size
    # 7 prompts, 6 with a max_new_tokens of their own: the decode batch shrinks through
    # 7, 6, ..., 1 sequences, so most steps pad up to a bucket (8, 4, 2).
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 70))] for _ in range(7)]
    params = [SamplingParams(max_new_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(7)]
    want = eager.generate(prompts, params)
    got = graphed.generate(prompts, params)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert graphed.model.graphs.replays > 20
    for eng in (eager, graphed):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_padding_rows_touch_only_scratch(demo_model_path):
    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=8)
    assert runner.enable_decode_graphs(capture=eager_replay) is None
    for cache in (runner.k_cache, runner.v_cache):
        cache.normal_()
    before_k, before_v = runner.k_cache.clone(), runner.v_cache.clone()
    # Three sequences decode (bucket 4: one padding row): each writes exactly its own slot.
    chunks = [([5], 20, [1, 2], True), ([6], 3, [7], True), ([7], 40, [9, 10, 11], True)]
    batch = runner.prepare(chunks)
    assert batch.decode_only
    logits = runner.forward(batch)
    assert runner.graphs.replays == 1 and logits.shape[0] == 3
    written = {2 * BS + 4, 7 * BS + 3, 11 * BS + 8}
    scratch = set(range(BLOCKS * BS, runner.k_cache.shape[2]))
    changed = ((runner.k_cache != before_k) | (runner.v_cache != before_v)).any(dim=(0, 1, 3))
    changed_slots = set(torch.nonzero(changed).flatten().tolist())
    assert written <= changed_slots and changed_slots - written <= scratch


def test_same_logits_as_eager_forward(demo_model_path):
    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=8)
    assert runner.enable_decode_graphs(capture=eager_replay) is None
    runner.k_cache.normal_()
    runner.v_cache.normal_()
    chunks = [([5], 20, [1, 2], True), ([6], 3, [7], True)]
    graphed = runner.forward(runner.prepare(chunks))
    eager = runner.eager_forward(runner.prepare(chunks))  # same K/V written again: same inputs
    torch.testing.assert_close(graphed, eager)


def test_prefill_and_oversized_steps_run_eagerly(demo_model_path):
    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=2)
    assert runner.enable_decode_graphs(capture=eager_replay) is None
    runner.forward(runner.prepare([([1, 2, 3], 0, [1], True)]))  # a prefill chunk
    runner.forward(runner.prepare([([1], 5, [1], True)] * 3))  # 3 decodes > largest bucket (2)
    assert runner.graphs.replays == 0
    runner.forward(runner.prepare([([1], 5, [1], True)] * 2))
    assert runner.graphs.replays == 1


def test_given_embeddings_run_eagerly(demo_model_path):
    # A one-row input_embeds prompt (or the last row of one) makes a decode-shaped step, but the
    # graphs embed token ids only: it must run eagerly, with the given row.
    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=2)
    assert runner.enable_decode_graphs(capture=eager_replay) is None
    row = torch.randn(1, runner.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.02
    chunks = [([1], 0, [1], True), ([2], 0, [2], True)]
    logits = runner.forward(runner.prepare(chunks, embeds=[row, None]))
    assert runner.graphs.replays == 0
    want = runner.eager_forward(runner.prepare(chunks, embeds=[row, None]))
    torch.testing.assert_close(logits, want)
    assert not torch.allclose(logits[0], runner.eager_forward(runner.prepare(chunks))[0])


def test_bad_capture_is_rejected(demo_model_path):
    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=4)

    def wrong(forward, pool):  # replays something other than the forward pass
        out = forward()
        return (lambda: out.zero_()), out

    problem = runner.enable_decode_graphs(capture=wrong)
    assert problem and "difference" in problem and runner.graphs is None

    def failing(forward, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    problem = runner.enable_decode_graphs(capture=failing)
    assert problem and "capture failed" in problem and runner.graphs is None
    assert ModelRunner(demo_model_path, BLOCKS, BS, device="cpu").enable_decode_graphs() is not None


def test_flat_prefill_steps_replay_decode_graphs_and_equal_the_general_layout(demo_model_path):
    # flat_prefill_tokens: steps of at most 32 tokens, prefill chunks included, laid out as decode
    # rows (one paged-kernel query per token) and replayed from the decode graphs, which then
    # hand back only the logits the step wants (the chunks' last rows, prompt logprob rows).
    # Against the general layout, run eagerly: the same tokens and the same prompt logprobs.
    general, flat = _flat_engine(demo_model_path, False), _flat_engine(demo_model_path, True)
    flat_steps = []
    prepare_flat = flat.model._prepare_flat
    flat.model._prepare_flat = lambda chunks: flat_steps.append(sum(len(c[0]) for c in chunks)) or prepare_flat(chunks)
    lp = _same_as_the_general_layout(general, flat, (3, 45, 70, 9, 100), new_tokens=(5, 4), logprobs_of=1, seed=11)
    assert len(lp) == 45 and lp[0] is None
    assert flat_steps and max(flat_steps) > 1  # prefill chunks went flat ...
    assert flat.model.graphs.replays >= len(flat_steps)  # ... and replayed graphs, with the decodes


def _same_as_the_general_layout(general: LLMEngine, other: LLMEngine, lengths: tuple[int, ...],
                                new_tokens: tuple[int, int], logprobs_of: int, seed: int) -> list:
    """Greedy prompts of these lengths (prompt i: new_tokens[0] + i * new_tokens[1] tokens; prompt
    `logprobs_of` with its prompt logprobs) on both engines: the same tokens and prompt logprobs,
    both pools free after. Returns `other`'s prompt logprobs."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(general.vocab_size) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_new_tokens=new_tokens[0] + new_tokens[1] * i, temperature=0.0, ignore_eos=True,
                             **({"return_logprob": True, "logprob_start_len": 0} if i == logprobs_of else {}))
              for i in range(len(lengths))]
    want = general.generate(prompts, params)
    got = other.generate(prompts, params)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    lp_got = [e[0] for e in got[logprobs_of].logprobs["input_token_logprobs"]]
    lp_want = [e[0] for e in want[logprobs_of].logprobs["input_token_logprobs"]]
    assert lp_want[0] is None
    torch.testing.assert_close(torch.tensor(lp_got[1:]), torch.tensor(lp_want[1:]))
    for eng in (general, other):
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return lp_got


def _flat_engine(path, flat: bool, query_tile: int = 1, tokens: int = 32) -> LLMEngine:
    """Steps of at most `tokens` tokens; `flat`: laid out flat and replayed from graphs
    (eager_replay), `query_tile` > 1: through the Triton kernel (interpreted) in query tiles."""
    eng = LLMEngine(EngineConfig(model_path=path, device="cpu", dtype="float32", num_kv_blocks=BLOCKS,
                                 block_size=BS, max_num_seqs=tokens, enable_prefix_caching=False,
                                 max_num_batched_tokens=tokens, max_prefill_tokens_while_decoding=tokens,
                                 flat_prefill_tokens=tokens if flat else 0))
    if flat:
        eng.model = ModelRunner(path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=tokens)
        eng.model.flat_tokens = tokens
        if query_tile > 1:
            eng.model.decode_attention, eng.model.query_tile = "triton", query_tile
        assert eng.model.enable_decode_graphs(capture=eager_replay) is None
    return eng


def _interpreted() -> bool:
    import kernels.triton_ops as ops

    return ops.interpreted()


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernel on CPU tensors: the interpreter only")
def test_flat_steps_with_query_tiles_equal_the_general_layout(demo_model_path):
    # LLM_QUERY_TILE: the Triton kernel (interpreted here) scores a flat chunk's rows four at a
    # time from tiled graphs of their own; the captured tiled graph was checked against the
    # untiled pass at start-up. The same tokens and prompt logprobs as the general layout.
    general = _flat_engine(demo_model_path, False, tokens=16)
    tiled = _flat_engine(demo_model_path, True, query_tile=4, tokens=16)
    assert tiled.model.graphs.tiled_problem is None and tiled.model.query_tile == 4
    _same_as_the_general_layout(general, tiled, (45, 3, 30, 20), new_tokens=(3, 2), logprobs_of=0, seed=12)
    assert tiled.model.graphs.tiled_replays > 0


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernel on CPU tensors: the interpreter only")
def test_tiles_that_disagree_at_start_up_are_dropped(demo_model_path, monkeypatch):
    # A tiled kernel that is wrong on this device: the tiled graph agrees with the eager tiled
    # pass (both wrong), but the start-up check of the tiled kernel against the untiled one
    # drops the tiled graphs and the tiles, and keeps the decode graphs.
    from kernels import paged_attention

    real = paged_attention.paged_decode_attention

    def broken(*args, query_tiles=None, **kw):
        out = real(*args, query_tiles=query_tiles, **kw)
        return out if query_tiles is None else out * 1.5

    monkeypatch.setattr(paged_attention, "paged_decode_attention", broken)
    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=16)
    runner.decode_attention, runner.query_tile = "triton", 4
    assert runner.enable_decode_graphs(capture=eager_replay) is None
    assert runner.graphs is not None and "(tiled attention up to" in runner.graphs.tiled_problem
    assert runner.query_tile == 1 and not runner.graphs._tiled


@pytest.mark.skipif(not _interpreted(), reason="the Triton kernel on CPU tensors: the interpreter only")
def test_a_tiled_graph_that_disagrees_with_the_eager_tiled_pass_is_dropped(demo_model_path):
    # The kernel is right but the tiled graph's replay is not (its buffers wired wrong, say):
    # the check against the eager tiled pass drops the tiled graphs, the decode graphs stay.
    captures = []

    def capture(forward, pool):
        replay, out = eager_replay(forward, pool)
        captures.append(out)
        if len(captures) <= len(graph_buckets(16)):  # the untiled buckets come first
            return replay, out

        def wrong() -> None:
            replay()
            out.mul_(1.5)

        return wrong, out

    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32, graph_batch=16)
    runner.decode_attention, runner.query_tile = "triton", 4
    assert runner.enable_decode_graphs(capture=capture) is None
    assert len(captures) == len(graph_buckets(16)) + 1
    assert runner.graphs is not None and "(logits up to" in runner.graphs.tiled_problem
    assert runner.query_tile == 1 and not runner.graphs._tiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graph capture: CUDA only")
def test_cuda_query_tiles_pass_the_start_up_check_on_a_deep_bf16_model(demo_model_path, tmp_path, monkeypatch):
    # On an H200 the 0.4B model (24 layers, bf16) lost its tiles at start-up: the tiled graph's
    # logits differed from the untiled pass by 0.047 of 2.9, a reduction order's bf16 ulps grown
    # over 24 layers. The check now compares like with like; a narrow model as deep keeps them.
    import subprocess
    import sys

    out = tmp_path / "deep"
    subprocess.run([sys.executable, "-m", "bench.make_random_model", "--out", str(out), "--tokenizer-from",
                    str(demo_model_path), "--hidden", "448", "--layers", "24", "--heads", "7", "--kv-heads", "1",
                    "--intermediate", "512", "--max-position", "2048"], check=True, capture_output=True)
    monkeypatch.setenv("LLM_QUERY_TILE", "auto")
    runner = ModelRunner(str(out), BLOCKS, BS, device="cuda", dtype=torch.bfloat16, graph_batch=128)
    assert runner.query_tile == 9
    assert runner.enable_decode_graphs() is None
    assert runner.graphs.tiled_problem is None and runner.query_tile == 9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graph capture: CUDA only")
def test_cuda_graphs_equal_eager_on_gpu(demo_model_path):
    def engine(graphs: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=demo_model_path, device="cuda", dtype="float32", num_kv_blocks=BLOCKS,
                                      block_size=BS, max_num_seqs=16, cuda_graphs=graphs))

    graphed, eager = engine(True), engine(False)
    assert graphed.model.graphs is not None and eager.model.graphs is None
    rng = random.Random(5)
    prompts = [[rng.randrange(eager.vocab_size) for _ in range(rng.randint(3, 70))] for _ in range(11)]
    params = [SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(11)]
    want = eager.generate(prompts, params)
    got = graphed.generate(prompts, params)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert graphed.model.graphs.replays > 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real CUDA graph capture: CUDA only")
@pytest.mark.parametrize("query_tile", ["1", "auto", "3"])
def test_cuda_flat_prefill_steps_equal_eager_on_gpu(demo_model_path, query_tile, monkeypatch):
    # flat_prefill_tokens on a GPU: steps carrying prefill chunks replay the captured decode
    # graphs (with LLM_QUERY_TILE, tiled graphs of their own, checked at start-up against the
    # untiled pass); against the eager general layout, the same greedy tokens.
    monkeypatch.setenv("LLM_QUERY_TILE", query_tile)

    def engine(flat: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=demo_model_path, device="cuda", dtype="float32", num_kv_blocks=BLOCKS,
                                      block_size=BS, max_num_seqs=32, max_num_batched_tokens=32,
                                      max_prefill_tokens_while_decoding=32, flat_prefill_tokens=32 if flat else 0,
                                      cuda_graphs=flat))

    flat, eager = engine(True), engine(False)
    assert flat.model.graphs is not None
    rng = random.Random(9)
    prompts = [[rng.randrange(eager.vocab_size) for _ in range(rng.randint(3, 90))] for _ in range(9)]
    params = [SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(9)]
    want = eager.generate(prompts, params)
    replays = flat.model.graphs.replays
    got = flat.generate(prompts, params)
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert flat.model.graphs.replays - replays > 10
    assert flat.model.graphs.tiled_problem is None
    assert (flat.model.graphs.tiled_replays > 0) == (query_tile != "1")


def test_cuda_runner_keeps_sdpa_off_cudnn(demo_model_path):
    """cuDNN's SDPA builds a graph per new shape (tens of ms; backend/model_runner.py): a CUDA
    runner turns that backend off, a CPU runner leaves the process's setting alone."""
    from backend.model_runner import avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        if torch.cuda.is_available():
            ModelRunner(demo_model_path, BLOCKS, BS, device="cuda")
        else:
            avoid_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_decode_only_layout_equals_the_general_one(demo_model_path):
    # prepare()'s one-pass layout for steps where every sequence decodes and samples
    # (_prepare_decode) against the general layout of the same step: the same tensors, and the
    # same logits from the forward pass.
    runner = ModelRunner(demo_model_path, BLOCKS, BS, device="cpu", dtype=torch.float32)
    rng = random.Random(7)
    free = list(range(BLOCKS))
    rng.shuffle(free)
    chunks = []
    for _ in range(9):
        pos = rng.randint(0, 5 * BS)  # the token's position: its table covers it, some tables longer
        table = [free.pop() for _ in range(pos // BS + 1 + rng.randint(0, 2))]
        chunks.append(([rng.randrange(runner.config.vocab_size)], pos, table, True))
    fast = runner.prepare(chunks)
    general = runner._prepare_general(chunks)
    assert fast.decode_only and general.decode_only
    for name in ("input_ids", "positions", "slot_mapping", "logits_index"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert fast.max_position == general.max_position
    (f,), (g,) = fast.groups, general.groups
    for name in ("token_index", "query_slots", "block_tables", "context_lens"):
        assert torch.equal(getattr(f, name), getattr(g, name)), name
    assert (f.num_seqs, f.max_q) == (g.num_seqs, g.max_q)
    # The cache holds random rows below every position: attention reads real context.
    for cache in (*runner.k_cache, *runner.v_cache):
        cache.normal_()
    assert torch.equal(runner.forward(fast), runner.forward(general))
    # Anything else (a prompt chunk, a row that does not sample) takes the general layout.
    assert not runner.prepare(chunks[:-1] + [([1, 2], 3, [0], True)]).decode_only
    assert runner.prepare(chunks[:-1] + [([1], 3, [0], False)]).logits_index.shape[0] == len(chunks) - 1


def test_the_cuda_defaults_flat_steps_keep_every_feature(demo_model_path):
    """CUDA's default layout (flat steps of up to flat_prefill_tokens, replayed from decode
    graphs) emulated on the CPU, where CI runs: with prefix caching hits, n samples seeded and
    penalized, a grammar, top logprobs, and a pool tight enough to preempt, the same outputs as
    the general layout run eagerly, and both pools free at the end."""
    import json

    def engine(flat: bool) -> LLMEngine:
        eng = LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", dtype="float32", num_kv_blocks=40,
                                     block_size=BS, max_num_seqs=16, enable_prefix_caching=True, max_model_len=256,
                                     max_num_batched_tokens=64, max_prefill_tokens_while_decoding=64,
                                     flat_prefill_tokens=32 if flat else 0))
        if flat:
            eng.model = ModelRunner(demo_model_path, 40, BS, device="cpu", dtype=torch.float32, graph_batch=32)
            eng.model.flat_tokens = 32
            assert eng.model.enable_decode_graphs(capture=eager_replay) is None
        return eng

    rng = random.Random(19)
    shared = [rng.randrange(100, 4000) for _ in range(40)]
    prompts = [shared + [rng.randrange(100, 4000) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})
    raws = [
        {"temperature": 0.8, "top_k": 40, "seed": 3, "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.3},
        {"temperature": 0.0, "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0},
        {"temperature": 0.7, "seed": 8, "json_schema": schema},
        {"temperature": 0.9, "top_p": 0.8, "seed": 11, "repetition_penalty": 1.1},
        {"temperature": 0.0, "n": 2},
        {"temperature": 0.6, "min_p": 0.05, "seed": 4},
    ]
    runs = {}
    for flat in (False, True):
        eng = engine(flat)
        layouts = []
        prepare_flat = eng.model._prepare_flat
        eng.model._prepare_flat = lambda chunks: layouts.append(len(chunks)) or prepare_flat(chunks)
        try:
            params = [eng.parse_params({**raw, "max_new_tokens": 48, "ignore_eos": "json_schema" not in raw})
                      for raw in raws]
            outs = eng.generate(prompts, params)
            runs[flat] = outs, eng.scheduler.num_preemptions, eng.stats(), layouts
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        finally:
            eng.shutdown()
    (want, preempted, plain_stats, _), (got, preempted_flat, stats, flat_layouts) = runs[False], runs[True]
    assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert all(o.error is None for o in got)
    for a, b in zip(got, want):
        if b.logprobs:
            for key in ("input_token_logprobs", "output_token_logprobs"):
                torch.testing.assert_close(torch.tensor([e[0] for e in a.logprobs[key][1:]]),
                                           torch.tensor([e[0] for e in b.logprobs[key][1:]]))
            assert [[t for _, t, _ in row] for row in a.logprobs["output_top_logprobs"]] == [
                [t for _, t, _ in row] for row in b.logprobs["output_top_logprobs"]]
    assert preempted > 0 and preempted_flat > 0
    assert stats.prefix_cache_hits > 0 and plain_stats.prefix_cache_hits > 0
    assert flat_layouts and eng.model.graphs.replays > 0

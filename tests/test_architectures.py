"""The engine against Hugging Face generate on the other supported architectures.

The demo model is Qwen2 (biased QKV, tied embeddings). Llama (no QKV bias, llama3 rope scaling,
untied head), Qwen3 (per-head q/k RMSNorm), Gemma 3 (its norms, scales, two ropes and soft cap)
and the mixture-of-experts models (Qwen2-MoE with its shared expert, Qwen3-MoE, Mixtral) take
other branches of the model runner; each gets a tiny
random model here, with the demo tokenizer, and must match HF greedy token for token through the
real step loop (batched prefill, then decodes on the paged kernel); the greedy and logits tests
run on LLM_TEST_DEVICE (scripts/gpu_check.sh's engine step: cuda).
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from tests.test_engine import TEST_DEVICE

MAX_NEW = 12


def _build(kind: str, demo_model_path, out_dir):
    from transformers import (AutoConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                              Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    base = AutoConfig.from_pretrained(demo_model_path)
    common = dict(
        vocab_size=base.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
    )
    torch.manual_seed(7)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2_yarn":
        # YaRN as Qwen's model cards add it for long contexts: the pretraining length stays in
        # max_position_embeddings, the factor stretches it (here 64 -> 256).
        cfg = Qwen2Config(**{**common, "max_position_embeddings": 64}, tie_word_embeddings=True,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
        model = Qwen2ForCausalLM(cfg)
    elif kind == "mistral_swa":
        # Mistral's sliding window in every layer, narrower than the longer prompts.
        cfg = MistralConfig(**common, sliding_window=32, tie_word_embeddings=False)
        model = MistralForCausalLM(cfg)
    elif kind == "qwen2_mixed_swa":
        # Qwen2's use_sliding_window from max_window_layers on: layer 0 full, layer 1 sliding.
        cfg = Qwen2Config(**common, sliding_window=32, use_sliding_window=True, max_window_layers=1,
                          tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "qwen2_moe":
        # 8 experts, 2 a token, not renormalised, a gated shared expert; layer 1 sparse, layer 0
        # a dense MLP (mlp_only_layers).
        cfg = Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                             shared_expert_intermediate_size=96, norm_topk_prob=False, mlp_only_layers=[0],
                             tie_word_embeddings=False)
        model = Qwen2MoeForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                             norm_topk_prob=True, tie_word_embeddings=False)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "mixtral":
        cfg = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
        model = MixtralForCausalLM(cfg)
    elif kind == "gemma3":
        # Gemma 3: (1 + w) norms around both sublayers, scaled embeddings, GELU, q/k norms, a
        # softmax scale of its own, sliding layers with a rope of their own base beside a global
        # layer whose rope is linearly scaled, and soft-capped logits.
        from transformers import Gemma3TextConfig, Gemma3ForCausalLM

        cfg = Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                               sliding_window=32, layer_types=["sliding_attention", "full_attention",
                                                               "sliding_attention"],
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 10000.0}},
                               final_logit_softcapping=3.0, tie_word_embeddings=True)
        model = Gemma3ForCausalLM(cfg)
    elif kind == "granite":
        # Granite: Llama with its embedding, softmax, residual and logit scales in the config.
        from transformers import GraniteConfig, GraniteForCausalLM

        cfg = GraniteConfig(**common, embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.6,
                            logits_scaling=2.5, tie_word_embeddings=True)
        model = GraniteForCausalLM(cfg)
    elif kind == "olmo2":
        # OLMo 2: no pre-norms, each sublayer's output normed before its residual add, q and k
        # normed across all their heads.
        from transformers import Olmo2Config, Olmo2ForCausalLM

        cfg = Olmo2Config(**common, tie_word_embeddings=False, pad_token_id=0)
        model = Olmo2ForCausalLM(cfg)
    elif kind == "phi3":
        # Phi-3 / Phi-4: q, k, v and gate, up stored fused; a sliding window in every layer.
        from transformers import Phi3Config, Phi3ForCausalLM

        cfg = Phi3Config(**common, sliding_window=32, tie_word_embeddings=False, pad_token_id=0)
        model = Phi3ForCausalLM(cfg)
    elif kind == "llama_biased_gelu":
        # attention_bias biases o_proj too in Llama; mlp_bias gate/up/down; another activation.
        cfg = LlamaConfig(**common, attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh")
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(cfg)
    # Random init is near zero everywhere; larger weights make the logits decisive enough that
    # float32 summation order cannot flip an argmax.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model = model.float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in demo_model_path.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out_dir / f.name)
    return model


def _assert_hf_greedy(hf, prompts, outs, new: int) -> None:
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        assert out.new_token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind, chunk, flat", [("llama", None, False), ("qwen3", None, False),
                                               ("llama_biased_gelu", None, False), ("qwen2_yarn", None, False),
                                               ("mistral_swa", None, False), ("mistral_swa", 24, False),
                                               ("mistral_swa", 24, True), ("qwen2_mixed_swa", None, False),
                                               ("qwen2_mixed_swa", 24, False), ("qwen2_mixed_swa", 24, True),
                                               ("qwen2_moe", None, False), ("qwen3_moe", 24, False),
                                               ("mixtral", 24, True), ("qwen3_moe_loop", None, False),
                                               ("gemma3", None, False), ("gemma3", 24, False), ("gemma3", 24, True),
                                               ("phi3", None, False), ("phi3", 24, True), ("granite", 24, False),
                                               ("olmo2", 24, False)])
def test_engine_matches_hf_greedy(kind, chunk, flat, demo_model_path, tmp_path, monkeypatch):
    from pathlib import Path

    import backend.moe

    looped = kind.endswith("_loop")
    if looped:  # experts one matmul pair each, as where torch has no grouped_mm
        kind = kind[: -len("_loop")]
        monkeypatch.setattr(backend.moe, "grouped_mm_works", lambda device, dtype: False)
    hf = _build(kind, Path(demo_model_path), tmp_path)
    # chunk: prefill in chunks of that many tokens, so a chunk starts past the sliding window;
    # flat: every step (at most `chunk` tokens) as paged-kernel queries, the window in the kernel
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device=TEST_DEVICE, dtype="float32", num_kv_blocks=64,
                                    block_size=16, sampling_defaults="openai",
                                    **({"max_num_batched_tokens": chunk, "max_prefill_tokens_while_decoding": chunk}
                                       if chunk else {}),
                                    **({"flat_prefill_tokens": chunk} if flat else {})))
    flat_steps = []
    if flat:
        prepare_flat = engine.model._prepare_flat
        engine.model._prepare_flat = lambda chunks: flat_steps.append(len(chunks)) or prepare_flat(chunks)
    try:
        rng = random.Random(1)
        # Lengths past the llama3 / YaRN rope's original 64 positions and Mistral's 32-token window.
        prompts = [[rng.randrange(10, hf.config.vocab_size) for _ in range(n)] for n in (5, 40, 90)]
        params = engine.parse_params({"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True})
        outs = engine.generate(prompts, params)
        _assert_hf_greedy(hf, prompts, outs, MAX_NEW)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        if flat:  # every prefill step went flat, prompts past the window among them
            assert len(flat_steps) >= (5 + 40 + 90) // chunk and max(flat_steps) > 1
        if kind == "qwen2_yarn":
            assert engine.max_model_len == 256  # 64 pretrained x factor 4, as vLLM reads it
        if kind == "mistral_swa":
            assert engine.model.windows == (32, 32) and engine.max_model_len == 512  # not capped at the window
        if kind == "qwen2_mixed_swa":
            assert engine.model.windows == (0, 32) and engine.max_model_len == 512
        if kind == "phi3":
            assert engine.model.windows == (32, 32)
        if kind == "gemma3":  # the linear factor does not stretch Gemma 3's context (vLLM's reading)
            assert engine.model.windows == (32, 0, 32) and engine.max_model_len == 512
            assert engine.model._uses_local_rope == [True, False, True]
        if kind.endswith("moe") or kind == "mixtral":
            moe = engine.model.config.moe_layers
            assert moe == ((False, True) if kind == "qwen2_moe" else (True, True)), moe
            assert ["router" in layer for layer in engine.model.layers] == list(moe)
            if TEST_DEVICE == "cpu":  # torch 2.13's grouped_mm runs there (on CUDA: bf16 on Hopper)
                assert engine.model.grouped_experts is not looped
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["gemma3", "qwen2_moe", "qwen3_moe", "mixtral", "phi3", "granite", "olmo2"])
def test_one_mixed_step_gives_hf_logits(kind, demo_model_path, tmp_path):
    """Logits, not only the argmax: a monotone change (Gemma's soft cap) or a small one (its
    softmax scale) leaves greedy tokens alone. A prompt's first chunk, another's later chunk and
    a decode in one step, against HF's logits at the same positions."""
    from pathlib import Path

    from backend.model_runner import ModelRunner
    from tests.test_engine import mixed_step, mixed_step_hf_logits

    hf = _build(kind, Path(demo_model_path), tmp_path)
    _, logits = mixed_step(ModelRunner(str(tmp_path), 64, 16, device=TEST_DEVICE, dtype=torch.float32))
    torch.testing.assert_close(logits, mixed_step_hf_logits(hf), atol=2e-4, rtol=1e-4)


def test_sliding_window_model_runs_past_the_pool_on_released_blocks(demo_model_path, tmp_path):
    # Mistral, window 32, blocks of 16: two sequences of 190 and 160 tokens need 22 blocks with
    # every block kept, and a pool of 12 would preempt. Released behind the window (prefill in
    # 24-token chunks, so it happens mid-prompt too), they run side by side, reusing released
    # blocks at once, and still match HF greedy token for token.
    from pathlib import Path

    hf = _build("mistral_swa", Path(demo_model_path), tmp_path)
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=12,
                                    block_size=16, sampling_defaults="openai", max_num_batched_tokens=24,
                                    max_prefill_tokens_while_decoding=24, enable_prefix_caching=False))
    try:
        assert engine.block_manager.sliding_window == 32
        rng = random.Random(3)
        prompts = [[rng.randrange(10, hf.config.vocab_size) for _ in range(n)] for n in (90, 60)]
        new = 100
        params = engine.parse_params({"temperature": 0, "max_new_tokens": new, "ignore_eos": True})
        outs = engine.generate(prompts, params)
        _assert_hf_greedy(hf, prompts, outs, new)
        assert engine.scheduler.num_preemptions == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()
    # The pool must hold a window and a step's tokens from any offset: 31 + 24 tokens -> 5 blocks.
    from backend.engine import ModelRunnerSizing

    small = EngineConfig(model_path=str(tmp_path), device="cpu", num_kv_blocks=4, block_size=16, max_num_batched_tokens=24)
    with pytest.raises(ValueError, match="cannot hold the sliding window of 32 and a step's 24 tokens"):
        ModelRunnerSizing(tmp_path, small)
    assert ModelRunnerSizing(tmp_path, small.model_copy(update={"num_kv_blocks": 5})).num_blocks == 5


def test_sliding_window_release_with_prefix_caching_keeps_outputs_exact(demo_model_path, tmp_path):
    # A 100-token prefix shared by three prompts, prefix caching on: the later prompts find the
    # first one's blocks cached, those its window had already released included (kept in the
    # pool's LRU with their contents), and release their own copies behind the window again.
    from pathlib import Path

    hf = _build("mistral_swa", Path(demo_model_path), tmp_path)
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=32,
                                    block_size=16, sampling_defaults="openai", enable_prefix_caching=True))
    try:
        rng = random.Random(5)
        prefix = [rng.randrange(10, hf.config.vocab_size) for _ in range(100)]
        prompts = [prefix + [rng.randrange(10, hf.config.vocab_size) for _ in range(n)] for n in (3, 20, 41)]
        params = engine.parse_params({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        outs = [engine.generate([p], params)[0] for p in prompts]  # one after another: the cache is warm
        _assert_hf_greedy(hf, prompts, outs, 40)
        assert [o.cached_tokens for o in outs] == [0, 96, 96]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("first_new", [1, 40])
def test_a_cached_prefix_on_a_window_sized_pool(first_new, demo_model_path, tmp_path):
    # Mistral, window 32, a pool of 12 blocks of 16; the second prompt shares 176 tokens (11
    # blocks) with the first.
    # first_new=1: the first stops at 192 tokens, so the whole prefix is still cached. Admitting
    # the second took every cached block of it, those behind the window too: 11 cached blocks and
    # the new ones never fit, and the request waited forever. Only the blocks its window sees
    # are taken now.
    # first_new=40: the first runs 15 blocks long. Its head blocks, released as it moved on, are
    # the first reused; the second's window needs only the last two prefix blocks, still cached.
    # The lookup ended at the first evicted block and recomputed all 176 tokens.
    from pathlib import Path

    hf = _build("mistral_swa", Path(demo_model_path), tmp_path)
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=12,
                                    block_size=16, sampling_defaults="openai", max_num_batched_tokens=24,
                                    max_prefill_tokens_while_decoding=24, enable_prefix_caching=True))
    try:
        rng = random.Random(first_new)
        first = [rng.randrange(10, hf.config.vocab_size) for _ in range(191)]
        second = first[:176] + [rng.randrange(10, hf.config.vocab_size) for _ in range(30)]
        outs = []
        for prompt, n in ((first, first_new), (second, 8)):
            got = []
            engine.add_request(prompt, engine.parse_params({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}),
                               lambda out: got.append(out if not got else got.pop().merge(out)))
            for _ in range(500):  # bounded: one bug was a request that waits for ever
                if not engine.has_unfinished():
                    break
                engine.step()
            assert not engine.has_unfinished() and got[0].finished
            outs.append(got[0])
        _assert_hf_greedy(hf, [first], outs[:1], first_new)
        _assert_hf_greedy(hf, [second], outs[1:], 8)
        assert [o.cached_tokens for o in outs] == [0, 176]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_model_directories_as_published_load_as_transformers_loads_them(demo_model_path, tmp_path):
    # QA on real repos' layouts: which layers slide, as transformers reads each config; a
    # max_model_len past the model's context is refused; EOS ids from config.json count without
    # generation_config.json; only the shards the index names load (Mistral repos add
    # consolidated.safetensors).
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from backend.engine import ModelRunnerSizing

    _build("llama", Path(demo_model_path), tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "model_type": "mistral", "sliding_window": 128, "eos_token_id": [4093, 7],
                                    "rope_scaling": None, "max_position_embeddings": 160}))
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    weights = json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}})
    (tmp_path / "model.safetensors.index.json").write_text(weights)
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, str(tmp_path / "consolidated.safetensors"))
    assert ModelRunnerSizing(tmp_path, EngineConfig(model_path=str(tmp_path), num_kv_blocks=64)).max_model_len == 160
    with pytest.raises(ValueError, match="max_model_len 256 is more than the model's context, max_position_embeddings 160"):
        ModelRunnerSizing(tmp_path, EngineConfig(model_path=str(tmp_path), num_kv_blocks=64, max_model_len=256))
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64))
    try:
        assert {4093, 7} <= set(engine.eos_ids) and engine.max_model_len == 160 and engine.model.windows == (128, 128)
        with pytest.raises(Exception, match="context is 160 tokens"):
            engine.add_request(list(range(10, 170)), engine.parse_params({}), lambda out: None)
    finally:
        engine.shutdown()
    from backend.model_runner import ModelConfig

    qwen2 = {"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}
    for extra, windows in (
        ({"model_type": "qwen2", "sliding_window": 64}, (0, 0)),  # unused unless use_sliding_window
        (qwen2, (0, 0)),  # from layer max_window_layers (28 by default) on: none of these 2
        ({**qwen2, "max_window_layers": 1}, (0, 64)),
        ({**qwen2, "max_window_layers": 0}, (64, 64)),
        ({"model_type": "mistral", "sliding_window": 64}, (64, 64)),
        ({"model_type": "mistral", "sliding_window": None}, (0, 0)),
        ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}, (64, 0)),
        ({"model_type": "qwen3", "sliding_window": 64}, (0, 0)),
        ({"model_type": "llama", "sliding_window": 64}, (0, 0)),
    ):
        cfg_path.write_text(json.dumps({**cfg, **extra}))
        model = ModelConfig.from_model_dir(tmp_path)
        assert (model.context_limit, model.layer_windows) == (512, windows), extra
    cfg_path.write_text(json.dumps({**cfg, "hidden_act": "sigmoid"}))
    with pytest.raises(ValueError, match="unsupported hidden_act 'sigmoid'"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", num_kv_blocks=64))


@pytest.mark.parametrize("scaling, context", [
    (None, 512),
    ({"rope_type": "linear", "factor": 2.0}, 1024),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}, 1024),
    ({"rope_type": "yarn", "factor": 4.0}, 2048),  # no original length given: max_position_embeddings is it
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, 512),  # already the long one
])
def test_rope_scaling_stretches_the_context_as_vllm_reads_it(scaling, context, demo_model_path, tmp_path):
    import json
    from pathlib import Path

    from backend.model_runner import ModelConfig

    cfg = json.loads((Path(demo_model_path) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512, "rope_scaling": scaling}))
    assert ModelConfig.from_model_dir(tmp_path).context_limit == context


def test_an_unsupported_rope_scaling_is_refused_by_name(demo_model_path, tmp_path):
    import json
    from pathlib import Path

    cfg = json.loads((Path(demo_model_path) / "config.json").read_text())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        src = Path(demo_model_path) / name
        if src.exists() and name != "config.json":
            shutil.copy2(src, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'.*yarn"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", num_kv_blocks=64, max_model_len=256))


def test_pytorch_bin_checkpoints_load_as_safetensors_do(demo_model_path, tmp_path):
    """Older repos ship pytorch_model.bin (sharded with pytorch_model.bin.index.json); vLLM loads
    them, so does the engine (weights_only: tensors, never code), with the same outputs."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    hf = _build("llama", Path(demo_model_path), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, tmp_path / shard)
    (tmp_path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    engine = LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64,
                                    block_size=16, sampling_defaults="openai"))
    try:
        prompts = [[5, 17, 300, 42, 9]]
        outs = engine.generate(prompts, engine.parse_params({"temperature": 0, "max_new_tokens": MAX_NEW,
                                                             "ignore_eos": True}))
        _assert_hf_greedy(hf, prompts, outs, MAX_NEW)
    finally:
        engine.shutdown()
    for f in list(tmp_path.glob("pytorch_model*")):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="neither \\*.safetensors nor pytorch_model\\*.bin"):
        LLMEngine(EngineConfig(model_path=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64))


def test_a_mixture_of_experts_model_runs_eagerly_and_takes_attention_adapters_only(demo_model_path, tmp_path):
    """Grouped into one grouped_mm per projection, computed on the device, the experts fit in a
    decode graph; where torch has no grouped_mm they run a matmul pair each, whose counts are
    read on the host, which a CUDA graph cannot: decode graphs stay off then, saying why. LoRA on
    the attention of an MoE model loads and changes the output; on
    an MoE layer's MLP it is refused, naming the layer (its weights are the experts')."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from backend.decode_graphs import eager_replay
    from backend.lora import LoraError
    from backend.model_runner import ModelRunner

    model_dir = tmp_path / "model"
    _build("qwen3_moe", Path(demo_model_path), model_dir)
    runner = ModelRunner(str(model_dir), 64, 16, device="cpu", dtype=torch.float32, graph_batch=8)
    assert runner.grouped_experts and runner.enable_decode_graphs(capture=eager_replay) is None
    runner.grouped_experts = False
    assert runner.enable_decode_graphs(capture=eager_replay) == \
        "mixture-of-experts layers group their tokens by expert on the host (no grouped_mm here)"

    def adapter(name: str, module: str) -> Path:
        out = tmp_path / name
        out.mkdir()
        (out / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": [module]}))
        part = "self_attn" if module.endswith(("q_proj", "o_proj")) else "mlp"
        g = torch.Generator().manual_seed(0)
        rows = 64 if module == "q_proj" else 128
        save_file({f"base_model.model.model.layers.0.{part}.{module}.lora_A.weight": torch.randn(2, 64, generator=g),
                   f"base_model.model.model.layers.0.{part}.{module}.lora_B.weight": torch.randn(rows, 2, generator=g)},
                  str(out / "adapter_model.safetensors"))
        return out

    with pytest.raises(LoraError, match=r"layer 0 gate_proj: the layer's MLP is a mixture of experts"):
        runner.load_lora("mlp", adapter("mlp", "gate_proj"))
    # A config that says other experts than the checkpoint holds is refused at load, naming them.
    wrong = tmp_path / "wrong"
    shutil.copytree(model_dir, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 32}))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has shape \[48, 64\] .*"
                                         r"moe_intermediate_size 32"):
        ModelRunner(str(wrong), 64, 16, device="cpu", dtype=torch.float32)
    (wrong / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 9}))
    with pytest.raises(ValueError, match=r"num_experts_per_tok 9 must be in 1\.\.the number of experts \(8\)"):
        ModelRunner(str(wrong), 64, 16, device="cpu", dtype=torch.float32)
    engine = LLMEngine(EngineConfig(model_path=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                                    block_size=16, sampling_defaults="openai",
                                    lora_modules={"attn": str(adapter("attn", "q_proj"))}))
    try:
        prompt = [[11, 12, 13, 14, 15]]
        base = engine.generate(prompt, engine.parse_params({"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}))
        tuned = engine.generate(prompt, engine.parse_params({"temperature": 0, "max_new_tokens": 8, "ignore_eos": True,
                                                             "lora_path": "attn"}))
        assert base[0].new_token_ids != tuned[0].new_token_ids
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.shutdown()


def test_a_gemma3_config_of_either_generation_reads_alike_and_gemma2_capping_is_refused(demo_model_path, tmp_path):
    """transformers 5 writes Gemma 3's ropes per layer type (rope_parameters) and its layer
    pattern as layer_types; configs on the Hub from before say rope_theta / rope_scaling /
    rope_local_base_freq and sliding_window_pattern. Both give the same model."""
    import json
    from pathlib import Path

    from backend.model_runner import ModelConfig, ModelRunner
    from tests.test_engine import mixed_step

    model_dir = tmp_path / "new"
    _build("gemma3", Path(demo_model_path), model_dir)
    old = tmp_path / "old"
    shutil.copytree(model_dir, old)
    cfg = json.loads((model_dir / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        cfg.pop(key)
    cfg.update(rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_local_base_freq=100.0,
               sliding_window_pattern=2)
    (old / "config.json").write_text(json.dumps(cfg))
    new_cfg, old_cfg = ModelConfig.from_model_dir(model_dir), ModelConfig.from_model_dir(old)
    for field in ("rope_theta", "rope_type", "local_rope_theta", "layer_windows", "query_pre_attn_scalar",
                  "final_logit_softcapping", "context_limit"):
        assert getattr(new_cfg, field) == getattr(old_cfg, field), field
    runners = [ModelRunner(str(d), 64, 16, device="cpu", dtype=torch.float32) for d in (model_dir, old)]
    assert torch.equal(mixed_step(runners[0])[1], mixed_step(runners[1])[1])
    (old / "config.json").write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
    with pytest.raises(ValueError, match="attn_logit_softcapping is not supported"):
        ModelConfig.from_model_dir(old)


def test_phi3_refuses_what_it_cannot_run_by_name(demo_model_path, tmp_path):
    """Phi-4-mini's partial rotary and Phi-3.5's longrope (short and long factors picked by
    length) are refused at load, saying which, rather than run wrong."""
    import json
    from pathlib import Path

    from backend.model_runner import ModelRunner

    _build("phi3", Path(demo_model_path), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for change, message in [({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
                            ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                               "long_factor": [2.0] * 8}},
                             "unsupported rope scaling type 'longrope'")]:
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=message):
            ModelRunner(str(tmp_path), 64, 16, device="cpu", dtype=torch.float32)

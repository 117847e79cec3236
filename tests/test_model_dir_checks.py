"""config.json against transformers and against the checkpoint, at load.

A key config.json leaves out means what transformers' config class for the model type makes of
it (Qwen3's head_dim 128, Qwen2's 32 KV heads, Mistral's 8 KV heads and 4096-token window, each
type's max_position_embeddings), and every weight's shape is checked against what the config
implies, so a config that does not fit its checkpoint is refused at load, naming the weight and
the fields, instead of failing every request once the server is up.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model_config import _DEFAULTED_KEYS
from backend.model_runner import ModelConfig, ModelRunner

TINY = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def _save(model, out: Path, demo_model_path, drop: tuple[str, ...] = ()) -> Path:
    """Save an HF model with the demo tokenizer; `drop`: keys then removed from config.json."""
    with torch.no_grad():  # decisive logits: summation order cannot flip an argmax
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.float().eval().save_pretrained(out, safe_serialization=True)
    for f in Path(demo_model_path).iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


# ------------------------------------------------------------------ defaults
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("drop", [
    ("head_dim",), ("num_key_value_heads",), ("max_position_embeddings",), ("sliding_window",),
    ("rope_theta", "rope_parameters", "rope_scaling"), ("rms_norm_eps", "tie_word_embeddings", "hidden_act"),
    ("head_dim", "num_key_value_heads", "max_position_embeddings", "sliding_window", "use_sliding_window",
     "max_window_layers", "attention_bias", "mlp_bias", "vocab_size", "intermediate_size"),
])
def test_a_missing_key_means_what_transformers_makes_of_it(model_type, drop, tmp_path):
    from transformers import AutoConfig

    cfg = {"model_type": model_type, **TINY, "hidden_size": 256, "num_attention_heads": 32, "num_key_value_heads": 4,
           "head_dim": 16,
           "rms_norm_eps": 1e-5, "rope_theta": 5e5, "tie_word_embeddings": True, "hidden_act": "gelu",
           "sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}
    if model_type == "llama":
        cfg.pop("sliding_window"), cfg.pop("use_sliding_window"), cfg.pop("max_window_layers")
    for key in drop:
        cfg.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(tmp_path)
    got = ModelConfig.from_model_dir(tmp_path)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # Qwen2 has no head_dim field
    if model_type in ("qwen2", "qwen3"):
        windows = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    else:  # Mistral slides in every layer, Llama in none
        windows = (hf.sliding_window or 0,) * hf.num_hidden_layers if model_type == "mistral" else (0, 0)
    assert (got.vocab_size, got.hidden_size, got.intermediate_size, got.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (got.num_heads, got.num_kv_heads, got.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, head_dim)
    assert (got.max_position_embeddings, got.rms_norm_eps, got.rope_theta) == (
        hf.max_position_embeddings, hf.rms_norm_eps, hf.rope_parameters["rope_theta"])
    assert (got.tie_word_embeddings, got.hidden_act, got.layer_windows) == (hf.tie_word_embeddings, hf.hidden_act, windows)
    assert {k for k in drop if k in _DEFAULTED_KEYS} <= got.defaulted and "num_attention_heads" not in got.defaulted


def test_defaults_differ_by_model_type_as_in_transformers(tmp_path):
    # The values QA saw guessed wrong: Qwen3 head_dim 128 (not hidden / heads), Qwen2 32 KV heads,
    # Mistral 8 KV heads and a 4096 window, max_position_embeddings 2048 / 32768 / 131072.
    base = {k: v for k, v in TINY.items() if k not in ("num_key_value_heads", "max_position_embeddings")}
    base.update(hidden_size=256, num_attention_heads=32)
    expect = {"llama": (32, 8, 2048, None), "qwen2": (32, 8, 32768, None), "qwen3": (32, 128, 32768, None),
              "mistral": (8, 8, 131072, 4096)}
    for model_type, want in expect.items():
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **base}))
        got = ModelConfig.from_model_dir(tmp_path)
        assert (got.num_kv_heads, got.head_dim, got.max_position_embeddings, got.sliding_window) == want, model_type


def test_biases_follow_transformers_modeling_per_model_type(tmp_path):
    cases = [({"model_type": "qwen2"}, (True, False, False)),  # Qwen2 biases q, k, v always
             ({"model_type": "llama", "attention_bias": True, "mlp_bias": True}, (True, True, True)),
             ({"model_type": "mistral", "attention_bias": True, "mlp_bias": True}, (False, False, False)),
             ({"model_type": "qwen2", "mlp_bias": True}, (True, False, False))]
    for extra, want in cases:
        (tmp_path / "config.json").write_text(json.dumps({**TINY, **extra}))
        got = ModelConfig.from_model_dir(tmp_path)
        assert (got.attention_bias, got.o_bias, got.mlp_bias) == want, extra


def _build(kind: str, out: Path, demo_model_path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(11)
    base = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    if kind == "qwen3_no_head_dim":  # built with Qwen3's default head_dim, 128 (not 64 / 4)
        model = Qwen3ForCausalLM(Qwen3Config(**base, num_key_value_heads=2))
        return _save(model, out, demo_model_path, drop=("head_dim", "max_position_embeddings"))
    if kind == "qwen2_no_kv_heads":  # 64 heads of 2 over Qwen2's default 32 KV heads (not 64)
        model = Qwen2ForCausalLM(Qwen2Config(**{**base, "hidden_size": 128, "num_attention_heads": 64}))
        return _save(model, out, demo_model_path, drop=("num_key_value_heads",))
    # Mistral: 16 heads over its default 8 KV heads, its default window of 4096
    model = MistralForCausalLM(MistralConfig(**{**base, "num_attention_heads": 16}))
    return _save(model, out, demo_model_path, drop=("num_key_value_heads", "sliding_window", "max_position_embeddings"))


@pytest.mark.parametrize("kind", ["qwen3_no_head_dim", "qwen2_no_kv_heads", "mistral_defaults"])
def test_a_model_dir_missing_keys_runs_as_transformers_runs_it(kind, demo_model_path, tmp_path):
    from transformers import AutoModelForCausalLM

    path = _build(kind, tmp_path, demo_model_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model_path=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                                    block_size=16, max_model_len=512, sampling_defaults="openai"))
    try:
        c = engine.model.config
        assert (c.num_kv_heads, c.head_dim) == (hf.config.num_key_value_heads, hf.model.layers[0].self_attn.head_dim)
        rng = random.Random(2)
        prompts = [[rng.randrange(10, 4000) for _ in range(n)] for n in (5, 40)]
        new = 10
        outs = engine.generate(prompts, engine.parse_params({"temperature": 0, "max_new_tokens": new, "ignore_eos": True}))
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            assert out.new_token_ids == ref[0, len(prompt):].tolist()
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ shapes
@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, demo_model_path):
    """Qwen3 (q/k norms), head_dim 16, untied head: every kind of weight the runner loads but biases."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=False))
    return _save(model, tmp_path_factory.mktemp("qwen3"), demo_model_path)


@pytest.fixture(scope="module")
def llama_biased_dir(tmp_path_factory, demo_model_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(**TINY, head_dim=16, attention_bias=True, mlp_bias=True))
    return _save(model, tmp_path_factory.mktemp("llama"), demo_model_path)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _runner(path: Path) -> ModelRunner:
    return ModelRunner(path, num_blocks=4, block_size=16)


@pytest.mark.parametrize("change, message", [
    # Qwen3's head_dim left out: transformers' 128, not what the checkpoint was built with.
    ({"head_dim": None}, r"model\.layers\.0\.self_attn\.q_proj\.weight has shape \[64, 64\] in the checkpoint, but "
                         r".*config\.json implies \[512, 64\] \(num_attention_heads 4 x head_dim 128 \(not in config\.json: "
                         r"transformers' default\), hidden_size 64\)"),
    ({"num_key_value_heads": 4}, r"self_attn\.k_proj\.weight has shape \[32, 64\] .* implies \[64, 64\] "
                                 r"\(num_key_value_heads 4 x head_dim 16, hidden_size 64\)"),
    ({"vocab_size": 4000}, r"model\.embed_tokens\.weight has shape \[4096, 64\] .* implies \[4000, 64\] \(vocab_size 4000"),
    ({"intermediate_size": 96}, r"mlp\.gate_proj\.weight has shape \[128, 64\] .* implies \[96, 64\] \(intermediate_size 96"),
    ({"hidden_size": 32, "head_dim": 16}, r"model\.embed_tokens\.weight has shape \[4096, 64\] .* implies \[4096, 32\]"),
])
def test_a_config_that_does_not_fit_the_checkpoint_is_refused_at_load(change, message, qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update({k: v for k, v in change.items() if v is not None})
    for k in [k for k, v in change.items() if v is None]:
        cfg.pop(k)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model_path=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=16))


@pytest.mark.parametrize("model, name, shape, message", [
    ("qwen3", "model.norm.weight", (32,), r"implies \[64\] \(hidden_size 64\)"),
    ("qwen3", "model.layers.1.input_layernorm.weight", (63,), r"implies \[64\]"),
    ("qwen3", "model.layers.1.post_attention_layernorm.weight", (65,), r"implies \[64\]"),
    ("qwen3", "model.layers.0.self_attn.v_proj.weight", (48, 64), r"implies \[32, 64\] \(num_key_value_heads 2 x head_dim 16"),
    ("qwen3", "model.layers.1.self_attn.o_proj.weight", (64, 32), r"implies \[64, 64\] \(hidden_size 64, num_attention_heads 4"),
    ("qwen3", "model.layers.0.mlp.up_proj.weight", (130, 64), r"implies \[128, 64\] \(intermediate_size 128"),
    ("qwen3", "model.layers.0.mlp.down_proj.weight", (64, 130), r"implies \[64, 128\] \(hidden_size 64, intermediate_size 128"),
    ("qwen3", "model.layers.0.self_attn.q_norm.weight", (8,), r"implies \[16\] \(head_dim 16\)"),
    ("qwen3", "model.layers.1.self_attn.k_norm.weight", (32,), r"implies \[16\] \(head_dim 16\)"),
    ("qwen3", "lm_head.weight", (4000, 64), r"implies \[4096, 64\] \(vocab_size 4096"),
    ("llama", "model.layers.0.self_attn.q_proj.bias", (32,), r"implies \[64\] \(num_attention_heads 4 x head_dim 16\)"),
    ("llama", "model.layers.0.self_attn.k_proj.bias", (64,), r"implies \[32\] \(num_key_value_heads 2 x head_dim 16\)"),
    ("llama", "model.layers.1.self_attn.o_proj.bias", (32,), r"implies \[64\] \(hidden_size 64\)"),
    ("llama", "model.layers.0.mlp.gate_proj.bias", (64,), r"implies \[128\] \(intermediate_size 128\)"),
    ("llama", "model.layers.1.mlp.down_proj.bias", (128,), r"implies \[64\] \(hidden_size 64\)"),
])
def test_every_weight_is_checked_against_the_config(model, name, shape, message, qwen3_dir, llama_biased_dir, tmp_path):
    path = _copy(qwen3_dir if model == "qwen3" else llama_biased_dir, tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    assert name in weights
    weights[name] = torch.zeros(shape)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(name) + r" has shape " + re.escape(str(list(shape))) +
                       r" in the checkpoint, but .*config\.json " + message):
        _runner(path)


def test_a_gqa_config_whose_heads_do_not_divide_is_refused(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir, tmp_path / "m")
    _edit_config(path, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        ModelConfig.from_model_dir(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("num_key_value_heads")
    (path / "config.json").write_text(json.dumps(cfg))  # Qwen3's default, 32 KV heads
    with pytest.raises(ValueError, match=r"num_key_value_heads 32 \(not in config.json: transformers' default\)"):
        ModelConfig.from_model_dir(path)


def test_tied_config_with_its_own_lm_head_warns_which_is_used(qwen3_dir, tmp_path, caplog):
    path = _copy(qwen3_dir, tmp_path / "m")
    _edit_config(path, tie_word_embeddings=True)
    with caplog.at_level(logging.WARNING, logger="backend.model_runner"):
        runner = _runner(path)
    assert runner.lm_head is runner.embed
    assert "the embeddings are used as the output head" in caplog.text
    caplog.clear()
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # the same values: nothing to say
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="backend.model_runner"):
        _runner(path)
    assert "output head" not in caplog.text



def test_an_untied_model_without_its_lm_head_is_refused(qwen3_dir, tmp_path):
    # QA: it loaded with the embeddings as the output head, and every token was wrong, silently.
    path = _copy(qwen3_dir, tmp_path / "m")
    assert json.loads((path / "config.json").read_text()).get("tie_word_embeddings") is False
    weights = load_file(str(path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight 'lm_head.weight' missing from .*tie_word_embeddings false"):
        _runner(path)


def test_a_broken_file_is_named_in_the_load_error(qwen3_dir, tmp_path):
    """QA: a bare JSONDecodeError or SafetensorError named no file (a sharded model has many),
    and a directory without tokenizer files got transformers' advice to install sentencepiece."""
    from backend.model_runner import weight_files
    from backend.sampling_params import load_model_defaults
    from backend.tokenizer import load_tokenizer

    path = _copy(qwen3_dir, tmp_path / "m")
    (path / "model.safetensors.index.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        weight_files(path)
    (path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json has no weight_map"):
        weight_files(path)
    (path / "model.safetensors.index.json").unlink()
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:7])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        _runner(path)
    (path / "generation_config.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"generation_config\.json is not valid JSON"):
        load_model_defaults(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"):
        (path / name).unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError, match="no tokenizer in .*: none of tokenizer.json"):
        load_tokenizer(path)

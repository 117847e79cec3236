"""The demo model builder: deterministic bytes, loadable by transformers, sane generation."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.demo_model import ADDED_TOKENS, IM_END, build_demo_model

REPO_ROOT = Path(__file__).resolve().parents[1]
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "build_info.json",
)


def hashes(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def hf(demo_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(demo_model_path, local_files_only=True).eval()
    return tok, model


def test_cli_build_is_byte_identical_to_fixture_build(demo_model_path, tmp_path):
    # A separate process (the CLI) must reproduce the session's build bit for bit.
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "backend.demo_model", "--out", str(out), "--seed", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[demo_model] done" in proc.stdout  # progress is printed
    assert sorted(hashes(out)) == sorted(FILES)
    assert hashes(out) == hashes(demo_model_path)


def test_seed_changes_weights_only(demo_model_path, tmp_path):
    other = build_demo_model(tmp_path / "seed1", seed=1, log=lambda msg: None)
    a, b = hashes(demo_model_path), hashes(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert a[name] == b[name]


def test_config_files(demo_model_path, hf):
    tok, model = hf
    cfg = json.loads((demo_model_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
    assert cfg["tie_word_embeddings"] is True and cfg["torch_dtype"] == "float32"
    assert cfg["rope_theta"] == 1e6 and cfg["max_position_embeddings"] == 4096
    # Every token id the tokenizer can produce has an embedding row.
    assert cfg["vocab_size"] >= len(tok) and cfg["vocab_size"] == model.config.vocab_size
    assert 3500 <= len(tok) <= 4096

    ids = {content: tok.convert_tokens_to_ids(content) for content, _ in ADDED_TOKENS}
    gen = json.loads((demo_model_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen["bos_token_id"] is None
    assert (gen["temperature"], gen["top_p"], gen["top_k"], gen["repetition_penalty"]) == (0.7, 0.8, 20, 1.05)
    assert gen["do_sample"] is True

    tcfg = json.loads((demo_model_path / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == IM_END and tcfg["pad_token"] == "<|endoftext|>"
    assert "<tool_call>" in tcfg["chat_template"] and tcfg["model_max_length"] == 4096
    assert tok.eos_token_id == ids["<|im_end|>"] and tok.pad_token_id == ids["<|endoftext|>"]


def test_tokenizer_covers_text_code_cjk_emoji(hf):
    tok, _ = hf
    for text in [
        "Hello, world! The quick brown fox.",
        "  leading spaces,\ttabs\n\nand newlines  ",
        'def f(x):\n    return {"a": [1, 2]}',
        "你好，世界！今天天气很好。",
        "こんにちは、世界",
        "emoji 😀🎉👍🏽 and ZWJ 👨‍👩‍👧",
        "rare: ǅ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x7f",  # not in the corpus: byte-level fallback
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # Common words are single tokens, not byte soup.
    assert len(tok.encode(" the weather", add_special_tokens=False)) == 2


def test_added_tokens_are_atomic_and_tool_call_markers_survive_skipping(hf):
    tok, _ = hf
    text = '<|im_start|>assistant\n<tool_call>\n{"name": "f"}\n</tool_call><|im_end|><|endoftext|>'
    ids = tok.encode(text, add_special_tokens=False)
    for content, _ in ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(content) in ids
    assert tok.decode(ids) == text
    # As in Qwen2.5: <|...|> are special (skipped), <tool_call> markers are not (a tool-call
    # parser must see them in the streamed text).
    assert tok.decode(ids, skip_special_tokens=True) == 'assistant\n<tool_call>\n{"name": "f"}\n</tool_call>'


def test_hf_loads_and_generates_non_degenerate_text(hf):
    tok, model = hf
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=32, pad_token_id=tok.pad_token_id)
    a = model.generate(ids, do_sample=False, min_new_tokens=32, **kwargs)[0, ids.shape[1]:].tolist()
    b = model.generate(ids, do_sample=False, min_new_tokens=32, **kwargs)[0, ids.shape[1]:].tolist()
    assert a == b and len(a) == 32
    assert len(set(a)) >= 8, "greedy output collapsed into a repeated token"
    torch.manual_seed(0)
    s = model.generate(ids, do_sample=True, temperature=0.7, top_p=0.8, top_k=20, **kwargs)[0, ids.shape[1]:].tolist()
    assert len(set(s)) >= 8

    # Next-token distributions are neither uniform nor one-hot.
    text = (Path(__file__).resolve().parents[1] / "backend" / "demo_model" / "corpus.txt").read_text()
    x = torch.tensor([tok.encode(text[:2000])[:256]])
    with torch.no_grad():
        probs = model(x).logits[0].softmax(-1)
    top1 = probs.max(-1).values.median().item()
    assert 0.05 < top1 < 0.9, top1

"""Deterministic builder of the demo model: a tiny random-weight Qwen2 in Hugging Face format.

Everything comes from files in this package (corpus, chat template) and a seed, so the same
seed gives byte-identical files on every run and machine with the same library versions. The
model is meant for tests and CPU demos: it loads with `AutoModelForCausalLM` /
`AutoTokenizer` offline, speaks the Qwen2.5 chat format (ChatML + `<tool_call>`), and its
random weights are scaled so generation is neither uniform noise nor one repeated token.
"""

from __future__ import annotations

import os

# The BPE trainer parallelizes word counting with rayon; pin it to one thread so merge order
# never depends on scheduling (set before `tokenizers` is first imported).
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Iterator, Optional  # noqa: E402

PACKAGE_DIR = Path(__file__).resolve().parent
CORPUS_PATH = PACKAGE_DIR / "corpus.txt"
CHAT_TEMPLATE_PATH = PACKAGE_DIR / "chat_template.jinja"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# (content, special). As in Qwen2.5, <tool_call>/</tool_call> are added tokens (never split,
# one id each) but not *special*: skip_special_tokens must keep them in the text, otherwise a
# tool-call parser downstream could not see where a call starts and ends.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (ENDOFTEXT, True),
    (IM_START, True),
    (IM_END, True),
    (TOOL_CALL_START, False),
    (TOOL_CALL_END, False),
)

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs,
# newlines and whitespace.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape of the demo model; defaults keep CPU tests fast."""

    vocab_target: int = 4096  # total ids incl. added tokens, if the corpus allows that many merges
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    model_max_length: int = 4096
    # Init scales (std of normal init). Plain std-0.02 everywhere gives a degenerate model:
    # attention scores ~0, so every position averages its whole context into nearly the same
    # hidden state, one "hub" token wins everywhere and greedy output repeats one token (and
    # RoPE or KV-cache bugs barely change the output). Larger q/k weights make attention
    # peaked, larger o/down projections let the layers (not the tied token embedding) dominate
    # the residual stream, and the final norm's gain sets the logit scale (median top-1 prob
    # ~0.3). q/k stay moderate: sharper attention amplifies float rounding, and greedy
    # engine-vs-HF comparisons need top-2 logit gaps far above it (measured: rounding ~5e-5,
    # 1st-percentile gap ~9e-3).
    init_std: float = 0.02
    qk_std: float = 0.15
    out_std: float = 0.2  # o_proj / down_proj
    emb_std: float = 0.02
    final_norm_gain: float = 18.0


def _corpus_lines() -> Iterator[str]:
    text = CORPUS_PATH.read_text(encoding="utf-8")
    # Special tokens are atomic added tokens; BPE merges spent on their pieces would be wasted.
    for content, _ in ADDED_TOKENS:
        text = text.replace(content, "\n")
    yield from text.splitlines(keepends=True)


def train_tokenizer(spec: DemoModelSpec):
    """Byte-level BPE (GPT-2/Qwen style) trained on the package corpus, added tokens last."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_target - len(ADDED_TOKENS),
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        # All 256 bytes are in the base vocabulary, so any string encodes (no unknown token).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(_corpus_lines()), trainer=trainer)
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


BUILD_INFO = "build_info.json"


def source_fingerprint() -> str:
    """Hash of everything the build reads, to tell whether a built directory is current."""
    h = hashlib.sha256()
    for f in (Path(__file__).resolve(), CORPUS_PATH, CHAT_TEMPLATE_PATH):
        h.update(f.read_bytes())
    return h.hexdigest()


def is_current(path: Path | str, seed: int = 0) -> bool:
    """True if `path` holds a complete build of this builder's sources with this seed."""
    info = Path(path) / BUILD_INFO
    try:
        data = json.loads(info.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return data == {"builder": "backend.demo_model", "fingerprint": source_fingerprint(), "seed": seed}


def chat_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text(encoding="utf-8").rstrip("\n")


def _dump_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _tokenizer_config(tok, spec: DemoModelSpec) -> dict:
    added = {
        str(tok.token_to_id(content)): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for content, special in ADDED_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": chat_template(),
        # Cleanup rewrites " ." to "." etc.; it corrupts BPE text and breaks incremental decoding.
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": spec.model_max_length,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        # The generic fast tokenizer loads tokenizer.json as is (a model-specific class may
        # rebuild the pipeline from vocab/merges in newer transformers).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _model_config(spec: DemoModelSpec, vocab_size: int, eos_id: int) -> dict:
    # Written by hand in the layout Qwen2.5 ships (rope_theta/torch_dtype at top level), so the
    # bytes do not depend on the installed transformers version and older versions load it too.
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "model_type": "qwen2",
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _generation_config(im_end: int, endoftext: int) -> dict:
    # Qwen2.5-Instruct's shipped sampling defaults.
    return {
        "bos_token_id": None,
        "do_sample": True,
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
        "repetition_penalty": 1.05,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }


def _weight_shapes(spec: DemoModelSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Qwen2ForCausalLM's persistent tensors (lm_head is tied to embed_tokens, so not saved)."""
    h, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h), "model.norm.weight": (h,)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    return shapes


def make_weights(spec: DemoModelSpec, vocab_size: int, seed: int) -> dict:
    """Seeded weights, drawn in sorted-name order from one generator (independent of HF init)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_weight_shapes(spec, vocab_size).items()):
        if name == "model.norm.weight":
            t = torch.full(shape, spec.final_norm_gain)
        elif name.endswith("layernorm.weight"):
            # Near 1 but not exactly, so a runner that skips a norm's weight is caught.
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            if ".q_proj." in name or ".k_proj." in name:
                std = spec.qk_std
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                std = spec.out_std
            elif name == "model.embed_tokens.weight":
                std = spec.emb_std
            else:
                std = spec.init_std
            t = std * torch.randn(shape, generator=gen)
        tensors[name] = t.to(torch.float32).contiguous()
    return tensors


def build_demo_model(
    out: Path | str,
    seed: int = 0,
    spec: Optional[DemoModelSpec] = None,
    log: Callable[[str], None] = print,
) -> Path:
    """Build the demo model into `out` (created or overwritten) and return its path.

    Files are written into a temporary sibling directory and moved into place at the end, so
    a half-built directory is never seen under `out`.
    """
    from safetensors.torch import save_file

    spec = spec or DemoModelSpec()
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model directory is shared data
    try:
        log(f"[demo_model] training byte-level BPE on {CORPUS_PATH.name} (target vocab {spec.vocab_target})")
        tok = train_tokenizer(spec)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        ids = {content: tok.token_to_id(content) for content, _ in ADDED_TOKENS}
        log(f"[demo_model] tokenizer: {vocab_size} tokens; added tokens {ids}")
        tok.save(str(tmp / "tokenizer.json"), pretty=True)
        _dump_json(tmp / "tokenizer_config.json", _tokenizer_config(tok, spec))
        _dump_json(tmp / "special_tokens_map.json", {
            "additional_special_tokens": [IM_START, IM_END],
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
        })

        log(
            f"[demo_model] config: qwen2, hidden {spec.hidden_size}, {spec.num_layers} layers, "
            f"{spec.num_heads} heads / {spec.num_kv_heads} kv heads, head_dim {spec.head_dim}, vocab {vocab_size}"
        )
        _dump_json(tmp / "config.json", _model_config(spec, vocab_size, ids[IM_END]))
        _dump_json(tmp / "generation_config.json", _generation_config(ids[IM_END], ids[ENDOFTEXT]))

        log(f"[demo_model] sampling weights with seed {seed}")
        tensors = make_weights(spec, vocab_size, seed)
        n_params = sum(t.numel() for t in tensors.values())
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        log(f"[demo_model] wrote model.safetensors ({n_params / 1e6:.2f}M parameters)")
        _dump_json(tmp / BUILD_INFO, {"builder": "backend.demo_model", "fingerprint": source_fingerprint(), "seed": seed})

        for f in tmp.iterdir():
            os.chmod(f, 0o644)  # safetensors writes owner-only files
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"[demo_model] done: {out}")
    return out

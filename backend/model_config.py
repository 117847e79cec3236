"""What a model directory's config.json means to the runner: ModelConfig, read as transformers'
config classes read it (a key config.json leaves out takes the class's default), one family at a
time: Llama, Qwen2/3, Mistral, Phi-3, Granite, OLMo 2, Gemma 3, and the mixture-of-experts
variants (backend/moe.py). A config the runner cannot serve is refused here, by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from backend import moe
from backend.model_files import read_json
from backend.quantized_checkpoint import check_quantization

def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# hidden_act -> the MLP's activation, as transformers' ACT2FN computes it.
ACTIVATIONS: dict[str, Any] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh, "relu": F.relu,
}


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "olmo2", "qwen2_moe", "qwen3_moe",
                         "mixtral", "gemma3_text")
# Checkpoints whose q, k, v and gate, up projections are stored fused (Phi-3's qkv_proj and
# gate_up_proj), in the order the runner fuses them itself.
FUSED_CHECKPOINTS = ("phi3",)
# A mixture-of-experts model's attention and everything but its MLPs are its dense family's.
_DENSE_FAMILY = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "mixtral": "mistral"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"
    # Llama's attention_bias also biases o_proj (Qwen2's biases only q, k, v); mlp_bias biases
    # gate, up and down.
    o_bias: bool = False
    mlp_bias: bool = False
    # Sliding-window attention (Mistral's; Qwen2's with use_sliding_window): in a sliding layer
    # each token sees the last `sliding_window` positions, itself included. Which layers slide:
    # all (Mistral), or from Qwen2's max_window_layers on (layer_windows).
    sliding_window: Optional[int] = None
    sliding_layers: tuple[bool, ...] = ()
    # config.json's quantization_config: FP8 checkpoints load (backend/quantized_checkpoint.py).
    quantization: Optional[dict[str, Any]] = None
    # Mixture-of-experts MLPs, in the layers moe_layers marks (Qwen's decoder_sparse_step and
    # mlp_only_layers; every layer in Mixtral): a token's MLP output is the weighted sum of its
    # num_experts_per_tok best experts (a softmax over the router's logits, renormalised over the
    # chosen ones when norm_topk_prob), plus, in Qwen2-MoE, a shared expert scaled by a sigmoid
    # gate (backend/moe.py). 0 experts: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    # Where the norms sit and how they round. Llama's: before each sublayer (pre_norms), the
    # weight applied after rounding to the model's dtype. Gemma 3 and OLMo 2 norm each
    # sublayer's output before its residual add (post_norms) and apply the weight in float32
    # before rounding (norms_in_float); Gemma's weight is 1 + the checkpoint's (norm_offset);
    # OLMo 2 has no pre-norms, and norms q and k over all their heads at once (qk_norm_whole).
    pre_norms: bool = True
    post_norms: bool = False
    norms_in_float: bool = False
    norm_offset: float = 0.0
    qk_norm_whole: bool = False
    # Gemma 3: the embeddings scaled by sqrt(hidden_size); the softmax scale is
    # query_pre_attn_scalar^-1/2; sliding layers rotate by a rope of their own
    # (local_rope_theta, no scaling); the logits may be soft-capped (cap * tanh(logits / cap)).
    embed_sqrt_hidden: bool = False
    query_pre_attn_scalar: Optional[float] = None
    local_rope_theta: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    # Granite: Llama with its scales as config fields: the embeddings times
    # embedding_multiplier, the softmax scale attention_multiplier (not head_dim^-1/2), each
    # sublayer's output times residual_multiplier before its residual add, the logits divided
    # by logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: Optional[float] = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    # config.json's keys that the engine read from transformers' defaults, because config.json
    # leaves them out (a load error names them: a shape mismatch often comes from one).
    defaulted: frozenset[str] = frozenset()

    @classmethod
    def from_model_dir(cls, model_path: str | Path) -> "ModelConfig":
        cfg = read_json(Path(model_path) / "config.json")
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type '{model_type}'; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        # A key config.json leaves out means what transformers' config class for the model type
        # makes of it (Qwen3's head_dim 128, Qwen2's 32 KV heads, Mistral's 4096-token window,
        # each type's max_position_embeddings), not a guess of our own.
        defaults = _transformers_defaults(cfg, model_type)
        family = _DENSE_FAMILY.get(model_type, model_type)
        default_theta = defaults.pop("rope_theta", 10000.0)
        defaulted = frozenset(k for k in _DEFAULTED_KEYS if k not in cfg)
        cfg = {**defaults, **cfg}
        rope = cfg.get("rope_parameters") or {}
        partial = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (every head dimension rotates here)")
        gemma: dict[str, Any] = {}
        if model_type == "gemma3_text":
            rope, gemma = _gemma3(cfg)
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        num_heads = cfg["num_attention_heads"]
        act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act '{act}'; supported: {', '.join(ACTIVATIONS)}")
        window, sliding = _sliding_window(cfg, family)
        quantization = cfg.get("quantization_config") or None
        check_quantization(quantization)
        # As transformers' modeling code reads them: Llama's attention_bias biases q, k, v and o,
        # its mlp_bias the MLP; Qwen2 biases q, k, v (its config has no such key: an explicit
        # false drops them); Mistral and Qwen2/3 MLPs never have biases, nor Mistral's attention.
        # Qwen2-MoE names its q, k, v bias qkv_bias (true unless false).
        attention_bias = (bool(cfg.get("qkv_bias", True)) if model_type == "qwen2_moe"
                          else bool(cfg.get("attention_bias", family == "qwen2")) and family != "mistral")
        if family in ("qwen3", "gemma3_text", "olmo2") and attention_bias:
            raise ValueError(f"attention_bias is not supported for {model_type} models")
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        if num_heads % num_kv_heads:
            heads, kv_heads = (_defaulted_note(k, defaulted) for k in ("num_attention_heads", "num_key_value_heads"))
            raise ValueError(f"num_attention_heads {num_heads}{heads} is not a multiple of num_key_value_heads "
                             f"{num_kv_heads}{kv_heads} in {Path(model_path) / 'config.json'}")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta") or default_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
            attention_bias=attention_bias,
            qk_norm=family in ("qwen3", "gemma3_text", "olmo2"),
            hidden_act=act,
            o_bias=attention_bias and model_type in ("llama", "granite"),
            mlp_bias=bool(cfg.get("mlp_bias", False)) and model_type in ("llama", "granite"),
            sliding_window=window,
            sliding_layers=sliding,
            quantization=quantization,
            defaulted=defaulted,
            **(moe.config_fields(cfg, model_type) if model_type in _DENSE_FAMILY else {}),
            **gemma,
            **(_granite(cfg) if model_type == "granite" else {}),
            **(dict(pre_norms=False, post_norms=True, norms_in_float=True, qk_norm_whole=True)
               if model_type == "olmo2" else {}),
        )

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    def describe(self, *fields: str) -> str:
        """'num_attention_heads 4 x head_dim 128': config.json's fields as the engine read them,
        each taken from transformers' defaults marked so."""
        values = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                  "num_hidden_layers": self.num_layers}
        return " x ".join(f"{f} {values[f] if f in values else getattr(self, f)}{_defaulted_note(f, self.defaulted)}"
                          for f in fields)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window, 0 for full causal attention (kernels.paged_decode_attention)."""
        if self.sliding_window is None:
            return (0,) * self.num_layers
        return tuple(self.sliding_window if s else 0 for s in self.sliding_layers)

    @property
    def uniform_window(self) -> int:
        """The window every layer slides by; 0 when any layer attends to the whole context."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0

    @property
    def rope_type(self) -> str:
        """The rope scaling's kind ("rope_type", or the older "type"): "default" without one."""
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))

    @property
    def context_limit(self) -> int:
        """The model's context: max_position_embeddings, stretched by a linear or YaRN rope
        scaling as vLLM reads them (a YaRN config keeps the pretraining length, e.g. Qwen's
        32768 with factor 4 for 131072)."""
        scaling, kind = self.rope_scaling or {}, self.rope_type
        factor = scaling.get("factor")
        if kind == "yarn" and factor:
            base = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
            return max(self.max_position_embeddings, int(base * factor))
        # Gemma 3's linear factor stretches its global layers' rope to the context that
        # max_position_embeddings already gives (131072), as vLLM reads it.
        if kind == "linear" and factor and self.model_type != "gemma3_text":
            return int(self.max_position_embeddings * factor)
        return self.max_position_embeddings


# The config.json keys the engine reads whose absence transformers' config classes fill in, and
# the keys those defaults derive from (head_dim from hidden_size / num_attention_heads, the
# number of KV heads from num_attention_heads, Qwen's window from use_sliding_window).
_DEFAULTED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                   "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window",
                   "max_window_layers")
_DERIVED_FROM = ("hidden_size", "num_attention_heads", "use_sliding_window")


def _transformers_defaults(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """What transformers' config class for `model_type` gives the keys in _DEFAULTED_KEYS that
    config.json leaves out (an explicit null is not left out), derived from the keys it does give
    as the class derives them; "rope_theta": the class's default theta. A key the class does not
    have (Qwen2's head_dim, Mistral's attention_bias) is left to the caller, which reads it as
    transformers' modeling code does."""
    missing = [k for k in _DEFAULTED_KEYS if k not in cfg]
    rope = cfg.get("rope_parameters") or {}
    if not missing and (cfg.get("rope_theta") or rope.get("rope_theta")):
        return {}
    from transformers import AutoConfig  # a runtime dependency already (backend/tokenizer.py)

    given = {k: cfg[k] for k in _DERIVED_FROM if cfg.get(k) is not None}
    try:
        hf = AutoConfig.for_model(model_type, **given)
    except Exception as exc:
        raise ValueError(f"config.json leaves out {', '.join(missing)}, and transformers' {model_type} config refuses "
                         f"what it gives for the defaults ({', '.join(given)}): {exc}") from None
    out = {k: getattr(hf, k) for k in missing if hasattr(hf, k)}
    out["rope_theta"] = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or 10000.0
    return out


def _granite(cfg: dict[str, Any]) -> dict[str, Any]:
    """Granite's scales (transformers' defaults, 1.0, where config.json leaves one out)."""
    def scale(key: str) -> float:
        value = float(cfg.get(key) if cfg.get(key) is not None else 1.0)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"granite: {key} must be a positive number, got {cfg.get(key)!r}")
        return value

    return dict(embedding_multiplier=scale("embedding_multiplier"), attention_multiplier=scale("attention_multiplier"),
                residual_multiplier=scale("residual_multiplier"), logits_scaling=scale("logits_scaling"))


def _gemma3(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3's global rope (as a rope_parameters dict the caller reads as any model's) and its
    ModelConfig fields, from transformers 5's per-layer-type rope_parameters or the older
    rope_theta / rope_scaling / rope_local_base_freq keys."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError("gemma3_text: attn_logit_softcapping is not supported (the attention kernels do not cap)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("gemma3_text: use_bidirectional_attention (an embedding model's) is not supported")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        rope, local = dict(params["full_attention"]), params.get("sliding_attention") or {}
    else:
        rope = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta") or 1_000_000.0}
        local = {"rope_theta": cfg.get("rope_local_base_freq") or 10_000.0}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"gemma3_text: a sliding layers' rope of type '{local['rope_type']}' is not supported")
    return rope, dict(post_norms=True, norms_in_float=True, norm_offset=1.0, embed_sqrt_hidden=True,
                      query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 256),
                      local_rope_theta=float(local.get("rope_theta") or 10_000.0),
                      final_logit_softcapping=cfg.get("final_logit_softcapping"))


def _defaulted_note(key: str, defaulted: frozenset[str]) -> str:
    return " (not in config.json: transformers' default)" if key in defaulted else ""


def _sliding_window(cfg: dict[str, Any], model_type: str) -> tuple[Optional[int], tuple[bool, ...]]:
    """(the window, which layers slide) as transformers reads the config: its `layer_types` when
    given; Mistral slides in every layer; Qwen2/3 only with use_sliding_window, in the layers
    from max_window_layers on; Gemma 3 in all but every sliding_window_pattern-th; Llama never."""
    window = cfg.get("sliding_window")
    if not window or model_type == "llama":
        return None, ()
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types:
        sliding = [t == "sliding_attention" for t in types]
    elif model_type in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None, ()  # Qwen configs carry a window they use only when told to
        first = cfg.get("max_window_layers", 28)
        sliding = [i >= first for i in range(layers)]
    elif model_type == "gemma3_text":  # a config from before layer_types: every Nth layer global
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        sliding = [True] * layers
    if len(sliding) != layers:
        raise ValueError(f"layer_types names {len(sliding)} layers; the model has {layers}")
    if not any(sliding):
        return None, ()
    return int(window), tuple(sliding)

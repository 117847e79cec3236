"""LoRA adapters (PEFT format), several served at once next to the base model.

An adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) and ``adapter_model.safetensors`` with ``...layers.{i}.{module}.lora_A.weight``
([r, in]) and ``lora_B.weight`` ([out, r]). A targeted projection computes
``W x + scaling * B (A x)``, with ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA).
``embed_tokens`` (``lora_embedding_A`` [r, vocab], ``lora_embedding_B`` [hidden, r]) adds
``scaling * B A[:, id]`` to a token's embedding, and ``lm_head`` is a projection like the others.
With tied embeddings, an adapter on ``embed_tokens`` changes the input embedding only, as in PEFT.

The base weights are never changed (no merging): every step, each adapter in the batch adds its
delta to the rows of its own tokens, so requests for different adapters and for the base model
share a batch (SGLang's and vLLM's multi-LoRA serving). The runner fuses q/k/v and gate/up into
one matmul each; an adapter's per-module delta lands in that module's columns of the fused
output.

KV blocks depend on the adapter (k and v are projected through it), so prefix caching keys them
by adapter too (``cache_salt``). Batches with an adapter run eagerly (decode graphs are captured
for the base model only).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file

__all__ = ["LoraAdapter", "LoraError", "apply_lora", "apply_lora_embedding", "apply_lora_logits", "load_adapter",
           "parse_lora_modules", "TARGETS"]

# PEFT module name -> (the runner's fused weight, which part of its output).
# qkv_proj and gate_up_proj: Phi-3's fused projections, which the runner fuses in the same order.
TARGETS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
           "embed_tokens", "lm_head")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")
# PEFT saves an embedding's LoRA as parameters, without ".weight".
_EMBED_KEY = re.compile(r"(?:^|\.)embed_tokens\.lora_embedding_([AB])(?:\.weight)?$")
_LM_HEAD_KEY = re.compile(r"(?:^|\.)lm_head\.lora_([AB])\.weight$")


def _edge_key(key: str) -> Optional[tuple[str, str]]:
    """("embed_tokens" | "lm_head", "A" | "B") for those modules' LoRA tensors, else None."""
    for module, pattern in (("embed_tokens", _EMBED_KEY), ("lm_head", _LM_HEAD_KEY)):
        m = pattern.search(key)
        if m is not None:
            return module, m.group(1)
    return None


class LoraError(ValueError):
    """An adapter that cannot be loaded or used; the message says why."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # Per layer: fused weight name -> (A of its modules stacked [k*r, in], B block-diagonal
    # [fused out, k*r], scaling folded in): one pair of thin matmuls per fused weight, whatever
    # subset of its modules the adapter targets.
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    # embed_tokens: (A transposed [vocab, r], so a token's row is a lookup; B^T scaled [r, hidden]).
    embed: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # lm_head: (A [r, hidden], B scaled [vocab, r]).
    lm_head: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # Which load this is: an adapter unloaded, rewritten and loaded again under the same name and
    # path has other weights, so its prefix-cache entries must not be the old ones (vLLM gives
    # every load a new id too).
    load_id: int = field(default_factory=lambda: next(_LOADS))

    @property
    def cache_salt(self) -> int:
        """The start of this adapter's prefix-cache hash chain."""
        return hash(("lora", self.name, self.path, self.load_id))


_LOADS = itertools.count()


def parse_lora_modules(spec: Any) -> dict[str, str]:
    """vLLM's ``--lora-modules name=path ...`` (a string with commas or spaces, or a dict)."""
    if not spec:
        return {}
    if isinstance(spec, dict):
        return {str(k): str(v) for k, v in spec.items()}
    out: dict[str, str] = {}
    # Entries are split at commas, and at spaces only before the next `name=`: a path may hold
    # spaces (QA: "a=/tmp/my adapter" was refused over its fragment "adapter").
    for item in re.split(r"\s*,\s*|\s+(?=[^\s=,]+=)", str(spec).strip()):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise LoraError(f"lora_modules entries are name=path, got {item!r}")
        out[name] = path
    return out


def load_adapter(name: str, path: str | Path, config: Any, device: torch.device, dtype: torch.dtype) -> LoraAdapter:
    """Load a PEFT adapter for a runner whose model has ``config`` (backend.model_runner.ModelConfig)."""
    path = Path(path)
    try:
        meta = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter '{name}': cannot read {path / 'adapter_config.json'}: {exc}") from None
    files = sorted(path.glob("adapter_model*.safetensors"))
    if not files:
        raise LoraError(f"LoRA adapter '{name}': no adapter_model.safetensors in {path}")
    rank = int(meta.get("r", 0))
    alpha = float(meta.get("lora_alpha", rank))
    if rank <= 0:
        raise LoraError(f"LoRA adapter '{name}': r must be positive")
    for key in ("rank_pattern", "alpha_pattern"):
        if meta.get(key):  # per-module r / alpha: every module here has the adapter's own
            raise LoraError(f"LoRA adapter '{name}': adapter_config.json's {key} (a per-module "
                            f"{key.split('_')[0]}) is not supported")
    scaling = alpha / math.sqrt(rank) if meta.get("use_rslora") else alpha / rank
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    spans = {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, q + kv), "v_proj": ("qkv", q + kv, q + 2 * kv),
             "o_proj": ("o", 0, config.hidden_size), "gate_proj": ("gate_up", 0, inter),
             "up_proj": ("gate_up", inter, 2 * inter), "down_proj": ("down", 0, config.hidden_size),
             "qkv_proj": ("qkv", 0, q + 2 * kv), "gate_up_proj": ("gate_up", 0, 2 * inter)}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    edges: dict[str, dict[str, torch.Tensor]] = {}  # embed_tokens / lm_head -> {"A", "B"}
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as exc:  # safetensors' own errors: a corrupt file is the adapter's fault
            raise LoraError(f"LoRA adapter '{name}': cannot read {f.name}: {exc}") from None
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                # NaN weights make NaN logits: every token garbage, or a crashed sampler.
                raise LoraError(f"LoRA adapter '{name}': tensor {key!r} holds NaN or infinite values")
            edge = _edge_key(key)
            if edge is not None:
                edges.setdefault(edge[0], {})[edge[1]] = tensor.to(device=device, dtype=dtype)
                continue
            m = _KEY.search(key)
            if m is None:
                raise LoraError(f"LoRA adapter '{name}': unexpected tensor {key!r} (only {', '.join(TARGETS)} "
                                "LoRA weights are supported)")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if module not in spans:
                raise LoraError(f"LoRA adapter '{name}': module {module!r} is not supported")
            if layer >= config.num_layers:
                raise LoraError(f"LoRA adapter '{name}': layer {layer} is beyond the model's {config.num_layers}")
            moe_layers = getattr(config, "moe_layers", ())
            if spans[module][0] in ("gate_up", "down") and moe_layers and moe_layers[layer]:
                raise LoraError(f"LoRA adapter '{name}': layer {layer} {module}: the layer's MLP is a mixture of "
                                "experts, and LoRA on experts is not supported (attention and embeddings are)")
            pairs.setdefault((layer, module), {})[ab] = tensor.to(device=device, dtype=dtype)
    adapter = LoraAdapter(name, str(path), rank, scaling, [{} for _ in range(config.num_layers)])
    widths = {"qkv": q + 2 * kv, "o": config.hidden_size, "gate_up": 2 * inter, "down": config.hidden_size}
    parts: list[dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]]] = [{} for _ in range(config.num_layers)]
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter '{name}': layer {layer} {module} lacks lora_A or lora_B")
        fused, lo, hi = spans[module]
        a, b = ab["A"], ab["B"]
        in_features = config.intermediate_size if module == "down_proj" else (
            q if module == "o_proj" else config.hidden_size)
        if a.shape != (rank, in_features) or b.shape != (hi - lo, rank):
            raise LoraError(f"LoRA adapter '{name}': layer {layer} {module} has lora_A {tuple(a.shape)} and "
                            f"lora_B {tuple(b.shape)}; this model needs {(rank, in_features)} and {(hi - lo, rank)}")
        parts[layer].setdefault(fused, []).append((lo, hi, a, b))
    if not pairs and not edges:
        raise LoraError(f"LoRA adapter '{name}': no LoRA weights in {path}")
    for module, ab in edges.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter '{name}': {module} lacks its LoRA A or B")
        a, b = ab["A"], ab["B"]
        # embed_tokens: A [r, vocab], B [hidden, r]; lm_head: A [r, hidden], B [vocab, r].
        want = ((rank, config.vocab_size), (config.hidden_size, rank)) if module == "embed_tokens" else (
            (rank, config.hidden_size), (config.vocab_size, rank))
        if (tuple(a.shape), tuple(b.shape)) != want:
            raise LoraError(f"LoRA adapter '{name}': {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                            f"this model needs {want[0]} and {want[1]}")
        if module == "embed_tokens":
            adapter.embed = (a.t().contiguous(), (b * scaling).t().contiguous())
        else:
            adapter.lm_head = (a, b * scaling)
    for layer, fused_parts in enumerate(parts):
        for fused, items in fused_parts.items():
            a_cat = torch.cat([a for _, _, a, _ in items])
            b_blk = torch.zeros(widths[fused], a_cat.shape[0], device=device, dtype=dtype)
            for k, (lo, hi, _, b) in enumerate(items):
                b_blk[lo:hi, k * rank:(k + 1) * rank] = b * scaling
            adapter.layers[layer][fused] = (a_cat, b_blk)
    return adapter


def apply_lora(out: torch.Tensor, x: torch.Tensor, layer: int, fused: str,
               lora: list[tuple[LoraAdapter, Optional[torch.Tensor]]]) -> None:
    """Add each adapter's delta to the rows of its tokens, in place. ``lora``: (adapter, token
    indexes), or (adapter, None) when every token of the step uses that adapter."""
    for adapter, rows in lora:
        pair = adapter.layers[layer].get(fused)
        if pair is None:
            continue
        a, b = pair
        if rows is None:
            out.addmm_(x @ a.t(), b.t())
        else:
            out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())


def apply_lora_embedding(h: torch.Tensor, input_ids: torch.Tensor,
                         lora: list[tuple[LoraAdapter, Optional[torch.Tensor]]]) -> None:
    """Add each adapter's embed_tokens delta to its tokens' embeddings ``h`` [T, hidden], in place."""
    for adapter, rows in lora:
        if adapter.embed is None:
            continue
        a_t, b_t = adapter.embed
        if rows is None:
            h.add_(a_t[input_ids] @ b_t)
        else:
            h.index_add_(0, rows, a_t[input_ids.index_select(0, rows)] @ b_t)


def apply_lora_logits(logits: torch.Tensor, h: torch.Tensor, lora: list[tuple[LoraAdapter, Optional[torch.Tensor]]],
                      logit_rows: list[Optional[torch.Tensor]]) -> None:
    """Add each adapter's lm_head delta to its rows of ``logits`` [S, vocab], in place. ``h`` holds
    the final hidden states of those rows; ``logit_rows`` pairs with ``lora`` (None: every row)."""
    for (adapter, _), rows in zip(lora, logit_rows):
        if adapter.lm_head is None:
            continue
        a, b = adapter.lm_head
        if rows is None:
            logits.addmm_(h @ a.t(), b.t())
        elif rows.numel():
            logits.index_add_(0, rows, (h.index_select(0, rows) @ a.t()) @ b.t())

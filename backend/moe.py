"""Mixture-of-experts MLPs (Qwen2-MoE, Qwen3-MoE, Mixtral) for backend/model_runner.py: their
config fields, their weights as Hub checkpoints name them, and the layer's forward pass.

A token's MLP is the weighted sum of its num_experts_per_tok best experts (a softmax over the
router's logits, renormalised over the chosen ones where norm_topk_prob says, always in Mixtral),
plus in Qwen2-MoE a shared expert scaled by a sigmoid gate. The forward pass groups the
token-expert pairs by expert on the device and runs each projection of every expert as one
grouped_mm over their offsets, where torch has grouped_mm for the device and dtype (no host sync,
so decode graphs can hold it); else one matmul pair per expert, over counts read on the host.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

def config_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A mixture-of-experts config's ModelConfig fields, as transformers' modeling code reads it
    (a key config.json leaves out is its config class's default)."""
    from transformers import AutoConfig

    hf = AutoConfig.for_model(model_type)

    def get(key: str) -> Any:
        return cfg[key] if cfg.get(key) is not None else getattr(hf, key, None)

    layers = cfg["num_hidden_layers"]
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or get("num_experts")
                  or get("num_local_experts") or 0)
    top_k = int(get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"{model_type}: num_experts_per_tok {top_k} must be in 1..the number of experts ({experts})")
    if model_type == "mixtral":  # every layer, the experts as wide as intermediate_size, always renormalised
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=cfg["intermediate_size"],
                    norm_topk_prob=True, moe_layers=(True,) * layers)
    step = int(get("decoder_sparse_step") or 1)
    dense = set(get("mlp_only_layers") or ())
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(get("moe_intermediate_size")),
                norm_topk_prob=bool(get("norm_topk_prob")),
                shared_expert_intermediate_size=int(get("shared_expert_intermediate_size") or 0)
                if model_type == "qwen2_moe" else 0,
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)))


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm runs here and agrees with a matmul per group (it needs a recent
    torch, and on CUDA some architectures and dtypes only)."""
    grouped_mm = getattr(F, "grouped_mm", None)
    if grouped_mm is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(8, 16, generator=g).to(device=device, dtype=dtype)
        b = torch.randn(3, 32, 16, generator=g).to(device=device, dtype=dtype)
        offs = torch.tensor([3, 3, 8], dtype=torch.int32, device=device)
        out = grouped_mm(a, b.transpose(-2, -1), offs=offs)
        want = torch.cat([F.linear(a[:3], b[0]), F.linear(a[3:], b[2])])
        return bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        log.info("grouped_mm unavailable on %s %s (%s): MoE experts run one matmul pair each", device, dtype, exc)
        return False


def take_experts(c: Any, p: str, take: Callable[[str, str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer `p`'s expert weights (`c`: its ModelConfig), as checkpoints on the Hub name them (Qwen's
    mlp.gate / mlp.experts.{e}.{gate,up,down}_proj, Mixtral's block_sparse_moe.gate /
    .experts.{e}.w1 (gate), w3 (up), w2 (down)): each expert's gate and up fused, every
    expert stacked, so that one expert is one index and two matmuls."""
    if c.model_type == "mixtral":
        m, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        m, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    gate, up, down = names
    out = {
        "router": take(m + "gate.weight", "router"),
        "experts_gate_up": torch.stack([
            torch.cat([take(f"{m}experts.{e}.{gate}.weight", "expert_gate_up"),
                       take(f"{m}experts.{e}.{up}.weight", "expert_gate_up")]) for e in range(c.num_experts)]),
        "experts_down": torch.stack([take(f"{m}experts.{e}.{down}.weight", "expert_down")
                                     for e in range(c.num_experts)]),
    }
    if c.shared_expert_intermediate_size:
        out["shared_gate_up"] = torch.cat([take(m + "shared_expert.gate_proj.weight", "shared_gate_up"),
                                           take(m + "shared_expert.up_proj.weight", "shared_gate_up")])
        out["shared_down"] = take(m + "shared_expert.down_proj.weight", "shared_down")
        out["shared_gate"] = take(m + "shared_expert_gate.weight", "shared_gate")
    return out


def forward(c: Any, x: torch.Tensor, layer: dict[str, torch.Tensor], act: Callable[[torch.Tensor], torch.Tensor],
            grouped: bool) -> torch.Tensor:
    """A mixture-of-experts MLP over the packed tokens `x`, as transformers computes it: the
    token-expert pairs grouped by expert, each expert's tokens through its gate/up and down
    matmuls, scaled by the routing weight and added back to their tokens in expert order
    (so each token's sum is transformers' to the bit in float32). `grouped`: every
    expert's matmul is one grouped_mm call over offsets computed on the device; else a
    matmul pair per expert, whose counts are read on the host (no decode graphs then)."""
    probs = torch.softmax(F.linear(x, layer["router"]), dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, c.num_experts_per_tok, dim=-1)
    if c.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # Qwen scales by weights in the model's dtype; Mixtral by the float32 ones, then rounds.
    weights = (weights if c.model_type == "mixtral" else weights.to(x.dtype)).flatten()
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # pairs by expert, each expert's tokens in order
    tokens = order // c.num_experts_per_tok
    out = torch.zeros_like(x)
    if grouped:
        # Per-expert counts by index_add, not bincount: bincount sizes its output on the host.
        counts = torch.zeros(c.num_experts, dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = F.grouped_mm(x[tokens], layer["experts_gate_up"].transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = F.grouped_mm(act(gate) * up, layer["experts_down"].transpose(-2, -1), offs=offs)
        out.index_add_(0, tokens, (y * weights[order, None]).to(x.dtype))
    else:
        start = 0
        for e, n in enumerate(torch.bincount(flat, minlength=c.num_experts).tolist()):
            if not n:
                continue
            pairs, rows = order[start : start + n], tokens[start : start + n]
            start += n
            gate, up = F.linear(x[rows], layer["experts_gate_up"][e]).chunk(2, dim=-1)
            y = F.linear(act(gate) * up, layer["experts_down"][e]) * weights[pairs, None]
            out.index_add_(0, rows, y.to(x.dtype))
    if "shared_gate_up" in layer:
        gate, up = F.linear(x, layer["shared_gate_up"]).chunk(2, dim=-1)
        shared = F.linear(act(gate) * up, layer["shared_down"])
        out = out + torch.sigmoid(F.linear(x, layer["shared_gate"])) * shared
    return out

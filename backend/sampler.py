"""Logits → next tokens, one row per sequence, every row with its own parameters.

Order as SGLang: temperature, top-k, top-p, min-p, draw. Seeded rows draw from a counter-based
generator keyed by (seed, output position), so a seeded request gives the same tokens whatever
else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    step: int  # index of the token being drawn within the output


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device="cpu").manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        if all(r.params.greedy for r in rows):
            return logits.argmax(dim=-1).tolist()
        dev = logits.device
        temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=dev)
        top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
        logits = logits / temps[:, None]
        logits = _filter(logits, top_k, top_p, min_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        for i, r in enumerate(rows):
            gen = self._generator
            if r.params.seed is not None:
                gen = torch.Generator(device="cpu").manual_seed((r.params.seed * 1_000_003 + r.step) % 2**63)
            noise[i] = torch.empty(probs.shape[1]).exponential_(generator=gen).to(dev)
        # Exponential race: argmax p_i / E_i draws i with probability p_i.
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([r.params.greedy for r in rows], device=dev)
        return torch.where(greedy, logits.argmax(dim=-1), sampled).tolist()


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    remove = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)

"""The CPU sampling ops (csrc/sampling_cpu.cpp): penalties, grammar bitmask, the
top-k/top-p/min-p filter and the draw, built on first use (kernels/cpu_build.py). Same semantics
as their `reference` namesakes, which sort whole rows, run Philox as tensor ops over every token
and build full-size temporaries: a sampled decode step of 64 rows took several times a greedy
one. LLM_CPU_SAMPLING=0, or no compiler: `load()` returns None and kernels/ uses the reference."""

from __future__ import annotations

from typing import Optional

import torch

from .cpu_build import CpuKernel

_KERNEL = CpuKernel(
    "llm_sampling_cpu",
    "sampling_cpu.cpp",
    switch="LLM_CPU_SAMPLING",
    # No -ffast-math: the filters compare against -inf, which finite-math would fold away. No
    # fused multiply-adds: the penalties must round as the reference's separate ops do.
    cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
    fallback="the torch reference sampler",
)


load = _KERNEL.load  # the compiled module, or None (disabled, or the build failed: see error())
error = _KERNEL.error


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    return _KERNEL.require().apply_penalties(logits, counts, prompt_mask, frequency, presence, repetition)


def apply_penalties_by_slot_(logits: torch.Tensor, counts_table: torch.Tensor, prompt_table: torch.Tensor,
                             slots: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                             repetition: torch.Tensor, seen: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    """`reference.apply_penalties(logits, counts_table[slots], prompt_table[slots], ...)` written
    into `logits` (contiguous float32) itself; rows at slot -1 are left alone. `seen`: each
    slot's distinct prompt and output ids ([slots, cap] int32 and their counts [slots] int64);
    rows that have seen few tokens then visit only those, with the same result."""
    seen_ids, seen_len = seen if seen is not None else (None, None)
    _KERNEL.require().apply_penalties_by_slot_(logits, counts_table, prompt_table, slots, frequency, presence, repetition,
                                               seen_ids, seen_len)


def penalized_argmax(logits: torch.Tensor, counts_table: torch.Tensor, prompt_table: torch.Tensor, slots: torch.Tensor,
                     frequency: torch.Tensor, presence: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """argmax of `reference.apply_penalties(logits, counts_table[slots], prompt_table[slots], ...)`
    per row (lowest index on ties), in one pass without the penalized copy; slot -1: no penalty."""
    return _KERNEL.require().penalized_argmax(logits, counts_table, prompt_table, slots, frequency, presence, repetition)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    return _KERNEL.require().apply_token_bitmask(logits, bitmask, row_mask)


def top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    return _KERNEL.require().top_k_top_p_min_p(logits, top_k, top_p, min_p)


def sample(logits: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor, greedy_mask: torch.Tensor) -> torch.Tensor:
    return _KERNEL.require().sample(logits, seeds, offsets, greedy_mask)


if __name__ == "__main__":  # scripts/setup.sh: build ahead of time
    print("CPU sampling kernels:", "ready" if load() is not None else f"unavailable ({error()})")

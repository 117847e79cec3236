"""The CPU decode-attention kernel (csrc/paged_attention_cpu.cpp), built on first use
(kernels/cpu_build.py). LLM_CPU_ATTENTION=0, or no compiler: `load()` returns None and the
model runner keeps gathering blocks for torch attention."""

from __future__ import annotations

import torch

from .cpu_build import CpuKernel

_KERNEL = CpuKernel(
    "llm_paged_attention_cpu",
    "paged_attention_cpu.cpp",
    switch="LLM_CPU_ATTENTION",
    # native: AVX2/FMA where the CPU has them; fast-math lets the softmax's exp vectorize
    # (libmvec): 0.95 -> 0.68 ms a call at 64 sequences on the demo shapes. Results stay within
    # 1e-6 of the float32 reference (tests).
    cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
    fallback="gathered torch attention",
)


load = _KERNEL.load  # the compiled module, or None (disabled, or the build failed: see error())
error = _KERNEL.error


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    module = _KERNEL.require()
    return module.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, int(block_size), float(scale),
                                         int(window))


def widen_fp8(x: torch.Tensor) -> torch.Tensor:
    """A CPU fp8 tensor (e4m3fn or e5m2) as float32, widened as the kernel reads the cache."""
    return _KERNEL.require().widen_fp8(x)


if __name__ == "__main__":  # scripts/setup.sh: build ahead of time
    print("CPU paged-attention kernel:", "ready" if load() is not None else f"unavailable ({error()})")

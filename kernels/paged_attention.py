"""Decode attention straight from the paged KV cache (Triton kernel + torch reference).

A decode step has one query token per sequence. Gathering each sequence's blocks into a padded
[B, max_k] tensor and running SDPA copies the whole context every layer; this kernel reads the
blocks in place through the block table instead, with an online softmax, one program per
(sequence, KV head) covering the G query heads that share that KV head (GQA).

Cache layout (backend/model_runner.py): k_cache / v_cache [kvh, num_slots, d], slot = block *
block_size + offset. Import only after deciding on TRITON_INTERPRET (see triton_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
    stride_qb, stride_qh, stride_kh, stride_ks, stride_tb, stride_ob, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
    WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    offs_s = tl.arange(0, BLOCK)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kvh * G + offs_g
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gmask[:, None] & dmask[None, :], other=0.0,
    ).to(tl.float32)
    ctx = tl.load(lens_ptr + b)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_kh
    num_blocks = tl.cdiv(ctx, BLOCK)
    # Sliding window: keys before `first` are out of sight, and whole blocks of them are skipped.
    first = 0
    if WINDOW > 0:
        first = tl.maximum(ctx - WINDOW, 0)
    for i in range(first // BLOCK, num_blocks):
        block = tl.load(tables_ptr + b.to(tl.int64) * stride_tb + i).to(tl.int64)
        pos = i * BLOCK + offs_s
        valid = (pos < ctx) & (pos >= first)
        slots = block * BLOCK + offs_s
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BLOCK]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :],
    )


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
    """q [B, H, d]; k/v_cache [kvh, slots, d]; block_tables [B, max_blocks] int32; context_lens
    [B] int32 (keys 0..len-1 are visible, only len-window.. with a sliding `window` > 0; the
    current token's K/V already written) -> [B, H, d]."""
    B, H, D = q.shape
    kvh = k_cache.shape[0]
    if block_size & (block_size - 1) or H % kvh or k_cache.stride(2) != 1:
        raise ValueError("paged_decode_attention needs a power-of-two block size, H % kvh == 0, contiguous head dim")
    G = H // kvh
    q = q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    _paged_decode_kernel[(B, kvh)](
        q, k_cache, v_cache, out, tables, lens, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        out.stride(0), out.stride(1),
        G=G, GP=triton.next_power_of_2(G), D=D, DP=triton.next_power_of_2(D), BLOCK=block_size,
        WINDOW=int(window),
    )
    return out

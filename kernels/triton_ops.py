"""Triton kernels for batched LLM sampling, plus thin launchers.

Every kernel works on [ROWS, BLOCK] tiles of a row-major [B, V] float32 logits tensor; per-row
parameters are [B] vectors loaded once per tile. Row-reduction kernels (filter, sample,
log-softmax) give each program ROWS whole rows and loop over the vocabulary in BLOCK-wide chunks,
so any V (1000, 4099, 151936, ...) works. Tile sizes depend only on V and the device (never on
B), so a row's result does not depend on the rest of the batch.

Import this module only after deciding on TRITON_INTERPRET: Triton picks interpreter vs compiler
when a function is decorated, and its own library functions (tl.sum, tl.rand, ...) are decorated
when triton is first imported. ``kernels/__init__.py`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_PIVOTS = 16  # threshold candidates evaluated per pass of the top-k / top-p search


def interpreted() -> bool:
    """True if these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_sample_kernel, InterpretedFunction)


# ---------------------------------------------------------------------------------------------
# elementwise kernels: 2-D grid (row tiles x column tiles)
# ---------------------------------------------------------------------------------------------
@triton.jit
def _temperature_kernel(x_ptr, out_ptr, temp_ptr, B, V, stride_x, stride_o,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < B
    mask = rmask[:, None] & (cols < V)[None, :]
    rows64 = rows.to(tl.int64)
    t = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    t = tl.where(t > 0, t, 1.0)  # greedy rows (t == 0): divide by 1 == unchanged
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    y = tl.math.div_rn(x, tl.broadcast_to(t[:, None], (ROWS, BLOCK)))
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], y, mask=mask)


@triton.jit
def _penalties_kernel(x_ptr, out_ptr, cnt_ptr, prompt_ptr, freq_ptr, pres_ptr, rep_ptr,
                      B, V, stride_x, stride_o, stride_c, stride_p,
                      ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < B
    mask = rmask[:, None] & (cols < V)[None, :]
    rows64 = rows.to(tl.int64)
    freq = tl.load(freq_ptr + rows, mask=rmask, other=0.0)
    pres = tl.load(pres_ptr + rows, mask=rmask, other=0.0)
    rep = tl.load(rep_ptr + rows, mask=rmask, other=1.0)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    cnt = tl.load(cnt_ptr + rows64[:, None] * stride_c + cols[None, :], mask=mask, other=0)
    prm = tl.load(prompt_ptr + rows64[:, None] * stride_p + cols[None, :], mask=mask, other=0)
    in_output = cnt > 0
    seen = in_output | (prm != 0)
    rep2 = tl.broadcast_to(rep[:, None], (ROWS, BLOCK))
    scaled = tl.where(x > 0, tl.math.div_rn(x, rep2), x * rep2)
    x = tl.where(seen, scaled, x)
    x = x - freq[:, None] * cnt.to(tl.float32)
    x = x - pres[:, None] * in_output.to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], x, mask=mask)


@triton.jit
def _bitmask_kernel(x_ptr, out_ptr, bm_ptr, rowmask_ptr, B, V, COVER, stride_x, stride_o, stride_b,
                    ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < B
    mask = rmask[:, None] & (cols < V)[None, :]
    rows64 = rows.to(tl.int64)
    apply_row = tl.load(rowmask_ptr + rows, mask=rmask, other=0) != 0
    covered = mask & (cols < COVER)[None, :] & apply_row[:, None]
    words = tl.load(bm_ptr + rows64[:, None] * stride_b + (cols // 32)[None, :], mask=covered, other=-1)
    bit = (words >> (cols % 32)[None, :]) & 1
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = tl.where(covered & (bit == 0), float("-inf"), x)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], x, mask=mask)


# ---------------------------------------------------------------------------------------------
# row-reduction kernels: 1-D grid over row tiles, loop over V
# ---------------------------------------------------------------------------------------------
@triton.jit
def _float_key(x):
    """Order-preserving int32 key of a float32 (-0.0 and +0.0 share key 0)."""
    b = x.to(tl.int32, bitcast=True)
    k = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    return tl.where(x == 0.0, 0, k)


@triton.jit
def _row_max_sumexp(x_ptr, rows64, rmask, V, stride_x, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Online (single pass) row max and sum(exp(x - max)); also returns the min key."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    kmin = tl.full([ROWS], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
        m = m_new
        kmin = tl.minimum(kmin, tl.min(tl.where(mask, _float_key(x), 2147483647), 1))
    return m, s, kmin


@triton.jit
def _filter_kernel(x_ptr, out_ptr, k_ptr, p_ptr, minp_ptr, B, V, stride_x, stride_o,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    top_k = tl.load(k_ptr + rows, mask=rmask, other=0)
    top_p = tl.load(p_ptr + rows, mask=rmask, other=1.0)
    min_p = tl.load(minp_ptr + rows, mask=rmask, other=0.0)

    m, s, kmin = _row_max_sumexp(x_ptr, rows64, rmask, V, stride_x, ROWS, BLOCK)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    kmax = _float_key(m)

    need_k = rmask & (top_k > 0) & (top_k < V)
    need_p = rmask & (top_p < 1.0) & (m > float("-inf"))
    # top-k: largest key T with count(key >= T) >= k. Invariant: k_lo feasible, answer in
    # [k_lo, k_hi]; pivots probe (k_lo, k_hi].
    k_lo = tl.where(need_k, kmin, kmax).to(tl.int64)
    k_hi = kmax.to(tl.int64)
    # top-p: smallest key T with mass(key > T) < top_p * s. Invariant: p_hi feasible (or the
    # row max), answer in [p_lo, p_hi]; pivots probe [p_lo, p_hi).
    p_lo = tl.where(need_p, kmin, kmax).to(tl.int64)
    p_hi = kmax.to(tl.int64)
    p_thr = top_p * s
    j = (tl.arange(0, NP) + 1).to(tl.int64)

    # Each pass counts / sums against NP pivots per search, shrinking both intervals by NP + 1;
    # a 2**32-wide key range needs at most 8 passes with NP = 16.
    active = tl.max(((k_hi > k_lo) | (p_hi > p_lo)).to(tl.int32), 0)
    while active > 0:
        k_step = (k_hi - k_lo) // (NP + 1) + 1
        k_piv = tl.minimum(k_lo[:, None] + k_step[:, None] * j[None, :], k_hi[:, None])
        p_step = (p_hi - p_lo) // (NP + 1) + 1
        p_piv = tl.maximum(p_hi[:, None] - p_step[:, None] * j[None, :], p_lo[:, None])
        k_piv32 = k_piv.to(tl.int32)
        p_piv32 = p_piv.to(tl.int32)
        k_cnt = tl.zeros([ROWS, NP], tl.int32)
        p_mass = tl.zeros([ROWS, NP], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < V)[None, :]
            x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask,
                        other=float("-inf"))
            key = _float_key(x)
            e = tl.exp(x - m_safe[:, None])
            ge = (key[:, :, None] >= k_piv32[:, None, :]) & mask[:, :, None]
            k_cnt += tl.sum(ge.to(tl.int32), 1)
            gt = key[:, :, None] > p_piv32[:, None, :]
            p_mass += tl.sum(tl.where(gt, e[:, :, None], 0.0), 1)
        k_ok = k_cnt >= top_k[:, None]
        k_lo = tl.max(tl.where(k_ok, k_piv, k_lo[:, None]), 1)
        k_hi = tl.min(tl.where(k_ok, k_hi[:, None], k_piv - 1), 1)
        p_ok = p_mass < p_thr[:, None]
        p_hi = tl.min(tl.where(p_ok, p_piv, p_hi[:, None]), 1)
        p_lo = tl.max(tl.where(p_ok, p_lo[:, None], p_piv + 1), 1)
        active = tl.max(((k_hi > k_lo) | (p_hi > p_lo)).to(tl.int32), 0)

    thr_key = tl.maximum(tl.where(need_k, k_lo, -2147483648), tl.where(need_p, p_hi, -2147483648))
    thr_key = thr_key.to(tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
        e = tl.exp(x - m_safe[:, None])
        keep = (_float_key(x) >= thr_key[:, None]) & (e >= min_p[:, None])
        keep = keep | (x == m[:, None])
        y = tl.where(keep, x, float("-inf"))
        tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], y, mask=mask)


@triton.jit
def _sample_kernel(x_ptr, out_ptr, seed_ptr, off_ptr, greedy_ptr, B, V, stride_x,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0)
    step = tl.load(off_ptr + rows, mask=rmask, other=0)
    greedy = tl.load(greedy_ptr + rows, mask=rmask, other=1) != 0
    base = step << 32  # Philox counter of token j: (offset << 32) + j
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = tl.zeros([ROWS], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
        u = tl.rand(seed[:, None], base[:, None] + cols[None, :].to(tl.int64))
        g = -tl.log(-tl.log(u))
        score = tl.where(greedy[:, None], x, x + g)
        score = tl.where(mask, score, float("-inf"))
        c_max = tl.max(score, 1)
        c_idx = tl.min(tl.where(score == c_max[:, None], cols[None, :], 2147483647), 1)
        better = c_max > best
        best = tl.where(better, c_max, best)
        best_idx = tl.where(better, c_idx, best_idx)
    tl.store(out_ptr + rows, best_idx.to(tl.int64), mask=rmask)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, B, V, stride_x, stride_o, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    rows64 = rows.to(tl.int64)
    m, s, _ = _row_max_sumexp(x_ptr, rows64, rmask, V, stride_x, ROWS, BLOCK)
    lse = m + tl.log(s)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], x - lse[:, None], mask=mask)


# ---------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------
# (max BLOCK, max ROWS * BLOCK) per kernel family, for the GPU and for the CPU interpreter (which
# pays per op, not per element, so it gets big tiles).
_TILES = {
    "elementwise": {"cuda": (1024, 2048), "cpu": (16384, 65536)},
    "row": {"cuda": (2048, 2048), "cpu": (16384, 65536)},
    # [ROWS, BLOCK, NUM_PIVOTS] intermediates: keep ROWS * BLOCK modest on the GPU.
    "filter": {"cuda": (512, 512), "cpu": (16384, 65536)},
}


def _tile(V: int, family: str, device: torch.device) -> tuple[int, int]:
    """(ROWS, BLOCK) from the vocabulary size and device only (never the batch size)."""
    max_block, max_tile = _TILES[family]["cuda" if device.type == "cuda" else "cpu"]
    block = min(triton.next_power_of_2(V), max_block)
    return max(1, max_tile // block), block


def _as_u8(mask: torch.Tensor) -> torch.Tensor:
    mask = mask.contiguous()
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    B, V = logits.shape
    out = torch.empty_like(logits) if out is None else out  # elementwise: out may be logits
    ROWS, BLOCK = _tile(V, "elementwise", logits.device)
    grid = (triton.cdiv(B, ROWS), triton.cdiv(V, BLOCK))
    _temperature_kernel[grid](logits, out, temperature.contiguous(), B, V, logits.stride(0), out.stride(0),
                              ROWS=ROWS, BLOCK=BLOCK)
    return out


def apply_penalties(logits, output_token_counts, prompt_token_mask, frequency_penalty, presence_penalty,
                    repetition_penalty):
    B, V = logits.shape
    out = torch.empty_like(logits)
    cnt = output_token_counts.contiguous()
    prm = _as_u8(prompt_token_mask)
    ROWS, BLOCK = _tile(V, "elementwise", logits.device)
    grid = (triton.cdiv(B, ROWS), triton.cdiv(V, BLOCK))
    _penalties_kernel[grid](logits, out, cnt, prm, frequency_penalty.contiguous(), presence_penalty.contiguous(),
                            repetition_penalty.contiguous(), B, V, logits.stride(0), out.stride(0), cnt.stride(0),
                            prm.stride(0), ROWS=ROWS, BLOCK=BLOCK)
    return out


def apply_token_bitmask(logits, bitmask, row_mask):
    B, V = logits.shape
    out = torch.empty_like(logits)
    bm = bitmask.contiguous()
    cover = min(V, 32 * bm.shape[1])
    ROWS, BLOCK = _tile(V, "elementwise", logits.device)
    grid = (triton.cdiv(B, ROWS), triton.cdiv(V, BLOCK))
    _bitmask_kernel[grid](logits, out, bm, _as_u8(row_mask), B, V, cover, logits.stride(0), out.stride(0),
                          bm.stride(0), ROWS=ROWS, BLOCK=BLOCK)
    return out


def top_k_top_p_min_p(logits, top_k, top_p, min_p):
    B, V = logits.shape
    out = torch.empty_like(logits)
    ROWS, BLOCK = _tile(V, "filter", logits.device)
    grid = (triton.cdiv(B, ROWS),)
    _filter_kernel[grid](logits, out, top_k.contiguous(), top_p.contiguous(), min_p.contiguous(), B, V,
                         logits.stride(0), out.stride(0), ROWS=ROWS, BLOCK=BLOCK, NP=NUM_PIVOTS,
                         num_warps=8)
    return out


def sample(logits, seeds, offsets, greedy_mask):
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    ROWS, BLOCK = _tile(V, "row", logits.device)
    grid = (triton.cdiv(B, ROWS),)
    _sample_kernel[grid](logits, out, seeds.contiguous(), offsets.contiguous(), _as_u8(greedy_mask), B, V,
                         logits.stride(0), ROWS=ROWS, BLOCK=BLOCK, num_warps=8)
    return out


def log_softmax(logits):
    B, V = logits.shape
    out = torch.empty_like(logits)
    ROWS, BLOCK = _tile(V, "row", logits.device)
    grid = (triton.cdiv(B, ROWS),)
    _log_softmax_kernel[grid](logits, out, B, V, logits.stride(0), out.stride(0), ROWS=ROWS, BLOCK=BLOCK,
                              num_warps=8)
    return out

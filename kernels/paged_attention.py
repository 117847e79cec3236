"""Decode attention straight from the paged KV cache (Triton kernel + torch reference).

A decode step has one query token per sequence. Gathering each sequence's blocks into a padded
[B, max_k] tensor and running SDPA copies the whole context every layer; this kernel reads the
blocks in place through the block table instead, with an online softmax, one program per
(sequence, KV head) covering the G query heads that share that KV head (GQA).

A batch of a few sequences is then a few programs on a GPU of 132 SMs, each walking its whole
context alone. With `splits` > 1 each context is cut into parts run as programs of their own,
whose partial softmaxes a second kernel merges (flash-decoding; vLLM's paged attention v2 does
the same by 512-token partitions).

Cache layout (backend/model_runner.py): k_cache / v_cache [kvh, num_slots, d], slot = block *
block_size + offset. Import only after deciding on TRITON_INTERPRET (see triton_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import triton_ops


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr, tables_ptr, lens_ptr, tiles_ptr, scale,
    stride_qb, stride_qh, stride_kh, stride_ks, stride_tb, stride_ob, stride_oh,
    H: tl.constexpr, G: tl.constexpr, MP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BLOCK: tl.constexpr, TILE_BLOCKS: tl.constexpr, WINDOW: tl.constexpr, SPLITS: tl.constexpr,
    QT: tl.constexpr, LOWP: tl.constexpr,
):
    """One program per (query row, KV head, split). SPLITS == 1: the whole context, normalized
    into out. Else the blocks this program sees are cut into SPLITS parts of whole tiles; split
    `sp` reads part sp and leaves its running max, sum and unnormalized output in the partial
    buffers, which _combine_splits_kernel merges (flash-decoding: a short batch keeps more of
    the GPU busy). The parts come from the program's own context, not the table's width: under
    a CUDA graph the table is as wide as the longest context the model allows, and parts of
    that width left a 3k-token context's work to 4 of 9 splits, a 1k one's to 3 of 17.

    QT > 1 (query tiles): program b scores rows b .. b + tiles[b] - 1 together, consecutive
    positions of one sequence (a prefill chunk laid out flat) that share row b's block table,
    so each K/V tile is read once for all of them instead of once per row; tiles[b] == 0: row
    b belongs to an earlier program's tile and this one does nothing. The G query heads of
    each of the QT rows are the MP (>= QT * G) rows of the score tile."""
    # LOWP (by default query tiles with a bf16/fp16 query): the dots take their operands in the
    # query's dtype, on tensor cores; a float32 dot costs a 64-row score tile about four 16-row ones,
    # and tiles lost so on an H200. Scores stay exact products (K and Q are that dtype already),
    # only the softmax weights are rounded for P @ V, as FlashAttention does.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    # MP is at least 16 (tl.dot's smallest tile): the padded query rows are zeros, never stored.
    offs_m = tl.arange(0, MP)
    offs_d = tl.arange(0, DP)
    # A tile of TILE_BLOCKS blocks a loop iteration: one block (16 keys) at a time left each
    # program waiting on a chain of dependent loads (table -> K -> V) per 16 keys, ~5 us a block
    # on an H200 whatever the batch.
    offs_t = tl.arange(0, TILE_BLOCKS * BLOCK)
    tile_block = offs_t // BLOCK
    in_block = offs_t % BLOCK
    dmask = offs_d < D
    if QT == 1:
        rows = b + offs_m * 0
        mmask = offs_m < G
        heads = kvh * G + offs_m
    else:
        n_rows = tl.load(tiles_ptr + b)
        tok = offs_m // G
        rows = b + tok
        mmask = (tok < n_rows) & (offs_m < QT * G)
        heads = kvh * G + offs_m % G
    q = tl.load(
        q_ptr + rows.to(tl.int64)[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mmask[:, None] & dmask[None, :], other=0.0,
    )
    if not LOWP:
        q = q.to(tl.float32)
    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.zeros([MP], tl.float32)
    acc = tl.zeros([MP, DP], tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_kh
    table = tables_ptr + b.to(tl.int64) * stride_tb
    if QT == 1:
        ctx = tl.load(lens_ptr + b)
        # Sliding window: keys before `first` are out of sight, and whole blocks of them are skipped.
        first = 0
        if WINDOW > 0:
            first = tl.maximum(ctx - WINDOW, 0)
    else:
        # Each row sees keys [row_first, row_ctx); the tile walks the union, which starts at its
        # first row's window and ends at its last row's context (0: an empty program).
        row_ctx = tl.load(lens_ptr + rows, mask=mmask, other=0)
        ctx = tl.max(row_ctx, axis=0)
        row_first = row_ctx * 0
        if WINDOW > 0:
            row_first = tl.maximum(row_ctx - WINDOW, 0)
        first = tl.min(tl.where(mmask, row_first, 2147483647), axis=0)
        first = tl.minimum(first, ctx)
    lo = first // BLOCK
    hi = tl.cdiv(ctx, BLOCK)
    if SPLITS > 1:
        per = tl.cdiv(tl.cdiv(hi - lo, SPLITS), TILE_BLOCKS) * TILE_BLOCKS
        lo = lo + sp * per
        hi = tl.minimum(hi, lo + per)
    for i in range(lo, hi, TILE_BLOCKS):
        idx = i + tile_block
        in_range = idx < hi
        block = tl.load(table + idx, mask=in_range, other=0).to(tl.int64)
        pos = idx * BLOCK + in_block
        valid = in_range & (pos < ctx) & (pos >= first)
        slots = block * BLOCK + in_block
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        if LOWP:
            s = tl.dot(q, tl.trans(k.to(q_ptr.dtype.element_ty))) * scale  # [MP, tile], float32
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        if QT == 1:
            # Every tile starting in [lo, hi) holds at least one visible key (its first block
            # does), so m_new is finite from the first tile on.
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = m_new
        else:
            seen = valid[None, :] & (pos[None, :] < row_ctx[:, None]) & (pos[None, :] >= row_first[:, None])
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row may see no key of a tile (the keys are past its position, or before its
            # window): its max stays -inf, and -inf - -inf must not make NaNs.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + slots[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        if LOWP:
            pv = tl.dot(p.to(q_ptr.dtype.element_ty), v.to(q_ptr.dtype.element_ty))
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLITS == 1:
        # l_i is 0 only on padded rows, never stored.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None] * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :],
        )
    else:
        # Partials [B, H, SPLITS] and [B, H, SPLITS, DP], float32; an empty split leaves m = -inf, l = 0.
        part = (rows.to(tl.int64) * H + heads) * SPLITS + sp
        tl.store(part_m_ptr + part, m_i, mask=mmask)
        tl.store(part_l_ptr + part, l_i, mask=mmask)
        tl.store(part_o_ptr + part[:, None] * DP + offs_d[None, :], acc, mask=mmask[:, None])


@triton.jit
def _combine_splits_kernel(
    part_m_ptr, part_l_ptr, part_o_ptr, out_ptr, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SPLITS: tl.constexpr, SP: tl.constexpr,
):
    """One program per (sequence, query head): the splits' partial softmaxes rescaled to their
    common max and summed."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, DP)
    smask = offs_s < SPLITS
    row = (b.to(tl.int64) * H + h) * SPLITS + offs_s
    m = tl.load(part_m_ptr + row, mask=smask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=smask, other=0.0)
    m_max = tl.max(m, axis=0)  # finite: every context has a visible key
    w = tl.exp(m - m_max)  # 0 for empty splits (m = -inf)
    o = tl.load(part_o_ptr + row[:, None] * DP + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


_SM_COUNT: dict[int, int] = {}


# Triton's CPU interpreter (3.x) multiplies bf16 dot operands as raw bits: there the tiles keep
# float32 dots. Only a GPU runs the bf16 ones (tests/test_paged_attention.py). Known at import:
# not asked on every call, which is every layer of every step.
_INTERPRETED = triton_ops.interpreted()


def auto_splits(num_seqs: int, kv_heads: int, table_blocks: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) for a batch that would leave most of the GPU idle: enough
    programs for about two per SM, each split at least MIN_SPLIT_BLOCKS blocks of the table
    (the table's width is static under a CUDA graph, so this is too). 1 on the CPU."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    programs = max(num_seqs * kv_heads, 1)
    want = -(-2 * _SM_COUNT[index] // programs)
    return max(1, min(want, table_blocks // MIN_SPLIT_BLOCKS, MAX_SPLITS))


MIN_SPLIT_BLOCKS = 4
MAX_SPLITS = 64
TILE_KEYS = 64
# Past head dim 64 a 64-key tile spills registers: on an H200 (bench/paged_decode_bench.py, head
# dim 128) one row over 1k keys took 926 us at 64 keys and 197 at 32, 128 rows over 3k 23.4 ms
# and 4.3.
WIDE_HEAD_TILE_KEYS = 32
# Score rows (query tokens x the G heads of a KV head) a query tile aims for: tl.dot's tile.
QUERY_TILE_ROWS = 64
# Query tiles pay up to this head dim. At 64 (H200, 128 rows over 3k keys) 8-token tiles took
# 242 us against 347 for one row a program; at 128 every tile size lost to one row and to SDPA
# (7.4 ms at best against 4.3 and 3.7), its score and output tiles past the registers.
QUERY_TILE_MAX_HEAD_DIM = 64


def default_tile_keys(head_dim: int) -> int:
    """Keys a loop iteration reads for this head dim."""
    return TILE_KEYS if head_dim <= 64 else WIDE_HEAD_TILE_KEYS


def query_tile_tokens(group: int, head_dim: int = 64, rows: int = QUERY_TILE_ROWS) -> int:
    """Query tokens per tile for `group` query heads per KV head: about `rows` score rows, or 1
    (no tiles) past QUERY_TILE_MAX_HEAD_DIM."""
    if head_dim > QUERY_TILE_MAX_HEAD_DIM:
        return 1
    return max(1, rows // max(group, 1))


def query_tiles(chunk_lens: list[int], tokens: int) -> list[int]:
    """Tile lengths for a flat step whose chunks (in packed order) have these token counts: each
    chunk cut into tiles of at most `tokens` rows, a tile's length at its first row and 0 on the
    rows it covers (paged_decode_attention's `query_tiles`)."""
    out: list[int] = []
    for n in chunk_lens:
        for start in range(0, n, tokens):
            size = min(tokens, n - start)
            out.append(size)
            out.extend([0] * (size - 1))
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int = 0,
    splits: int = 1,
    tile_keys: int | None = None,
    query_tiles: torch.Tensor | None = None,
    tile_tokens: int = 1,
    low_precision_dots: bool | None = None,
) -> torch.Tensor:
    """q [B, H, d]; k/v_cache [kvh, slots, d]; block_tables [B, max_blocks] int32; context_lens
    [B] int32 (keys 0..len-1 are visible, only len-window.. with a sliding `window` > 0; the
    current token's K/V already written) -> [B, H, d]. `splits` > 1 cuts each context's visible
    blocks into that many parts, run as separate programs and merged after (auto_splits chooses).
    `tile_keys` keys (whole blocks, at least 16) are read per loop iteration (default:
    default_tile_keys for the head dim).

    `query_tiles` [B] int32 with `tile_tokens` > 1: rows scored together (see query_tiles(); at
    most `tile_tokens` a tile, a tile's rows one sequence's consecutive positions with the same
    block table). The result is the same as without; only the K/V reads are shared.

    `low_precision_dots` (None: with query tiles only): with a bf16/fp16 query, the dots take
    operands of its dtype (tensor cores) instead of float32; the softmax weights are rounded to
    it for P @ V. For one row a program it is there to be measured (bench/paged_decode_bench.py)."""
    B, H, D = q.shape
    kvh = k_cache.shape[0]
    if block_size & (block_size - 1) or H % kvh or k_cache.stride(2) != 1:
        raise ValueError("paged_decode_attention needs a power-of-two block size, H % kvh == 0, contiguous head dim")
    if splits < 1:
        raise ValueError(f"splits must be at least 1, not {splits}")
    if tile_tokens < 1 or (tile_tokens > 1) != (query_tiles is not None):
        raise ValueError("query_tiles and tile_tokens > 1 go together")
    G = H // kvh
    tile_keys = default_tile_keys(D) if tile_keys is None else tile_keys
    q = q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    tiles = lens if query_tiles is None else query_tiles.to(torch.int32).contiguous()  # unused when QT == 1
    splits = max(1, min(splits, tables.shape[1]))
    DP = max(16, triton.next_power_of_2(D))  # tl.dot's smallest tile
    if splits > 1:
        part_m = torch.empty((B, H, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty((B, H, splits, DP), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_o = out  # unused
    _paged_decode_kernel[(B, kvh, splits)](
        q, k_cache, v_cache, out, part_m, part_l, part_o, tables, lens, tiles, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        out.stride(0), out.stride(1),
        H=H, G=G, MP=max(16, triton.next_power_of_2(tile_tokens * G)), D=D, DP=DP, BLOCK=block_size,
        TILE_BLOCKS=max(1, max(tile_keys, 16) // block_size), WINDOW=int(window), SPLITS=splits, QT=tile_tokens,
        LOWP=(tile_tokens > 1 if low_precision_dots is None else low_precision_dots)
        and q.dtype in (torch.bfloat16, torch.float16) and not _INTERPRETED,
    )
    if splits > 1:
        _combine_splits_kernel[(B, H)](
            part_m, part_l, part_o, out, out.stride(0), out.stride(1),
            H=H, D=D, DP=DP, SPLITS=splits, SP=triton.next_power_of_2(splits),
        )
    return out

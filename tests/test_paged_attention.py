"""The paged decode-attention kernels vs their torch reference (and vs plain attention on a
contiguous copy of each context): the Triton kernel under TRITON_INTERPRET=1 on CPU or compiled
on CUDA, and the C++ CPU kernel."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import kernels
from kernels import cpu_attention
from kernels import reference as ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(B, H, kvh, D, block_size, num_blocks, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kvh, num_blocks * block_size, D, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(kvh, num_blocks * block_size, D, generator=g).to(DEVICE, dtype)
    lens = torch.randint(1, 5 * block_size, (B,), generator=g)
    lens[0] = 1
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(B, max_blocks, dtype=torch.int32)
    used = 0
    for b in range(B):
        n = int((lens[b] + block_size - 1) // block_size)
        tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q = torch.randn(B, H, D, generator=g).to(DEVICE, dtype)
    return q, k_cache, v_cache, tables.to(DEVICE), lens.to(DEVICE)


def _contiguous_attention(q, k_cache, v_cache, tables, lens, block_size, scale, window=0):
    out = []
    kvh = k_cache.shape[0]
    G = q.shape[1] // kvh
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.cat([tables[b, i].long() * block_size + torch.arange(block_size, device=q.device)
                           for i in range((n + block_size - 1) // block_size)])[:n]
        if window:
            slots = slots[max(n - window, 0) :]
        k = k_cache[:, slots].float().repeat_interleave(G, 0)  # [H, n, D]
        v = v_cache[:, slots].float().repeat_interleave(G, 0)
        att = (q[b].float()[:, None, :] @ k.transpose(1, 2)).squeeze(1) * scale
        out.append((att.softmax(-1)[:, None, :] @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("B,H,kvh,D,block_size", [(5, 4, 2, 32, 16), (3, 14, 2, 64, 16), (4, 8, 8, 16, 8), (2, 6, 1, 48, 4)])
def test_kernel_matches_reference_and_contiguous_attention(B, H, kvh, D, block_size):
    q, kc, vc, tables, lens = _case(B, H, kvh, D, block_size, num_blocks=64, seed=B * 31 + D)
    scale = D ** -0.5
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, block_size, scale, use_triton=True)
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, block_size, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(want.float(), _contiguous_attention(q, kc, vc, tables, lens, block_size, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 caches: CUDA only")
def test_bf16_cache_on_cuda():
    q, kc, vc, tables, lens = _case(8, 14, 2, 64, 16, num_blocks=256, seed=3, dtype=torch.bfloat16)
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.125, use_triton=True)
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _cpu_case(*args, **kw):
    return [t.cpu() for t in _case(*args, **kw)]


@pytest.mark.parametrize("B,H,kvh,D,block_size", [(5, 4, 2, 32, 16), (3, 14, 2, 64, 16), (4, 8, 8, 16, 8), (2, 6, 1, 48, 4), (3, 4, 4, 128, 16)])
def test_cpu_kernel_matches_reference(B, H, kvh, D, block_size):
    assert cpu_attention.load() is not None, cpu_attention.error()
    q, kc, vc, tables, lens = _cpu_case(B, H, kvh, D, block_size, num_blocks=64, seed=B * 17 + D)
    scale = D ** -0.5
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, block_size, scale, use_triton=False)
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, block_size, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_half_caches(dtype):
    q, kc, vc, tables, lens = _cpu_case(6, 4, 2, 32, 16, num_blocks=64, seed=5, dtype=dtype)
    got = cpu_attention.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17)
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_float_queries_over_a_narrower_cache(cache_dtype, use_triton):
    # kv_cache_dtype under a float32 model: both kernels widen each cached row and compute in
    # float32, so they agree with the reference on the same rounded cache to float32 precision.
    q, kc, vc, tables, lens = _case(6, 4, 2, 32, 16, num_blocks=64, seed=11)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    if not use_triton:
        assert cpu_attention.load() is not None, cpu_attention.error()
        q, kc, vc, tables, lens = (t.cpu() for t in (q, kc, vc, tables, lens))
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17, use_triton=use_triton)
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("D", [48, 44])  # eight-wide only, and with a leftover of four
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_cpu_kernel_widens_every_fp8_value_exactly(cache_dtype, D):
    # Each sequence's context is one token, so its output is that token's V row as the kernel
    # widened it: every finite byte pattern (subnormals, both zeros, the extremes) must come out
    # as torch's own conversion.
    assert cpu_attention.load() is not None, cpu_attention.error()
    bytes_ = torch.arange(256, dtype=torch.uint8)
    finite = bytes_[torch.isfinite(bytes_.view(cache_dtype).float())]
    rows = -(-finite.numel() // D)
    v = finite.repeat(2)[: rows * D].view(1, rows, D).view(cache_dtype)
    k = torch.zeros_like(v)
    tables = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    lens = torch.ones(rows, dtype=torch.int32)
    q = torch.randn(rows, 2, D)
    got = cpu_attention.paged_decode_attention(q, k, v, tables, lens, 1, 1.0)
    want = v[0].float()[:, None, :].expand(rows, 2, D)
    # Up to one float32 ulp from the kernel's final division (fast-math): a wrong widening would
    # be off in fp8's own 2-3 mantissa bits.
    torch.testing.assert_close(got, want, atol=0, rtol=2.5e-7)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_widen_fp8_equals_torchs_conversion(cache_dtype):
    # The prefill path's widening of gathered fp8 rows: every byte (NaN as NaN), any length.
    bytes_ = torch.arange(256, dtype=torch.uint8).repeat(3)[:700].view(7, 100)
    x = bytes_.view(cache_dtype)
    torch.testing.assert_close(cpu_attention.widen_fp8(x), x.float(), atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(cpu_attention.widen_fp8(x.t()), x.t().float(), atol=0, rtol=0, equal_nan=True)


def test_cpu_kernel_reads_a_layer_slice_of_the_cache():
    # The model runner passes k_cache[layer]: a view with a storage offset.
    q, kc, vc, tables, lens = _cpu_case(4, 4, 2, 32, 16, num_blocks=32, seed=9)
    stacked_k = torch.stack([torch.randn_like(kc), kc])
    stacked_v = torch.stack([torch.randn_like(vc), vc])
    got = cpu_attention.paged_decode_attention(q, stacked_k[1], stacked_v[1], tables, lens, 16, 0.17)
    torch.testing.assert_close(got, ref.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17), atol=2e-5, rtol=1e-4)


def test_cpu_kernel_rejects_bad_tables():
    q, kc, vc, tables, lens = _cpu_case(2, 4, 2, 32, 16, num_blocks=8, seed=1)
    bad = tables.clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_attention.paged_decode_attention(q, kc, vc, bad, lens, 16, 0.17)
    with pytest.raises(RuntimeError, match="context length"):
        cpu_attention.paged_decode_attention(q, kc, vc, tables, torch.zeros_like(lens), 16, 0.17)


@pytest.mark.parametrize("window", [1, 5, 16, 23, 1000])
@pytest.mark.parametrize("use_triton", [False, True])
def test_sliding_window_sees_the_last_keys_only(window, use_triton):
    # Mistral's sliding window: the query at context length L sees keys L-window..L-1. Windows
    # inside a block, on a block boundary, across blocks, and wider than every context.
    q, kc, vc, tables, lens = _case(6, 4, 2, 32, 16, num_blocks=64, seed=window)
    if not use_triton:
        assert cpu_attention.load() is not None, cpu_attention.error()
        q, kc, vc, tables, lens = (t.cpu() for t in (q, kc, vc, tables, lens))
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17, window=window, use_triton=use_triton)
    want = ref.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(want, _contiguous_attention(q, kc, vc, tables, lens, 16, 0.17, window), atol=2e-5, rtol=1e-4)
    if window < int(lens.max()):
        assert not torch.allclose(got, ref.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17))



@pytest.mark.parametrize("splits", [2, 3, 7, 64])
@pytest.mark.parametrize("window", [0, 21])
def test_split_contexts_merge_to_the_same_attention(splits, window):
    # Contexts of 1 to 5 blocks cut into more parts than some have blocks: empty parts, parts
    # wholly outside a sliding window, and a table narrower than `splits` (clamped) all merge.
    B, H, kvh, D, bs = 6, 14, 2, 64, 8
    q, kc, vc, tables, lens = _case(B, H, kvh, D, bs, num_blocks=64, seed=splits * 7 + window)
    scale = D ** -0.5
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, bs, scale, window=window, splits=splits,
                                         use_triton=True)
    want = _contiguous_attention(q, kc, vc, tables, lens, bs, scale, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("splits", [5, 17, 64])
@pytest.mark.parametrize("window,tile_keys", [(0, 64), (21, 16), (50, 32)])
def test_splits_cut_each_context_not_the_table_width(splits, window, tile_keys):
    # A CUDA graph's tables are as wide as the model's longest context; each program cuts its
    # own visible blocks into the splits (whole tiles each, so some splits may get none):
    # contexts of 1 to 20 blocks in tables 64 wide, whose unused tail holds other blocks.
    _matches_contiguous_attention([1, 9, 33, 64, 100, 157], 64, splits, window, tile_keys,
                                  seed=splits * 3 + window + tile_keys)


@pytest.mark.parametrize("tile_keys", [16, 32, 64, 128])
@pytest.mark.parametrize("splits,window", [(1, 0), (1, 37), (3, 0), (5, 50)])
def test_tiles_of_several_blocks_cover_every_context_once(tile_keys, splits, window):
    # The kernel reads `tile_keys` keys (whole blocks) an iteration: contexts of 1 to ~20 blocks of
    # 8 keys end inside a tile, on its edge, or inside a split's last tile; tiles straddle a
    # split's end and a sliding window's first block, and the table's unused tail holds blocks
    # another sequence owns (read past a context's end, they would change the result).
    _matches_contiguous_attention([1, 8, 9, 63, 64, 65, 157], 20, splits, window, tile_keys,
                                  seed=tile_keys * 13 + splits + window)


def _matches_contiguous_attention(lens: list[int], width: int, splits: int, window: int, tile_keys: int, seed: int):
    """The Triton kernel on contexts of these lengths (8-key blocks, 14 query / 2 KV heads, head
    dim 64) in tables `width` blocks wide, every entry a distinct block (the unused tail too)."""
    from kernels import paged_attention

    B, H, kvh, D, bs = len(lens), 14, 2, 64, 8
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(B * width, generator=g).to(torch.int32).reshape(B, width).to(DEVICE)
    kc = torch.randn(kvh, B * width * bs, D, generator=g).to(DEVICE)
    vc = torch.randn(kvh, B * width * bs, D, generator=g).to(DEVICE)
    q = torch.randn(B, H, D, generator=g).to(DEVICE)
    lens_t = torch.tensor(lens).to(DEVICE)
    scale = D ** -0.5
    got = paged_attention.paged_decode_attention(q, kc, vc, tables, lens_t, bs, scale, window=window, splits=splits,
                                                 tile_keys=tile_keys)
    want = _contiguous_attention(q, kc, vc, tables, lens_t, bs, scale, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_auto_splits_fill_the_gpu_only_where_a_batch_leaves_it_idle(monkeypatch):
    from kernels import paged_attention

    monkeypatch.setitem(paged_attention._SM_COUNT, 0, 132)  # an H100's
    cuda = torch.device("cuda", 0)
    assert paged_attention.auto_splits(1, 2, 256, cuda) == 64  # 2 programs: capped at MAX_SPLITS
    assert paged_attention.auto_splits(1, 2, 64, cuda) == 16  # at least 4 blocks a split
    assert paged_attention.auto_splits(8, 2, 256, cuda) == 17  # ceil(264 / 16)
    assert paged_attention.auto_splits(64, 2, 256, cuda) == 3
    assert paged_attention.auto_splits(256, 2, 256, cuda) == 1
    assert paged_attention.auto_splits(1, 2, 3, cuda) == 1  # too short to cut
    assert paged_attention.auto_splits(1, 2, 256, torch.device("cpu")) == 1


def _flat_step(chunks, H, kvh, D, bs, seed):
    """A flat step's rows: each (start, n) chunk is one sequence's positions start..start+n-1, a
    row per position with the sequence's block table; n == 1 is a decode row."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-(start + n) // bs) for start, n in chunks)
    num_blocks = width * len(chunks) + 4
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    kc = torch.randn(kvh, num_blocks * bs, D, generator=g)
    vc = torch.randn(kvh, num_blocks * bs, D, generator=g)
    tables, lens = [], []
    for i, (start, n) in enumerate(chunks):
        row = perm[i * width : (i + 1) * width]
        for p in range(start, start + n):
            tables.append(row)
            lens.append(p + 1)
    q = torch.randn(len(lens), H, D, generator=g)
    return (q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), torch.stack(tables).to(DEVICE),
            torch.tensor(lens, dtype=torch.int32).to(DEVICE))


@pytest.mark.parametrize("H,kvh,D,tokens,splits,window", [
    (14, 2, 64, 9, 1, 0), (14, 2, 64, 9, 1, 21), (14, 2, 64, 9, 3, 0), (14, 2, 64, 4, 4, 37),
    (8, 8, 32, 16, 1, 0), (6, 1, 48, 3, 3, 21), (4, 2, 128, 2, 1, 0),
])
def test_query_tiles_score_a_chunks_rows_together(H, kvh, D, tokens, splits, window):
    # A flat step as the runner lays it out: decode rows, a chunk starting a prompt, chunks in
    # the middle of one (on and off block edges), one shorter than a tile and one of several
    # tiles with a ragged last. Each tile's rows read row b's table only: the covered rows'
    # tables are overwritten with other blocks, which a per-row read would attend.
    from kernels import paged_attention

    chunks = [(30, 1), (0, 23), (5, 1), (16, 2 * tokens + 1), (41, tokens - 1 or 1), (7, 40)]
    bs = 8
    q, kc, vc, tables, lens = _flat_step(chunks, H, kvh, D, bs, seed=H * 7 + tokens + splits + window)
    scale = D ** -0.5
    want = _contiguous_attention(q, kc, vc, tables, lens, bs, scale, window=window)
    tiles = paged_attention.query_tiles([n for _, n in chunks], tokens)
    assert len(tiles) == q.shape[0] and max(tiles) <= tokens
    covered = torch.tensor(tiles, device=DEVICE) == 0
    tables[covered] = tables[covered].flip(1)
    got = kernels.paged_decode_attention(q, kc, vc, tables, lens, bs, scale, window=window, splits=splits,
                                         query_tiles=torch.tensor(tiles, dtype=torch.int32, device=DEVICE),
                                         tile_tokens=tokens, use_triton=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("H,kvh,D,tokens,splits,window", [(14, 2, 64, 9, 3, 0), (8, 2, 32, 4, 1, 21)])
def test_query_tiles_in_bf16_score_on_low_precision_dots(H, kvh, D, tokens, splits, window):
    # With a bf16 query the tiles' dots take bf16 operands (tensor cores on a GPU): the scores
    # are exact products summed in float32, only the softmax weights are rounded for P @ V.
    # Within bf16's error of exact attention, as the untiled float32-dot kernel is. (Under the
    # interpreter, whose bf16 dots are wrong, the tiles keep float32 dots: the same check.)
    from kernels import paged_attention

    chunks = [(30, 1), (0, 23), (16, 2 * tokens + 1), (7, 40)]
    bs = 8
    q, kc, vc, tables, lens = _flat_step(chunks, H, kvh, D, bs, seed=H + tokens + window)
    q, kc, vc = q.bfloat16(), kc.bfloat16(), vc.bfloat16()
    scale = D ** -0.5
    want = _contiguous_attention(q, kc, vc, tables, lens, bs, scale, window=window)
    tiles = torch.tensor(paged_attention.query_tiles([n for _, n in chunks], tokens), dtype=torch.int32, device=DEVICE)
    got = paged_attention.paged_decode_attention(q, kc, vc, tables, lens, bs, scale, window=window, splits=splits,
                                                 query_tiles=tiles, tile_tokens=tokens)
    rows = paged_attention.paged_decode_attention(q, kc, vc, tables, lens, bs, scale, window=window, splits=splits)
    # one row a program on bf16 dots too (not the default: there to be measured)
    rows_lowp = paged_attention.paged_decode_attention(q, kc, vc, tables, lens, bs, scale, window=window,
                                                       splits=splits, low_precision_dots=True)
    assert got.dtype == torch.bfloat16
    for out in (got, rows, rows_lowp):
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_query_tiles_cut_chunks_at_their_own_starts():
    from kernels import paged_attention

    assert paged_attention.query_tiles([1, 5, 1, 3], 2) == [1, 2, 0, 2, 0, 1, 1, 2, 0, 1]
    assert paged_attention.query_tiles([4], 4) == [4, 0, 0, 0]
    assert paged_attention.query_tile_tokens(7) == 9 and paged_attention.query_tile_tokens(1) == 64
    assert paged_attention.query_tile_tokens(128) == 1
    # past head dim 64 tiles lost on an H200 at every size: auto is then off
    assert paged_attention.query_tile_tokens(4, head_dim=128) == 1 and paged_attention.query_tile_tokens(4, 64) == 16
    assert paged_attention.default_tile_keys(64) == 64 and paged_attention.default_tile_keys(128) == 32
    q, kc, vc, tables, lens = _case(2, 4, 2, 32, 16, num_blocks=8, seed=1)
    with pytest.raises(ValueError, match="go together"):
        kernels.paged_decode_attention(q, kc, vc, tables, lens, 16, 0.17, tile_tokens=4, use_triton=True)

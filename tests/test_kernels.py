"""Triton sampling kernels vs their torch references (kernels/).

Without a GPU the kernels run in Triton's CPU interpreter: TRITON_INTERPRET must be set before
triton is first imported, hence the setdefault at the very top (a no-op where CUDA is present).
Every Triton call passes use_triton=True explicitly.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
import textwrap

import pytest

import kernels
from kernels import reference as ref

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEG_INF = float("-inf")


def _triton_unavailable() -> str | None:
    try:
        from kernels import triton_ops
    except Exception as exc:  # pragma: no cover - environment problem
        return f"triton unavailable: {exc!r}"
    if triton_ops.interpreted() != (DEVICE.type == "cpu"):
        return "triton was imported before TRITON_INTERPRET=1 was set; run the kernel tests on their own"
    return None


_SKIP = _triton_unavailable()
needs_triton = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")

VOCABS = [1000, 4099]  # non-powers-of-two; 151936 in dedicated small-batch tests


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(B: int, V: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return (torch.randn(B, V, generator=_gen(seed)) * scale).to(DEVICE)


def _mixed_filter_params(B: int, V: int, seed: int):
    g = _gen(seed)
    top_k = torch.randint(1, min(V, 200), (B,), generator=g, dtype=torch.int32)
    choice = torch.randint(0, 6, (B,), generator=g)
    top_k = torch.where(choice == 0, torch.tensor(-1, dtype=torch.int32), top_k)
    top_k = torch.where(choice == 1, torch.tensor(0, dtype=torch.int32), top_k)
    top_k = torch.where(choice == 2, torch.tensor(V, dtype=torch.int32), top_k)
    top_k[:3] = torch.tensor([1, V + 7, V - 1], dtype=torch.int32)
    top_p = torch.rand(B, generator=g) * 0.99 + 0.01
    top_p = torch.where(torch.rand(B, generator=g) < 0.3, torch.ones(B), top_p)
    min_p = torch.rand(B, generator=g) * 0.3
    min_p = torch.where(torch.rand(B, generator=g) < 0.5, torch.zeros(B), min_p)
    return top_k.to(DEVICE), top_p.to(DEVICE), min_p.to(DEVICE)


def _mass_above(x: torch.Tensor) -> torch.Tensor:
    """[B, V] float64: softmax mass of tokens strictly larger than each token."""
    x = x.double()
    m = x.max(1, keepdim=True).values
    e = torch.exp(x - torch.where(m > NEG_INF, m, torch.zeros_like(m)))
    e_sorted, order = e.sort(1, descending=True)
    x_sorted = x.gather(1, order)
    excl = e_sorted.cumsum(1) - e_sorted
    # first element of each tie group
    ar = torch.arange(x.shape[1], device=x.device).expand_as(x)
    start = torch.ones_like(x_sorted, dtype=torch.bool)
    start[:, 1:] = x_sorted[:, 1:] != x_sorted[:, :-1]
    idx = torch.where(start, ar, torch.zeros_like(ar)).cummax(1).values
    above_sorted = excl.gather(1, idx) / e.sum(1, keepdim=True)
    return torch.empty_like(above_sorted).scatter_(1, order, above_sorted)


def assert_filter_matches(out, expect, x, top_p, min_p, tol=1e-5):
    """Same kept set, kept values untouched; a disagreement is only tolerated for a token sitting
    within `tol` of a top-p or min-p boundary (float summation order differs between paths)."""
    keep_out, keep_exp = out > NEG_INF, expect > NEG_INF
    assert torch.equal(torch.where(keep_out, out, 0.0), torch.where(keep_out, x, 0.0))
    diff = keep_out != keep_exp
    if diff.any():
        m = x.max(1, keepdim=True).values
        e = torch.exp((x - m).double())
        near_p = (_mass_above(x) - top_p.double()[:, None]).abs() < tol
        near_min = (e - min_p.double()[:, None]).abs() < tol
        bad = diff & ~near_p & ~near_min
        assert not bad.any(), f"{int(bad.sum())} tokens differ away from any boundary: {bad.nonzero()[:10].tolist()}"
        assert int(diff.sum()) <= max(2, diff.shape[0] // 50)


def assert_tokens_match(tok, expect, x, seeds, offsets, greedy):
    """Same tokens; a disagreement is only tolerated where the two candidates' Gumbel scores tie to
    float precision (log() may differ in the last ulp between backends)."""
    assert tok.dtype == torch.int64 and tok.shape == expect.shape
    g = greedy.to(torch.bool)
    assert torch.equal(tok[g], expect[g])
    diff = (tok != expect).nonzero().flatten()
    if len(diff):
        score = x + ref.gumbel_noise(seeds, offsets, x.shape[1])
        for i in diff.tolist():
            a, b = score[i, tok[i]], score[i, expect[i]]
            assert (a - b).abs() <= 1e-5 * (1 + b.abs()), (i, tok[i].item(), expect[i].item(), a.item(), b.item())
        assert len(diff) <= max(1, len(tok) // 100)


# ---------------------------------------------------------------------------------------------
# temperature
# ---------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("V", VOCABS)
def test_temperature_matches_reference(V):
    B = 37
    x = _logits(B, V, 1)
    t = torch.rand(B, generator=_gen(2)) * 2 + 0.05
    t[::5] = 0.0  # greedy rows: untouched
    t = t.to(DEVICE)
    out = kernels.apply_temperature(x, t, use_triton=True)
    torch.testing.assert_close(out, ref.apply_temperature(x, t), rtol=1e-6, atol=0)
    assert torch.equal(out[::5], x[::5])
    assert not torch.equal(x, out)  # new tensor, input untouched
    assert torch.equal(x, _logits(B, V, 1))
    # out=: the same values written into the given tensor, the logits themselves included
    # (the sampler divides its own rows in place).
    same = kernels.apply_temperature(x, t, use_triton=True, out=x)
    assert same.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, out, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# penalties
# ---------------------------------------------------------------------------------------------
def test_penalties_reference_semantics():
    x = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2, 1, 0, 0, 0, 0]], dtype=torch.int32)
    prompt = torch.tensor([[False, False, True, True, False, False]])
    out = ref.apply_penalties(x, counts, prompt, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0]))
    # token 0: 2/2 - 0.5*2 - 0.25; token 1: -2*2 - 0.5 - 0.25; 2,3: prompt only -> repetition only
    expect = torch.tensor([[1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 0.5, -2.0, 0.5, 3.0]])
    torch.testing.assert_close(out, expect)


@needs_triton
@pytest.mark.parametrize("V", VOCABS)
def test_penalties_match_reference(V):
    B = 29
    g = _gen(3)
    x = _logits(B, V, 4)
    counts = torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32)
    counts *= (torch.rand(B, V, generator=g) < 0.05).to(torch.int32)
    prompt = torch.rand(B, V, generator=g) < 0.03
    freq = torch.rand(B, generator=g) * 4 - 2
    pres = torch.rand(B, generator=g) * 4 - 2
    rep = torch.rand(B, generator=g) * 1.8 + 0.2
    freq[::4], pres[::4], rep[::4] = 0.0, 0.0, 1.0  # neutral rows
    args = [t.to(DEVICE) for t in (counts, prompt, freq, pres, rep)]
    out = kernels.apply_penalties(x, *args, use_triton=True)
    torch.testing.assert_close(out, ref.apply_penalties(x, *args), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[::4], x[::4])


# ---------------------------------------------------------------------------------------------
# grammar bitmask
# ---------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("V,W", [(1000, 32), (4099, 129), (4099, 100), (1000, 40)])
def test_bitmask_matches_reference(V, W):
    B = 13
    g = _gen(5)
    x = _logits(B, V, 6)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (B, W), generator=g, dtype=torch.int32).to(DEVICE)
    bitmask[0] = -1  # all allowed
    bitmask[1] = 0  # all banned
    row_mask = (torch.rand(B, generator=g) < 0.7).to(DEVICE)
    row_mask[:2] = True
    out = kernels.apply_token_bitmask(x, bitmask, row_mask, use_triton=True)
    expect = ref.apply_token_bitmask(x, bitmask, row_mask)
    assert torch.equal(out, expect)
    assert torch.equal(out[~row_mask], x[~row_mask])
    cover = min(V, 32 * W)
    assert torch.equal(out[0], x[0])
    assert bool((out[1, :cover] == NEG_INF).all()) and torch.equal(out[1, cover:], x[1, cover:])
    # bit j of word i <-> token 32 i + j
    r = int(row_mask.nonzero()[2])
    for tok in (0, 31, 32, 33, cover - 1):
        allowed = (int(bitmask[r, tok // 32]) >> (tok % 32)) & 1
        assert (out[r, tok] == NEG_INF) == (not allowed)


def test_bitmask_reference_agrees_with_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    B, V = 5, 1000
    x = _logits(B, V, 7).cpu()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (B, (V + 31) // 32), generator=_gen(8), dtype=torch.int32)
    expect = x.clone()
    xgr.apply_token_bitmask_inplace(expect, bitmask)
    assert torch.equal(ref.apply_token_bitmask(x, bitmask, torch.ones(B, dtype=torch.bool)), expect)


# ---------------------------------------------------------------------------------------------
# top-k / top-p / min-p
# ---------------------------------------------------------------------------------------------
def _kept(row: torch.Tensor) -> list[int]:
    return (row > NEG_INF).nonzero().flatten().tolist()


def test_filter_reference_semantics():
    f = ref.top_k_top_p_min_p
    one = lambda v, dt=torch.float32: torch.tensor([v], dtype=dt)  # noqa: E731
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    # top-k keeps every token tied with the k-th largest value
    assert _kept(f(x, one(2, torch.int32), one(1.0), one(0.0))[0]) == [1, 2, 3, 5]
    assert _kept(f(x, one(1, torch.int32), one(1.0), one(0.0))[0]) == [1]
    for off in (0, -1, 6, 100):
        assert _kept(f(x, one(off, torch.int32), one(1.0), one(0.0))[0]) == list(range(6))
    # top-p: smallest set of largest tokens with mass >= p; the crossing tie group is kept whole
    p = torch.softmax(x, 1)[0]
    assert _kept(f(x, one(0, torch.int32), one(float(p[1]) - 1e-3), one(0.0))[0]) == [1]
    assert _kept(f(x, one(0, torch.int32), one(float(p[1]) + 1e-3), one(0.0))[0]) == [1, 2, 3, 5]
    assert _kept(f(x, one(0, torch.int32), one(0.0), one(0.0))[0]) == [1]  # max always survives
    # min-p: p_i >= min_p * p_max
    ratio = float(torch.exp(torch.tensor(2.0 - 3.0)))
    assert _kept(f(x, one(0, torch.int32), one(1.0), one(ratio - 1e-4))[0]) == [1, 2, 3, 5]
    assert _kept(f(x, one(0, torch.int32), one(1.0), one(ratio + 1e-4))[0]) == [1]
    assert _kept(f(x, one(0, torch.int32), one(1.0), one(5.0))[0]) == [1]
    # joint: each filter on the same distribution, a token must pass all three
    out = f(x, one(3, torch.int32), one(float(p[1]) + 1e-3), one(0.5))
    assert _kept(out[0]) == [1]
    assert torch.equal(out[0, 1], x[0, 1])


@needs_triton
@pytest.mark.parametrize("V", VOCABS)
def test_filter_matches_reference_mixed_batch(V):
    B = 40
    x = _logits(B, V, 10)
    x[5, ::3] = NEG_INF  # rows that were already partly masked (grammar)
    x[6] = NEG_INF  # fully masked row
    x[7, 0] = 50.0  # one dominant token
    top_k, top_p, min_p = _mixed_filter_params(B, V, 11)
    top_p[7] = 0.5
    out = kernels.top_k_top_p_min_p(x, top_k, top_p, min_p, use_triton=True)
    expect = ref.top_k_top_p_min_p(x, top_k, top_p, min_p)
    assert_filter_matches(out, expect, x, top_p, min_p)
    assert bool((out[6] == NEG_INF).all())
    assert _kept(out[7]) == [0]


@needs_triton
def test_filter_ties_match_reference():
    """Heavily tied logits (quantized): tie semantics must agree exactly."""
    B, V = 24, 1000
    x = torch.round(_logits(B, V, 12, scale=1.5) * 2) / 2  # values on a 0.5 grid
    x[0, :] = 1.0  # all tied
    x[1, :10] = -0.0  # signed zeros tie with +0.0
    top_k, top_p, min_p = _mixed_filter_params(B, V, 13)
    out = kernels.top_k_top_p_min_p(x, top_k, top_p, min_p, use_triton=True)
    expect = ref.top_k_top_p_min_p(x, top_k, top_p, min_p)
    assert_filter_matches(out, expect, x, top_p, min_p)
    assert torch.equal(out[0], x[0])  # every token ties with the max
    kth = x.sort(1, descending=True).values
    for r in range(B):
        k = int(top_k[r])
        if 0 < k < V and top_p[r] >= 1 and min_p[r] <= 0:
            assert len(_kept(out[r])) == int((x[r] >= kth[r, k - 1]).sum()) >= k


@needs_triton
def test_filter_large_vocab():
    B, V = 3, 151936
    x = _logits(B, V, 14, scale=4.0)
    top_k = torch.tensor([50, 0, 20000], dtype=torch.int32, device=DEVICE)
    top_p = torch.tensor([1.0, 0.9, 0.95], device=DEVICE)
    min_p = torch.tensor([0.0, 0.05, 0.0], device=DEVICE)
    out = kernels.top_k_top_p_min_p(x, top_k, top_p, min_p, use_triton=True)
    expect = ref.top_k_top_p_min_p(x, top_k, top_p, min_p)
    assert_filter_matches(out, expect, x, top_p, min_p)
    assert len(_kept(out[0])) == 50


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------
def test_philox_reference_known_answers():
    """Random123 known-answer vectors for Philox4x32-10."""
    vectors = [
        ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for ctr, key, expect in vectors:
        out = ref.philox4x32_10(*(torch.tensor([v]) for v in ctr + key))
        assert [int(o) for o in out] == expect


@needs_triton
def test_philox_reference_bit_exact_vs_tl_rand():
    import triton
    import triton.language as tl

    @triton.jit
    def _rand_kernel(seed_ptr, off_ptr, out_ptr, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        seed = tl.load(seed_ptr + row)
        ctr = (tl.load(off_ptr + row) << 32) + cols.to(tl.int64)
        tl.store(out_ptr + row * V + cols, tl.rand(seed, ctr), mask=cols < V)

    g = _gen(15)
    B, V = 6, 64
    seeds = torch.randint(-(2**63), 2**63 - 1, (B,), generator=g).to(DEVICE)
    offs = torch.randint(0, 2**40, (B,), generator=g).to(DEVICE)
    out = torch.empty(B, V, device=DEVICE)
    _rand_kernel[(B,)](seeds, offs, out, V, BLOCK=64)
    ctr = (offs[:, None] << 32) + torch.arange(V, device=DEVICE)
    assert torch.equal(out, ref.philox_uniform(seeds[:, None], ctr))


@needs_triton
@pytest.mark.parametrize("V", [1000, 4099, 151936])
def test_sample_matches_reference(V):
    B = {1000: 64, 4099: 16, 151936: 3}[V]
    g = _gen(20)
    x = _logits(B, V, 21, scale=2.0)
    x[1, 100:] = NEG_INF  # filtered row
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g).to(DEVICE)
    offsets = torch.randint(0, 2**31, (B,), generator=g).to(DEVICE)
    greedy = (torch.rand(B, generator=g) < 0.25).to(DEVICE)
    greedy[0] = True
    tok = kernels.sample(x, seeds, offsets, greedy, use_triton=True)
    expect = ref.sample(x, seeds, offsets, greedy)
    assert_tokens_match(tok, expect, x, seeds, offsets, greedy)
    assert torch.equal(tok[greedy], x[greedy].argmax(1))
    assert int(tok[1]) < 100


@needs_triton
def test_sample_same_seed_same_tokens_and_batch_independence():
    V, B = 1000, 300
    g = _gen(30)
    x = _logits(B, V, 31, scale=1.0)
    seeds = torch.randint(0, 2**40, (B,), generator=g).to(DEVICE)
    offsets = torch.randint(0, 1000, (B,), generator=g).to(DEVICE)
    greedy = torch.zeros(B, dtype=torch.bool, device=DEVICE)
    tok = kernels.sample(x, seeds, offsets, greedy, use_triton=True)
    assert torch.equal(tok, kernels.sample(x, seeds, offsets, greedy, use_triton=True))
    # each row alone, and rows in a permuted batch, give the same tokens
    perm = torch.randperm(B, generator=g).to(DEVICE)
    assert torch.equal(kernels.sample(x[perm], seeds[perm], offsets[perm], greedy, use_triton=True), tok[perm])
    for i in (0, 7, B - 1):
        sl = slice(i, i + 1)
        assert torch.equal(kernels.sample(x[sl], seeds[sl], offsets[sl], greedy[sl], use_triton=True), tok[sl])
    # the reference has the same property
    rt = ref.sample(x, seeds, offsets, greedy)
    assert torch.equal(ref.sample(x[perm], seeds[perm], offsets[perm], greedy), rt[perm])
    # another step (offset) or another seed changes the draws
    assert (kernels.sample(x, seeds, offsets + 1, greedy, use_triton=True) != tok).float().mean() > 0.5
    assert (kernels.sample(x, seeds + 1, offsets, greedy, use_triton=True) != tok).float().mean() > 0.5


@needs_triton
def test_sample_all_masked_row_and_ties():
    x = torch.full((3, 40), NEG_INF, device=DEVICE)
    x[1, [5, 9]] = 2.0  # greedy tie -> lowest index
    x[2, 17] = 0.0  # only one allowed token
    seeds = torch.tensor([1, 2, 3], device=DEVICE)
    offsets = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    greedy = torch.tensor([False, True, False], device=DEVICE)
    tok = kernels.sample(x, seeds, offsets, greedy, use_triton=True)
    assert tok.tolist() == [0, 5, 17]
    assert ref.sample(x, seeds, offsets, greedy).tolist() == [0, 5, 17]


# ---------------------------------------------------------------------------------------------
# log-softmax
# ---------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("V", [1000, 4099, 151936])
def test_log_softmax_matches_reference(V):
    B = 2 if V > 10000 else 17
    x = _logits(B, V, 40, scale=5.0)
    x[0, ::7] = NEG_INF
    out = kernels.log_softmax(x, use_triton=True)
    expect = ref.log_softmax(x)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=2e-5)
    assert bool((out[0, ::7] == NEG_INF).all())


def test_log_softmax_batch_independent():
    if _SKIP:
        pytest.skip(_SKIP)
    x = _logits(9, 1000, 41)
    full = kernels.log_softmax(x, use_triton=True)
    assert torch.equal(kernels.log_softmax(x[3:4], use_triton=True), full[3:4])


@needs_triton
def test_filter_batch_independent():
    V, B = 1000, 20
    x = _logits(B, V, 42)
    top_k, top_p, min_p = _mixed_filter_params(B, V, 43)
    full = kernels.top_k_top_p_min_p(x, top_k, top_p, min_p, use_triton=True)
    for i in (0, 11):
        sl = slice(i, i + 1)
        assert torch.equal(kernels.top_k_top_p_min_p(x[sl], top_k[sl], top_p[sl], min_p[sl], use_triton=True), full[sl])


# ---------------------------------------------------------------------------------------------
# dispatch / validation
# ---------------------------------------------------------------------------------------------
def test_reference_path_and_validation():
    x = _logits(4, 100, 50)
    t = torch.tensor([0.0, 0.5, 1.0, 2.0], device=DEVICE)
    torch.testing.assert_close(kernels.apply_temperature(x, t, use_triton=False), ref.apply_temperature(x, t))
    with pytest.raises(ValueError, match="temperature"):
        kernels.apply_temperature(x, t[:3], use_triton=False)
    y = x.clone()
    assert kernels.apply_temperature(y, t, use_triton=False, out=y).data_ptr() == y.data_ptr()
    torch.testing.assert_close(y, ref.apply_temperature(x, t), rtol=0, atol=0)
    with pytest.raises(ValueError, match="out must be"):
        kernels.apply_temperature(x, t, use_triton=False, out=x[:, :50])
    with pytest.raises(TypeError, match="float32"):
        kernels.log_softmax(x.double(), use_triton=False)
    with pytest.raises(TypeError, match="int32"):
        kernels.apply_token_bitmask(x, torch.zeros(4, 4, dtype=torch.int64), torch.ones(4, dtype=torch.bool))


def test_empty_batch():
    x = torch.zeros(0, 50, device=DEVICE)
    z = torch.zeros(0, device=DEVICE)
    assert kernels.sample(x, z.long(), z.long(), z.bool(), use_triton=True).shape == (0,)
    assert kernels.top_k_top_p_min_p(x, z.int(), z, z, use_triton=True).shape == (0, 50)
    assert kernels.log_softmax(x, use_triton=True).shape == (0, 50)


def test_default_dispatch(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "_launch", lambda name, *a: calls.append(name) or a[0])
    x = torch.zeros(2, 8)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    kernels.log_softmax(x)
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels.log_softmax(x)
    assert calls == ["log_softmax"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="real CUDA runs cover compilation")
def test_kernels_compile_for_cuda(tmp_path):
    """No GPU here: compile every kernel to a sm_90 cubin with Triton's bundled ptxas."""
    script = textwrap.dedent(
        """
        import os, sys
        import triton
        from triton.compiler import ASTSource
        from triton.backends.compiler import GPUTarget
        from kernels import triton_ops as T
        from kernels import paged_attention as A
        P, I = "*fp32", "i32"
        paged = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", part_m_ptr=P, part_l_ptr=P,
                     part_o_ptr=P, tables_ptr="*i32", lens_ptr="*i32", tiles_ptr="*i32", scale="fp32",
                     stride_qb=I, stride_qh=I, stride_kh=I, stride_ks=I, stride_tb=I, stride_ob=I, stride_oh=I)
        combine = dict(part_m_ptr=P, part_l_ptr=P, part_o_ptr=P, out_ptr="*bf16", stride_ob=I, stride_oh=I)
        specs = [
            (T._temperature_kernel, dict(x_ptr=P, out_ptr=P, temp_ptr=P, B=I, V=I, stride_x=I, stride_o=I), dict(ROWS=2, BLOCK=1024)),
            (T._penalties_kernel, dict(x_ptr=P, out_ptr=P, cnt_ptr="*i32", prompt_ptr="*u8", freq_ptr=P, pres_ptr=P,
             rep_ptr=P, B=I, V=I, stride_x=I, stride_o=I, stride_c=I, stride_p=I), dict(ROWS=2, BLOCK=1024)),
            (T._bitmask_kernel, dict(x_ptr=P, out_ptr=P, bm_ptr="*i32", rowmask_ptr="*u8", B=I, V=I, COVER=I, stride_x=I,
             stride_o=I, stride_b=I), dict(ROWS=2, BLOCK=1024)),
            (T._filter_kernel, dict(x_ptr=P, out_ptr=P, k_ptr="*i32", p_ptr=P, minp_ptr=P, B=I, V=I, stride_x=I, stride_o=I),
             dict(ROWS=1, BLOCK=512, NP=16)),
            (T._filter_kernel, dict(x_ptr=P, out_ptr=P, k_ptr="*i32", p_ptr=P, minp_ptr=P, B=I, V=I, stride_x=I, stride_o=I),
             dict(ROWS=16, BLOCK=32, NP=16)),
            (T._sample_kernel, dict(x_ptr=P, out_ptr="*i64", seed_ptr="*i64", off_ptr="*i64", greedy_ptr="*u8", B=I, V=I,
             stride_x=I), dict(ROWS=1, BLOCK=2048)),
            (T._log_softmax_kernel, dict(x_ptr=P, out_ptr=P, B=I, V=I, stride_x=I, stride_o=I), dict(ROWS=1, BLOCK=2048)),
            # decode attention: bf16 caches, head_dim 128, GQA 4 (padded to tl.dot's 16 rows),
            # 64-key tiles; full and sliding-window, whole contexts and split ones, and the merge;
            # query tiles (a flat chunk's rows together): 16 rows of GQA 4, 9 rows of the 0.4B's GQA 7,
            # float32 dots and bf16 ones (LOWP, tensor cores)
            (A._paged_decode_kernel, paged, dict(H=32, G=4, MP=16, D=128, DP=128, BLOCK=16, TILE_BLOCKS=4, WINDOW=0, SPLITS=1, QT=1, LOWP=False)),
            (A._paged_decode_kernel, paged, dict(H=32, G=4, MP=16, D=128, DP=128, BLOCK=16, TILE_BLOCKS=4, WINDOW=4096, SPLITS=1, QT=1, LOWP=False)),
            (A._paged_decode_kernel, paged, dict(H=32, G=4, MP=16, D=128, DP=128, BLOCK=16, TILE_BLOCKS=4, WINDOW=0, SPLITS=17, QT=1, LOWP=False)),
            (A._paged_decode_kernel, paged, dict(H=32, G=4, MP=16, D=128, DP=128, BLOCK=16, TILE_BLOCKS=2, WINDOW=0, SPLITS=17, QT=1, LOWP=True)),
            (A._paged_decode_kernel, paged, dict(H=32, G=4, MP=64, D=128, DP=128, BLOCK=16, TILE_BLOCKS=4, WINDOW=0, SPLITS=1, QT=16, LOWP=False)),
            (A._paged_decode_kernel, paged, dict(H=32, G=4, MP=64, D=128, DP=128, BLOCK=16, TILE_BLOCKS=4, WINDOW=4096, SPLITS=5, QT=16, LOWP=True)),
            (A._paged_decode_kernel, paged, dict(H=14, G=7, MP=64, D=64, DP=64, BLOCK=16, TILE_BLOCKS=4, WINDOW=0, SPLITS=1, QT=9, LOWP=False)),
            (A._paged_decode_kernel, paged, dict(H=14, G=7, MP=64, D=64, DP=64, BLOCK=16, TILE_BLOCKS=4, WINDOW=0, SPLITS=9, QT=9, LOWP=True)),
            (A._combine_splits_kernel, combine, dict(H=32, D=128, DP=128, SPLITS=17, SP=32)),
        ]
        for fn, sig, consts in specs:
            sig = dict(sig, **{k: "constexpr" for k in consts})
            cx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
            k = triton.compile(ASTSource(fn, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
            assert k.asm["cubin"], fn
        print("compiled", len(specs))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(kernels.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    if res.returncode != 0 and ("ptxas" in res.stderr and "not found" in res.stderr.lower()):
        pytest.skip("no ptxas available")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiled 16" in res.stdout

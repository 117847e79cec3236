"""The paged decode-attention kernel vs its torch reference (and vs plain attention on a
contiguous copy of each context), under TRITON_INTERPRET=1 on CPU or compiled on CUDA."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import kernels
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


def _contiguous_attention(q, k_cache, v_cache, tables, lens, block_size, scale):
    out = []
    kvh = k_cache.shape[0]
    G = q.shape[1] // kvh
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.cat([tables[b, i].long() * block_size + torch.arange(block_size, device=q.device)
                           for i in range((n + block_size - 1) // block_size)])[:n]
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

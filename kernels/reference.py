"""Pure-torch reference implementations of the sampling ops (any device, no Triton).

These define the semantics; the Triton kernels in ``kernels.triton_ops`` must match them
(exactly for the masking/selection ops, within float tolerance for arithmetic). See
``kernels/README.md`` for the contract of every op.

Shapes: ``logits`` is ``[B, V]`` float32, one row per sequence; every per-row parameter is a
``[B]`` tensor, so one batch mixes settings freely.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")

# Philox4x32-10 constants, identical to triton.language.random (tl.rand).
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_M32 = 0xFFFFFFFF
# uint_to_uniform_float scale used by tl.rand: largest value with (2**31 - 1) * scale < 1.
_UNIFORM_SCALE = 4.6566127342e-10


# ---------------------------------------------------------------------------------------------
# temperature
# ---------------------------------------------------------------------------------------------
def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits / temperature per row; rows with temperature <= 0 (greedy) are returned unscaled.
    Written into ``out`` when given (it may be ``logits``)."""
    t = temperature.to(device=logits.device, dtype=torch.float32)[:, None]
    return torch.div(logits, torch.where(t > 0, t, torch.ones_like(t)), out=out)


# ---------------------------------------------------------------------------------------------
# penalties
# ---------------------------------------------------------------------------------------------
def apply_penalties(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,
    prompt_token_mask: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (on tokens seen in the output or marked in the prompt mask: HF's and
    vLLM's rule with the prompt marked, SGLang's with an empty mask), then OpenAI
    frequency/presence penalties (on output tokens only), in vLLM's order."""
    cnt = output_token_counts
    in_output = cnt > 0
    # A term whose penalty is neutral in every row is skipped: it would change nothing
    # (x / 1, x * 1 and x - 0 are exact), and on the CPU path these full [B, V] passes were most
    # of the sampler's time for the usual single penalty from generation_config.json.
    x = logits
    if bool((repetition_penalty != 1).any()):
        # Only the seen tokens change (a few hundred of the vocabulary): gather, scale, scatter.
        rows, cols = (in_output | prompt_token_mask.to(torch.bool)).nonzero(as_tuple=True)
        v = logits[rows, cols]
        rep = repetition_penalty.to(device=logits.device, dtype=torch.float32)[rows]
        x = logits.clone()
        x[rows, cols] = torch.where(v > 0, v / rep, v * rep)
    if bool((frequency_penalty != 0).any()):
        x = x - frequency_penalty.to(torch.float32)[:, None] * cnt.to(torch.float32)
    if bool((presence_penalty != 0).any()):
        x = x - presence_penalty.to(torch.float32)[:, None] * in_output.to(torch.float32)
    return x if x is not logits else logits.clone()


# ---------------------------------------------------------------------------------------------
# grammar bitmask
# ---------------------------------------------------------------------------------------------
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor:
    """xgrammar layout: bit j of word i allows token 32*i + j; a 0 bit sets the logit to -inf.

    Only tokens < min(V, 32 * bitmask.shape[1]) are affected (as xgrammar); rows whose row_mask
    is False are untouched.
    """
    B, V = logits.shape
    cover = min(V, 32 * bitmask.shape[1])
    idx = torch.arange(cover, device=logits.device)
    words = bitmask[:, idx // 32].to(torch.int64)
    allowed = ((words >> (idx % 32)) & 1).to(torch.bool)
    out = logits.clone()
    block = ~allowed & row_mask.to(torch.bool)[:, None]
    out[:, :cover] = out[:, :cover].masked_fill(block, NEG_INF)
    return out


# ---------------------------------------------------------------------------------------------
# top-k / top-p / min-p
# ---------------------------------------------------------------------------------------------
def top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Joint top-k / top-p / min-p filter; removed tokens become -inf.

    All three filters are evaluated on the same (unfiltered) distribution p = softmax(x) of the
    row and a token survives iff it passes all of them ("joint": SGLang's semantics on both its
    paths, the torch fallback and flashinfer's filter_apply_order="joint"; HF and vLLM renormalize
    after top-k before top-p instead):

    * top-k (on iff 0 < k < V): keep x_i >= the k-th largest value (ties at the boundary are all
      kept, so more than k tokens can survive).
    * top-p (on iff top_p < 1): keep i iff the mass of tokens strictly larger than x_i is
      < top_p, i.e. sum_{j: x_j > x_i} e_j < top_p * sum_j e_j with e = exp(x - max).
      Tokens tied at the crossing value are all kept.
    * min-p (on iff min_p > 0): keep i iff exp(x_i - max) >= min_p (== p_i >= min_p * p_max).

    The max-valued token(s) always survive (whatever k, top_p <= 0 or min_p > 1).
    """
    x = logits.to(torch.float32)
    B, V = x.shape
    dev = x.device
    m = x.max(dim=1, keepdim=True).values
    m_safe = torch.where(m > NEG_INF, m, torch.zeros_like(m))
    e = torch.exp(x - m_safe)
    is_max = x == m

    # top-k: threshold = k-th largest value.
    k = top_k.to(device=dev, dtype=torch.int64)
    k_on = (k > 0) & (k < V)
    sorted_x, order = x.sort(dim=1, descending=True)
    kth = sorted_x.gather(1, (k.clamp(1, V) - 1)[:, None])
    keep = ~k_on[:, None] | (x >= kth)

    # top-p: mass strictly above each value (float64 exclusive cumsum over the sorted row,
    # taken at the first element of each group of equal values).
    p_on = top_p.to(dev) < 1.0
    sorted_e = e.gather(1, order).to(torch.float64)
    csum = sorted_e.cumsum(dim=1)
    excl = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=1)
    ar = torch.arange(V, device=dev).expand(B, V)
    is_start = torch.ones_like(sorted_x, dtype=torch.bool)
    is_start[:, 1:] = sorted_x[:, 1:] != sorted_x[:, :-1]
    start = torch.where(is_start, ar, torch.zeros_like(ar)).cummax(dim=1).values
    above = excl.gather(1, start)
    thr = top_p.to(device=dev, dtype=torch.float64)[:, None] * e.to(torch.float64).sum(dim=1, keepdim=True)
    keep_p_sorted = above < thr
    keep_p = torch.empty_like(keep_p_sorted).scatter_(1, order, keep_p_sorted)
    keep &= ~p_on[:, None] | keep_p

    # min-p, in the same form as the kernel: exp(x - max) >= min_p.
    keep &= e >= min_p.to(device=dev, dtype=torch.float32)[:, None]

    keep |= is_max
    return torch.where(keep, x, torch.full_like(x, NEG_INF))


# ---------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------
def _umul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a 32-bit constant a and int64 tensor b in [0, 2**32).

    The product is < 2**64: as int64 it wraps to the same 64 bits, so an arithmetic shift and a
    mask recover the high word exactly (one multiply instead of four).
    """
    p = b * a
    return (p >> 32) & _M32, p & _M32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors holding uint32 values (same round structure as
    triton.language.random.philox_impl). Returns the 4 output words."""
    for _ in range(10):
        hi_b, lo_b = _umul32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _umul32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def philox_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """Torch port of ``tl.rand(seed, counter)`` for int64 seed and counter (broadcastable).

    Philox4x32-10 with key (seed lo, seed hi) and counter (counter lo, counter hi, 0, 0); the first
    output word as int32 x, then float32(x if x >= 0 else ~x) * float32(4.6566127342e-10) in
    [0, 1). Bit-identical to Triton's tl.rand (exact integer math plus one IEEE multiply).
    """
    seed = seed.to(torch.int64)
    counter = counter.to(torch.int64)
    c0 = counter & _M32
    c1 = (counter >> 32) & _M32
    zero = torch.zeros_like(c0)
    k0 = (seed & _M32).expand_as(c0)
    k1 = ((seed >> 32) & _M32).expand_as(c0)
    r, _, _, _ = philox4x32_10(c0, c1, zero, zero, k0, k1)
    x = torch.where(r >= 2**31, r - 2**32, r)  # reinterpret as int32
    x = torch.where(x < 0, -x - 1, x)  # ~x
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32, device=x.device)


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] Gumbel(0, 1) noise; token j of a row uses Philox counter (offset << 32) + j keyed by
    the row's seed, so it depends only on (seed, offset, j)."""
    dev = seeds.device
    cols = torch.arange(vocab_size, device=dev, dtype=torch.int64)
    counter = (offsets.to(torch.int64)[:, None] << 32) + cols[None, :]
    u = philox_uniform(seeds.to(torch.int64)[:, None], counter)
    return -torch.log(-torch.log(u))


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    greedy_mask: torch.Tensor,
) -> torch.Tensor:
    """Gumbel-max draw from softmax(logits) per row (logits already temperature-scaled and
    filtered); greedy rows take argmax. Lowest index wins ties. Returns int64 [B]."""
    x = logits.to(torch.float32)
    out = x.argmax(dim=1)
    drawn = (~greedy_mask.to(torch.bool)).nonzero().flatten()
    if drawn.numel():  # noise only for the rows that draw: greedy rows are common and cheap
        g = gumbel_noise(seeds[drawn], offsets[drawn], x.shape[1])
        out[drawn] = (x[drawn] + g).argmax(dim=1)
    return out


# ---------------------------------------------------------------------------------------------
# log-softmax
# ---------------------------------------------------------------------------------------------
def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


# ---------------------------------------------------------------------------------------------
# paged decode attention
# ---------------------------------------------------------------------------------------------
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
    """One query token per sequence over its paged context: gather the blocks, mask, softmax.
    `window` > 0: sliding-window attention, only the last `window` keys are visible."""
    B, H, D = q.shape
    kvh = k_cache.shape[0]
    G = H // kvh
    max_k = block_tables.shape[1] * block_size
    slots = (block_tables.long()[:, :, None] * block_size + torch.arange(block_size, device=q.device)).reshape(B, max_k)
    k = k_cache[:, slots].float()  # [kvh, B, max_k, D]
    v = v_cache[:, slots].float()
    qg = q.float().view(B, kvh, G, D).transpose(0, 1)  # [kvh, B, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [kvh, B, G, max_k]
    key = torch.arange(max_k, device=q.device)[None, :]
    visible = key < context_lens.long()[:, None]  # [B, max_k]
    if window > 0:
        visible &= key >= context_lens.long()[:, None] - window
    scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v)  # [kvh, B, G, D]
    return out.transpose(0, 1).reshape(B, H, D).to(q.dtype)

"""Batched LLM sampling ops: Triton kernels with pure-torch references.

Every op takes ``logits`` [B, V] float32 (one row per sequence) and per-row parameters as [B]
tensors, and returns a new tensor (inputs are never modified). ``use_triton`` selects the
implementation; by default Triton is used for CUDA tensors, and for CPU tensors when
``TRITON_INTERPRET=1`` (Triton's numpy interpreter, slow: for tests). Otherwise CPU tensors
take the C++ kernels in csrc/ where they exist and are built (paged decode attention;
penalties, grammar bitmask, the top-k/top-p/min-p filter and the draw), else the torch
reference. Semantics: README.md.

Triton is imported lazily (on the first Triton call), so importing this package never fixes
Triton's interpreter/compiler choice; TRITON_INTERPRET must be set before triton is imported.
"""

from __future__ import annotations

import os

import torch

from . import reference

__all__ = [
    "apply_temperature",
    "apply_penalties",
    "apply_token_bitmask",
    "top_k_top_p_min_p",
    "sample",
    "log_softmax",
    "paged_decode_attention",
    "reference",
]


def _want_triton(logits: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return use_triton


def _ops():
    from . import triton_ops

    return triton_ops


def native_cpu_sampling(logits: torch.Tensor):
    """The C++ sampling ops (the cpu_sampling module) for CPU tensors when built, else None."""
    if logits.is_cuda:
        return None
    from . import cpu_sampling

    return cpu_sampling if cpu_sampling.load() is not None else None


def _check_logits(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension")
    return logits.contiguous()


def _rows(t: torch.Tensor, B: int, dtype: torch.dtype, device: torch.device, name: str) -> torch.Tensor:
    t = torch.as_tensor(t, device=device)
    if t.shape != (B,):
        raise ValueError(f"{name} must have shape [{B}], got {tuple(t.shape)}")
    return t.to(dtype).contiguous()


def _launch(name: str, logits: torch.Tensor, *args, **kwargs):
    if logits.shape[0] == 0:  # nothing to launch
        return getattr(reference, name)(logits, *args, **kwargs)
    ops = _ops()
    if logits.is_cuda == ops.interpreted():
        if logits.is_cuda:
            raise RuntimeError("kernels.triton_ops was imported with TRITON_INTERPRET=1; CUDA tensors need compiled kernels")
        raise RuntimeError(
                "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is first "
                "imported (or pass use_triton=False for the torch reference)"
            )
    return getattr(ops, name)(logits, *args, **kwargs)


def apply_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, *, use_triton: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits / temperature per row. Rows with temperature <= 0 are greedy rows and are returned
    unscaled (the caller takes their argmax, e.g. via ``sample(..., greedy_mask)``). ``out``
    (``logits`` itself allowed) receives the result instead of a new tensor: at 64 x 152k a fresh
    buffer costs more in page faults on the CPU than the division."""
    logits = _check_logits(logits)
    B, dev = logits.shape[0], logits.device
    temperature = _rows(temperature, B, torch.float32, dev, "temperature")
    if out is not None and (out.shape != logits.shape or out.dtype != logits.dtype or out.device != dev
                            or not out.is_contiguous()):
        raise ValueError("out must be a contiguous tensor of the logits' shape, dtype and device")
    if _want_triton(logits, use_triton):
        return _launch("apply_temperature", logits, temperature, out=out)
    return reference.apply_temperature(logits, temperature, out=out)


def apply_penalties(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,
    prompt_token_mask: torch.Tensor,
    frequency_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Repetition penalty, then frequency/presence penalties (vLLM's order).

    output_token_counts [B, V] int32: how often each token occurs in the generated output so far.
    prompt_token_mask [B, V] bool: token occurs in the prompt.
    * repetition (HF/SGLang; 1.0 = off): tokens seen in prompt or output get
      logit / r if logit > 0 else logit * r.
    * frequency/presence (OpenAI/SGLang; 0.0 = off): logit -= freq * count + pres * (count > 0),
      output tokens only.
    """
    logits = _check_logits(logits)
    B, V = logits.shape
    dev = logits.device
    if output_token_counts.shape != (B, V) or prompt_token_mask.shape != (B, V):
        raise ValueError("output_token_counts and prompt_token_mask must be [B, V]")
    counts = output_token_counts.to(device=dev, dtype=torch.int32).contiguous()
    prompt = prompt_token_mask.to(device=dev, dtype=torch.bool).contiguous()
    freq = _rows(frequency_penalty, B, torch.float32, dev, "frequency_penalty")
    pres = _rows(presence_penalty, B, torch.float32, dev, "presence_penalty")
    rep = _rows(repetition_penalty, B, torch.float32, dev, "repetition_penalty")
    if _want_triton(logits, use_triton):
        return _launch("apply_penalties", logits, counts, prompt, freq, pres, rep)
    native = native_cpu_sampling(logits)
    if native is not None:
        return native.apply_penalties(logits, counts, prompt, freq, pres, rep)
    return reference.apply_penalties(logits, counts, prompt, freq, pres, rep)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, row_mask: torch.Tensor, *, use_triton: bool | None = None
) -> torch.Tensor:
    """xgrammar bitmask [B, ceil(V/32)] int32: bit j of word i allows token 32*i + j; a 0 bit sets
    the logit to -inf. Rows with row_mask False are untouched. As xgrammar, only tokens
    < min(V, 32 * bitmask.shape[1]) are affected."""
    logits = _check_logits(logits)
    B = logits.shape[0]
    dev = logits.device
    if bitmask.dim() != 2 or bitmask.shape[0] != B:
        raise ValueError(f"bitmask must be [{B}, W], got {tuple(bitmask.shape)}")
    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    bitmask = bitmask.to(dev).contiguous()
    row_mask = _rows(row_mask, B, torch.bool, dev, "row_mask")
    if _want_triton(logits, use_triton):
        return _launch("apply_token_bitmask", logits, bitmask, row_mask)
    native = native_cpu_sampling(logits)
    if native is not None:
        return native.apply_token_bitmask(logits, bitmask, row_mask)
    return reference.apply_token_bitmask(logits, bitmask, row_mask)


def top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Joint top-k / top-p / min-p filter (removed tokens = -inf), all computed on softmax of the
    given row. top_k <= 0 or >= V: off; top_p >= 1: off; min_p <= 0: off.
    Keeps: x >= k-th largest value (ties kept); mass strictly above x < top_p (ties at the
    crossing kept); exp(x - max) >= min_p. The max token(s) always survive."""
    logits = _check_logits(logits)
    B, dev = logits.shape[0], logits.device
    top_k = _rows(top_k, B, torch.int32, dev, "top_k")
    top_p = _rows(top_p, B, torch.float32, dev, "top_p")
    min_p = _rows(min_p, B, torch.float32, dev, "min_p")
    if _want_triton(logits, use_triton):
        return _launch("top_k_top_p_min_p", logits, top_k, top_p, min_p)
    native = native_cpu_sampling(logits)
    if native is not None:
        return native.top_k_top_p_min_p(logits, top_k, top_p, min_p)
    return reference.top_k_top_p_min_p(logits, top_k, top_p, min_p)


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    greedy_mask: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Draw one token per row from softmax(logits) -> int64 [B].

    logits: temperature already applied and filtered (-inf = excluded). Gumbel-max with Philox
    noise: token j of a row gets noise from counter (offset << 32) + j keyed by the row's seed, so
    the draw depends only on (logits row, seed, offset) — not on the batch. Use a new offset per
    step (e.g. the output position). greedy_mask rows take argmax. Ties: lowest index. A row
    with every logit -inf returns 0.

    The torch reference uses a bit-exact port of the same Philox stream, so both paths agree
    except for rare last-ulp differences in log() (different tokens only at near-ties).
    """
    logits = _check_logits(logits)
    B, dev = logits.shape[0], logits.device
    seeds = _rows(seeds, B, torch.int64, dev, "seeds")
    offsets = _rows(offsets, B, torch.int64, dev, "offsets")
    greedy_mask = _rows(greedy_mask, B, torch.bool, dev, "greedy_mask")
    if _want_triton(logits, use_triton):
        return _launch("sample", logits, seeds, offsets, greedy_mask)
    native = native_cpu_sampling(logits)
    if native is not None:
        return native.sample(logits, seeds, offsets, greedy_mask)
    return reference.sample(logits, seeds, offsets, greedy_mask)


def log_softmax(logits: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """Row-wise log-softmax [B, V] (e.g. for logprobs). -inf logits give -inf."""
    logits = _check_logits(logits)
    if _want_triton(logits, use_triton):
        return _launch("log_softmax", logits)
    return reference.log_softmax(logits)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    *,
    window: int = 0,
    splits: int = 1,
    query_tiles: torch.Tensor | None = None,
    tile_tokens: int = 1,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Decode attention over the paged KV cache: q [B, H, d], caches [kvh, slots, d],
    block_tables [B, max_blocks], context_lens [B] -> [B, H, d]. `window` > 0: sliding-window
    attention (Mistral's), the last `window` keys of each context only. `splits` > 1 (the
    Triton kernel only; paged_attention.auto_splits chooses): each context in that many parts
    run side by side, merged after. `query_tiles` with `tile_tokens` > 1 (the Triton kernel
    only; paged_attention.query_tiles builds them): a flat prefill chunk's consecutive rows
    scored together, each K/V tile read once for them; the result is the same without.

    The Triton kernel (paged_attention.py) when Triton is chosen; otherwise, for CPU tensors,
    the C++ kernel (csrc/paged_attention_cpu.cpp) when it is built, else the torch reference."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be [B, H, d] and the caches [kvh, slots, d]")
    args = (q, k_cache, v_cache, block_tables, context_lens, block_size, scale, int(window))
    if _want_triton(q, use_triton):
        from . import paged_attention, triton_ops

        if q.is_cuda == triton_ops.interpreted():
            raise RuntimeError("paged_decode_attention: Triton mode does not match the tensor's device (TRITON_INTERPRET)")
        return paged_attention.paged_decode_attention(*args, splits=splits, query_tiles=query_tiles,
                                                      tile_tokens=tile_tokens)
    if not q.is_cuda:
        from . import cpu_attention

        if cpu_attention.load() is not None:
            return cpu_attention.paged_decode_attention(*args)
    return reference.paged_decode_attention(*args)

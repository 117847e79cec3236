"""Logits -> next tokens (and their logprobs), one row per sequence, each row with its own parameters.

Order of the per-row transforms: penalties, min_new_tokens suppression, grammar bitmask, custom
logit processor, temperature, [logprobs are taken here], top-k / top-p / min-p, draw. The grammar
mask comes before the top-k/top-p filters so a filter never keeps only forbidden tokens.

The transforms are the `kernels` package's ops: Triton-language kernels on CUDA tensors, their
torch references on CPU. Every row draws with its own seed and the output position as the
noise offset, so a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence as Seq

import torch

import kernels
from backend.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    step: int  # output position of the token being drawn (the noise offset)
    prompt_ids: Seq[int] = ()
    output_ids: Seq[int] = ()
    suppress_ids: Seq[int] = ()  # tokens that may not be drawn yet (EOS/stop under min_new_tokens)
    grammar: Any = None  # backend.grammar.GrammarState
    custom_processor: Any = None  # a loaded CustomLogitProcessor


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token, the top ones, the asked-for ones."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    requested: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]


def logprobs_at(
    logprobs: torch.Tensor, token_ids: Seq[int], top_n: int, requested: Optional[Seq[int]]
) -> list[TokenLogprobs]:
    """TokenLogprobs for each row of a [R, V] logprob tensor and the row's token."""
    out = []
    chosen = logprobs.gather(1, torch.as_tensor(list(token_ids), device=logprobs.device)[:, None])[:, 0].tolist()
    tops = logprobs.topk(top_n, dim=-1) if top_n > 0 else None
    req = None
    if requested:
        ids = [t for t in requested if 0 <= t < logprobs.shape[1]]
        req = (ids, logprobs[:, ids].tolist())
    for r, token in enumerate(token_ids):
        item = TokenLogprobs(int(token), float(chosen[r]))
        if tops is not None:
            item.top = list(zip(tops.indices[r].tolist(), tops.values[r].tolist()))
        if req is not None:
            item.requested = list(zip(req[0], req[1][r]))
        out.append(item)
    return out


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        B, V = logits.shape
        use_triton = logits.is_cuda
        dev = logits.device
        plain = all(
            r.params.greedy
            and not r.params.has_penalties
            and not r.suppress_ids
            and r.grammar is None
            and r.custom_processor is None
            and not r.params.return_logprob
            for r in rows
        )
        if plain:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * B)

        logits = logits.float().contiguous()
        pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if pen:
            counts, prompt_mask = _token_stats([rows[i] for i in pen], V)
            p = [rows[i].params for i in pen]
            logits[pen] = kernels.apply_penalties(
                logits[pen],
                counts.to(dev),
                prompt_mask.to(dev),
                torch.tensor([x.frequency_penalty for x in p], device=dev),
                torch.tensor([x.presence_penalty for x in p], device=dev),
                torch.tensor([x.repetition_penalty for x in p], device=dev),
                use_triton=use_triton,
            )
        for i, r in enumerate(rows):
            if r.suppress_ids:
                logits[i, [t for t in r.suppress_ids if t < V]] = float("-inf")

        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            words = (V + 31) // 32
            bitmask = torch.full((B, words), -1, dtype=torch.int32)
            row_mask = torch.zeros(B, dtype=torch.bool)
            for i in constrained:
                rows[i].grammar.fill_bitmask(bitmask, i)
                row_mask[i] = True
            logits = kernels.apply_token_bitmask(logits, bitmask.to(dev), row_mask.to(dev), use_triton=use_triton)

        custom = [i for i, r in enumerate(rows) if r.custom_processor is not None]
        if custom:
            logits = _apply_custom(logits, rows, custom)

        temps = torch.tensor([r.params.temperature for r in rows], device=dev, dtype=torch.float32)
        logits = kernels.apply_temperature(logits, temps, use_triton=use_triton)

        want_lp = [i for i, r in enumerate(rows) if r.params.return_logprob]
        logprobs = kernels.log_softmax(logits[want_lp], use_triton=use_triton) if want_lp else None

        if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in rows if not r.params.greedy):
            logits = kernels.top_k_top_p_min_p(
                logits,
                torch.tensor([r.params.top_k for r in rows], device=dev, dtype=torch.int32),
                torch.tensor([r.params.top_p for r in rows], device=dev, dtype=torch.float32),
                torch.tensor([r.params.min_p for r in rows], device=dev, dtype=torch.float32),
                use_triton=use_triton,
            )
        tokens = kernels.sample(
            logits,
            torch.tensor([r.seed for r in rows], device=dev, dtype=torch.int64),
            torch.tensor([r.step for r in rows], device=dev, dtype=torch.int64),
            torch.tensor([r.params.greedy for r in rows], device=dev, dtype=torch.bool),
            use_triton=use_triton,
        ).tolist()

        lps: list[Optional[TokenLogprobs]] = [None] * B
        if logprobs is not None:
            for j, i in enumerate(want_lp):
                p = rows[i].params
                lps[i] = logprobs_at(logprobs[j : j + 1], [tokens[i]], p.top_logprobs_num, p.token_ids_logprob)[0]
        return SamplerOutput(tokens, lps)


def _token_stats(rows: list[SamplingRow], V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row output-token counts [R, V] and prompt-token presence [R, V], by two scatters over
    padded id matrices (index V is a scratch column), not a Python loop of tensor ops."""
    R = len(rows)
    width_out = max(1, max(len(r.output_ids) for r in rows))
    width_prompt = max(1, max(len(r.prompt_ids) for r in rows))
    out_ids = torch.full((R, width_out), V, dtype=torch.long)
    prompt_ids = torch.full((R, width_prompt), V, dtype=torch.long)
    for j, r in enumerate(rows):
        if len(r.output_ids):
            out_ids[j, : len(r.output_ids)] = torch.as_tensor(r.output_ids)
        if len(r.prompt_ids):
            prompt_ids[j, : len(r.prompt_ids)] = torch.as_tensor(r.prompt_ids)
    counts = torch.zeros((R, V + 1), dtype=torch.int32).scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.int32))
    present = torch.zeros((R, V + 1), dtype=torch.bool).scatter_(1, prompt_ids, True)
    return counts[:, :V], present[:, :V]


def _apply_custom(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> torch.Tensor:
    # One call per distinct processor, with the rows that use it, as SGLang batches them.
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(id(rows[i].custom_processor), []).append(i)
    for members in groups.values():
        proc: Callable = rows[members[0]].custom_processor
        params = [dict(rows[i].params.custom_params or {}) for i in members]
        out = proc(logits[members].clone(), params)
        if not isinstance(out, torch.Tensor) or out.shape != (len(members), logits.shape[1]):
            raise ValueError("custom_logit_processor must return a tensor shaped like its input logits")
        logits[members] = out.to(device=logits.device, dtype=logits.dtype)
    return logits

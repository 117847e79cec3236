"""vLLM's `thinking_token_budget`: at most N tokens inside a reasoning model's thinking section,
then its closing marker is forced and the model goes on to answer.

The markers are the server's reasoning parser's (the OpenAI frontend sends them with the budget:
SamplingParams.thinking_budget), matched on token ids as vLLM matches its reasoning_start_str and
reasoning_end_str: a marker is counted where the output's ids end with the marker's own encoding
(Qwen3's and DeepSeek-R1's `<think>` / `</think>` are single added tokens). The state follows
from the output ids alone, so a preempted and recomputed sequence ends up where it was.

A per-sequence row processor (backend/sampler.py runs it before penalties and the grammar): while
the closing marker is being forced, every other token's logit is -inf.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from backend.sampling_params import ThinkingBudget

__all__ = ["ThinkingBudgetProcessor"]


class ThinkingBudgetProcessor:
    name = "thinking_token_budget"

    def __init__(self, spec: ThinkingBudget, encode: Callable[[str], list[int]]) -> None:
        self.budget = spec.budget
        self.starts = [ids for ids in (encode(s) for s in spec.starts) if ids]
        self.end = encode(spec.end)
        self._inside_at_start = spec.inside
        self._reset()

    def _reset(self) -> None:
        self.seen = 0  # output ids taken into the state
        self.inside = self._inside_at_start
        self.closed = False  # the section ended (naturally or forced): nothing more to count
        self.count = 0  # tokens inside the section so far
        self.forcing = False
        self.forced = 0  # ids of the closing marker forced so far

    def _advance(self, output: Sequence[int]) -> None:
        if len(output) < self.seen:  # not this sequence's continuation: start over
            self._reset()
        for i in range(self.seen, len(output)):
            if self.closed:
                break
            if self.forcing:  # the id this processor forced
                self.forced += 1
                self.closed = self.forced == len(self.end)
            elif not self.inside:
                self.inside = any(_ends_with(output, s, i + 1) for s in self.starts)
            elif _ends_with(output, self.end, i + 1):
                self.closed = True
            else:
                self.count += 1
                self._check_budget(output, i + 1)
        self.seen = len(output)

    def _check_budget(self, output: Sequence[int], upto: int) -> None:
        """Start forcing once the section's tokens reach the budget. The first ids of the marker
        that the model may be writing itself do not count, and forcing goes on from them."""
        partial = next((k for k in range(len(self.end) - 1, 0, -1) if _ends_with(output, self.end[:k], upto)), 0)
        if self.count - partial >= self.budget:
            self.forcing, self.forced = True, partial

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self._advance(output_ids)
        if self.closed or not self.inside or not self.end:
            return logits
        if not self.forcing:
            self._check_budget(output_ids, len(output_ids))  # a budget of 0
            if not self.forcing:
                return logits
        # Over budget: the closing marker, one id a step, whatever the model would draw.
        row = torch.full_like(logits, float("-inf"))
        row[self.end[self.forced]] = 0.0
        return row


def _ends_with(seq: Sequence[int], suffix: Sequence[int], upto: int) -> bool:
    """Whether seq[:upto] ends with suffix."""
    n = len(suffix)
    return 0 < n <= upto and all(seq[upto - n + j] == suffix[j] for j in range(n))

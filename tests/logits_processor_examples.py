"""Server-side logits processors the tests load by qualified name (vLLM's `logits_processors`).

Importable inside tritonserver too: the llm model has the repository root on its path.
"""

from __future__ import annotations

import torch


def _force(logits: torch.Tensor, token: int) -> torch.Tensor:
    logits[:] = float("-inf")
    logits[token] = 0.0
    return logits


def replay_prompt(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Three parameters: the output repeats the prompt, token by token."""
    return _force(logits, prompt_ids[len(output_ids) % len(prompt_ids)])


def ban_previous(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Two parameters: never the same token twice in a row."""
    if output_ids:
        logits[output_ids[-1]] = float("-inf")
    return logits


class CountUp:
    """A constructor object with args: forces start, start + 1, ... and checks that it sees every
    step of one sequence exactly once (shared between samples, it would see steps twice)."""

    def __init__(self, start: int, step: int = 1) -> None:
        self.start, self.step, self.calls = start, step, 0

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) != self.calls:
            raise RuntimeError(f"called for output position {len(output_ids)} after {self.calls} calls")
        self.calls += 1
        return _force(logits, self.start + self.step * len(output_ids))


def fail_after_two(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    if len(output_ids) >= 2:
        raise RuntimeError("boom")
    return logits


def wrong_shape(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    return logits[:3]


not_callable = 42


class ForceAfter:
    """Forces `tokens`, one a step, from output position `after` on (e.g. a closing marker)."""

    def __init__(self, after: int, tokens: list[int]) -> None:
        self.after, self.tokens = after, tokens

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        k = len(output_ids) - self.after
        return _force(logits, self.tokens[k]) if 0 <= k < len(self.tokens) else logits

"""N-gram speculative decoding (vLLM's `{"method": "ngram"}`, prompt lookup): draft tokens come
from the sequence's own history, and one step verifies them all.

A decoding sequence whose last few tokens occurred earlier in its prompt or output proposes the
tokens that followed that earlier occurrence. The step then runs its newest token and the draft
as one chunk and samples every position. Each position's token is drawn exactly as a plain
decode step would draw it: the same logits (up to batch-shape rounding), the same per-row
transforms, and the same noise, which depends only on the request's seed and the output
position. So a draft token is accepted when it is the token that position draws, and the first
position that draws something else contributes that token and ends the run. The output is the
one decoding token by token gives, for greedy and seeded sampling alike; what speculation
changes is how many steps it takes.

Penalties count a position's earlier draft tokens as output, and a grammar masks it as it stands
after them, as its own decode step would. Requests with logits processors (whose state follows
the tokens one at a time), hidden states, or a grammar under jump-forward decoding decode one
token a step, beside speculating ones.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backend.sampling_params import SamplingParams


class SpeculativeConfig(BaseModel):
    """vLLM's --speculative-config, for the n-gram and draft-model methods."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # None with a `model`: the draft model's (vLLM's rule).
    method: Optional[Literal["ngram", "draft_model"]] = None
    num_speculative_tokens: int = Field(ge=1, le=32)
    # draft_model: a smaller model directory of the same vocabulary (backend/draft_model.py).
    model: Optional[str] = None
    # The n-gram sizes matched, longest first. vLLM's rule for the ones not given: both 5, or
    # the one given for both.
    prompt_lookup_max: Optional[int] = Field(default=None, ge=1)
    prompt_lookup_min: Optional[int] = Field(default=None, ge=1)
    # No drafts in a step whose running batch is larger than this: verifying a draft costs a
    # decode's attention per drafted token, which a large batch cannot hide.
    disable_by_batch_size: Optional[int] = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _from_json(cls, value: Any) -> Any:
        return json.loads(value) if isinstance(value, (str, bytes)) else value

    @model_validator(mode="after")
    def _lookup_sizes(self) -> "SpeculativeConfig":
        if self.method is None:
            if self.model is None:
                raise ValueError('method is required: "ngram", or "draft_model" with a "model"')
            self.method = "draft_model"
        if self.method == "draft_model":
            if self.model is None:
                raise ValueError('the draft_model method needs a "model": the draft model\'s directory')
            given = [n for n in ("prompt_lookup_max", "prompt_lookup_min") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{given[0]} applies to the ngram method, not draft_model")
            return self
        if self.model is not None:
            raise ValueError('"model" applies to the draft_model method; ngram drafts from the sequence itself')
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max = self.prompt_lookup_min = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} is more than prompt_lookup_max "
                             f"{self.prompt_lookup_max}")
        return self


def speculates(params: SamplingParams, jump_forward: bool = False) -> bool:
    """Whether a request's tokens can be verified several at a time: each position's draw depends
    only on its own logits, seed and output position; on penalties, whose counts take the draft
    tokens before it (Sampler._penalize_pending); and on a grammar's mask after the draft tokens
    before it (GrammarState.draft_masks). Not with jump-forward decoding, which appends forced
    tokens after a drawn one; nor with logits processors or a thinking budget (their state follows
    the tokens one step at a time) or hidden states."""
    if params.constraint is not None and jump_forward:
        return False
    return not (params.processes_rows or params.custom_logit_processor or params.return_hidden_states)


# A sequence whose draft was rejected outright drafts again only after this many more tokens,
# doubling with each further miss up to the cap: a verifying step costs more than a decode step
# (about twice at batch 1 on the CPU), so text that does not repeat should stop paying for it.
BACKOFF_TOKENS = 2
BACKOFF_CAP = 64
# Positions indexed per call at most: a long prompt is indexed over several steps (no drafts
# until it is), so no one step of the loop pays for all of it (a 32k prompt at ~1 us a position).
INDEX_PER_CALL = 2048


class Backoff:
    """One sequence's wait after drafts rejected outright: BACKOFF_TOKENS more tokens after the
    first, doubling with each further one in a row, up to BACKOFF_CAP; a kept token resets it.
    Every proposer (n-grams, a prediction, a draft model) uses it."""

    __slots__ = ("misses", "resume_at")

    def __init__(self) -> None:
        self.misses = 0  # drafts rejected outright in a row
        self.resume_at = 0  # no drafts before the sequence is this long

    def ready(self, length: int) -> bool:
        return length >= self.resume_at

    def verified(self, length: int, accepted: int) -> None:
        """A draft was verified, `accepted` of its tokens kept; the sequence is now `length` long."""
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.resume_at = length + min(BACKOFF_TOKENS**self.misses, BACKOFF_CAP)


class _History:
    """One sequence's n-grams -> where each last ended, over every position before its newest."""

    __slots__ = ("ends", "indexed", "backoff")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`
        self.backoff = Backoff()


class NgramProposer:
    """Drafts from each sequence's own token history (prompt lookup)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)  # longest first
        self._histories: dict[int, _History] = {}

    def propose(self, seq_id: int, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the longest
        n-gram (of the configured sizes) the tokens end with; [] when none occurred before.
        `tokens` only grows between calls for one sequence."""
        if limit <= 0:
            return []
        h = self._histories.get(seq_id)
        if h is None:
            h = self._histories[seq_id] = _History()
        end = len(tokens)
        if not h.backoff.ready(end):
            return []
        # Index the n-grams ending at positions [indexed, end - 1): every one but the suffix
        # itself, whose own occurrence is no prediction. A later occurrence replaces an earlier
        # one, so the nearest repeat is the one continued.
        lo = self.sizes.stop + 1  # the smallest size
        stop = min(end, max(h.indexed, lo) + INDEX_PER_CALL)
        for e in range(max(h.indexed, lo), stop):
            for n in self.sizes:
                if e >= n:
                    h.ends[tuple(tokens[e - n : e])] = e
        h.indexed = max(h.indexed, stop)
        if stop < end:
            return []
        for n in self.sizes:
            if end <= n:
                continue
            e = h.ends.get(tuple(tokens[end - n :]))
            if e is not None:
                # What followed the earlier occurrence, past the end as well: a repeat with
                # period end - e goes on repeating (a run of one token drafts k of it).
                draft: list[int] = []
                for i in range(min(self.k, limit)):
                    draft.append(tokens[e + i] if e + i < end else draft[e + i - end])
                return draft
        return []

    def verified(self, seq_id: int, length: int, accepted: int) -> None:
        """A draft of the sequence was verified, `accepted` of its tokens kept; the sequence is now
        `length` tokens long. After a draft rejected outright, the next waits (BACKOFF_TOKENS)."""
        h = self._histories.get(seq_id)
        if h is not None:
            h.backoff.verified(length, accepted)

    def forget(self, seq_id: int) -> None:
        self._histories.pop(seq_id, None)

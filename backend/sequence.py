"""One sequence's state as it moves through the engine."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from backend.sampling_params import SamplingParams

_seq_ids = itertools.count()


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine id of sample `index` of a request with `n` samples (the request's own when n is 1)."""
    return request_id if n == 1 else f"{request_id}#{index}"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    # Tokens whose K/V are in the cache. A sequence computes [num_computed_tokens, num_tokens).
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Leading table entries already released behind a sliding window (BlockManager.free_behind_window).
    num_window_freed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    # The stop string or token id that ended the sequence (None for length/abort).
    stop_reason: Optional[str | int] = None
    matched_eos: bool = False  # the stop token was the model's EOS, not one of stop_token_ids
    num_preemptions: int = 0
    is_cancelled: Optional[Callable[[], bool]] = None
    arrival_time: float = 0.0
    # Prefix caching: whether this sequence may reuse cached blocks (not when it needs the
    # prompt's logits), how many of its blocks are published, and the hash chain up to them.
    prefix_cacheable: bool = True
    num_hashed_blocks: int = 0
    block_hash: Optional[int] = None
    # LoRA: the sequence's adapter (backend.lora.LoraAdapter) and the start of its prefix-cache
    # hash chain (K/V computed through an adapter are that adapter's only).
    lora: Any = None
    cache_salt: Optional[int] = None
    num_cached_tokens: int = 0  # prompt tokens served from the cache at first admission
    # input_embeds: the prompt's rows [num_prompt_tokens, hidden] (a torch tensor on the model's
    # device), which the model reads instead of embedding token_ids[:num_prompt_tokens] (there
    # placeholders). Kept to the end: a preempted sequence computes its prompt again.
    prompt_embeds: Any = None
    # Prompt positions whose logprobs were reported: a prompt computed again after a preemption
    # reports only the rest.
    prompt_logprobs_done: int = 0
    # n > 1: the sibling whose prefill the others wait for, so they find its blocks cached.
    wait_for: Optional["Sequence"] = None
    index: int = 0  # which of the request's n samples this is
    # Speculative decoding: tokens proposed to follow this decoding sequence's newest one, which
    # the next step verifies (backend/speculative.py); set before each step, [] for none.
    draft_tokens: list[int] = field(default_factory=list)
    # Predicted Outputs (backend/predicted_outputs.py): the request's Prediction, the prediction's
    # tokens the output took and the rest of them (OpenAI's accepted_prediction_tokens /
    # rejected_prediction_tokens: PredictionProposer.taken).
    prediction: Any = None
    draft_predicted: bool = False  # draft_tokens come from the prediction
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    # Speculative decoding, SGLang's per-request meta_info: whether this sequence may draft (the
    # server speculates or its request has a prediction), its verifying steps, the draft tokens
    # they verified and kept, and every step that gave it tokens (for tokens per step).
    speculates: bool = False
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    num_token_steps: int = 0
    seed: int = 0  # effective seed: the request's, or one drawn for it

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

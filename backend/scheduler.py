"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step is a mix of decodes (1 token) and prefill chunks, under a token budget. Running
sequences go first, so a long prompt never stalls the streams already running; it is prefilled
in chunks across steps. When the KV pool runs dry the newest running sequence is preempted:
its blocks are freed and it is recomputed later from its tokens (prompt + output so far).

With the "priority" policy (vLLM's), "newest" and "first" are in the order of the requests'
`priority` (lower first), then arrival: the waiting queue is kept in that order, the running
batch takes the step budget in that order, and the last in it is preempted first.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Optional

from backend.block_manager import BlockManager
from backend.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Speculative decoding: draft tokens run after the sequence's newest one, part of
    # num_new_tokens (its K/V slots are allocated; the step verifies them).
    draft: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a next token is drawn (not for
        a prompt that is only scored: max_new_tokens 0 with prompt logprobs)."""
        end = self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft)
        return end == self.seq.num_tokens and self.seq.max_new_tokens > 0


def _prefilled(seq: Sequence) -> bool:
    return seq.status is SequenceStatus.FINISHED or seq.num_computed_tokens >= seq.num_prompt_tokens


def _priority_order(seq: Sequence) -> tuple[int, int]:
    return seq.params.priority, seq.seq_id  # sequence ids are handed out in arrival order


# Smallest prefill chunk while others decode, whatever its context weight: a 30k-token prompt
# still advances by a block per step. (At 32, a chunk at a 3k context already cost twice a
# decode step of 8 streams on 2 CPU cores, past the 3x inter-token bound with noise.)
MIN_PREFILL_CHUNK = 16


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_tokens_while_decoding: Optional[int] = None,
        prefill_context_unit: int = 0,
        prefill_tokens_per_decode: int = 0,
        policy: Literal["fcfs", "priority"] = "fcfs",
        flat_step_tokens: int = 0,
        prefill_cap_queue_ratio: float = 0.0,
    ) -> None:
        self.block_manager = block_manager
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # While streams are decoding, a step's prefill work is capped so their inter-token
        # latency stays bounded; an idle batch prefills with the whole budget.
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding or max_num_batched_tokens
        # Context-weighted cap (EngineConfig.prefill_context_unit); 0 counts every token as 1.
        self.prefill_context_unit = prefill_context_unit
        # ... and the cap grows with the decode batch (EngineConfig.prefill_tokens_per_decode).
        self.prefill_tokens_per_decode = prefill_tokens_per_decode
        # EngineConfig.flat_prefill_tokens: while streams decode, chunks are cut so the step stays
        # within it (a flat step, on CUDA a decode graph), where that leaves room for a chunk.
        self.flat_step_tokens = flat_step_tokens
        # EngineConfig.prefill_cap_queue_ratio: the cap above is lifted while more than this many
        # requests per running one wait. 0: never.
        self.prefill_cap_queue_ratio = prefill_cap_queue_ratio
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=_priority_order)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        bm = self.block_manager
        if self.by_priority:
            self.running.sort(key=_priority_order)

        num_decoding = sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens == 1)
        # In a burst more requests wait than run: their users wait for a first token, which is
        # worth more than the streams' next one. The step then admits with its whole budget, as
        # vLLM always does, until the batch has caught up with the queue. Not with every seat
        # taken: none of them could be admitted, and the streams would pay for nothing.
        queued = (0 < self.prefill_cap_queue_ratio * len(self.running) < len(self.waiting)
                  and len(self.running) < self.max_num_seqs)
        decoding = num_decoding > 0 and not queued
        cap = max(self.max_prefill_tokens_while_decoding, self.prefill_tokens_per_decode * num_decoding)
        if decoding and self.flat_step_tokens - num_decoding >= MIN_PREFILL_CHUNK:
            cap = min(cap, self.flat_step_tokens - num_decoding)
        prefill_left = cap if decoding else budget
        weight = (lambda start: 1 + start / self.prefill_context_unit) if decoding and self.prefill_context_unit else (lambda start: 1)

        def chunk(start: int, remaining: int) -> int:
            # Tokens of a prefill chunk starting at `start` that fit what is left of the cap,
            # at least MIN_PREFILL_CHUNK (as the cap allows) so a long prompt keeps moving.
            fit = int(prefill_left / weight(start))
            return min(remaining, budget, max(fit, min(MIN_PREFILL_CHUNK, prefill_left)))

        preempted = False
        block_size = bm.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            remaining = len(seq.token_ids) - start
            if remaining == 1 and seq.draft_tokens and budget > 1:
                draft = seq.draft_tokens[: budget - 1]
                # A draft takes free blocks only while every running sequence could still get
                # one: speculation never preempts anything.
                needed = bm.num_blocks_needed(seq, start + 1 + len(draft))
                if needed == 0 or needed + len(self.running) <= bm.num_free_blocks:
                    bm.allocate(seq, start + 1 + len(draft))
                    scheduled.append(ScheduledSeq(seq, 1 + len(draft), draft))
                    budget -= 1 + len(draft)
                    i += 1
                    continue
            if remaining == 1 and start < len(seq.block_table) * block_size:
                # A decode whose block has room (all but one step in block_size): nothing to
                # allocate. The common case, per sequence per step, kept to a few operations.
                scheduled.append(ScheduledSeq(seq, 1))
                budget -= 1
                i += 1
                continue
            n = min(remaining, budget) if remaining == 1 else chunk(start, remaining)
            if n <= 0:
                i += 1
                continue
            if remaining > 1:
                prefill_left -= max(1, round(n * weight(start)))
            target = seq.num_computed_tokens + n
            while not bm.can_allocate(seq, target) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
                preempted = True
            if not bm.can_allocate(seq, target):
                # The sequences ahead of it hold the rest of the pool: it waits for them.
                self._preempt(self.running.pop())
                preempted = True
                break
            bm.allocate(seq, target)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        # After a preemption the pool is full: admitting more now would only thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.wait_for is not None and seq.wait_for.status is SequenceStatus.RUNNING and not _prefilled(seq.wait_for):
                break  # its sibling's prompt blocks are about to be cached: share them
            hits = bm.match_prefix(seq)
            start = len(hits) * bm.block_size
            remaining = seq.num_tokens - start
            n = chunk(start, remaining) if remaining > 1 else min(remaining, budget)
            if n <= 0:
                break
            if not bm.can_admit(seq, hits, start + n):
                break
            self.waiting.popleft()
            seq.wait_for = None
            if bm.enable_prefix_caching and seq.prefix_cacheable:
                cached = bm.take_prefix(seq, hits)
                seq.num_computed_tokens = cached
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = cached
            bm.allocate(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            if n > 1:
                prefill_left -= max(1, round(n * weight(start)))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=_priority_order)
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove a sequence wherever it is and free its blocks at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

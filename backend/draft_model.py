"""Draft-model speculative decoding (vLLM's `{"method": "draft_model", "model": ...}`): a smaller
model of the same vocabulary drafts k tokens, and the target's step verifies them as it verifies
any draft (backend/speculative.py), so the output is the target's own.

Draft tokens are drawn as the target would draw them from the draft model's logits: the engine's
sampler, the request's sampling parameters and penalties, and the same noise (it depends only on
the request's seed and the output position). Where the two models' distributions agree, the
draw agrees too, so a good draft model's tokens hold at any temperature, not only greedy.

The draft model keeps a paged KV cache of its own, with its own block tables: it shares nothing
with the target's pool, scheduler or prefix cache, so it can never make the target preempt, and
a draft pool that runs short only means fewer drafts. Each step, every sequence that drafts
first catches the draft model up on the tokens it has not seen (the prompt, the first time;
then the tokens the last step kept), in one batched forward pass, whose last row gives the first
draft token; then k - 1 batched decode passes give the rest. Draft tokens the target keeps have
their draft K/V already written, so the next catch-up starts after them. A sequence whose draft
was rejected outright drafts again only after a few more tokens, as with n-grams.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from backend.model_runner import ModelConfig, ModelRunner
from backend.speculative import Backoff

log = logging.getLogger(__name__)

# Catch-up tokens per step at most: a long prompt is caught up over several steps (no drafts for
# it until then), so no one step pays a whole batch's prompts through the draft model at once.
CATCH_UP_PER_STEP = 2048


# How draft tokens are drawn: logits [R, target vocabulary] and, per row, (the index of its
# sequence in propose_batch's `wanted`, the draft tokens before it) -> one token per row.
Choose = Callable[[torch.Tensor, list[tuple[int, list[int]]]], list[int]]


def greedy(logits: torch.Tensor, rows: list[tuple[int, list[int]]]) -> list[int]:
    return logits.argmax(dim=-1).tolist()


@dataclass
class _DraftSeq:
    table: list[int] = field(default_factory=list)  # the draft pool's blocks
    computed: int = 0  # tokens whose draft K/V are written
    # The last draft: the sequence's length when it was made, and its length.
    drafted_at: int = 0
    drafted: int = 0
    backoff: Backoff = field(default_factory=Backoff)


class DraftModelProposer:
    """Drafts from a smaller model, for a batch of decoding sequences at once."""

    def __init__(self, model_path: str | Path, k: int, num_blocks: int, block_size: int, target_vocab: int,
                 max_model_len: int, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                 graph_batch: int = 0) -> None:
        """`graph_batch` > 0 (CUDA): the draft's decode passes replay CUDA graphs of up to that
        many sequences, as the target's decode steps do; its catch-up passes run eagerly."""
        config = ModelConfig.from_model_dir(model_path)
        if config.context_limit < max_model_len:
            raise ValueError(f"the draft model's context ({config.context_limit}) is shorter than max_model_len "
                             f"{max_model_len}: lower max_model_len or use a draft model of a longer context")
        self.k = k
        self.block_size = block_size
        # A draft vocabulary padded past the target's never drafts the ids the target lacks; a
        # smaller one never drafts the ids it lacks.
        self.vocab = min(config.vocab_size, target_vocab)
        self.target_vocab = target_vocab
        self.runner = ModelRunner(model_path, num_blocks, block_size, device=device, dtype=dtype, kv_dtype=kv_dtype,
                                  graph_batch=graph_batch)
        if graph_batch:
            problem = self.runner.enable_decode_graphs()
            if problem:
                log.warning("draft model: CUDA graphs off, its decode passes run eagerly: %s", problem)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[int, _DraftSeq] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose_batch(self, wanted: list[tuple[int, list[int], int]], running: set[int],
                      choose: Choose = greedy) -> dict[int, list[int]]:
        """Drafts for (seq_id, tokens, limit) of decoding sequences: up to min(k, limit) tokens
        each, none for one still catching up or without draft blocks. `running`: the seq ids
        that still run; the draft state of the others is dropped when the pool runs short.
        `choose` draws the tokens (greedy without the engine's sampler)."""
        chunks, ids, budget = [], [], CATCH_UP_PER_STEP
        for i, (seq_id, tokens, limit) in enumerate(wanted):
            st = self._seqs.get(seq_id)
            if st is None:
                st = self._seqs[seq_id] = _DraftSeq()
            n = len(tokens)
            if not st.backoff.ready(n):
                continue
            # Positions written: the catch-up's up to n - 1, then the fed draft tokens' up to n + m - 2.
            m = min(self.k, limit)
            if m <= 0 or not self._reserve(st, n + m - 1, running):
                continue
            take = min(n - st.computed, budget)
            if take <= 0:
                continue
            budget -= take
            done = st.computed + take == n
            chunks.append((tokens[st.computed : st.computed + take], st.computed, st.table, done))
            st.computed += take
            if done:
                st.drafted_at, st.drafted = n, m
                ids.append((i, seq_id, st, m))
        if not chunks:
            return {}
        drafts: dict[int, list[int]] = {}
        # After its first pass a sequence catches up on a few tokens (those the target kept, and
        # its own). With decode graphs, laid out as a decode step, as the target's verifying step
        # is, so the pass replays a graph rather than running an eager prefill pass; on the CPU
        # the prefill layout measured ~8% faster at batch 1 (a 1-layer draft of a 38M target).
        flat = self.runner.graphs is not None and all(len(c[0]) <= self.k + 1 for c in chunks)
        with torch.inference_mode():
            logits = self.runner.forward(self.runner.prepare(chunks, flat=flat))
            if not ids:
                return {}
            tokens = choose(self._target_logits(logits), [(i, []) for i, *_ in ids])
            for (_, seq_id, _, _), token in zip(ids, tokens):
                drafts[seq_id] = [token]
            live = [entry for entry in ids if entry[3] > 1]
            for step in range(1, self.k):
                live = [entry for entry in live if len(drafts[entry[1]]) < entry[3]]
                if not live:
                    break
                batch = self.runner.prepare([([drafts[seq_id][-1]], st.drafted_at + step - 1, st.table, True)
                                             for _, seq_id, st, _ in live])
                logits = self._target_logits(self.runner.forward(batch))
                tokens = choose(logits, [(i, list(drafts[seq_id])) for i, seq_id, *_ in live])
                for (_, seq_id, _, _), token in zip(live, tokens):
                    drafts[seq_id].append(token)
        return drafts

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft model's logits over the target's vocabulary (ids it lacks at -inf)."""
        logits = logits[:, : self.vocab]
        if self.vocab < self.target_vocab:
            logits = torch.nn.functional.pad(logits, (0, self.target_vocab - self.vocab), value=float("-inf"))
        return logits

    def _reserve(self, st: _DraftSeq, positions: int, running: set[int]) -> bool:
        """Blocks for the sequence's first `positions` positions; False when the pool cannot
        give them even after dropping the draft state of sequences that no longer run."""
        need = -(-positions // self.block_size) - len(st.table)
        if need > len(self._free):
            for seq_id in [s for s in self._seqs if s not in running]:
                self.forget(seq_id)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            st.table.append(self._free.pop())
        return True

    def verified(self, seq_id: int, length: int, accepted: int) -> None:
        """The sequence kept `accepted` tokens of its draft: those the draft model was fed (all
        but its last) have their K/V written at the positions they now hold."""
        st = self._seqs.get(seq_id)
        if st is not None and st.drafted:
            st.computed = st.drafted_at + min(accepted, st.drafted - 1)
            st.drafted = 0
            # As an n-gram draft (backend/speculative.py): after a draft rejected outright the
            # next waits, 2, 4, ... up to 64 tokens, so a sequence the draft model reads badly
            # (a flat target distribution it does not share, text it never saw) stops paying a
            # verifying step for nothing each token.
            st.backoff.verified(length, accepted)

    def forget(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self._free.extend(reversed(st.table))

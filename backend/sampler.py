"""Logits -> next tokens (and their logprobs), one row per sequence, each row with its own parameters.

Order of the per-row transforms: logit_bias, allowed_token_ids and bad_words, vLLM's logits_processors, penalties, min_new_tokens
suppression, grammar bitmask, custom logit processor, temperature, [logprobs are taken here, unless
the engine's logprobs_mode is raw_logprobs: then before all of these],
top-k / top-p / min-p, draw. The grammar mask comes before the top-k/top-p filters so a filter
never keeps only forbidden tokens.

The transforms are the `kernels` package's ops: Triton-language kernels on CUDA tensors, their
torch references on CPU. Every row draws with its own seed and the output position as the
noise offset, so a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence as Seq

import torch

import kernels
from backend.host_tensors import host_tensor
from backend.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    step: int  # output position of the token being drawn (the noise offset)
    # Penalty rows: the sequence (its id keys the running counts) and its token ids, prompt
    # first (the list itself, not a copy: only what is new since the last step is read).
    seq_id: Optional[int] = None
    token_ids: Seq[int] = ()
    num_prompt_tokens: int = 0
    # input_embeds: the prompt's ids are placeholders, so penalties and logits processors see
    # no prompt tokens (as for an empty prompt).
    prompt_is_placeholder: bool = False
    suppress_ids: Seq[int] = ()  # tokens that may not be drawn yet (EOS/stop under min_new_tokens)
    grammar: Any = None  # backend.grammar.GrammarState
    custom_processor: Any = None  # a loaded CustomLogitProcessor
    logits_processors: Seq[Any] = ()  # backend.logits_processors.RowProcessor, this sequence's own
    # Speculative decoding: draft tokens before this row's position, verified in the same step.
    # Penalties count them as output, as the row's own decode step would have.
    pending: Seq[int] = ()


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token, the top ones, the asked-for ones."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    requested: list[tuple[int, float]] = field(default_factory=list)
    rank: Optional[int] = None  # 1 + how many tokens are more likely (when asked for)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[TokenLogprobs]]
    # Rows whose logits processor failed: row -> message. Their tokens are meaningless; the
    # engine ends those requests with the message and keeps the others.
    errors: dict[int, str] = field(default_factory=dict)


# The logprob reported for a token that cannot be drawn (-inf: masked by a grammar, suppressed,
# outside allowed_token_ids). JSON has no -Infinity, and strict parsers (JavaScript's
# JSON.parse, Go's encoding/json) reject Python's; vLLM's OpenAI server reports -9999.0 too.
LOGPROB_FLOOR = -9999.0


def logprobs_at(
    logprobs: torch.Tensor, token_ids: Seq[int], top_n: int, requested: Optional[Seq[int]], ranks: bool = False
) -> list[TokenLogprobs]:
    """TokenLogprobs for each row of a [R, V] logprob tensor and the row's token (values below
    LOGPROB_FLOOR are reported as the floor; ranks count the exact values)."""
    out = []
    chosen_t = logprobs.gather(1, torch.as_tensor(list(token_ids), device=logprobs.device)[:, None])
    rank = (logprobs > chosen_t).sum(dim=-1).add_(1).tolist() if ranks else None
    # Only the picked values are clamped: a copy of the [R, V] table would cost as much memory
    # as the table (prompt logprobs of a long chunk with a large vocabulary).
    chosen = chosen_t.clamp(min=LOGPROB_FLOOR)[:, 0].tolist()
    tops = logprobs.topk(top_n, dim=-1) if top_n > 0 else None
    top_values = tops.values.clamp(min=LOGPROB_FLOOR) if tops is not None else None
    req = None
    if requested:
        ids = [t for t in requested if 0 <= t < logprobs.shape[1]]
        req = (ids, logprobs[:, ids].clamp(min=LOGPROB_FLOOR).tolist())
    for r, token in enumerate(token_ids):
        item = TokenLogprobs(int(token), float(chosen[r]), rank=None if rank is None else int(rank[r]))
        if tops is not None:
            item.top = list(zip(tops.indices[r].tolist(), top_values[r].tolist()))
        if req is not None:
            item.requested = list(zip(req[0], req[1][r]))
        out.append(item)
    return out


class TokenCounts:
    """Each penalized sequence's output-token counts and prompt-token presence, as rows of two
    [slots, V] tables that every step updates with only the tokens drawn since the last one.

    Recounting each sequence's whole history every step cost O(length) per row and was a tenth
    of a decode step. A row is taken the first time a sequence is sampled and given back by
    `release` when it ends.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.counts: Optional[torch.Tensor] = None  # [slots, V] int32
        self.prompt_mask: Optional[torch.Tensor] = None  # [slots, V] bool
        self._slot: dict[int, list[int]] = {}  # seq id -> [slot, number of output ids counted]
        self._free: list[int] = []
        # On the CPU, also each slot's distinct prompt and output ids: the first seen_len[slot]
        # of seen[slot]. The C++ penalties then visit only those tokens of a row instead of the
        # whole vocabulary (see cpu_sampling.apply_penalties_by_slot_).
        self.seen: Optional[torch.Tensor] = None  # [slots, cap] int32
        self.seen_len: Optional[torch.Tensor] = None  # [slots] int64
        self._seen_sets: dict[int, set[int]] = {}  # slot -> its distinct ids

    def _grow(self, device: torch.device) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        size = max(16, 2 * old)
        counts = torch.zeros((size, self.vocab_size), dtype=torch.int32, device=device)
        mask = torch.zeros((size, self.vocab_size), dtype=torch.bool, device=device)
        if old:
            counts[:old] = self.counts
            mask[:old] = self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        if device.type == "cpu":
            cap = 64 if self.seen is None else self.seen.shape[1]
            seen = torch.zeros((size, cap), dtype=torch.int32)
            seen_len = torch.zeros(size, dtype=torch.int64)
            if old:
                seen[:old], seen_len[:old] = self.seen, self.seen_len
            self.seen, self.seen_len = seen, seen_len
        self._free.extend(range(size - 1, old - 1, -1))

    def _note_seen(self, slot: int, ids: list[int]) -> None:
        """Append the ids this slot has not seen yet to its row of `seen`."""
        known = self._seen_sets.setdefault(slot, set())
        fresh = [t for t in dict.fromkeys(ids) if t not in known]
        if not fresh:
            return
        known.update(fresh)
        n = int(self.seen_len[slot])
        if n + len(fresh) > self.seen.shape[1]:
            cap = min(max(2 * self.seen.shape[1], n + len(fresh)), self.vocab_size)
            wider = torch.zeros((self.seen.shape[0], cap), dtype=torch.int32)
            wider[:, : self.seen.shape[1]] = self.seen
            self.seen = wider
        self.seen[slot, n : n + len(fresh)] = torch.tensor(fresh, dtype=torch.int32)
        self.seen_len[slot] = n + len(fresh)

    def rows(self, rows: list[SamplingRow], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts [R, V] and prompt presence [R, V] for these rows, brought up to date."""
        idx = self.update(rows, device)
        return self.counts.index_select(0, idx), self.prompt_mask.index_select(0, idx)

    def update(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """Bring these rows' counts up to date; their slots in the tables, as a tensor [R]."""
        slots: list[int] = []
        upd_slots: list[int] = []
        upd_ids: list[int] = []
        V = self.vocab_size
        for r in rows:
            if r.seq_id is None:
                raise ValueError("a penalized sampling row needs its sequence id")
            entry = self._slot.get(r.seq_id)
            if entry is None:
                if not self._free:
                    self._grow(device)
                slot = self._free.pop()
                self.counts[slot].zero_()
                self.prompt_mask[slot].zero_()
                if self.seen is not None:
                    self.seen_len[slot] = 0
                    self._seen_sets.pop(slot, None)
                if not r.prompt_is_placeholder and r.params.repetition_penalty_counts_prompt:
                    prompt = torch.as_tensor(r.token_ids[: r.num_prompt_tokens], dtype=torch.long, device=device)
                    prompt = prompt[(prompt >= 0) & (prompt < V)]
                    self.prompt_mask[slot, prompt] = True
                    if self.seen is not None:
                        self._note_seen(slot, prompt.tolist())
                entry = self._slot[r.seq_id] = [slot, 0]
            slot, counted = entry
            new = [t for t in r.token_ids[r.num_prompt_tokens + counted :] if 0 <= t < V]
            if new:
                upd_slots.extend([slot] * len(new))
                upd_ids.extend(new)
                if self.seen is not None:
                    self._note_seen(slot, new)
            entry[1] = len(r.token_ids) - r.num_prompt_tokens
            slots.append(slot)
        if upd_ids:
            index = (host_tensor(upd_slots, torch.long, device), host_tensor(upd_ids, torch.long, device))
            self.counts.index_put_(index, torch.ones(len(upd_ids), dtype=torch.int32, device=device), accumulate=True)
        return host_tensor(slots, torch.long, device)

    def slot_of(self, seq_id: int) -> int:
        """A tracked sequence's row in the tables (after `update` has seen it)."""
        return self._slot[seq_id][0]

    def release(self, seq_id: int) -> None:
        entry = self._slot.pop(seq_id, None)
        if entry is not None:
            self._free.append(entry[0])
            self._seen_sets.pop(entry[0], None)

    @property
    def num_tracked(self) -> int:
        return len(self._slot)


class Sampler:
    def __init__(self, vocab_size: int, logprobs_mode: str = "processed") -> None:
        self.vocab_size = vocab_size
        self.token_counts = TokenCounts(vocab_size)
        # "processed" (SGLang's): logprobs of the distribution the token is drawn from, before
        # top-k/top-p/min-p. "raw_logprobs" (vLLM's default): the model's own, before anything.
        self.raw_logprobs = logprobs_mode == "raw_logprobs"

    def release(self, seq_id: int) -> None:
        """The sequence is finished: drop its penalty counts."""
        self.token_counts.release(seq_id)

    def _penalized_argmax(self, logits: torch.Tensor, rows: list[SamplingRow]) -> Optional[list[int]]:
        """Greedy tokens under penalties that only lower logits, without penalizing whole rows.

        The penalized argmax is among the k highest raw logits when the best penalized candidate
        is above the k-th raw logit: every other token starts at or below it and can only go
        down. Candidates are penalized by the torch reference itself, and ties go to the
        lowest token id as in argmax, so the token is the one the full pass would pick (on this
        engine's default workload, generation_config's repetition penalty, the full pass was a
        tenth of a 64-sequence CPU step). None when a row's candidates do not settle it. On the
        CPU the C++ kernel finds the same tokens in one pass over each row and its rows of the
        count tables, in a third of this path's time, and always settles.
        """
        dev = logits.device
        native = kernels.native_cpu_sampling(logits)
        if native is not None:
            return native.penalized_argmax(logits, *self._penalty_args(rows)).tolist()
        vals, idx = logits.topk(min(PENALIZED_ARGMAX_CANDIDATES, logits.shape[1]), dim=-1)
        x = vals
        pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
        if pen:
            slots = self.token_counts.update([rows[i] for i in pen], dev)[:, None]
            at = host_tensor(pen, torch.long, dev)
            cand = idx.index_select(0, at)
            p = [rows[i].params for i in pen]
            x = vals.clone()
            x[at] = kernels.reference.apply_penalties(  # the candidates are a [P, k] slice of the rows
                vals.index_select(0, at),
                self.token_counts.counts[slots, cand],
                self.token_counts.prompt_mask[slots, cand],
                host_tensor([q.frequency_penalty for q in p], torch.float32, dev),
                host_tensor([q.presence_penalty for q in p], torch.float32, dev),
                host_tensor([q.repetition_penalty for q in p], torch.float32, dev),
            )
        best = x.max(dim=-1, keepdim=True).values
        if not bool((best[:, 0] > vals[:, -1]).all()):
            return None
        ties = torch.where(x == best, idx, torch.full_like(idx, logits.shape[1]))
        return ties.min(dim=-1).values.tolist()

    def _penalize_pending(self, logits: torch.Tensor, rows: list[SamplingRow], ahead: list[tuple[int, list[int]]],
                          raw: list[torch.Tensor]) -> None:
        """Rows of a speculative draft were penalized for the sequence's committed tokens; their
        pending draft tokens are output too by that position. Those few tokens' values are
        penalized again from their values before the penalties, with the counts the row's own
        decode step would have, by the reference's arithmetic (repetition, then frequency, then
        presence)."""
        tc = self.token_counts
        for (i, toks), v in zip(ahead, raw):
            r, p = rows[i], rows[i].params
            t = torch.as_tensor(toks, dtype=torch.long, device=logits.device)
            extra = torch.tensor([r.pending.count(x) for x in toks], dtype=torch.float32, device=logits.device)
            count = tc.counts[tc.slot_of(r.seq_id), t].to(torch.float32) + extra
            x = v
            if p.repetition_penalty != 1:  # every pending token is in the output: seen
                rep = torch.tensor(p.repetition_penalty, dtype=torch.float32, device=logits.device)
                x = torch.where(v > 0, v / rep, v * rep)
            if p.frequency_penalty != 0:
                x = x - torch.tensor(p.frequency_penalty, dtype=torch.float32, device=logits.device) * count
            if p.presence_penalty != 0:
                x = x - torch.tensor(p.presence_penalty, dtype=torch.float32, device=logits.device)
            logits[i, t] = x

    def _penalty_args(self, rows: list[SamplingRow]) -> tuple[torch.Tensor, ...]:
        """For the C++ kernels that read the count tables in place (CPU): the tables, each row's
        slot in them brought up to date (-1: not penalized), and its three penalties."""
        pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
        slots = [-1] * len(rows)
        if pen:
            for i, slot in zip(pen, self.token_counts.update([rows[i] for i in pen], torch.device("cpu")).tolist()):
                slots[i] = slot
        p = [r.params for r in rows]
        return (
            self.token_counts.counts, self.token_counts.prompt_mask, host_tensor(slots, torch.long, "cpu"),
            host_tensor([q.frequency_penalty for q in p], torch.float32, "cpu"),
            host_tensor([q.presence_penalty for q in p], torch.float32, "cpu"),
            host_tensor([q.repetition_penalty for q in p], torch.float32, "cpu"),
        )

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        B, V = logits.shape
        use_triton = logits.is_cuda
        dev = logits.device
        if all(_argmax_after_lowering(r) for r in rows):
            if not any(r.params.has_penalties for r in rows):
                return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * B)
            tokens = self._penalized_argmax(logits.float(), rows)
            if tokens is not None:
                return SamplerOutput(tokens, [None] * B)

        logits = logits.float().contiguous()
        want_lp = [i for i, r in enumerate(rows) if r.params.return_logprob]
        raw_lp = kernels.log_softmax(logits[want_lp], use_triton=use_triton) if want_lp and self.raw_logprobs else None
        if any(r.params.restricts_tokens for r in rows):
            _restrict_tokens(logits, rows)
        errors: dict[int, str] = {}
        for i, r in enumerate(rows):
            if r.logits_processors:
                _apply_row_processors(logits, i, r, errors)
        pen = [i for i, r in enumerate(rows) if r.params.has_penalties]
        # Draft rows: their pending tokens' values before the penalties (see _penalize_pending).
        ahead = [(i, list(dict.fromkeys(rows[i].pending))) for i in pen if rows[i].pending]
        raw = [logits[i, toks].clone() for i, toks in ahead]
        native = kernels.native_cpu_sampling(logits)
        if pen and native is not None:
            # In place, statistics read by slot: no [rows, V] copies (the sampler owns `logits`).
            tc = self.token_counts
            args = self._penalty_args(rows)  # brings the tables (and `seen`) up to date first
            native.apply_penalties_by_slot_(logits, *args, seen=None if tc.seen is None else (tc.seen, tc.seen_len))
        elif pen:
            counts, prompt_mask = self.token_counts.rows([rows[i] for i in pen], dev)
            p = [rows[i].params for i in pen]
            every = len(pen) == B  # the usual case (generation_config's penalty): no gather/scatter
            penalized = kernels.apply_penalties(
                logits if every else logits[pen],
                counts,
                prompt_mask,
                host_tensor([x.frequency_penalty for x in p], torch.float32, dev),
                host_tensor([x.presence_penalty for x in p], torch.float32, dev),
                host_tensor([x.repetition_penalty for x in p], torch.float32, dev),
                use_triton=use_triton,
            )
            if every:
                logits = penalized
            else:
                logits[pen] = penalized
        if ahead:
            self._penalize_pending(logits, rows, ahead, raw)
        suppressed = [i for i, r in enumerate(rows) if r.suppress_ids]
        # min_new_tokens yields where it would leave no token at all (a grammar or
        # allowed_token_ids that only an end token can satisfy now): the rows before it are kept.
        unsuppressed = logits[suppressed].clone() if suppressed and any(
            rows[i].grammar is not None or rows[i].params.restricts_tokens for i in suppressed) else None
        for i in suppressed:
            logits[i, [t for t in rows[i].suppress_ids if t < V]] = float("-inf")

        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        bitmask = row_mask = None
        if constrained:
            words = (V + 31) // 32
            bitmask = torch.full((B, words), -1, dtype=torch.int32)
            row_mask = torch.zeros(B, dtype=torch.bool)
            for i in constrained:
                rows[i].grammar.fill_bitmask(bitmask, i)
                row_mask[i] = True
            bitmask, row_mask = bitmask.to(dev), row_mask.to(dev)
            logits = kernels.apply_token_bitmask(logits, bitmask, row_mask, use_triton=use_triton)
        if unsuppressed is not None:
            dead = (logits[suppressed].amax(dim=-1) == float("-inf")).tolist()
            for j in (j for j, d in enumerate(dead) if d):
                i = suppressed[j]
                row = unsuppressed[j : j + 1]
                if rows[i].grammar is not None:
                    row = kernels.apply_token_bitmask(row, bitmask[i : i + 1], row_mask[i : i + 1], use_triton=use_triton)
                logits[i] = row[0]

        custom = [i for i, r in enumerate(rows) if r.custom_processor is not None]
        if custom:
            logits = _apply_custom(logits, rows, custom, errors)
        # A row with nothing left to draw would yield token 0 with a NaN logprob: its request ends
        # with the reason instead (a grammar against allowed_token_ids, a processor that bans all).
        masked = [i for i, r in enumerate(rows) if i not in errors and (
            r.grammar is not None or r.params.restricts_tokens or r.custom_processor is not None or r.logits_processors)]
        if masked:
            for i, empty in zip(masked, (logits[masked].amax(dim=-1) == float("-inf")).tolist()):
                if empty:
                    errors[i] = ("no token can be drawn: the constraints on this request (grammar, allowed_token_ids, "
                                 "logit_bias, bad_words, logits processors) leave none allowed at this point")

        if any(r.params.temperature > 0 for r in rows):  # rows at temperature 0 come back unscaled anyway
            # In place: this is the sampler's own copy of the rows, and a fresh [rows, V] buffer
            # cost more than the division on the CPU (9 ms of page faults at 64 x 152k).
            temps = host_tensor([r.params.temperature for r in rows], torch.float32, dev)
            logits = logits.contiguous()
            logits = kernels.apply_temperature(logits, temps, use_triton=use_triton, out=logits)

        logprobs = raw_lp
        if want_lp and raw_lp is None:
            logprobs = kernels.log_softmax(logits[want_lp], use_triton=use_triton)

        if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in rows if not r.params.greedy):
            logits = kernels.top_k_top_p_min_p(
                logits,
                host_tensor([r.params.top_k for r in rows], torch.int32, dev),
                host_tensor([r.params.top_p for r in rows], torch.float32, dev),
                host_tensor([r.params.min_p for r in rows], torch.float32, dev),
                use_triton=use_triton,
            )
        tokens = kernels.sample(
            logits,
            host_tensor([r.seed for r in rows], torch.int64, dev),
            host_tensor([r.step for r in rows], torch.int64, dev),
            host_tensor([r.params.greedy for r in rows], torch.bool, dev),
            use_triton=use_triton,
        ).tolist()

        lps: list[Optional[TokenLogprobs]] = [None] * B
        if logprobs is not None:
            for j, i in enumerate(want_lp):
                p = rows[i].params
                lps[i] = logprobs_at(logprobs[j : j + 1], [tokens[i]], p.top_logprobs_num, p.token_ids_logprob)[0]
        return SamplerOutput(tokens, lps, errors)


# Greedy rows whose penalties can only lower logits look for their token among this many of the
# highest raw logits (see Sampler._penalized_argmax).
PENALIZED_ARGMAX_CANDIDATES = 8


def _argmax_after_lowering(r: SamplingRow) -> bool:
    """A greedy row with nothing but penalties that lower logits (repetition >= 1, frequency and
    presence >= 0), or none: its token is an argmax of the (penalized) logits."""
    p = r.params
    return (
        p.greedy and not r.suppress_ids and r.grammar is None and r.custom_processor is None
        and not (r.pending and p.has_penalties)
        and not r.logits_processors
        and not p.return_logprob and not p.restricts_tokens
        and p.repetition_penalty >= 1 and p.frequency_penalty >= 0 and p.presence_penalty >= 0
    )


def _restrict_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit_bias (added) and allowed_token_ids (every other token -inf), in place, before anything
    else reads the logits (vLLM's order)."""
    dev = logits.device
    bias = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
    if bias:
        i, t, b = zip(*bias)
        index = (torch.tensor(i, device=dev), torch.tensor(t, device=dev))
        logits.index_put_(index, torch.tensor(b, dtype=logits.dtype, device=dev), accumulate=True)
    allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if allowed:
        banned = torch.ones((len(allowed), logits.shape[1]), dtype=torch.bool)
        for j, (_, ids) in enumerate(allowed):
            banned[j, ids] = False
        idx = torch.tensor([i for i, _ in allowed], device=dev)
        logits[idx] = logits[idx].masked_fill(banned.to(dev), float("-inf"))
    for i, r in enumerate(rows):
        if r.params.bad_word_ids:
            banned_ids = _bad_word_endings(r)
            if banned_ids:
                logits[i, banned_ids] = float("-inf")


def _bad_word_endings(r: SamplingRow) -> list[int]:
    """The tokens that would complete one of the row's bad words now: a one-token word always,
    a longer one's last token when the output so far (drafts before this position included)
    ends with the rest of it. The output only, as vLLM: a prompt may end mid-word."""
    output = list(r.token_ids[r.num_prompt_tokens:]) + list(r.pending)
    endings = set()
    for word in r.params.bad_word_ids:
        head = len(word) - 1
        if head == 0 or (len(output) >= head and output[-head:] == word[:-1]):
            endings.add(word[-1])
    return sorted(endings)


def _apply_row_processors(logits: torch.Tensor, i: int, r: SamplingRow, errors: dict[int, str]) -> None:
    """vLLM's per-sequence logits processors on row i, in order, in place. A processor that
    raises or returns a bad row fails only its own request: the row is recorded in ``errors``
    and left drawable so the batch's draw still runs."""
    prompt = [] if r.prompt_is_placeholder else r.token_ids[: r.num_prompt_tokens]
    output = r.token_ids[r.num_prompt_tokens :]
    row = logits[i].clone()
    proc = None
    try:
        for proc in r.logits_processors:
            row = proc(prompt, output, row)
        if not bool(torch.isfinite(row).any()):
            raise ValueError("it left no token that can be drawn")
    except Exception as exc:  # noqa: BLE001 - processors are code the request chose
        errors[i] = f"logits processor '{getattr(proc, 'name', '?')}' failed: {exc}"
        return
    logits[i] = row.to(device=logits.device, dtype=logits.dtype)


class _RequestView:
    """What SGLang passes a custom logit processor as `custom_params["__req__"]` (its Req), as far
    as processors read it: the prompt's ids and the output so far (SGLang's own thinking-budget and
    no-repeat-n-gram processors read `origin_input_ids` and `output_ids`)."""

    __slots__ = ("_row",)

    def __init__(self, row: SamplingRow) -> None:
        self._row = row

    @property
    def origin_input_ids(self) -> list[int]:
        row = self._row
        return [] if row.prompt_is_placeholder else list(row.token_ids[: row.num_prompt_tokens])

    @property
    def output_ids(self) -> list[int]:
        row = self._row
        return list(row.token_ids[row.num_prompt_tokens :]) + list(row.pending)


def _apply_custom(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int], errors: dict[int, str]) -> torch.Tensor:
    # One call per distinct processor, with the rows that use it, as SGLang batches them. A
    # processor that raises or returns a bad tensor fails only the rows it was given (recorded
    # in ``errors``, left drawable), not the batch.
    groups: dict[int, list[int]] = {}
    for i in idx:
        groups.setdefault(id(rows[i].custom_processor), []).append(i)
    for members in groups.values():
        proc: Callable = rows[members[0]].custom_processor
        params = [{**(rows[i].params.custom_params or {}), "__req__": _RequestView(rows[i])} for i in members]
        try:
            out = proc(logits[members].clone(), params)
            if not isinstance(out, torch.Tensor) or out.shape != (len(members), logits.shape[1]):
                raise ValueError("it must return a tensor shaped like its input logits")
            if not bool(torch.isfinite(out).any(dim=-1).all()):
                raise ValueError("it left no token that can be drawn")
        except Exception as exc:  # noqa: BLE001 - processors are code the request chose
            for i in members:
                errors[i] = f"custom_logit_processor failed: {exc!r}"
            continue
        logits[members] = out.to(device=logits.device, dtype=logits.dtype)
    return logits

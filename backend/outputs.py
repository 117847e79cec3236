"""Turning sampled tokens into what a request sees: stop checks and released text windows.

Text is released to the client only once it cannot turn out to be the start of a stop string,
so a stop string is never half-streamed and then retracted. Release works in whole engine steps:
each response carries the token window postprocessing decodes (see docs/ARCHITECTURE.md), and
a window always ends on a step boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Optional

import regex

from backend.detokenizer import IncrementalDetokenizer
from backend.sequence import FinishReason, Sequence

# How far back into released text a stop regex may reach, and how long one search may take
# (a pathological pattern ends its request instead of stalling the engine).
STOP_REGEX_LOOKBACK = 256
STOP_REGEX_TIMEOUT_S = 0.05


class StopRegexTimeout(RuntimeError):
    pass


@dataclass
class RequestOutput:
    """One response's worth of a request's progress."""

    request_id: str
    new_token_ids: list[int]
    # Detokenization window: all_ids[window_start : window_start + len(window_ids)], of which
    # the first prefix_len tokens were already released. Text = decode delta minus `trim` chars.
    window_ids: list[int]
    window_start: int
    prefix_len: int
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: Optional[str] = None
    stop_reason: Optional[str | int] = None
    matched_eos: bool = False  # stop_reason is the model's EOS (vLLM reports no stop_reason then)
    trim: int = 0
    error: Optional[str] = None
    num_preemptions: int = 0
    index: int = 0  # which of the request's n samples
    cached_tokens: int = 0
    # Predicted Outputs: the prediction's draft tokens kept so far and those verified and
    # discarded (None without a prediction).
    accepted_prediction_tokens: Optional[int] = None
    rejected_prediction_tokens: Optional[int] = None
    # A speculating sequence's final output: SGLang's spec_* meta_info (backend.sequence.Sequence).
    spec: Optional[dict[str, Any]] = None
    # SGLang-format logprob entries for new_token_ids ([logprob, token_id, text]) and friends,
    # and hidden_states entries (return_hidden_states): meta_info lists that grow per response.
    logprobs: Optional[dict[str, list]] = None
    error_code: str = "internal"  # or "invalid_arg"
    # return_prompt_token_ids: the prompt's ids, on the sample's first output only.
    prompt_token_ids: Optional[list[int]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """One output covering self then `later` (for non-streaming or coalesced responses)."""
        if not self.window_ids:
            window, start, prefix_len = later.window_ids, later.window_start, later.prefix_len
        elif not later.window_ids:
            window, start, prefix_len = self.window_ids, self.window_start, self.prefix_len
        else:
            # later's window starts inside self's (at most at its end), so the two overlap.
            end = self.window_start + len(self.window_ids)
            window = self.window_ids + later.window_ids[end - later.window_start :]
            start, prefix_len = self.window_start, self.prefix_len
        logprobs = self.logprobs
        if later.logprobs:
            logprobs = {k: list(v) for k, v in (self.logprobs or {}).items()}
            for k, v in later.logprobs.items():
                logprobs.setdefault(k, []).extend(v)
        return replace(
            later,
            prompt_token_ids=self.prompt_token_ids if self.prompt_token_ids is not None else later.prompt_token_ids,
            logprobs=logprobs,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            window_ids=window,
            window_start=start,
            prefix_len=prefix_len,
            text=self.text + later.text,
        )

    def meta(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }


@dataclass
class _Step:
    text: str
    window_ids: list[int]
    window_start: int
    prefix_len: int
    read_offset: int  # detokenizer read_offset after this step


@dataclass
class OutputState:
    """Per-sequence detokenizer and the steps whose text is not released yet."""

    detok: IncrementalDetokenizer
    stops: list[str]
    eos_ids: frozenset[int]
    stop_regexes: list[Any] = field(default_factory=list)  # compiled `regex` patterns
    special_stops: dict[int, str] = field(default_factory=dict)  # stop strings the text skips, by token id
    # The tokenizer's EOS: the one vLLM reports no stop_reason for. The other EOS ids of
    # generation_config.json are stop token ids to vLLM, reported as the stop_reason.
    model_eos: Optional[int] = None
    pending: list[_Step] = field(default_factory=list)
    released_tail: str = ""  # last few released chars, enough to match a stop across the boundary
    pending_new_ids: list[int] = field(default_factory=list)
    pending_logprobs: dict[str, list] = field(default_factory=dict)
    prompt_ids_sent: bool = False
    hidden_tokens: int = 0  # trailing tokens kept out of the text (a matched stop token)
    held_seen: str = ""  # the detokenizer's held-back text as of the last token (searched or not)
    held_late: bool = False  # held_seen began under min_tokens: searched once released
    # return_hidden_states: positions whose hidden state is accounted for (a preemption's
    # recompute runs them again), and the prompt's rows until the prompt is complete.
    hidden_done: int = 0
    prompt_hidden: list[list[float]] = field(default_factory=list)

    @property
    def max_stop_len(self) -> int:
        longest = max((len(s) for s in self.stops), default=0)
        return max(longest, STOP_REGEX_LOOKBACK) if self.stop_regexes else longest

    def add_logprobs(self, entries: dict[str, list]) -> None:
        for k, v in entries.items():
            self.pending_logprobs.setdefault(k, []).extend(v)

    def add_hidden_states(self, first_pos: int, rows: list[list[float]], num_prompt_tokens: int) -> None:
        """Hidden states of positions first_pos, first_pos + 1, ... in SGLang's layout: one entry
        for the whole prompt (a list of rows, sent once the prompt's last row is in, whatever the
        chunking), then one row per later position. Positions already accounted for are skipped,
        so a sequence recomputed after a preemption reports each position once."""
        entries: list[Any] = []
        for pos, row in enumerate(rows, start=first_pos):
            if pos < self.hidden_done:
                continue
            self.hidden_done = pos + 1
            if pos < num_prompt_tokens:
                self.prompt_hidden.append(row)
                if pos == num_prompt_tokens - 1:
                    entries.append(self.prompt_hidden)
                    self.prompt_hidden = []
            else:
                entries.append(row)
        if entries:
            self.add_logprobs({"hidden_states": entries})

    def on_tokens(self, seq: Sequence, new_ids: list[int], grammar_done: bool = False) -> Optional[RequestOutput]:
        """Feed the step's tokens (already appended to seq); returns the output to send, if any."""
        params = seq.params
        last = new_ids[-1]
        # A grammar ends on the model's EOS even under ignore_eos: it is then the stop matched,
        # as SGLang reports a finished grammar (matched: its last token).
        stop_token = seq.finish_reason is None and (
            last in params.stop_token_ids or (last in self.eos_ids and (not params.ignore_eos or grammar_done))
        )
        # As SGLang: a matched stop token ends the text before it (unless no_stop_trim, or vLLM's
        # include_stop_str_in_output); it stays in the output ids and counts as a completion token.
        keep_stop = params.no_stop_trim or params.include_stop_str_in_output
        self.hidden_tokens = 1 if stop_token and not keep_stop else 0
        ids = new_ids[: len(new_ids) - self.hidden_tokens] if self.hidden_tokens else new_ids
        total = seq.num_tokens - self.hidden_tokens
        if self.stops or self.stop_regexes:
            return self._on_tokens_watched(seq, new_ids, ids, stop_token, grammar_done)
        delta = self.detok.push(ids)
        self._end_by_tokens(seq, stop_token, grammar_done)
        if seq.finish_reason is None and not self.pending:
            # Most tokens of most requests: nothing held back, nothing to match, not the end.
            # What _release(seq, 1) would return for this one step, without the bookkeeping.
            return self._output(seq, list(new_ids), seq.token_ids[delta.window_start : delta.read_offset],
                                delta.window_start, delta.prefix_len, delta.text)
        self.pending.append(
            _Step(delta.text, list(delta.window_ids), total - len(delta.window_ids), delta.prefix_len, delta.read_offset)
        )
        self.pending_new_ids.extend(new_ids)
        return self._release(seq, len(self.pending), final=seq.finish_reason is not None)

    def _end_by_tokens(self, seq: Sequence, stop_token: bool, grammar_done: bool) -> None:
        if seq.finish_reason is not None:
            return
        if stop_token:
            last = seq.token_ids[-1]
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, last
            seq.matched_eos = last not in seq.params.stop_token_ids and self.model_eos in (None, last)
        elif grammar_done:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output_tokens >= seq.max_new_tokens:
            seq.finish_reason = FinishReason.LENGTH

    def _on_tokens_watched(self, seq: Sequence, new_ids: list[int], ids: list[int], stop_token: bool,
                           grammar_done: bool) -> RequestOutput:
        """on_tokens with stop strings or regexes to match.

        A stop counts where it ends in the text of a token: any token under SGLang's
        min_new_tokens, only those after vLLM's min_tokens. A step of several tokens (drafts,
        jump-forward) is pushed one token at a time, so it ends the text where the same tokens one
        step each would have.
        """
        params = seq.params
        before = seq.num_output_tokens - len(new_ids)  # output tokens before this step
        base = seq.num_tokens - len(new_ids)
        hit: Optional[_Hit] = None
        hit_end = 0  # where the text of the token that completed the stop ends (in pending text)
        partial_at: Optional[int] = None
        # Only a hidden stop token: one empty push still makes the step that text held back for
        # half a character can be flushed into.
        for j, push in enumerate([[t] for t in ids] or [[]]):
            d = self.detok.push(push)
            end = base + j + len(push)
            self.pending.append(_Step(d.text, list(d.window_ids), end - len(d.window_ids), d.prefix_len, d.read_offset))
            if hit is None:
                # Text under min_tokens is searched for nothing, only for what to hold back; nor is
                # a kept stop token's own text: the token is the stop (vLLM and SGLang check stop
                # tokens first), "<|im_end|>" does not end on the stop string "|i" (QA).
                counts = before + j + 1 > params.min_tokens and not (stop_token and j == len(new_ids) - 1)
                # A token ending in half a character (" amanh" + a lead byte) releases nothing
                # yet, but a stop in its text ends the sequence on it: one token later, the finish
                # reason could already be an EOS sampled after it.
                held = self.detok.held_text() if push else ""
                fresh_held = self._fresh_held(held, counts)
                hit, partial_at = self._search(len(d.text) + fresh_held if counts else 0, held)
                if hit is None and counts and push and push[0] in self.special_stops:
                    stop = self.special_stops[push[0]]
                    hit = _Hit(len(self.released_tail) + self._pending_chars(), len(stop), stop)
                if hit is not None:  # measured only then: this runs for every token watched
                    hit_end = self._pending_chars() + len(held)
        self.pending_new_ids.extend(new_ids)
        if hit is None:
            self._end_by_tokens(seq, stop_token, grammar_done)
        if seq.finish_reason is not None or hit is not None:
            # Ending: text held back for half a character comes out now (as U+FFFD), and the stop
            # strings must see it too (it could complete one).
            flushed = self.detok.finish()
            if flushed:
                self.pending[-1] = replace(self.pending[-1], text=self.pending[-1].text + flushed)
                if hit is None and seq.num_output_tokens > params.min_tokens:
                    hit, _ = self._search(len(flushed))
                    hit_end = self._pending_chars()
        if hit is not None:
            pos, length, matched = hit
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, matched
            seq.matched_eos = False
            pending_len = self._pending_chars()
            start = pos - len(self.released_tail)
            if params.no_stop_trim:  # SGLang's: the text as decoded, up to the completing token
                keep = hit_end
            elif params.include_stop_str_in_output:  # vLLM's: up to the stop string's end
                keep = min(start + length, hit_end)
            else:
                keep = start
            return self._release(seq, len(self.pending), trim=pending_len - max(keep, 0), final=True)
        if seq.finish_reason is not None:
            return self._release(seq, len(self.pending), final=True)
        # Hold back steps whose text could still grow into a stop string, under min_new_tokens
        # too: a stop may begin there and end after, and its start must still be trimmable.
        pending_text = "".join(s.text for s in self.pending)
        hay = self.released_tail + pending_text
        hold = _longest_stop_prefix_suffix(hay, self.stops)
        if partial_at is not None:
            hold = max(hold, len(hay) - partial_at)
        safe = len(pending_text) - hold
        n, acc = 0, 0
        for step in self.pending:
            if acc + len(step.text) > safe:
                break
            acc += len(step.text)
            n += 1
        return self._release(seq, n)

    def _fresh_held(self, held: str, counts: bool) -> int:
        """How much of the held-back text to search as new: what this token added to it (a
        skipped special token adds nothing). Text that began to be held under min_tokens is not
        searched until released, where all of it counts, as in vLLM's detokenizer."""
        if not held:
            self.held_late = False
        elif not self.held_seen:
            self.held_late = not counts
        fresh = 0 if self.held_late else len(held) - _common_prefix_len(held, self.held_seen)
        self.held_seen = held
        return fresh

    def _pending_chars(self) -> int:
        return sum(len(s.text) for s in self.pending)

    def _search(self, fresh: int, held: str = "") -> tuple[Optional[_Hit], Optional[int]]:
        """(the earliest stop match ending in the last `fresh` characters of released_tail +
        pending text + `held` text; where a stop regex match still in progress begins)."""
        hay = self.released_tail + "".join(s.text for s in self.pending) + held
        # The text before the fresh part was searched when it came (or came too early to count).
        fresh_from = len(hay) - fresh
        hit = _find_stop(hay, self.stops, fresh_from)
        partial_at: Optional[int] = None
        if self.stop_regexes:
            rx_hit, partial_at = _find_stop_regex(hay, self.stop_regexes, fresh_from)
            if rx_hit is not None and (hit is None or rx_hit.pos < hit.pos):
                hit = rx_hit
        return hit, partial_at

    def _release(self, seq: Sequence, n: int, trim: int = 0, final: bool = False) -> RequestOutput:
        steps, self.pending = self.pending[:n], self.pending[n:]
        text = "".join(s.text for s in steps)
        if final:
            flushed = self.detok.finish()
            text += flushed
            if steps:
                steps[-1] = replace(steps[-1], text=steps[-1].text + flushed)
        if trim:
            text = text[: len(text) - trim] if trim <= len(text) else ""
        if steps:
            first = steps[0]
            # A non-final window ends at read_offset: tokens held back for half a character
            # would make the whole window decode to U+FFFD; they open the next window instead.
            end = seq.num_tokens - self.hidden_tokens if final else steps[-1].read_offset
            window = seq.token_ids[first.window_start : end]
            start, prefix_len = first.window_start, first.prefix_len
        else:
            # Nothing released: an empty-delta window (the released prefix alone).
            start, prefix_len, window = seq.num_tokens, 0, []
        if self.max_stop_len:
            self.released_tail = (self.released_tail + text)[-self.max_stop_len :]
        new_ids, self.pending_new_ids = self.pending_new_ids, []
        return self._output(seq, new_ids, window, start, prefix_len, text, trim=trim, final=final)

    def _output(self, seq: Sequence, new_ids: list[int], window: list[int], start: int, prefix_len: int, text: str,
                trim: int = 0, final: bool = False) -> RequestOutput:
        """The response's output: what was released, the sequence's counts, and the logprob
        entries gathered since the last one."""
        logprobs, self.pending_logprobs = (self.pending_logprobs or None), {}
        prompt_ids = None
        if seq.params.return_prompt_token_ids and not self.prompt_ids_sent:
            self.prompt_ids_sent = True
            prompt_ids = list(seq.token_ids[: seq.num_prompt_tokens])
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            window_ids=window,
            window_start=start,
            prefix_len=prefix_len,
            text=text,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            finish_reason=seq.finish_reason.value if final and seq.finish_reason else None,
            stop_reason=seq.stop_reason if final else None,
            matched_eos=final and seq.matched_eos,
            trim=trim,
            num_preemptions=seq.num_preemptions,
            index=seq.index,
            cached_tokens=seq.num_cached_tokens,
            accepted_prediction_tokens=seq.prediction_accepted if seq.params.prediction else None,
            rejected_prediction_tokens=seq.prediction_rejected if seq.params.prediction else None,
            spec=spec_meta(seq) if final and seq.speculates else None,
            logprobs=logprobs,
            prompt_token_ids=prompt_ids,
        )

    def close(self, seq: Sequence, error: Optional[str] = None) -> RequestOutput:
        """Final output for a sequence ended outside a step (length 0, cancel, error)."""
        out = self._release(seq, len(self.pending), final=True)
        out.finish_reason = (seq.finish_reason or FinishReason.ABORT).value
        out.error = error
        return out


def spec_meta(seq: Sequence) -> dict[str, Any]:
    """SGLang's speculative meta_info for a sequence: its verifying steps, the draft tokens they
    verified and kept, their ratio, and its output tokens per step that gave it tokens."""
    return {
        "spec_verify_ct": seq.spec_verify_ct,
        "spec_draft_token_num": seq.spec_draft_tokens,
        "spec_accept_token_num": seq.spec_accepted_tokens,
        "spec_accept_rate": seq.spec_accepted_tokens / seq.spec_draft_tokens if seq.spec_draft_tokens else 0.0,
        "spec_accept_length": seq.num_output_tokens / seq.num_token_steps if seq.num_token_steps else 0.0,
    }


class _Hit(NamedTuple):
    """A stop found in the text: where it begins, how many characters it spans there, and what
    the finish reason reports (the stop string; a stop regex's pattern, as SGLang reports it)."""

    pos: int
    length: int
    matched: str


def _find_stop(text: str, stops: list[str], fresh_from: int) -> Optional[_Hit]:
    """The earliest match that ends after text[:fresh_from]."""
    best: Optional[_Hit] = None
    for s in stops:
        pos = text.find(s, max(0, fresh_from - len(s) + 1))
        if pos != -1 and (best is None or pos < best.pos):
            best = _Hit(pos, len(s), s)
    return best


def _find_stop_regex(text: str, patterns: list[Any], fresh_from: int) -> tuple[Optional[_Hit], Optional[int]]:
    """(earliest complete match, start of a match still in progress).

    A partial match (the `regex` module's partial=True) reaching the end of the text means the
    next tokens may complete it: that text is held back, as for a prefix of a stop string.
    Matches ending inside text[:fresh_from] were checked before (or may not count) and are skipped.
    """
    best: Optional[_Hit] = None
    partial: Optional[int] = None
    for pat in patterns:
        pos = 0
        try:
            while pos <= len(text):
                m = pat.search(text, pos, partial=True, timeout=STOP_REGEX_TIMEOUT_S)
                if m is None:
                    break
                if m.partial:
                    partial = m.start() if partial is None else min(partial, m.start())
                    break
                if m.end() > fresh_from and m.end() > m.start():
                    if best is None or m.start() < best.pos:
                        best = _Hit(m.start(), m.end() - m.start(), pat.pattern)
                    break
                pos = m.start() + 1
        except TimeoutError:
            raise StopRegexTimeout(f"stop_regex {pat.pattern!r} took too long to evaluate") from None
    return best, partial


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best

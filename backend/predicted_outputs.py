"""OpenAI's Predicted Outputs: drafts from text the client expects the output to largely repeat
(a file to be returned with a small edit, a document to be reformatted).

The prediction's tokens are drafted from where the output stands in them, and a step verifies a
draft as it verifies an n-gram draft (backend/speculative.py): every position is drawn as its
own decode step would draw it, so the output is the one decoding without a prediction gives,
and a good prediction only makes it take fewer steps.

Alignment. While each new output token is the prediction's next one, the next draft is what
follows in the prediction. Where the output leaves it (an edit), drafting stops until the
output's last few tokens, written since it parted, occur in the prediction again: at the
earliest occurrence at or after the point where the two parted, as an edit rarely goes back,
else at the latest before it. A tail reaching back past the parting would let the token before
it and one chance neighbour rejoin anywhere the pair recurs. The follower moves token by token,
so where it parts and rejoins depends on the output alone, not on the steps it came in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from backend.speculative import Backoff

# Tail lengths the output is matched by to rejoin its prediction, longest first. Not one token:
# while the output writes something new, its single tokens (a comma, a newline) recur in the
# prediction by chance, and each chance match costs a verifying step.
REJOIN_SIZES = (3, 2)
# Draft tokens a step verifies for a prediction, unless the server's speculative_config sets
# num_speculative_tokens: a prediction is usually followed for long runs, so a draft is longer
# than an n-gram's.
DEFAULT_DRAFT_TOKENS = 8


class Prediction:
    """A request's predicted tokens (shared by its n samples), searched for the output's tail
    with numpy: no index to build or hold. A dict of every run of 2 and 3 tokens cost ~200 bytes
    a token and ~1 us a token to build, 13 MB and 30 ms for a 32k-token prediction; the search
    runs only while the output stands apart from the prediction, at ~20 us per 32k tokens, and
    only when the output's last two tokens both occur in it (a set lookup: an output writing
    something else costs ~0.3 us a step, not a search's ~8)."""

    __slots__ = ("tokens", "length", "_array", "_vocab")

    def __init__(self, tokens: list[int], length: Optional[int] = None) -> None:
        self.tokens = tokens
        # The whole prediction's token count, for OpenAI's counts: `tokens` may be only the part
        # an output could follow (no output is longer than a context).
        self.length = len(tokens) if length is None else length
        self._array = np.asarray(tokens, dtype=np.int64)
        self._vocab = frozenset(tokens)

    def rejoin(self, output: list[int], floor: int) -> Optional[tuple[int, int]]:
        """(the prediction position after the output's tail, the tail's length): its last 3 or 2
        tokens, longest first, nearest at or after `floor`, else the latest before it; None when
        none occurs."""
        if len(output) < REJOIN_SIZES[-1] or not all(t in self._vocab for t in output[-REJOIN_SIZES[-1] :]):
            return None
        p = self._array
        for n in REJOIN_SIZES:
            if len(output) < n or len(p) < n:
                continue
            tail = output[-n:]
            match = p[: len(p) - n + 1] == tail[0]
            for j in range(1, n):
                match &= p[j : len(p) - n + 1 + j] == tail[j]
            ends = np.flatnonzero(match) + n
            if len(ends):
                i = int(np.searchsorted(ends, floor))
                return int(ends[i] if i < len(ends) else ends[-1]), n
        return None


@dataclass
class _Follow:
    """One sequence's place in its prediction."""

    pos: Optional[int]  # the prediction index the next output token should match; None: parted
    seen: int  # the sequence's length when last followed
    floor: int = 0  # where the output last stood in the prediction
    backoff: Backoff = field(default_factory=Backoff)
    taken: int = 0  # output tokens that continued the prediction where the output stood in it
    parted: int = 0  # the index of the output token where it last left the prediction


class PredictionProposer:
    """Drafts for sequences whose request carries a prediction."""

    def __init__(self, k: int = DEFAULT_DRAFT_TOKENS) -> None:
        self.k = k
        self._follows: dict[int, _Follow] = {}

    def propose(self, seq_id: int, prediction: Prediction, tokens: list[int], num_prompt_tokens: int,
                limit: int) -> list[int]:
        """Up to min(k, limit) prediction tokens to follow the sequence's newest one; [] while
        the output stands nowhere in the prediction, or at its end. `tokens` (prompt and output)
        only grows between calls for one sequence."""
        f = self._follow(seq_id, prediction, tokens, num_prompt_tokens)
        if limit <= 0 or f.pos is None or not f.backoff.ready(len(tokens)):
            return []
        return prediction.tokens[f.pos : f.pos + min(self.k, limit)]

    def taken(self, seq_id: int, prediction: Prediction, tokens: list[int], num_prompt_tokens: int) -> int:
        """The prediction's tokens the output has taken so far: OpenAI's
        accepted_prediction_tokens (the rest of the prediction is its rejected ones). Each
        output token that continued the prediction where the output stood in it counts, drafted
        or drawn, and so does the tail by which the output rejoined it after an edit."""
        return min(self._follow(seq_id, prediction, tokens, num_prompt_tokens).taken, len(prediction.tokens))

    def _follow(self, seq_id: int, prediction: Prediction, tokens: list[int], num_prompt_tokens: int) -> _Follow:
        """The sequence's place in its prediction, moved along the tokens added since last time,
        one at a time: where it parts and rejoins depends on the tokens alone, not on the steps
        they came in or on which steps could draft (none while KV blocks run short), so neither
        do the drafts after nor accepted_prediction_tokens."""
        f = self._follows.get(seq_id)
        if f is None:
            f = self._follows[seq_id] = _Follow(pos=0, seen=num_prompt_tokens)
        predicted = prediction.tokens
        for i in range(f.seen, len(tokens)):
            if f.pos is not None:
                if f.pos < len(predicted) and predicted[f.pos] == tokens[i]:
                    f.pos += 1
                    f.taken += 1
                    continue
                f.floor, f.pos, f.parted = f.pos, None, i  # parted here
            found = prediction.rejoin(tokens[max(f.parted, i + 1 - REJOIN_SIZES[0]) : i + 1], f.floor)
            if found is not None:
                f.pos, tail = found
                f.floor = f.pos
                f.taken += tail  # all written since it parted (the tail never reaches back past that)
        f.seen = len(tokens)
        return f

    def verified(self, seq_id: int, length: int, accepted: int) -> None:
        """A draft was verified and `accepted` of its tokens kept; the sequence is now `length`
        tokens long. After a draft rejected outright the next waits, as an n-gram draft does
        (backend/speculative.py): a chance rejoin should not cost a verifying step each token."""
        f = self._follows.get(seq_id)
        if f is not None:
            f.backoff.verified(length, accepted)

    def forget(self, seq_id: int) -> None:
        self._follows.pop(seq_id, None)

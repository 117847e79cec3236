"""Stop strings in OutputState (backend/outputs.py) against vLLM v1's rule, written out here one
token at a time: a stop string counts only where it ends in the text of a token after the first
`min_new_tokens`; the text ends where the earliest such match begins (or after it, with
`no_stop_trim`). Whatever the steps' sizes (drafts and jump-forward push several tokens at
once), the text released over the responses must be exactly that."""

from __future__ import annotations

import random
from typing import Optional

import pytest

from backend.detokenizer import IncrementalDetokenizer
from backend.outputs import OutputState
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence
from backend.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(demo_model_path):
    return load_tokenizer(demo_model_path)


@pytest.fixture(scope="module")
def pieces(tok) -> list[int]:
    """Tokens that decode to short printable ASCII on their own and in any sequence, so each
    token's text is known without a detokenizer."""
    ids = [i for i in range(tok.vocab_size) if i not in tok.all_special_ids]
    good = [i for i in ids if (t := tok.decode([i])).isascii() and t.isprintable() and 1 <= len(t) <= 3
            and t.strip() == t]
    assert len(good) > 200
    return good


def _expected(texts: list[str], stops: list[str], min_new: int, no_stop_trim: bool) -> tuple[str, Optional[str], int]:
    """(text, matched stop, tokens generated) by vLLM v1's rule, one token at a time."""
    out = ""
    for k, piece in enumerate(texts, start=1):
        checked_from = len(out)
        out += piece
        if k <= min_new:
            continue
        best = None
        for s in stops:
            pos = out.find(s, max(0, checked_from - len(s) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            pos, s = best
            return out[: pos + (len(s) if no_stop_trim else 0)], s, k
    return out, None, len(texts)


def _run(tok, ids: list[int], steps: list[int], stops: list[str], min_new: int, no_stop_trim: bool = False):
    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=stops, min_new_tokens=min_new,
                            no_stop_trim=no_stop_trim)
    prompt = tok("a prompt").input_ids
    seq = Sequence(request_id="r", token_ids=list(prompt), params=params, max_new_tokens=len(ids))
    state = OutputState(detok=IncrementalDetokenizer(tok, prompt), stops=stops, eos_ids=frozenset())
    text, i, outs = "", 0, []
    for n in steps:
        step = ids[i : i + n]
        i += n
        seq.token_ids.extend(step)
        out = state.on_tokens(seq, step)
        outs.append(out)
        text += out.text
        if out.finished:
            break
    return text, outs[-1], seq


def test_a_stop_ending_in_the_first_min_new_tokens_does_not_count(tok, pieces):
    a, b, c, d = pieces[:4]
    texts = [tok.decode([t]) for t in (a, b, c, d)]
    ids = [a, b, c, d, a, b, c, d]
    # A stop across tokens 2|3: matched with min_new_tokens 2, not with 3 (it ends in token 3).
    stop = texts[1][-1] + texts[2][0]
    text, out, _ = _run(tok, ids, [1] * 8, [stop], min_new=2)
    assert out.finish_reason == "stop" and text == texts[0] + texts[1][:-1]
    text, out, seq = _run(tok, ids, [1] * 8, [stop], min_new=3)
    # Its second occurrence (tokens 6|7) is past the line: the text, tokens 1..5 whole, ends there.
    assert out.finish_reason == "stop" and text == "".join(texts) + texts[0] + texts[1][:-1]
    assert seq.num_output_tokens == 7


def test_a_stop_that_never_matches_changes_nothing(tok, pieces):
    """The QA case: `stop: ["}"]` and `stop: ["}", "zzzzzzzz"]` must end alike, and text sent
    under min_new_tokens that holds a stop must not end the request later."""
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.choice(pieces[:40]) for _ in range(16)]
        texts = [tok.decode([t]) for t in ids]
        stop = rng.choice("".join(texts))
        min_new = rng.randrange(0, 10)
        one = _run(tok, ids, [1] * 16, [stop], min_new)
        two = _run(tok, ids, [1] * 16, [stop, "\x00never ever"], min_new)
        assert (one[0], one[1].finish_reason, one[1].stop_reason) == (two[0], two[1].finish_reason, two[1].stop_reason)
        assert one[0] == _expected(texts, [stop], min_new, False)[0]


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_random_steps_release_exactly_vllms_text(tok, pieces, no_stop_trim):
    rng = random.Random(5 + no_stop_trim)
    for trial in range(400):
        ids = [rng.choice(pieces[:30]) for _ in range(rng.randint(1, 24))]
        texts = [tok.decode([t]) for t in ids]
        joined = "".join(texts)
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(joined))
            stops.append(joined[i : i + rng.randint(1, 6)] if rng.random() < 0.8 else "\x01nope" * rng.randint(1, 3))
        min_new = rng.choice([0, 0, rng.randrange(len(ids) + 1)])
        steps, left = [], len(ids)
        while left:  # drafts / jump-forward: several tokens a step, crossing min_new anywhere
            steps.append(min(left, rng.choice([1, 1, 2, 3, 5])))
            left -= steps[-1]
        text, out, seq = _run(tok, ids, steps, stops, min_new, no_stop_trim)
        want, stop, k = _expected(texts, stops, min_new, no_stop_trim)
        if stop is None:
            assert (text, out.finish_reason) == (want, "length"), (trial, ids, stops, min_new, steps)
        else:
            # A step of several tokens is checked as a whole: it may find the earliest match
            # that ends in any of its tokens; that is the same match, and ends the same text.
            assert (text, out.finish_reason, out.stop_reason) == (want, "stop", stop), \
                (trial, ids, stops, min_new, steps)
            assert seq.num_output_tokens >= k


def test_a_stop_token_alone_after_half_a_character_flushes_it_as_without_stops(tok):
    """The step of a hidden stop token alone pushes no text; the half character held back before
    it is flushed into that step, watched for stop strings or not."""
    half = next(i for i in range(tok.vocab_size) if i not in tok.all_special_ids and tok.decode([i]).endswith("\ufffd"))
    eos = 4093
    texts = []
    for stops in ([], ["zz"]):
        params = SamplingParams(max_new_tokens=8, stop=stops)
        prompt = tok("a prompt").input_ids
        seq = Sequence(request_id="r", token_ids=list(prompt), params=params, max_new_tokens=8)
        state = OutputState(detok=IncrementalDetokenizer(tok, prompt), stops=stops, eos_ids=frozenset({eos}))
        text = ""
        for step in ([half], [eos]):
            seq.token_ids.extend(step)
            out = state.on_tokens(seq, step)
            text += out.text
        assert out.finish_reason == "stop" and out.stop_reason == eos
        texts.append(text)
    assert texts[0] == texts[1] and texts[0].endswith("\ufffd")

"""Stop strings in OutputState (backend/outputs.py) against the two rules, written out here one
token at a time. vLLM v1's: a stop string counts only where it ends in the text of a token after
the first `min_tokens`; the text ends where the earliest such match begins (or after it, with
`include_stop_str_in_output`). SGLang's: `min_new_tokens` holds back no stop string, and
`no_stop_trim` leaves the text as decoded, up to the token that completed the stop. Whatever the
steps' sizes (drafts and jump-forward push several tokens at once), the text released over the
responses must be exactly that."""

from __future__ import annotations

import random
from typing import Optional

import pytest

from backend.detokenizer import IncrementalDetokenizer
from backend.outputs import OutputState
from backend.sampling_params import SamplingParams
from backend.sequence import Sequence
from backend.tokenizer import load_tokenizer

TRIM, INCLUDE, UNTOUCHED = "trim", "include_stop_str_in_output", "no_stop_trim"


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


def _expected(texts: list[str], stops: list[str], min_tokens: int, keep: str = TRIM) -> tuple[str, Optional[str], int]:
    """(text, matched stop, tokens generated), one token at a time."""
    out = ""
    for k, piece in enumerate(texts, start=1):
        checked_from = len(out)
        out += piece
        if k <= min_tokens:
            continue
        best = None
        for s in stops:
            pos = out.find(s, max(0, checked_from - len(s) + 1))
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is not None:
            pos, s = best
            return {TRIM: out[:pos], INCLUDE: out[: pos + len(s)], UNTOUCHED: out}[keep], s, k
    return out, None, len(texts)


def _run(tok, ids: list[int], steps: list[int], stops: list[str], min_tokens: int = 0, keep: str = TRIM,
         min_new_tokens: int = 0):
    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=stops, min_tokens=min_tokens,
                            min_new_tokens=min_new_tokens, no_stop_trim=keep == UNTOUCHED,
                            include_stop_str_in_output=keep == INCLUDE)
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


def test_a_stop_ending_in_the_first_min_tokens_does_not_count(tok, pieces):
    a, b, c, d = pieces[:4]
    texts = [tok.decode([t]) for t in (a, b, c, d)]
    ids = [a, b, c, d, a, b, c, d]
    # A stop across tokens 2|3: matched with min_tokens 2, not with 3 (it ends in token 3).
    stop = texts[1][-1] + texts[2][0]
    text, out, _ = _run(tok, ids, [1] * 8, [stop], min_tokens=2)
    assert out.finish_reason == "stop" and text == texts[0] + texts[1][:-1]
    text, out, seq = _run(tok, ids, [1] * 8, [stop], min_tokens=3)
    # Its second occurrence (tokens 6|7) is past the line: the text, tokens 1..5 whole, ends there.
    assert out.finish_reason == "stop" and text == "".join(texts) + texts[0] + texts[1][:-1]
    assert seq.num_output_tokens == 7
    # SGLang's min_new_tokens holds back EOS and stop tokens only: the first occurrence ends it.
    text, out, seq = _run(tok, ids, [1] * 8, [stop], min_new_tokens=3)
    assert (out.finish_reason, text, seq.num_output_tokens) == ("stop", texts[0] + texts[1][:-1], 3)


def test_no_stop_trim_keeps_the_completing_tokens_text_and_include_stop_str_cuts_after_the_stop(tok, pieces):
    a, b, c = [t for t in pieces if len(tok.decode([t])) >= 2][:3]
    texts = [tok.decode([t]) for t in (a, b, c)]
    stop = texts[1][:-1]  # ends inside token 2
    for steps in ([1, 1, 1], [3]):
        assert _run(tok, [a, b, c], steps, [stop])[0] == texts[0]
        assert _run(tok, [a, b, c], steps, [stop], keep=INCLUDE)[0] == texts[0] + stop
        # SGLang: the output untouched, token 2 whole, nothing of token 3 (the stop ended it).
        assert _run(tok, [a, b, c], steps, [stop], keep=UNTOUCHED)[0] == texts[0] + texts[1]


def test_a_stop_that_never_matches_changes_nothing(tok, pieces):
    """The QA case: `stop: ["}"]` and `stop: ["}", "zzzzzzzz"]` must end alike, and text sent
    under min_tokens that holds a stop must not end the request later."""
    rng = random.Random(3)
    for _ in range(200):
        ids = [rng.choice(pieces[:40]) for _ in range(16)]
        texts = [tok.decode([t]) for t in ids]
        stop = rng.choice("".join(texts))
        min_tokens = rng.randrange(0, 10)
        one = _run(tok, ids, [1] * 16, [stop], min_tokens)
        two = _run(tok, ids, [1] * 16, [stop, "\x00never ever"], min_tokens)
        assert (one[0], one[1].finish_reason, one[1].stop_reason) == (two[0], two[1].finish_reason, two[1].stop_reason)
        assert one[0] == _expected(texts, [stop], min_tokens)[0]


@pytest.mark.parametrize("keep", [TRIM, INCLUDE, UNTOUCHED])
@pytest.mark.parametrize("rule", ["vllm", "sglang"])
def test_random_steps_release_exactly_the_rules_text(tok, pieces, keep, rule):
    rng = random.Random(5 + len(keep) + len(rule))
    for trial in range(300):
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
        if rule == "vllm":
            text, out, seq = _run(tok, ids, steps, stops, min_tokens=min_new, keep=keep)
            want, stop, k = _expected(texts, stops, min_new, keep)
        else:
            text, out, seq = _run(tok, ids, steps, stops, min_new_tokens=min_new, keep=keep)
            want, stop, k = _expected(texts, stops, 0, keep)
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


def _half_character_token(tok) -> tuple[int, int, str]:
    """(a token whose text is a few characters and then the lead byte of one more, a token that
    completes that character, the complete characters' text)."""
    for i in range(tok.vocab_size):
        if i in tok.all_special_ids:
            continue
        text = tok.decode([i])
        if text.endswith("\ufffd") and len(text) >= 5 and "\ufffd" not in text[:-1] and text[:-1].isascii():
            for j in range(tok.vocab_size):
                whole = tok.decode([i, j])
                if "\ufffd" not in whole and whole.startswith(text[:-1]) and len(whole) > len(text) - 1:
                    return i, j, text[:-1]
    raise AssertionError("the demo tokenizer has no such token")


def test_a_stop_in_a_token_that_ends_in_half_a_character_ends_the_sequence_on_that_token(tok, pieces):
    """QA: " amanh" + a lead byte is held back until the character completes; the stop "man" in it
    was found one token late, and a sequence ending on that token (EOS next, or length) reported
    "man" from the flushed text over its real finish reason. SGLang finds it in that token."""
    half, completer, head = _half_character_token(tok)
    stop = head[2:-1]  # inside the complete characters, ending before the last of them
    start = len(head) - len(stop) - 1
    after = pieces[0]
    for steps in ([1, 1, 1], [3]):
        text, out, seq = _run(tok, [half, completer, after], steps, [stop])
        assert (text, out.finish_reason, out.stop_reason) == (head[:start], "stop", stop)
        if steps == [1, 1, 1]:
            assert seq.num_output_tokens == 1
        assert _run(tok, [half, completer, after], steps, [stop], keep=INCLUDE)[0] == head[:start] + stop
    # SGLang's no_stop_trim: the text as decoded up to the token that completed the stop.
    assert _run(tok, [half, completer, after], [1, 1, 1], [stop], keep=UNTOUCHED)[0] == tok.decode([half])
    # Half a character alone never matches a stop early; it still counts once completed.
    whole = tok.decode([half, completer])
    tail_stop = whole[len(head) - 1 :]  # the last complete character and the completed one
    text, out, seq = _run(tok, [half, completer, after], [1, 1, 1], [tail_stop])
    assert (text, out.stop_reason, seq.num_output_tokens) == (head[:-1], tail_stop, 2)
    # Under min_tokens the held-back text is not searched; once completed it is the text of the
    # token that completed it, as vLLM's detokenizer sees it, and counts then.
    text, out, seq = _run(tok, [half, completer, after], [1, 1, 1], [stop], min_tokens=1)
    assert (text, out.stop_reason, seq.num_output_tokens) == (head[:start], stop, 2)


def test_a_stop_in_half_a_character_wins_over_the_eos_that_would_follow(tok):
    half, _, head = _half_character_token(tok)
    stop = head[2:-1]
    eos = 4093
    params = SamplingParams(max_new_tokens=8, stop=[stop])
    prompt = tok("a prompt").input_ids
    seq = Sequence(request_id="r", token_ids=list(prompt), params=params, max_new_tokens=8)
    state = OutputState(detok=IncrementalDetokenizer(tok, prompt), stops=[stop], eos_ids=frozenset({eos}))
    seq.token_ids.append(half)
    out = state.on_tokens(seq, [half])
    assert out.finished and (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == head[: len(head) - len(stop) - 1]
    # A length limit on that token: the stop string still names the end, as vLLM reports it.
    params = SamplingParams(max_new_tokens=1, stop=[stop])
    seq = Sequence(request_id="r", token_ids=list(prompt), params=params, max_new_tokens=1)
    state = OutputState(detok=IncrementalDetokenizer(tok, prompt), stops=[stop], eos_ids=frozenset({eos}))
    seq.token_ids.append(half)
    out = state.on_tokens(seq, [half])
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def _feed(tok, ids: list[int], stops=(), regexes=(), min_tokens: int = 0):
    import regex as re_mod

    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=list(stops),
                            stop_regex=list(regexes) or None, min_tokens=min_tokens)
    prompt = tok("a prompt").input_ids
    seq = Sequence(request_id="r", token_ids=list(prompt), params=params, max_new_tokens=len(ids))
    state = OutputState(detok=IncrementalDetokenizer(tok, prompt), stops=list(stops), eos_ids=frozenset({4093}),
                        stop_regexes=[re_mod.compile(r) for r in regexes])
    text = ""
    for t in ids:
        seq.token_ids.append(t)
        out = state.on_tokens(seq, [t])
        text += out.text
        if out.finished:
            break
    return text, out, seq.num_output_tokens, state


def test_held_back_text_keeps_its_half_character_for_stop_regexes(tok, pieces):
    """QA: the held text was searched without its U+FFFD, so `h$` matched at the end of
    " amanh" though no text ever ends there; SGLang's tail keeps the U+FFFD."""
    half, completer, head = _half_character_token(tok)
    ids = [half, completer, pieces[0], pieces[1]]
    last = head[-1]
    for rx in (f"{last}$", f"{last}\\Z", f"\\w+{last}$"):
        text, out, n, _ = _feed(tok, ids, regexes=[rx])
        assert (out.finish_reason, text, n) == ("length", tok.decode(ids), 4), rx
    # A regex that the held text's complete characters satisfy still ends on that token.
    text, out, n, _ = _feed(tok, ids, regexes=[head[2:] + "\\b"])
    # It is reported by its pattern, as SGLang reports a stop regex (matched: the pattern).
    assert (out.finish_reason, out.stop_reason, text, n) == ("stop", head[2:] + "\\b", head[:2], 1)


def test_held_back_text_counts_under_min_tokens_where_it_is_released(tok, pieces):
    """QA: a skipped special token after a half character held under min_tokens found the stop
    in the held text as if that token had written it (vLLM: where the text is released)."""
    half, completer, head = _half_character_token(tok)
    stop = head[2:-1]
    for ids, want_n in (([half, 4093, completer, pieces[0]], 3),  # EOS under ignore_eos: skipped
                        ([half, half, completer, pieces[0]], 3),  # a second half char, counting
                        ([half, completer, pieces[0]], 2)):
        text, out, n, _ = _feed(tok, ids, stops=[stop], min_tokens=1)
        assert (out.stop_reason, text, n) == (stop, head[: len(head) - len(stop) - 1], want_n), ids
    # Without min_tokens, a skipped token after the half character finds nothing new in it.
    text, out, n, _ = _feed(tok, [half, 4093, completer], stops=["zz"])
    assert out.finish_reason == "length" and n == 3


def test_a_skipped_special_token_costs_no_held_text_decode(tok, pieces):
    _, _, _, state = _feed(tok, [pieces[0]], stops=["zz"])
    calls = []
    decode = state.detok._decode
    state.detok._decode = lambda ids: calls.append(1) or decode(ids)
    assert state.detok.held_text() == "" and not calls

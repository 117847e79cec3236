"""Incremental detokenization: engine side (IncrementalDetokenizer) and the stateless
postprocessing side (decode_delta over the shipped window) must both reproduce decode(all)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from backend.detokenizer import IncrementalDetokenizer, decode_delta, make_decoder
from backend.tokenizer import load_tokenizer
from backend.triton_utils import postprocess_arrays
from conftest import FakeRequest, load_triton_model

TEXTS = [
    "Hello world, how are you doing today? Fine, thanks.",
    "  spaces   everywhere\n\n\tand tabs  ",
    "你好，世界！人工智能正在改变我们的生活。",
    "東京は日本の首都です。こんにちは",
    "emoji 😀🎉 mixed 👍🏽 ZWJ 👨‍👩‍👧 flags 🇯🇵 🦄🫠",
    'Tool: <tool_call>\n{"name": "f", "arguments": {"城市": "北京"}}\n</tool_call> done<|im_end|>',
    "ǅ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — “quotes” … naïve café",
]
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(demo_model_path):
    return load_tokenizer(demo_model_path)


def build_byte_fallback_tokenizer(out_dir) -> None:
    """A Llama-2-style tokenizer: BPE with byte fallback (the 256 `<0xNN>` tokens are plain vocab
    entries), "▁" for spaces, Llama 2's decoder chain; a vocabulary small enough that CJK and
    emoji fall back to bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizer
    corpus = ["Hello world, the quick brown fox jumps over the lazy dog. stop done"] * 40 + ["世界 你好"] * 10
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=["\u2581"]))
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in sorted(trained["vocab"], key=trained["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    bf = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    bf.normalizer = normalizer
    bf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    bf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>", "<|im_end|>")])
    PreTrainedTokenizerFast(tokenizer_object=bf, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            additional_special_tokens=["<|im_end|>"]).save_pretrained(str(out_dir))


@pytest.fixture(scope="module")
def bf_tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("byte_fallback_tokenizer")
    build_byte_fallback_tokenizer(out)
    return load_tokenizer(str(out))


def _byte(tok, b: int) -> int:
    return tok.convert_tokens_to_ids(f"<0x{b:02X}>")


def _incomplete(tok, token_id: int) -> bool:
    return tok.decode([token_id]).endswith("\ufffd")


def _stream(tok, prompt_ids, output_ids, chunks, skip):
    """Run the engine side and, per push, the postprocessing side; return both texts."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    engine, post, held = [], [], 0
    i = 0
    for n in chunks:
        new = output_ids[i : i + n]
        i += n
        final = i >= len(output_ids)
        delta = detok.push(new)
        text = delta.text + (detok.finish() if final else "")
        held += delta.text == ""
        # Postprocessing sees only the window (as an INT32 tensor) and the final flag.
        window = np.asarray(delta.window_ids, dtype=np.int32)
        assert delta.window_ids == detok.all_ids[delta.window_start :]
        post.append(decode_delta(tok, window, delta.prefix_len, skip_special_tokens=skip, final=final))
        engine.append(text)
    assert engine == post
    assert "".join(engine) == detok.text
    return "".join(engine), held


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time(tok, text, skip):
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    output_ids = tok.encode(text, add_special_tokens=False)
    got, _ = _stream(tok, prompt_ids, output_ids, [1] * len(output_ids), skip)
    assert got == tok.decode(output_ids, skip_special_tokens=skip)


def test_split_multibyte_characters_are_held_back(tok):
    # Prove the hard case happens: tokens that end inside a UTF-8 character.
    for text in TEXTS[2:5]:
        ids = tok.encode(text, add_special_tokens=False)
        assert any(_incomplete(tok, i) for i in ids), f"no split character in {text!r}"
        got, held = _stream(tok, [], ids, [1] * len(ids), skip=True)
        assert held > 0 and got == text and "\ufffd" not in got


@pytest.mark.parametrize("skip", [True, False])
def test_random_chunks_and_random_tokens(tok, skip):
    rng = random.Random(1234)
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    for _ in range(200):
        # Random ids, biased to partial-character tokens: also invalid UTF-8 byte soup.
        ids = [rng.choice(partial) if rng.random() < 0.5 else rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 4))
        got, _ = _stream(tok, prompt_ids, ids, chunks, skip)
        assert got == tok.decode(ids, skip_special_tokens=skip)


def test_special_tokens_between_text(tok):
    ids = tok.encode("Hi<|im_end|><|endoftext|> there 你", add_special_tokens=False)
    assert _stream(tok, [], ids, [1] * len(ids), skip=True)[0] == "Hi there 你"
    assert _stream(tok, [], ids, [1] * len(ids), skip=False)[0] == "Hi<|im_end|><|endoftext|> there 你"


def test_truncated_character_is_flushed_by_finish(tok):
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    released = "".join(detok.push([i]).text for i in ids[:cut])
    assert released.startswith("ok") and "\ufffd" not in released
    tail = detok.finish()
    assert tail.endswith("\ufffd") and detok.text == tok.decode(ids[:cut])
    assert detok.finish() == ""  # idempotent


def _responses_in_random_groups(tok, prompt_ids, ids, rng, skip) -> list[str]:
    """Push `ids` a few at a time and close responses covering random runs of pushes; each
    response's window must decode (as postprocessing does) to the text of its pushes."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    mark, texts, responses, i = detok.mark(), [], [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        texts.append(detok.push(ids[i : i + n]).text)
        i += n
        final = i >= len(ids)
        if final:
            texts.append(detok.finish())
        if final or rng.random() < 0.3:
            window, prefix_len = detok.window_since(mark, final=final)
            got = decode_delta(tok, window, prefix_len, skip_special_tokens=skip, final=final)
            assert got == "".join(texts)
            responses.append(got)
            mark, texts = detok.mark(), []
    return responses


def test_aggregated_windows_equal_concatenated_pushes(tok):
    rng = random.Random(7)
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    for trial in range(200):
        text = TEXTS[trial % len(TEXTS)]
        ids = tok.encode(text, add_special_tokens=False)
        if trial % 2:
            ids = [rng.choice(partial) for _ in range(rng.randrange(1, 20))] + ids
        responses = _responses_in_random_groups(tok, tok.encode(PROMPT, add_special_tokens=False), ids, rng, True)
        assert "".join(responses) == tok.decode(ids, skip_special_tokens=True)


def test_merging_pushes_with_delta_offsets(tok):
    # The engine's view: merge per-push deltas p..q via window_start / read_offset.
    ids = tok.encode("ab 你好 😀 cd 世界🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT, add_special_tokens=False))
    deltas = [detok.push([i]) for i in ids]
    assert any(d.text == "" for d in deltas[:-1])  # some pushes held back half a character
    for p in range(len(deltas)):
        for q in range(p, len(deltas)):
            window = detok.all_ids[deltas[p].window_start : deltas[q].read_offset]
            want = "".join(d.text for d in deltas[p : q + 1])
            assert decode_delta(tok, window, deltas[p].prefix_len) == want


def test_byte_fallback_text_is_the_same_however_responses_are_merged(bf_tok):
    # Review (s19): a ByteFallback decoder turns a byte run that is not valid UTF-8 as a whole
    # into one U+FFFD per byte, valid characters included. "é" was streamed, then garbled when
    # the non-streaming response decoded its merged window: 'é��� the' streamed, '���� the' not.
    tok = bf_tok
    the = tok.encode("the", add_special_tokens=False)
    ids = [_byte(tok, 0xC3), _byte(tok, 0xA9), _byte(tok, 0xE4), _byte(tok, 0xB8)] + the
    detok = IncrementalDetokenizer(tok, tok.encode("Hello world", add_special_tokens=False))
    mark = detok.mark()
    streamed = "".join(detok.push([i]).text for i in ids) + detok.finish()
    window, prefix_len = detok.window_since(mark, final=True)
    assert streamed == decode_delta(tok, window, prefix_len, final=True) == "é\ufffd\ufffd the"
    # Valid bytes decode as the tokenizer decodes them.
    ok = tok.encode("naïve 世界 🙂 done", add_special_tokens=False)
    assert any(i == _byte(tok, 0xF0) for i in ok)
    assert make_decoder(tok)(ok) == tok.decode(ok) == "naïve 世界 🙂 done"
    # A skipped special token between a character's bytes does not split it, as in the tokenizer.
    split = [_byte(tok, 0xC3), tok.convert_tokens_to_ids("</s>"), _byte(tok, 0xA9)]
    assert make_decoder(tok)(split) == tok.decode(split, skip_special_tokens=True) == "é"
    assert make_decoder(tok, skip_special_tokens=False)(split) == "\ufffd</s>\ufffd"


@pytest.mark.parametrize("prompt, output", [("Emoji: 🙂🙂", "👍 done"), ("日本語の文章：猫", "犬です")])
def test_byte_fallback_first_window_inside_a_prompt_character(bf_tok, prompt, output):
    # Review (s19): the first window starts 5 tokens before the prompt's end, here inside a
    # character spelled in bytes; the decoder turned that whole run, the output's first
    # character included, into U+FFFD ('���� done'), and a stop string on it never matched.
    tok = bf_tok
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    out_ids = tok.encode(prompt + output, add_special_tokens=False)[len(prompt_ids):]
    assert tok.decode(prompt_ids[-5:]).startswith("\ufffd")  # the window starts mid-character
    got, _ = _stream(tok, prompt_ids, out_ids, [1] * len(out_ids), skip=True)
    assert got == output


def test_byte_fallback_random_bytes_stream_and_merge_alike(bf_tok):
    tok = bf_tok
    rng = random.Random(5)
    byte_ids = [_byte(tok, b) for b in range(256)]
    prompt = tok.encode("Hello 世界", add_special_tokens=False)
    valid = 0
    for _ in range(300):
        soup = rng.random() < 0.8  # else only valid text
        ids = [rng.choice(byte_ids) if rng.random() < 0.7 else rng.randrange(len(tok))
               for _ in range(rng.randrange(1, 30) if soup else 0)]
        if not soup or rng.random() < 0.5:  # valid characters, split over byte tokens
            ids += tok.encode(rng.choice(["世界", " 🙂", "é the", "你好 fox"]), add_special_tokens=False)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 4))
        skip = rng.random() < 0.7
        got, _ = _stream(tok, prompt, ids, chunks, skip)
        # The reference: the output decoded after the prompt (a leading space is kept there).
        decode = make_decoder(tok, skip_special_tokens=skip)
        before = decode(prompt)
        assert decode(prompt + ids).startswith(before)
        assert got == decode(prompt + ids)[len(before):]
        hf_before = tok.decode(prompt, skip_special_tokens=skip)
        hf_whole = tok.decode(prompt + ids, skip_special_tokens=skip)
        if "\ufffd" not in hf_whole:  # valid bytes: the tokenizer's own text
            assert got == hf_whole[len(hf_before):]
            valid += 1
        # Any grouping of the pushes into responses decodes to the same text.
        assert "".join(_responses_in_random_groups(tok, prompt, ids, rng, skip)) == got
    assert valid >= 10, valid


def test_window_stays_small(tok):
    ids = tok.encode(" ".join(TEXTS) * 5, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT, add_special_tokens=False))
    biggest = max(len(detok.push([i]).window_ids) for i in ids)
    assert biggest <= 8  # a few tokens, never the whole output


def test_initial_window_uses_last_prompt_tokens(tok):
    prompt = tok.encode("one two three four five six seven", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    delta = detok.push(tok.encode(" eight", add_special_tokens=False))
    assert delta.window_start == len(prompt) - 5 and delta.prefix_len == 5
    assert delta.text == " eight"
    assert IncrementalDetokenizer(tok, [1, 2]).push([3]).prefix_len == 2


def test_decode_delta_validates_prefix_len(tok):
    with pytest.raises(ValueError, match="prefix_len"):
        decode_delta(tok, [1, 2], 3)
    assert decode_delta(tok, [1, 2], 2) == ""
    assert decode_delta(tok, [], 0, final=True) == ""


def _post(**arrays):
    return {k: (np.array([v.encode()], dtype=object) if isinstance(v, str) else np.asarray(v)) for k, v in arrays.items()}


def test_postprocess_arrays(tok):
    window = tok.encode("Hello world STOP", add_special_tokens=False)
    prefix = len(tok.encode("Hello", add_special_tokens=False))
    out = postprocess_arrays(tok, _post(detok_ids=np.array(window, np.int32), detok_prefix_len=np.array([prefix], np.int32)))
    assert out["text_output"][0].decode() == " world STOP"
    assert set(out) == {"text_output"}  # the ensemble takes the other outputs from llm

    out = postprocess_arrays(
        tok,
        _post(
            detok_ids=np.array(window, np.int32),
            detok_prefix_len=np.array([prefix], np.int32),
            detok_trim=np.array([5], np.int32),
            finish_reason="stop",
            skip_special_tokens=np.array([True]),
        ),
    )
    assert out["text_output"][0].decode() == " world"
    # A client calling postprocessing itself gets its errors named (QA: -1 was a 500, a token
    # past the vocabulary silently no text).
    for ids, prefix, trim, message in (([-1], 0, 0, "detok_ids out of range"), ([len(tok)], 0, 0, "detok_ids out of range"),
                                       (window, len(window) + 1, 0, "detok_prefix_len must be in"),
                                       (window, -1, 0, "detok_prefix_len must be in"),
                                       (window, 0, -2, "detok_trim must be >= 0")):
        with pytest.raises(ValueError, match=message):
            postprocess_arrays(tok, _post(detok_ids=np.array(ids, np.int32), detok_prefix_len=np.array([prefix], np.int32),
                                          detok_trim=np.array([trim], np.int32)))


def test_postprocess_final_flag_flushes_partial_character(tok):
    ids = tok.encode("a😀", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    window = np.array(ids[:cut], np.int32)
    assert postprocess_arrays(tok, _post(detok_ids=window, detok_prefix_len=np.array([0], np.int32)))["text_output"][0] == b""
    final = postprocess_arrays(tok, _post(detok_ids=window, detok_prefix_len=np.array([0], np.int32), finish_reason="length"))
    assert final["text_output"][0].decode().endswith("\ufffd")


def test_postprocessing_model_py(fake_pb_utils, demo_model_path, monkeypatch, tok):
    monkeypatch.setenv("LLM_MODEL_PATH", str(demo_model_path))
    model = load_triton_model("postprocessing").TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {"model_path": {"string_value": "models/demo"}}})})
    ids = tok.encode("Hi there", add_special_tokens=False)
    good = FakeRequest(**_post(detok_ids=np.array(ids, np.int32), detok_prefix_len=np.array([1], np.int32)))
    bad = FakeRequest(**_post(detok_ids=np.array(ids, np.int32), detok_prefix_len=np.array([99], np.int32)))
    missing = FakeRequest(**_post(finish_reason="stop"))
    responses = model.execute([good, bad, missing])
    assert responses[0].error is None
    outs = responses[0].outputs()
    assert outs["text_output"][0].decode() == tok.decode(ids[1:])
    assert set(outs) == {"text_output"}
    assert "detok_prefix_len must be in [0, 2] (the ids in detok_ids), got 99" in responses[1].error.message() and responses[1].error.code() == "INVALID_ARG"
    assert "required" in responses[2].error.message()


def test_llm_response_omits_default_hints_and_postprocessing_reads_them_back(tok):
    """The llm response leaves out detok_trim / skip_special_tokens /
    spaces_between_special_tokens when they hold postprocessing's defaults; either way the text
    is what postprocessing decodes with the request's own settings."""
    from backend.outputs import RequestOutput
    from backend.sampling_params import SamplingParams
    from backend.triton_io import llm_output_arrays

    special = tok.convert_tokens_to_ids(tok.all_special_tokens[0])
    window = tok.encode("Hi there", add_special_tokens=False) + [special]
    for skip, trim in ((True, 0), (False, 0), (True, 2), (False, 3)):
        params = SamplingParams(skip_special_tokens=skip)
        out = RequestOutput(request_id="r", new_token_ids=window[1:], window_ids=window, window_start=0, prefix_len=1,
                            text="", prompt_tokens=4, completion_tokens=len(window) - 1, trim=trim)
        arrays = llm_output_arrays(out, params)
        assert ("skip_special_tokens" in arrays) == (not skip) and ("detok_trim" in arrays) == bool(trim)
        assert "spaces_between_special_tokens" not in arrays
        text = postprocess_arrays(tok, {k: (np.array([x.encode() for x in v], dtype=object) if v.dtype == object else v)
                                        for k, v in arrays.items()})["text_output"][0].decode()
        full = tok.decode(window[1:], skip_special_tokens=skip)
        assert text == (full[: len(full) - trim] if trim else full), (skip, trim)


def test_output_fast_path_equals_the_general_release(tok):
    """OutputState.on_tokens returns a token's output directly when nothing is held back and no
    stop string is watched; with a stop string that never matches, the same tokens take the
    general path (pending steps, _release). The outputs must be the same, field for field,
    through split multi-byte characters, special tokens and the final flush."""
    from dataclasses import asdict

    from backend.outputs import OutputState
    from backend.sampling_params import SamplingParams
    from backend.sequence import Sequence

    rng = random.Random(11)
    special = sorted(tok.all_special_ids)
    prompt = tok("日本語 🙂 prompt").input_ids[:-1]  # ends inside a character
    for trial in range(20):
        outs = []
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(tok.vocab_size - 1) for _ in range(30)]
        for stops in ([], ["\x00\x01never"]):
            params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=stops,
                                    skip_special_tokens=trial % 2 == 0)
            seq = Sequence(request_id="r", token_ids=list(prompt), params=params, max_new_tokens=len(ids))
            state = OutputState(detok=IncrementalDetokenizer(tok, prompt, skip_special_tokens=params.skip_special_tokens),
                                stops=stops, eos_ids=frozenset())
            got = []
            for t in ids:
                seq.token_ids.append(t)
                got.append(asdict(state.on_tokens(seq, [t])))
            outs.append(got)
        assert outs[0] == outs[1]
        assert outs[0][-1]["finish_reason"] == "length"

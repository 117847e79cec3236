"""Jump-forward decoding: text a grammar forces is appended without sampling (EngineConfig
.enable_jump_forward). The grammar side (which tokens, where the jump stops) against xgrammar's
own matcher, and the engine side through its real step loop on the demo model: outputs satisfy
their constraint, take fewer steps, stream the same ids and text as the final output, respect
max_new_tokens, preemption and the pool."""

from __future__ import annotations

import json
import re

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.grammar import GrammarCompiler
from backend.triton_io import engine_config_overrides
from tests.test_engine_sampling import make_engine as sampling_engine

FORM = r"Answer: (yes|no)\. Confidence: [0-9]{2}%\. Reason: [a-z]{3,12}\."
SCHEMA = {
    "type": "object",
    "properties": {
        "status": {"enum": ["active", "inactive"]},
        "owner": {"type": "object", "properties": {"role": {"enum": ["administrator", "guest"]}},
                  "required": ["role"], "additionalProperties": False},
    },
    "required": ["status", "owner"],
    "additionalProperties": False,
}
T1 = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}


@pytest.fixture(scope="module")
def tokenizer(demo_model_path):
    from backend.tokenizer import load_tokenizer

    return load_tokenizer(demo_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, 4096)
    yield c
    c.shutdown()


def encoder(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def make_engine(path, **kw) -> LLMEngine:
    return sampling_engine(path, **{"num_kv_blocks": 256, "enable_jump_forward": True, **kw})


@pytest.fixture(scope="module")
def engine(demo_model_path):
    eng = make_engine(demo_model_path)
    yield eng
    eng.shutdown()


@pytest.fixture(autouse=True)
def _pool_free(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        assert eng.sampler.token_counts.num_tracked == 0


# ------------------------------------------------------------------------------------ grammar
def test_forced_text_is_taken_but_its_last_token(compiler, tokenizer):
    state = compiler.matcher(compiler.compile("regex", FORM))
    forced = state.jump_forward_string()
    assert forced == "Answer: "
    encode = encoder(tokenizer)
    taken = state.jump_forward(encode, limit=100)
    assert taken == encode(forced)[:-1] and taken
    assert state.num_accepted == len(taken)
    # The matcher is exactly past the taken tokens: what is still forced is the rest.
    assert tokenizer.decode(taken) + state.jump_forward_string() == forced


def test_jump_respects_limit_stop_tokens_and_refusals(compiler, tokenizer):
    encode = encoder(tokenizer)
    full = encode("Answer: ")[:-1]
    assert len(full) >= 2

    state = compiler.matcher(compiler.compile("regex", FORM))
    assert state.jump_forward(encode, limit=1) == full[:1]
    assert state.jump_forward(encode, limit=0) == []

    state = compiler.matcher(compiler.compile("regex", FORM))
    assert state.jump_forward(encode, limit=100, stop_before={full[1]}) == full[:1]

    # Tokens the matcher refuses (here: another text than the forced one) end the jump at once,
    # and leave the matcher where it was.
    state = compiler.matcher(compiler.compile("regex", FORM))
    assert state.jump_forward(lambda text: encode("Question: "), limit=100) == []
    assert state.num_accepted == 0 and state.jump_forward_string() == "Answer: "


def test_nothing_is_forced_where_the_model_has_a_choice(compiler, tokenizer):
    state = compiler.matcher(compiler.compile("regex", r"[a-z]{1,4}(yes|no)"))
    assert state.jump_forward_string() == ""
    assert state.jump_forward(encoder(tokenizer), limit=100) == []


def test_forced_bytes_inside_a_character_force_nothing(compiler, tokenizer):
    # "ã" is two bytes; a byte-level token holding only the first leaves its second byte (not
    # text on its own) as what is forced next.
    state = compiler.matcher(compiler.compile("regex", "não sei"))
    first_byte = tokenizer.convert_tokens_to_ids("Ã")  # the byte-level alphabet's 0xC3
    assert state.accept(tokenizer.convert_tokens_to_ids("n")) and state.accept(first_byte)
    assert state.jump_forward_string() == ""
    assert state.jump_forward(encoder(tokenizer), limit=100) == []
    assert state.accept(tokenizer.convert_tokens_to_ids("£"))  # 0xA3: the rest of "ã"
    assert state.jump_forward_string() == "o sei"


BRACE = r'( \{|\[)"status": "(yes|no)"'


def _id(tokenizer, text: str) -> int:
    [token] = tokenizer.encode(text, add_special_tokens=False)
    return token


def test_sampled_token_is_respelled_where_the_forced_text_merges_with_it(compiler, tokenizer):
    encode = encoder(tokenizer)
    assert encode(' {"status') == [_id(tokenizer, ' {"'), _id(tokenizer, "status")]  # the merge tested
    state = compiler.matcher(compiler.compile("regex", BRACE))
    brace = _id(tokenizer, " {")
    assert state.accept(brace)
    assert state.jump_forward_string() == '"status": "'
    tokens = state.jump_forward_from(brace, encode, tokenizer.decode, limit=100)
    # ' {' + '"status": "' in context, less its last token; ' {"' stands for the sampled ' {'.
    assert tokens == encode(' {"status": "')[:-1] and tokens[0] == _id(tokenizer, ' {"')
    assert state.num_accepted == len(tokens)
    assert tokenizer.decode(tokens) + state.jump_forward_string() == ' {"status": "'


def test_a_sampled_token_that_does_not_merge_is_kept(compiler, tokenizer):
    encode = encoder(tokenizer)
    state = compiler.matcher(compiler.compile("regex", FORM))
    for token in encode("Answer: yes"):
        assert state.accept(token)
    last = encode("Answer: yes")[-1]
    tokens = state.jump_forward_from(last, encode, tokenizer.decode, limit=100)
    assert tokens[0] == last and len(tokens) > 2
    assert tokenizer.decode(tokens) + state.jump_forward_string() == tokenizer.decode([last]) + ". Confidence: "
    assert state.num_accepted == len(encode("Answer: yes")) + len(tokens) - 1
    # The limit counts forced tokens only; the sampled token (or its respelling) is always first.
    state = compiler.matcher(compiler.compile("regex", BRACE))
    assert state.accept(_id(tokenizer, " {"))
    assert state.jump_forward_from(_id(tokenizer, " {"), encode, tokenizer.decode, limit=0) == [_id(tokenizer, " {")]
    assert state.jump_forward_from(_id(tokenizer, " {"), encode, tokenizer.decode, limit=1) == [
        _id(tokenizer, ' {"'), _id(tokenizer, "status")]


def test_a_refused_respelling_leaves_the_sampled_token(compiler, tokenizer):
    # A respelling that covers the sampled text but that the grammar refuses (here: a token of
    # other text, presented as if it spelled ' {"'): the rollback is undone.
    encode = encoder(tokenizer)
    state = compiler.matcher(compiler.compile("regex", BRACE))
    brace, other = _id(tokenizer, " {"), _id(tokenizer, "yes")
    assert state.accept(brace)

    def fake_encode(text: str) -> list[int]:
        return [other, *encode(text)[1:]] if text.startswith(" {") else encode(text)

    def fake_decode(ids: list[int]) -> str:
        return ' {"' if ids == [other] else tokenizer.decode(ids)

    tokens = state.jump_forward_from(brace, fake_encode, fake_decode, limit=100)
    assert tokens[0] == brace and state.num_accepted == len(tokens)
    assert tokenizer.decode(tokens) + state.jump_forward_string() == ' {"status": "'


def test_config_flag_is_off_by_default_and_parsed():
    assert EngineConfig(model_path="x", device="cpu").enable_jump_forward is False
    assert engine_config_overrides({"enable_jump_forward": "true"}, {}) == {"enable_jump_forward": True}
    assert engine_config_overrides({}, {"LLM_ENABLE_JUMP_FORWARD": "0"}) == {"enable_jump_forward": False}


# ------------------------------------------------------------------------------------- engine
def _prompts(engine, n: int) -> list[list[int]]:
    return [engine.tokenizer(f"Request {i}: answer in the form.").input_ids for i in range(n)]


def test_forced_tokens_save_steps_and_outputs_satisfy_the_constraint(demo_model_path, engine):
    params = [engine.parse_params({**T1, "seed": i, "max_new_tokens": 200, "regex": FORM}) for i in range(6)]
    before = engine.stats()
    outs = engine.generate(_prompts(engine, 6), params)
    after = engine.stats()
    forced = after.jump_forward_tokens_total - before.jump_forward_tokens_total
    generated = sum(o.completion_tokens for o in outs)
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(FORM, o.text), o.text
    assert forced >= 6 * 10  # "Answer: ", ". Confidence: ", "%. Reason: " less their last tokens
    assert after.generation_tokens_total - before.generation_tokens_total == generated
    # All six run in one batch: it takes as many steps as the longest output, less its jumps.
    assert after.num_steps - before.num_steps < max(o.completion_tokens for o in outs) - 8

    plain = make_engine(demo_model_path, enable_jump_forward=False)
    try:
        before = plain.stats()
        plain_outs = plain.generate(_prompts(plain, 6), params)
        assert plain.stats().jump_forward_tokens_total == 0
        assert all(re.fullmatch(FORM, o.text) for o in plain_outs)
        assert plain.stats().num_steps - before.num_steps >= max(o.completion_tokens for o in plain_outs)
    finally:
        plain.shutdown()


@pytest.mark.parametrize("jump", [True, False], ids=["jump_forward", "plain"])
def test_a_grammar_ends_on_its_eos_alike_with_ignore_eos(demo_model_path, engine, jump):
    eng = engine if jump else make_engine(demo_model_path, enable_jump_forward=False)
    try:
        raw = {"temperature": 0, "max_new_tokens": 64, "regex": r"(yes|no)-[0-9]{3}"}
        prompts = _prompts(eng, 2)
        plain = eng.generate(prompts, eng.parse_params(raw))
        ignoring = eng.generate(prompts, eng.parse_params({**raw, "ignore_eos": True}))
        for a, b in zip(plain, ignoring):
            assert a.new_token_ids == b.new_token_ids and a.new_token_ids[-1] in eng.eos_ids
            # matched_eos: the tokenizer's EOS, not generation_config.json's others (vLLM's stop_reason)
            model_eos = a.new_token_ids[-1] == eng.tokenizer.eos_token_id
            assert (b.finish_reason, b.stop_reason, b.matched_eos, b.text) == ("stop", a.new_token_ids[-1], model_eos,
                                                                               a.text)
            assert re.fullmatch(r"(yes|no)-[0-9]{3}", b.text)
    finally:
        if not jump:
            eng.shutdown()


def test_json_schema_with_jump_forward_validates(engine):
    params = [engine.parse_params({**T1, "seed": i, "max_new_tokens": 400, "json_schema": json.dumps(SCHEMA)})
              for i in range(4)]
    before = engine.stats().jump_forward_tokens_total
    for o in engine.generate(_prompts(engine, 4), params):
        assert o.finish_reason == "stop", o.text
        doc = json.loads(o.text)
        assert doc["status"] in ("active", "inactive") and doc["owner"] == {"role": doc["owner"]["role"]}
        assert doc["owner"]["role"] in ("administrator", "guest")
    assert engine.stats().jump_forward_tokens_total > before


def test_streamed_chunks_carry_every_forced_token_and_the_final_text(engine):
    chunks = []
    done = []
    params = engine.parse_params({**T1, "seed": 7, "max_new_tokens": 200, "regex": FORM})
    engine.add_request(_prompts(engine, 1)[0], params, lambda out: (chunks.append(out), out.finished and done.append(out)))
    while not done:
        engine.step()
    ids = [t for c in chunks for t in c.new_token_ids]
    text = "".join(c.text for c in chunks)
    assert re.fullmatch(FORM, text)
    assert len(ids) == chunks[-1].completion_tokens
    assert engine.tokenizer.decode(ids, skip_special_tokens=True) == text  # the EOS that ended it is in ids
    assert any(len(c.new_token_ids) > 1 for c in chunks)  # a sampled token and its forced ones together


def test_engine_respells_sampled_tokens_and_counts_them(engine):
    params = [engine.parse_params({**T1, "seed": i, "max_new_tokens": 40, "regex": BRACE + r"\}"}) for i in range(6)]
    before = engine.stats()
    outs = engine.generate(_prompts(engine, 6), params)
    respelled = engine.stats().jump_forward_respelled_total - before.jump_forward_respelled_total
    merged = _id(engine.tokenizer, ' {"')
    for o in outs:
        assert re.fullmatch(BRACE + r"\}", o.text), o.text
        assert engine.tokenizer.decode(o.new_token_ids, skip_special_tokens=True) == o.text
        if o.text.startswith(" {"):
            # However the model began (' {' or ' ' then '{'), the forced '"' joined it.
            assert merged in o.new_token_ids, o.new_token_ids
    assert respelled >= sum(o.text.startswith(" {") for o in outs) > 0


def test_max_new_tokens_caps_the_jump(engine):
    params = engine.parse_params({**T1, "seed": 1, "max_new_tokens": 3, "regex": FORM})
    [out] = engine.generate(_prompts(engine, 1), params)
    assert out.finish_reason == "length" and out.completion_tokens == 3
    assert "Answer: ".startswith(out.text)


def test_no_jump_with_logprobs_or_stop_strings(engine):
    before = engine.stats().jump_forward_tokens_total
    lp = engine.parse_params({**T1, "seed": 2, "max_new_tokens": 200, "regex": FORM, "return_logprob": True})
    stop = engine.parse_params({**T1, "seed": 3, "max_new_tokens": 200, "regex": FORM, "stop": ["Reason"]})
    out_lp, out_stop = engine.generate(_prompts(engine, 2), [lp, stop])
    assert engine.stats().jump_forward_tokens_total == before
    assert len(out_lp.logprobs["output_token_logprobs"]) == out_lp.completion_tokens
    assert out_stop.text.endswith("%. ") and out_stop.stop_reason == "Reason"


def test_preemption_recomputes_forced_tokens(demo_model_path):
    # 8 sequences of ~40 tokens need more than 12 blocks of 8 at once: some are preempted and
    # recomputed from their tokens, forced ones included.
    eng = make_engine(demo_model_path, num_kv_blocks=12, block_size=8, max_model_len=96)
    try:
        params = [eng.parse_params({**T1, "seed": i, "max_new_tokens": None, "regex": FORM}) for i in range(8)]
        outs = eng.generate(_prompts(eng, 8), params)
        assert eng.stats().num_preemptions > 0
        assert eng.stats().jump_forward_tokens_total > 0
        for o in outs:
            assert re.fullmatch(FORM, o.text), o.text
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_a_finished_compile_wakes_the_idle_loop(engine, monkeypatch):
    # An idle step loop sleeps until woken, up to half a second. A request that waits for its
    # grammar is not in the batch, so only the compile's end can wake the loop: without that
    # every new grammar added the sleep to its time to first token.
    from concurrent.futures import Future

    from backend.grammar import GrammarError

    pending: Future = Future()
    engine._submit_grammar(engine.parse_params({"regex": "a"})).result()  # the compiler exists
    monkeypatch.setattr(engine._grammar_compiler, "submit", lambda kind, spec: pending)
    outs = []
    engine.add_request(_prompts(engine, 1)[0], engine.parse_params({"max_new_tokens": 4, "regex": FORM}),
                       outs.append)
    engine.step()  # takes the request in; it waits for its grammar, off the batch
    assert not engine.scheduler.has_work()
    engine._wakeup.clear()
    pending.set_exception(GrammarError("the compile failed"))
    assert engine._wakeup.is_set()
    engine.step()
    assert outs and outs[-1].finished and "the compile failed" in (outs[-1].error or "")

"""backend/grammar.py: xgrammar compile (cache, timeout, errors) and per-sequence matchers.

Matchers are driven by random walks: at each step the bitmask says which tokens are allowed, one
of them is drawn at random (the stop token is preferred a little once the grammar may end, so
walks finish), and at the end the decoded text must satisfy the constraint (json.loads +
jsonschema, re.fullmatch, a parser for the EBNF).
"""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import pytest
import torch

import kernels
from backend.grammar import GrammarCompiler, GrammarError, GrammarState, allocate_bitmask

VOCAB = 4096

# Nested objects, arrays, enums, required fields, string patterns; bounded so walks end.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "verified": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "role": {"type": "string", "enum": ["admin", "user", "guest"]},
                "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
            },
            "required": ["name", "role"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 4,
        },
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 3},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["id", "status", "owner", "tags"],
    "additionalProperties": False,
}

REGEX = r"[A-Z]{2}-\d{3}(-(alpha|beta|rc[0-9]))?( [a-z]{1,6}){0,3}"

# Arithmetic over small integers, recursive; checked by the parser below.
EXPR_EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor ("*" factor){0,2}
factor ::= [0-9]{1,3} | "(" expr ")"
"""


def parse_expr(text: str) -> bool:
    """Recursive-descent recogniser of EXPR_EBNF's language."""
    pos = 0

    def number() -> bool:
        nonlocal pos
        m = re.match(r"[0-9]{1,3}", text[pos:])
        if not m:
            return False
        pos += m.end()
        return True

    def factor() -> bool:
        nonlocal pos
        if text[pos : pos + 1] == "(":
            pos += 1
            if not expr() or text[pos : pos + 1] != ")":
                return False
            pos += 1
            return True
        return number()

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        for _ in range(2):
            if pos >= len(text) or text[pos] != "*":
                break
            pos += 1
            if not factor():
                return False
        return True

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        for _ in range(3):
            if pos >= len(text) or text[pos] not in "+-":
                break
            pos += 1
            if not term():
                return False
        return True

    return expr() and pos == len(text)


@pytest.fixture(scope="module")
def tokenizer(demo_model_path):
    from backend.tokenizer import load_tokenizer

    return load_tokenizer(demo_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    gc = GrammarCompiler(tokenizer, VOCAB)
    yield gc
    gc.shutdown()


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int = VOCAB) -> list[int]:
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(1) >> torch.arange(32)) & 1
    return [t for t in bits.flatten().nonzero().flatten().tolist() if t < vocab]


def walk(state: GrammarState, stop_ids: list[int], rng: random.Random, max_steps: int = 600, p_stop: float = 0.3,
         vocab: int = VOCAB) -> list[int]:
    """Draw allowed tokens until the matcher terminates; returns the ids before the stop token."""
    out: list[int] = []
    bitmask = allocate_bitmask(1, vocab)
    for _ in range(max_steps):
        bitmask.fill_(0)
        state.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask, 0, vocab)
        assert allowed, "the grammar allows no token"
        stops = [t for t in allowed if t in stop_ids]
        if stops and (len(stops) == len(allowed) or rng.random() < p_stop):
            token = rng.choice(stops)
        else:
            token = rng.choice([t for t in allowed if t not in stop_ids])
        assert state.accept(token)
        if state.is_terminated:
            assert token in stop_ids
            return out
        out.append(token)
    raise AssertionError(f"no termination after {max_steps} steps")


def feed(state: GrammarState, tokenizer, text: str) -> bool:
    return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_allocate_bitmask():
    b = allocate_bitmask(3, 4097)
    assert b.shape == (3, 129) and b.dtype == torch.int32 and b.device.type == "cpu"
    assert bool((b == -1).all())


def test_stop_tokens_are_the_models_eos(compiler, tokenizer):
    # tokenizer eos (<|im_end|>) and generation_config.json's eos_token_id list
    assert tokenizer.eos_token_id in compiler.stop_token_ids
    assert set(compiler.stop_token_ids) == {4091, 4093}


def test_json_schema_walks_validate(compiler, tokenizer):
    compiled = compiler.submit("json_schema", json.dumps(SCHEMA)).result(timeout=30)
    rng = random.Random(0)
    lengths = []
    for _ in range(25):
        ids = walk(compiler.matcher(compiled), compiler.stop_token_ids, rng)
        text = tokenizer.decode(ids)
        jsonschema.validate(json.loads(text), SCHEMA)
        lengths.append(len(ids))
    assert max(lengths) < 400


def test_json_object_allows_any_members(compiler, tokenizer):
    """OpenAI json_object = '{"type": "object"}': arbitrary members, nested values too."""
    compiled = compiler.submit("json_schema", '{"type": "object"}').result(timeout=30)
    state = compiler.matcher(compiled)
    assert feed(state, tokenizer, '{"a": [1, {"b": null}], "c": "x", "d": {"e": true}}')
    assert state.is_completed and not state.is_terminated
    assert state.accept(tokenizer.eos_token_id) and state.is_terminated
    # not an object: refused at the first token
    state = compiler.matcher(compiled)
    assert not state.accept(tokenizer.encode("[", add_special_tokens=False)[0])


def test_length_bounded_strings_are_valid_json(compiler, tokenizer):
    """xgrammar 0.2.8 lets raw control characters into minLength/maxLength strings (xgrammar#800);
    the compiler rewrites the bounds into a JSON-string-aware pattern."""
    spec = json.dumps({"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
                       "required": ["s"], "additionalProperties": False})
    compiled = compiler.submit("json_schema", spec).result(timeout=30)
    state = compiler.matcher(compiled)
    assert feed(state, tokenizer, '{"s": "a')
    assert not state.accept(tokenizer.encode("\x01", add_special_tokens=False)[0])
    assert not feed(compiler.matcher(compiled), tokenizer, '{"s": "a"')  # minLength
    assert not feed(compiler.matcher(compiled), tokenizer, '{"s": "abcde')  # maxLength
    assert feed(compiler.matcher(compiled), tokenizer, '{"s": "é漢字x"}')  # code points, not bytes
    rng = random.Random(7)
    for _ in range(10):
        value = json.loads(tokenizer.decode(walk(compiler.matcher(compiled), compiler.stop_token_ids, rng)))
        assert 2 <= len(value["s"]) <= 4


def test_constrained_text_stays_well_formed_utf8(compiler, tokenizer):
    """In a length-bounded JSON string (the pattern maxLength is rewritten into) xgrammar 0.2.8
    takes overlong UTF-8 (E0 9A 94 for U+0694); the guard keeps such bytes out, here right after
    a token holding only the lead byte E0."""
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for b, c in _byte_chars().items()}
    spec = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    compiled = compiler.compile("json_schema", json.dumps(spec))
    state = compiler.matcher(compiled)
    prefix = tokenizer.encode('{"s": "', add_special_tokens=False)
    assert feed(state, tokenizer, '{"s": "') and state.accept(byte_token[0xE0])
    mask = allocate_bitmask(1, VOCAB)
    state.fill_bitmask(mask, 0)
    allowed = set(allowed_ids(mask, 0))
    assert byte_token[0xA4] in allowed and byte_token[0x9A] not in allowed and byte_token[0x80] not in allowed

    raw = compiler._xgr.GrammarMatcher(compiled)  # what xgrammar alone allows there
    assert all(raw.accept_token(t) for t in prefix + [byte_token[0xE0]])
    raw_mask = allocate_bitmask(1, VOCAB)
    raw.fill_next_token_bitmask(raw_mask, 0)
    assert byte_token[0x9A] in allowed_ids(raw_mask, 0)

    # Random walks over the whole vocabulary always decode cleanly, and keep to maxLength.
    rng = random.Random(3)
    for _ in range(30):
        ids = walk(compiler.matcher(compiled), compiler.stop_token_ids, rng)
        text = b"".join(compiler.utf8_guard.token_bytes[t] for t in ids).decode("utf-8")  # raises if ill-formed
        assert len(json.loads(text)["s"]) <= 5


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character each byte is written as in the vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def test_declared_properties_are_strict(compiler, tokenizer):
    spec = json.dumps({"type": "object", "properties": {"x": {"type": "integer"}}})
    state = compiler.matcher(compiler.submit("json_schema", spec).result(timeout=30))
    assert feed(state, tokenizer, '{"x": 1')
    assert not feed(state, tokenizer, ', "y"')  # no invented keys


def test_eos_only_where_the_grammar_can_end(compiler, tokenizer):
    state = compiler.matcher(compiler.submit("regex", "ab+").result(timeout=30))
    bm = allocate_bitmask(2, VOCAB)
    bm.fill_(0)
    state.fill_bitmask(bm, 1)
    assert bool((bm[0] == 0).all())  # other rows untouched
    eos = tokenizer.eos_token_id
    assert eos not in allowed_ids(bm, 1)
    assert not state.accept(eos) and not state.is_terminated
    assert feed(state, tokenizer, "ab")
    bm.fill_(0)
    state.fill_bitmask(bm, 0)
    assert set(compiler.stop_token_ids) <= set(allowed_ids(bm, 0))
    assert not state.accept(tokenizer.encode("c", add_special_tokens=False)[0])  # rejected, no change
    assert state.accept(eos) and state.is_terminated
    assert not state.accept(eos)  # nothing after termination
    # complete and unable to continue: only the stop tokens are left
    state = compiler.matcher(compiler.submit("regex", "ab").result(timeout=30))
    assert feed(state, tokenizer, "ab")
    bm = allocate_bitmask(1, VOCAB)
    state.fill_bitmask(bm, 0)
    assert allowed_ids(bm, 0) == compiler.stop_token_ids


def test_special_and_padding_ids_never_allowed(tokenizer):
    """A model vocabulary larger than the tokenizer's: the extra ids are never allowed."""
    vocab = VOCAB + 64
    gc = GrammarCompiler(tokenizer, vocab)
    try:
        state = gc.matcher(gc.submit("json_schema", json.dumps(SCHEMA)).result(timeout=30))
        bm = allocate_bitmask(1, vocab)
        state.fill_bitmask(bm, 0)
        allowed = allowed_ids(bm, 0, vocab)
        assert allowed and max(allowed) < VOCAB
        assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in allowed
        ids = walk(state, gc.stop_token_ids, random.Random(1), vocab=vocab)
        jsonschema.validate(json.loads(tokenizer.decode(ids)), SCHEMA)
        with pytest.raises(ValueError, match="words per row"):
            state.fill_bitmask(allocate_bitmask(1, VOCAB), 0)
    finally:
        gc.shutdown()


def test_regex_walks_fullmatch(compiler, tokenizer):
    compiled = compiler.submit("regex", REGEX).result(timeout=30)
    rng = random.Random(2)
    for _ in range(25):
        text = tokenizer.decode(walk(compiler.matcher(compiled), compiler.stop_token_ids, rng))
        assert re.fullmatch(REGEX, text), text


def test_ebnf_walks_parse(compiler, tokenizer):
    compiled = compiler.submit("ebnf", EXPR_EBNF).result(timeout=30)
    rng = random.Random(3)
    texts = set()
    for _ in range(25):
        text = tokenizer.decode(walk(compiler.matcher(compiled), compiler.stop_token_ids, rng))
        assert parse_expr(text), text
        texts.add(text)
    assert len(texts) > 5
    assert not parse_expr("1+") and not parse_expr("(1") and parse_expr("(1+2)*3")


def test_guided_choice_grammar(compiler, tokenizer):
    from backend.sampling_params import parse_sampling_params

    choices = ["yes", "no", "maybe so", "ça va"]
    kind, spec = parse_sampling_params({"guided_choice": choices}).constraint
    compiled = compiler.submit(kind, spec).result(timeout=30)
    rng = random.Random(4)
    seen = set()
    for _ in range(20):
        text = tokenizer.decode(walk(compiler.matcher(compiled), compiler.stop_token_ids, rng))
        assert text in choices
        seen.add(text)
    assert len(seen) >= 2


def test_structural_tag_new_format(compiler, tokenizer):
    inner = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["city", "days"], "additionalProperties": False}
    spec = json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": inner}, "end": "</answer>"}})
    compiled = compiler.submit("structural_tag", spec).result(timeout=30)
    rng = random.Random(5)
    for _ in range(10):
        text = tokenizer.decode(walk(compiler.matcher(compiled), compiler.stop_token_ids, rng))
        m = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)
        assert m, text
        jsonschema.validate(json.loads(m.group(1)), inner)
    # JSON inside a tag has the same whitespace bound as a json_schema constraint
    assert feed(compiler.matcher(compiled), tokenizer, "<answer>{" + " " * 16 + '"city"')
    assert not feed(compiler.matcher(compiled), tokenizer, "<answer>{" + " " * 17)


def test_strict_llama3_bare_calls_compile_and_hold_in_the_engine(compiler, tokenizer):
    """The strict-auto grammar for Llama 3's bare-object calls (openai_frontend/tools.py) in the
    engine's compiler: a call begun at the start is finished within its schema, and a call cut
    after its name is never completed otherwise."""
    from openai_frontend.protocol import ChatTool
    from openai_frontend.tools import get_parser, parse_as_streamed, plan_tools

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [ChatTool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": schema,
                                                                       "strict": True}})]
    plan = plan_tools(tools, "auto", False, "llama3")
    compiled = compiler.submit(*plan.constraint).result(timeout=30)
    begun = '{"name": "get_weather", "parameters": '
    rng = random.Random(3)
    for _ in range(8):
        state = compiler.matcher(compiled)
        assert feed(state, tokenizer, " " + begun)
        text = " " + begun + tokenizer.decode(walk(state, compiler.stop_token_ids, rng))
        _, calls = parse_as_streamed(get_parser("llama3"), text, plan.tools, False, lambda: "id")
        assert len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), schema)
    assert not feed(compiler.matcher(compiled), tokenizer, begun + '{"city": 5')
    assert not feed(compiler.matcher(compiled), tokenizer, '{"name": "other"')
    assert feed(compiler.matcher(compiled), tokenizer, 'Sunny, I think. {"not": "a call"}')


def test_structural_tag_legacy_format_and_response_format(compiler, tokenizer):
    """SGLang's legacy structures/triggers, as response_format sends it (sampling_params maps it)."""
    from backend.sampling_params import parse_sampling_params

    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"],
              "additionalProperties": False}
    fmt = {"type": "structural_tag", "structures": [{"begin": "<fn=search>", "schema": schema, "end": "</fn>"}],
           "triggers": ["<fn="]}
    kind, spec = parse_sampling_params({"response_format": fmt}).constraint
    assert kind == "structural_tag"
    compiled = compiler.submit(kind, spec).result(timeout=30)
    state = compiler.matcher(compiled)
    assert feed(state, tokenizer, 'Let me look. <fn=search>{"q": "cats"}</fn> done')
    assert state.accept(tokenizer.eos_token_id) and state.is_terminated
    state = compiler.matcher(compiled)
    assert feed(state, tokenizer, "free text <fn=search>")
    assert not feed(state, tokenizer, '{"x": 1}')  # inside the tag the schema rules


def test_after_reasoning_the_legacy_tag_and_a_whitespace_pattern_hold(compiler, tokenizer):
    """The frontend wraps a constraint in a structural tag behind a reasoning section; the legacy
    structures/triggers form and vLLM's whitespace pattern were 400s there."""
    from openai_frontend.reasoning import constrain_after_reasoning, get_reasoning_format

    r1 = get_reasoning_format("deepseek_r1")
    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 5}}, "required": ["q"],
              "additionalProperties": False}
    legacy = {"type": "structural_tag", "structures": [{"begin": "<fn=search>", "schema": schema, "end": "</fn>"}],
              "triggers": ["<fn="]}
    compiled = compiler.submit("structural_tag", constrain_after_reasoning(r1, "structural_tag", legacy)).result(timeout=30)
    state = compiler.matcher(compiled)
    assert feed(state, tokenizer, 'Hmm.</think>\nLet me look. <fn=search>{"q": "cats"}</fn> done')
    assert state.accept(tokenizer.eos_token_id)
    state = compiler.matcher(compiled)
    assert feed(state, tokenizer, "Hmm.</think> <fn=search>") and not feed(state, tokenizer, '{"x": 1}')

    for pattern, good, bad in (("", '{"q":"cats"}', '{"q": "cats"}'), (" ?", '{ "q": "cats" }', '{"q":  "cats"}')):
        spec = constrain_after_reasoning(r1, "json_schema", json.dumps(schema), pattern)
        compiled = compiler.submit("structural_tag", spec).result(timeout=30)
        state = compiler.matcher(compiled)
        assert feed(state, tokenizer, "Think  freely.</think>\n" + good) and state.accept(tokenizer.eos_token_id), pattern
        assert not feed(compiler.matcher(compiled), tokenizer, "Think  freely.</think>\n" + bad), pattern
    bad = constrain_after_reasoning(r1, "json_schema", json.dumps(schema), "\\s*")
    with pytest.raises(GrammarError, match="invalid whitespace_pattern"):
        compiler.submit("structural_tag", bad).result(timeout=30)


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("json_schema", '{"type": "strin"}', r"invalid json_schema: .*strin"),
        ("json_schema", '{"type": "string", "minLength": -1}', r"invalid json_schema: .*-1"),
        ("json_schema", "{not json", r"invalid json_schema: not valid JSON"),
        ("json_schema", "[1, 2]", r"invalid json_schema: a schema must be a JSON object"),
        ("json_schema", '{"$ref": "#/$defs/missing"}', r"invalid json_schema: .*missing"),
        ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}', r"invalid json_schema: .*minimum"),
        ("regex", "(abc", r"invalid regex: .*parenthesis is not closed"),
        ("regex", "[z-a]", r"invalid regex: .*lower bound is larger"),
        ("regex", r"\d+(?=x)", r"invalid regex: .*Lookahead"),
        ("regex", "", r"invalid regex: the pattern is empty"),
        # fuzz QA: seconds a token in the matcher, on the step every request shares
        ("regex", "( *)*x", r"invalid regex: it repeats without bound a part that can match nothing"),
        ("regex", "[a-z]((?: *)+,)*", r"invalid regex: it repeats without bound a part that can match nothing"),
        ("regex", "( ?)*x", r"invalid regex: it repeats without bound a part that can match nothing"),  # review
        ("regex", "(a|)+", r"invalid regex: it repeats without bound a part that can match nothing"),
        ("json_schema", '{"type": "string", "pattern": "^(a*)*$"}',
         r"invalid json_schema: 'pattern' that repeats without bound .* at \$ is not supported"),
        ("ebnf", "root ::= foo", r'invalid ebnf: .*Rule "foo" is not defined'),
        ("ebnf", 'start ::= "a"', r'invalid ebnf: .*root rule'),
        ("ebnf", 'root ::= "a" |', r"invalid ebnf: .*Expect element"),
        ("structural_tag", "{}", r"invalid structural_tag: expected"),
        ("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', r"invalid structural_tag: format"),
        ("structural_tag", '{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<b"]}',
         r"invalid structural_tag: .*starts with none of the triggers"),
        ("structural_tag", '{"structures": [{"begin": "<a>", "schema": {"type": 1}, "end": "</a>"}], "triggers": ["<a"]}',
         r"invalid structural_tag: structures\[0\]\.schema"),
        ("xml", "<a/>", r"unknown constraint kind 'xml'"),
    ],
)
def test_invalid_specs_name_the_problem(compiler, kind, spec, message):
    with pytest.raises(GrammarError, match=message):
        compiler.submit(kind, spec).result(timeout=30)


@pytest.mark.parametrize("pattern", ["( +)*x", r"(\s*,)*x", "[a-z]+(,[a-z]*)*", r"\d{3}-\d{4}"])
def test_unambiguous_repetitions_are_kept(compiler, pattern):
    # Only a repeated part that can match nothing is refused; one that cannot be empty splits a
    # text few ways. Nested past Python's stack, a pattern is left to the matcher's time limit.
    assert compiler.submit("regex", pattern).result(timeout=30) is not None


def test_cache_returns_the_same_compiled_grammar(tokenizer):
    gc = GrammarCompiler(tokenizer, VOCAB, cache_size=2)
    try:
        a = gc.submit("regex", "a+").result(timeout=30)
        assert gc.submit("regex", "a+").result(timeout=30) is a
        assert gc.submit("ebnf", 'root ::= "a"+').result(timeout=30) is not a
        assert gc.stats()["compiles"] == 2 and gc.stats()["cache_hits"] == 1
        gc.submit("regex", "b+").result(timeout=30)  # evicts the least recently used: ("regex", "a+")
        assert gc.submit("regex", "a+").result(timeout=30) is not a
        # failures are not cached: the same bad spec compiles again (and fails again)
        n = gc.stats()["compiles"]
        for _ in range(2):
            with pytest.raises(GrammarError):
                gc.submit("regex", "(").result(timeout=30)
        assert gc.stats()["compiles"] == n + 2
    finally:
        gc.shutdown()


def _slow_schema(n: int = 2000) -> str:
    # Thousands of optional properties: xgrammar needs about a second for this here (time ~ n^2).
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}})


def test_pathological_spec_times_out_and_frees_its_worker(tokenizer):
    gc = GrammarCompiler(tokenizer, VOCAB, max_workers=1, compile_timeout_s=0.15)
    try:
        spec = _slow_schema()
        t0 = time.monotonic()
        slow = gc.submit("json_schema", spec)
        assert time.monotonic() - t0 < 0.1  # submit never blocks (not even on starting a thread)
        with pytest.raises(GrammarError, match=r"json_schema took longer than 0.15 s"):
            slow.result(timeout=10)
        assert time.monotonic() - t0 < 2.0
        # The only worker slot is free again though the abandoned compile still runs.
        assert gc.stats()["abandoned"] == 1 and gc.stats()["timeouts"] == 1
        fast = gc.submit("regex", "[0-9]+").result(timeout=5)
        assert fast is not None
        # A timed-out spec is not cached: a later submit compiles it again.
        assert gc.stats()["cached"] == 1
    finally:
        gc.shutdown(wait_s=60)  # let the abandoned compile finish: it would slow the next tests
    assert gc.stats()["abandoned"] == 0


def test_slow_compile_does_not_hold_the_gil(tokenizer):
    """xgrammar releases the GIL while compiling: a Python loop (the engine's step loop) keeps
    running next to a slow compile."""
    gc = GrammarCompiler(tokenizer, VOCAB, max_workers=1)
    try:
        future = gc.submit("json_schema", _slow_schema(2500))
        worst, last, t0 = 0.0, time.monotonic(), time.monotonic()
        while not future.done() and time.monotonic() - t0 < 30:
            time.sleep(0.001)
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        assert future.result() is not None
        assert worst < 0.5, f"the Python thread stalled for {worst:.2f} s"
    finally:
        gc.shutdown(wait_s=60)


def test_queue_wait_is_bounded_when_abandoned_compiles_pile_up(tokenizer):
    gc = GrammarCompiler(tokenizer, VOCAB, max_workers=1, compile_timeout_s=0.15, max_abandoned=1)
    try:
        slow = [gc.submit("json_schema", _slow_schema(2000 + i)) for i in range(2)]
        # The first runs (then is abandoned: 1 = max abandoned), the second waits for a worker and
        # gives up after compile_timeout_s in the queue.
        for f in slow:
            with pytest.raises(GrammarError, match="took longer than"):
                f.result(timeout=10)
        assert "waited for a free compile worker" in str(slow[1].exception())
    finally:
        gc.shutdown(wait_s=60)


def test_many_concurrent_submits(tokenizer):
    gc = GrammarCompiler(tokenizer, VOCAB, max_workers=2)
    specs = [("regex", f"[a-z]{{{i}}}x") for i in range(1, 9)] + [
        ("json_schema", json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}))
        for i in range(8)
    ]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def client(t: int) -> None:
        try:
            futures = [gc.submit(*specs[(t + j) % len(specs)]) for j in range(len(specs))]
            results[t] = [f.result(timeout=60) for f in futures]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors and len(results) == 8
        # Every thread got the one compiled object per spec.
        for t, got in results.items():
            for j, compiled in enumerate(got):
                assert compiled is results[0][(t + j) % len(specs)]
        assert gc.stats()["compiles"] == len(specs)
        # and each works
        state = gc.matcher(results[0][2])  # "[a-z]{3}x"
        assert feed(state, tokenizer, "abcx") and state.accept(tokenizer.eos_token_id) and state.is_terminated
    finally:
        gc.shutdown()


def test_shutdown_refuses_new_work(tokenizer):
    gc = GrammarCompiler(tokenizer, VOCAB)
    gc.shutdown()
    with pytest.raises(GrammarError, match="shut down"):
        gc.submit("regex", "a").result(timeout=5)


def test_bitmask_through_the_sampling_kernel_keeps_unconstrained_rows(compiler, tokenizer):
    """The engine's use: one constrained row in a batch; the other rows' logits are untouched, the
    constrained row's argmax is a token the grammar allows."""
    state = compiler.matcher(compiler.submit("regex", "[0-9]{4}").result(timeout=30))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    bitmask = allocate_bitmask(3, VOCAB)
    state.fill_bitmask(bitmask, 1)
    row_mask = torch.tensor([False, True, False])
    out = kernels.apply_token_bitmask(logits, bitmask, row_mask, use_triton=False)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    token = int(out[1].argmax())
    assert token in allowed_ids(bitmask, 1)
    assert re.fullmatch(r"[0-9]+", tokenizer.decode([token]))
    assert state.accept(token)


# --------------------------------------------------------------------- whitespace_pattern
def _ws_compiled(compiler, pattern: str, schema=SCHEMA):
    from backend.sampling_params import parse_sampling_params

    kind, spec = parse_sampling_params({"guided_json": schema, "guided_whitespace_pattern": pattern}).constraint
    assert kind == "json_schema_whitespace"
    return compiler.submit(kind, spec).result(timeout=30)


# Whitespace between JSON tokens, outside strings: what a pattern governs.
_TOKEN_GAPS = re.compile(r'"(?:[^"\\]|\\.)*"|(\s+)')


def _gaps(text: str) -> list[str]:
    return [m.group(1) for m in _TOKEN_GAPS.finditer(text) if m.group(1)]


@pytest.mark.parametrize("pattern, gap", [("", None), (" ?", r" "), (r"[\n ]{0,3}", r"[\n ]{1,3}"),
                                          (r"(\n|\t)*", r"[\n\t]+")])
def test_whitespace_pattern_walks_validate(compiler, tokenizer, pattern, gap):
    compiled = _ws_compiled(compiler, pattern)
    rng = random.Random(1)
    seen = set()
    for _ in range(12):
        text = tokenizer.decode(walk(compiler.matcher(compiled), compiler.stop_token_ids, rng, p_stop=0.5))
        jsonschema.validate(json.loads(text), SCHEMA)
        for g in _gaps(text):
            assert gap is not None and re.fullmatch(gap, g), (pattern, text)
            seen.add(g)
    if gap is not None:
        assert seen, "random walks never produced whitespace"


def test_whitespace_pattern_accepts_and_refuses_exact_layouts(compiler, tokenizer):
    compact = _ws_compiled(compiler, "", {"type": "object"})
    state = compiler.matcher(compact)
    assert feed(state, tokenizer, '{"a":[1,{"b":null}],"c":"x y"}') and state.is_completed
    assert not feed(compiler.matcher(compact), tokenizer, '{"a": 1}')
    required = _ws_compiled(compiler, "\n", {"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"]})
    assert feed(compiler.matcher(required), tokenizer, '{\n"a"\n:\n1\n}')
    assert not feed(compiler.matcher(required), tokenizer, '{"a":1}')
    # a property named like a grammar rule stays a property, not a whitespace slot
    named = {"type": "object", "properties": {"whitespace{0, 16}": {"type": "integer"}},
             "required": ["whitespace{0, 16}"]}
    state = compiler.matcher(_ws_compiled(compiler, "", named))
    assert feed(state, tokenizer, '{"whitespace{0, 16}":7}') and state.is_completed


@pytest.mark.parametrize(
    "pattern, message",
    [
        (r"\s*", r"invalid whitespace_pattern: .*not JSON whitespace.*write \[ \\t\\n\\r\]"),
        ("[ x]*", r"invalid whitespace_pattern: it can produce 'x'"),
        ("[^a]*", r"invalid whitespace_pattern: it contains a negated character class"),
        ("( ", r"invalid whitespace_pattern: not a valid regular expression: (?!.*\.cc:)(?!\s*\[)"),  # no C++ log prefix
        (" " * 300, r"whitespace_pattern is longer than 256"),
        ("(( *)*)*", r"invalid whitespace_pattern: it repeats without bound a part that can match nothing"),
    ],
)
def test_whitespace_pattern_errors_name_the_problem(compiler, pattern, message):
    from backend.sampling_params import SamplingParamsError, parse_sampling_params

    try:
        kind, spec = parse_sampling_params({"json_schema": {"type": "object"}, "whitespace_pattern": pattern}).constraint
    except (SamplingParamsError, ValueError) as exc:
        assert re.search(message, str(exc)), exc
        return
    with pytest.raises(GrammarError, match=message):
        compiler.submit(kind, spec).result(timeout=30)


def test_whitespace_pattern_needs_a_json_schema():
    from backend.sampling_params import parse_sampling_params

    with pytest.raises(ValueError, match="whitespace_pattern applies only to a json_schema"):
        parse_sampling_params({"regex": "a+", "guided_whitespace_pattern": ""})
    with pytest.raises(ValueError, match="not both"):
        parse_sampling_params({"json_schema": {}, "guided_whitespace_pattern": "", "whitespace_pattern": ""})


# --------------------------------------------------------------------- reasoning, then the constraint
@pytest.mark.parametrize("parser, opening", [("deepseek_r1", ""), ("qwen3", "<think>")])
def test_constraint_after_free_reasoning(compiler, tokenizer, parser, opening):
    """openai_frontend.reasoning.constrain_after_reasoning: any text (JSON-breaking included) up to
    the closing marker, then the schema."""
    from openai_frontend.reasoning import constrain_after_reasoning, get_reasoning_format

    fmt = get_reasoning_format(parser)
    compiled = compiler.submit("structural_tag", constrain_after_reasoning(fmt, "json_schema", json.dumps(SCHEMA))).result(timeout=60)
    rng = random.Random(7)
    for _ in range(5):
        state = compiler.matcher(compiled)
        thought = opening + "Hmm { not json ]] 思考\n</think>\n\n"
        assert feed(state, tokenizer, thought)
        text = tokenizer.decode(walk(state, compiler.stop_token_ids, rng))
        jsonschema.validate(json.loads(text), SCHEMA)
    # qwen3 may answer without thinking; deepseek_r1 is inside the reasoning until the marker, so
    # the same document is reasoning text there and the output cannot end after it
    doc = '{"id": "AB-123", "status": "active", "owner": {"name": "Ann", "role": "user"}, "tags": ["red"]}'
    jsonschema.validate(json.loads(doc), SCHEMA)
    direct = compiler.matcher(compiled)
    assert feed(direct, tokenizer, doc)
    assert direct.is_completed == (opening == "<think>")

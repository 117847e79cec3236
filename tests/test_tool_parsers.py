"""Tool-call parsers: correctness per format, and streaming == non-streaming for every chunking.

The equivalence property checked everywhere (``assert_stream_matches``):

* feed the text split at every position into 2 chunks, one character at a time, and in seeded
  random chunkings (including empty chunks), then call ``finish()``;
* reassemble: normal text concatenated; per ``tool_index`` the name item (sent first, with
  ``parameters == ""``) and the concatenated argument fragments;
* the result equals ``detect_and_parse`` exactly (normal text included -- the whitespace rule is
  ``join_segments``, tested on its own below), and every ``parameters`` is a JSON object.
"""

from __future__ import annotations

import json
import re
import os
import random
from types import SimpleNamespace

import pytest

from openai_frontend.tool_parsers import (
    TOOL_PARSERS,
    BaseToolParser,
    DeepSeekV3ToolParser,
    Llama3ToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen25ToolParser,
    StreamingParseResult,
    ToolCallItem,
    get_tool_parser,
    join_segments,
)
from openai_frontend.tool_parsers.deepseekv3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, TOOL_SEP
from openai_frontend.tool_parsers.json_stream import JsonCanonicalizer, decode_json, dumps

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search"}},
]
FORMATS = ["qwen25", "llama3", "mistral", "deepseekv3", "pythonic"]

# ------------------------------------------------------------------------------------------------
# harness
# ------------------------------------------------------------------------------------------------


def reassemble(results: list[StreamingParseResult]) -> tuple[str, list[tuple[str, str]]]:
    """Join streamed increments, checking the item protocol on the way."""
    text = "".join(r.normal_text for r in results)
    calls: list[list[str]] = []
    for r in results:
        for item in r.calls:
            assert isinstance(item, ToolCallItem)
            if item.name is not None:  # a new call: indexes are 0, 1, 2... in order
                assert item.tool_index == len(calls), (item, calls)
                assert item.parameters == ""
                calls.append([item.name, ""])
            else:
                assert 0 <= item.tool_index < len(calls), item
                assert item.tool_index == len(calls) - 1, "fragments only for the latest call"
                assert item.parameters, "no empty fragments"
                calls[item.tool_index][1] += item.parameters
    return text, [(n, p) for n, p in calls]


def run_stream(fmt: str, chunks, tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    parser = get_tool_parser(fmt)
    results = [parser.parse_streaming_increment(c, tools) for c in chunks]
    results.append(parser.finish())
    assert parser.finish() == StreamingParseResult()  # idempotent
    return reassemble(results)


def parse_whole(fmt: str, text: str, tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    result = get_tool_parser(fmt).detect_and_parse(text, tools)
    assert [c.tool_index for c in result.calls] == list(range(len(result.calls)))
    return result.normal_text, [(c.name, c.parameters) for c in result.calls]


def chunkings(text: str, seed: int, n_random: int, all_splits: bool = True):
    """Every 2-chunk split, 1 char at a time, whole, and seeded random chunkings."""
    if all_splits:
        for i in range(len(text) + 1):
            yield [text[:i], text[i:]]
    yield list(text)
    yield [text]
    rng = random.Random(seed)
    for _ in range(n_random):
        chunks, i = [], 0
        while i < len(text):
            k = rng.choice([0, 1, 1, 2, 3, 4, 7, 16])
            chunks.append(text[i:i + k])
            i += k
        yield chunks


def assert_stream_matches(fmt: str, text: str, tools=TOOLS, n_random: int = 8, all_splits: bool = True):
    expected = parse_whole(fmt, text, tools)
    for _, params in expected[1]:
        assert isinstance(json.loads(params), dict)
    for chunks in chunkings(text, hash((fmt, text)) & 0xFFFF, n_random, all_splits):
        got = run_stream(fmt, chunks, tools)
        assert got == expected, f"chunks={chunks!r}"
        for (_, streamed), (_, whole) in zip(got[1], expected[1]):
            assert json.loads(streamed) == json.loads(whole)
    return expected


# ------------------------------------------------------------------------------------------------
# corpus: markup builders and texts
# ------------------------------------------------------------------------------------------------


def qwen(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def llama(*calls: tuple[str, str], tag: bool = True) -> str:
    body = "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)
    return ("<|python_tag|>" if tag else "") + body


def mistral(*calls: tuple[str, str]) -> str:
    return "[TOOL_CALLS] [" + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls) + "]"


def deepseek(*calls: tuple[str, str]) -> str:
    body = "\n".join(f"{CALL_BEGIN}function{TOOL_SEP}{n}\n```json\n{a}\n```{CALL_END}" for n, a in calls)
    return CALLS_BEGIN + body + CALLS_END


# Raw (non-canonical) JSON arguments and their canonical serialization.
ARGS = {
    "simple": '{"city": "Paris"}',
    "cjk_emoji": '{"city":"北京","note":"emoji 😀 👨‍👩‍👧 and e\u0301 ok"}',
    "tricky_strings": (
        '{ "q" : "braces {} [] ( ) and \\"quotes\\" and \\\\ backslash ;,", '
        '"tags": "</tool_call> <tool_call> [TOOL_CALLS] <|python_tag|> ' + CALLS_BEGIN + CALL_END + ' ```" }'
    ),
    "nested": '{"nested": {"a": [1, 2.50, -0, 1e5, 10E-2, true, false, null, {"b": []}], "c": {}}, "big": 12345678901234567890}',
    "escapes": '{"esc": "\\u00e9\\n\\t\\ud83d\\ude00 \\u0001 \\/ \\ud800x \\uDBFF\\uDFFF"}',
    "empty": "{}",
    "multiline": '{\n  "multi": "line",\n  "list": [ "a" , "b" ]\n}',
}


def canon(raw: str) -> str:
    # SGLang's json.dumps(ensure_ascii=False), but a lone surrogate stays an escape: UTF-8 has no
    # form for it, and a response holding one failed to encode.
    text = json.dumps(json.loads(raw), ensure_ascii=False)
    return re.sub("[\ud800-\udfff]", lambda m: f"\\u{ord(m.group()):04x}", text)


def w(name: str = "get_weather", args: str = ARGS["simple"]) -> tuple[str, str]:
    return name, args


PLAIN_TEXTS = [
    "",
    "Hello, world!",
    "   ",
    "trailing whitespace  \n",
    "  leading and inner   spaces ",
    "unicode 北京 😀 👨‍👩‍👧 e\u0301 and math a < b > c [1] {x} ; , ```",
    "looks like markup: <tool <|python [TOOL tool_call> {\"name\": 1}",
]

# (format, text, expected normal text, expected [(name, canonical args)])
CASES: list[tuple[str, str, str, list[tuple[str, str]]]] = []


def case(fmt, text, normal, calls):
    CASES.append((fmt, text, normal, calls))


for fmt in FORMATS:
    for t in PLAIN_TEXTS:
        if fmt == "llama3" and t.lstrip().startswith("{"):
            continue
        case(fmt, t, t, [])

# --- qwen25 ---
for key, raw in ARGS.items():
    case("qwen25", qwen("get_weather", raw), "", [("get_weather", canon(raw))])
case("qwen25", "Let me check.\n\n" + qwen(*w()), "Let me check.", [("get_weather", canon(ARGS["simple"]))])
case("qwen25", qwen(*w()) + "\nThe weather is nice.", "The weather is nice.", [("get_weather", canon(ARGS["simple"]))])
case(
    "qwen25",
    "Two calls:\n" + qwen(*w()) + "\n" + qwen("get_time", ARGS["cjk_emoji"]) + "\nand then\n" + qwen("search", "{}") + " end ",
    "Two calls:\nand then\nend ",
    [("get_weather", canon(ARGS["simple"])), ("get_time", canon(ARGS["cjk_emoji"])), ("search", "{}")],
)
case("qwen25", '<tool_call>{"name":"get_time","arguments":{"tz":"UTC"}}</tool_call>', "", [("get_time", '{"tz": "UTC"}')])
case("qwen25", '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call>', "", [("get_time", '{"tz": "UTC"}')])
case("qwen25", '<tool_call>{"name": "get_time", "parameters": {"tz": 1}}</tool_call>', "", [("get_time", '{"tz": 1}')])
case("qwen25", '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', "", [("get_time", '{"tz": "UTC"}')])
case("qwen25", '<tool_call>{"name": "get_time", "arguments": null}</tool_call>', "", [("get_time", "{}")])
case("qwen25", '<tool_call>{"name": "get_time"}</tool_call>', "", [("get_time", "{}")])
case("qwen25", '<tool_call>{"name": "get_time", "arguments": {}, "name": "x", "arguments": {"a": 1}, "extra": [1]}</tool_call>', "",
     [("get_time", "{}")])
# unknown function: dropped, markup consumed
case("qwen25", "A " + qwen("launch_missiles", ARGS["nested"]) + " B " + qwen(*w()), "A B", [("get_weather", canon(ARGS["simple"]))])
# malformed inside a complete block: normal text
bad = '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call>'
case("qwen25", "x " + bad, "x " + bad, [])
case("qwen25", "<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", [])
case("qwen25", '<tool_call>{"name": 5, "arguments": {}}</tool_call>', '<tool_call>{"name": 5, "arguments": {}}</tool_call>', [])
case("qwen25", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', [])
case("qwen25", '<tool_call>{"city": "Paris"}</tool_call>', '<tool_call>{"city": "Paris"}</tool_call>', [])
# NaN is read as Python's json module (so vLLM's and SGLang's parsers) reads it
case("qwen25", '<tool_call>{"name": "get_time", "x": NaN, "arguments": {}}</tool_call>', "", [("get_time", "{}")])
# The output ended inside a call before its name was written (max_tokens, a stop): the markup is
# neither text nor a call (test_cut_call_with_its_name_is_a_call_when_streamed: with the name).
for _cut in ("<tool_call>", "<tool_call>\n", "<tool_call>\n{", '<tool_call>\n{"na', '<tool_call>\n{"name": "get_wea'):
    case("qwen25", "Sure. " + _cut, "Sure.", [])
# a valid call hidden in the garbage is still found
case("qwen25", "<tool_call>oops " + qwen(*w()), "<tool_call>oops", [("get_weather", canon(ARGS["simple"]))])
# missing closing tag at the end is fine; text right after the object ends the block
case("qwen25", '<tool_call>\n{"name": "get_time", "arguments": {}}\n', "", [("get_time", "{}")])
case("qwen25", '<tool_call>{"name": "get_time", "arguments": {}} trailing', "trailing", [("get_time", "{}")])
case("qwen25", "stray </tool_call> tag", "stray </tool_call> tag", [])

# --- llama3 ---
case("llama3", llama(w()), "", [("get_weather", canon(ARGS["simple"]))])
case("llama3", llama(w(), ("get_time", ARGS["tricky_strings"]), ("search", ARGS["escapes"])), "",
     [("get_weather", canon(ARGS["simple"])), ("get_time", canon(ARGS["tricky_strings"])), ("search", canon(ARGS["escapes"]))])
case("llama3", "Sure thing.\n" + llama(w(), ("get_time", ARGS["nested"])), "Sure thing.",
     [("get_weather", canon(ARGS["simple"])), ("get_time", canon(ARGS["nested"]))])
case("llama3", "  \n" + llama(w(), tag=False), "", [("get_weather", canon(ARGS["simple"]))])
# A separator with nothing after it: the output ended before the next call (a cut, not text).
case("llama3", llama(w(), ("get_time", ARGS["multiline"]), tag=False) + " ;", "",
     [("get_weather", canon(ARGS["simple"])), ("get_time", canon(ARGS["multiline"]))])
# The output cut inside the markup after a complete call (max_tokens): the fragment is neither
# the call's nor text, so it is dropped; so is a next call cut before its name; a call malformed
# before it could stream stays text (see _BAD_CONTINUATION).
for _cut in ("\n</tool_", "\n</", "\n<", "\n", "</tool_call"):
    case("qwen25", qwen(*w())[: -len("\n</tool_call>")] + _cut, "", [("get_weather", canon(ARGS["simple"]))])
case("qwen25", qwen(*w()) + "\n<tool_call>\n", "", [("get_weather", canon(ARGS["simple"]))])
case("qwen25", qwen(*w()) + ' <tool_call>\n{"name": "get_ti', "", [("get_weather", canon(ARGS["simple"]))])
case("llama3", llama(w(), tag=False) + '; {"name": "get_ti', "", [("get_weather", canon(ARGS["simple"]))])
# llama3's bare object: JSON text cut short is text, unless a name made it a call.
case("llama3", '{"answer": [1, 2', '{"answer": [1, 2', [])
case("llama3", '<|python_tag|>{"answer": [1, 2', "", [])
for _cut in (", ", ",", " "):
    case("mistral", mistral(w())[:-1] + _cut, "", [("get_weather", canon(ARGS["simple"]))])
for _cut in ("\n```", "\n``", CALL_END[:3], "\n" + CALL_BEGIN[:2], CALLS_END[:4]):
    case("deepseekv3", deepseek(w())[: -len("\n```" + CALL_END + CALLS_END)] + _cut, "",
         [("get_weather", canon(ARGS["simple"]))])
case("llama3", '{"name": "get_time", "arguments": {"a": 1}} Done.', "Done.", [("get_time", '{"a": 1}')])
case("llama3", 'Text first {"name": "get_time", "parameters": {}}', 'Text first {"name": "get_time", "parameters": {}}', [])
case("llama3", '{"result": 42, "ok": true}', '{"result": 42, "ok": true}', [])
case("llama3", '{"name": "get_time", "parameters" {"a": 1}}', '{"name": "get_time", "parameters" {"a": 1}}', [])
case("llama3", llama(w()) + '; {"name": "get_time", "parameters": oops', '; {"name": "get_time", "parameters": oops',
     [("get_weather", canon(ARGS["simple"]))])
case("llama3", llama(w(), ("nope", "{}"), ("get_time", "{}")), "", [("get_weather", canon(ARGS["simple"])), ("get_time", "{}")])
case("llama3", "<|python_tag|>print('hi')", "<|python_tag|>print('hi')", [])

# --- mistral ---
case("mistral", mistral(w()), "", [("get_weather", canon(ARGS["simple"]))])
case("mistral", "Calling.\n" + mistral(w(), ("get_time", ARGS["cjk_emoji"])) + "\n\nDone!", "Calling.\nDone!",
     [("get_weather", canon(ARGS["simple"])), ("get_time", canon(ARGS["cjk_emoji"]))])
case("mistral", mistral(("get_time", ARGS["tricky_strings"]), ("search", ARGS["multiline"])), "",
     [("get_time", canon(ARGS["tricky_strings"])), ("search", canon(ARGS["multiline"]))])
case("mistral", '[TOOL_CALLS][{"name":"get_time","arguments":{}},{"arguments":{"q":1},"name":"search"}]', "",
     [("get_time", "{}"), ("search", '{"q": 1}')])
case("mistral", "x [TOOL_CALLS] [] y", "x y", [])
case("mistral", "[TOOL_CALLS] nope", "[TOOL_CALLS] nope", [])
case("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, 42]', ", 42]", [("get_time", "{}")])
case("mistral", mistral(("unknown", "{}"), w()), "", [("get_weather", canon(ARGS["simple"]))])
case("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}', "", [("get_time", "{}")])

# --- deepseekv3 ---
case("deepseekv3", deepseek(w()), "", [("get_weather", canon(ARGS["simple"]))])
case("deepseekv3", "思考中…\n" + deepseek(w(), ("get_time", ARGS["escapes"]), ("search", ARGS["tricky_strings"])) + "\n",
     "思考中…", [("get_weather", canon(ARGS["simple"])), ("get_time", canon(ARGS["escapes"])), ("search", canon(ARGS["tricky_strings"]))])
case("deepseekv3", deepseek(("get_time", ARGS["nested"]), ("unknown_fn", "{}")) + " after", "after",
     [("get_time", canon(ARGS["nested"]))])
case("deepseekv3", CALLS_BEGIN + "garbage" + CALLS_END, CALLS_BEGIN + "garbage" + CALLS_END, [])
case("deepseekv3", f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n[1]\n```{CALL_END}{CALLS_END}",
     f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n[1]\n```{CALL_END}{CALLS_END}", [])
case("deepseekv3", f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n{{}}", "", [("get_time", "{}")])

# --- pythonic ---
case("pythonic", '[get_weather(city="San Francisco", state="CA", unit="celsius")]', "",
     [("get_weather", '{"city": "San Francisco", "state": "CA", "unit": "celsius"}')])
case("pythonic", "[get_weather(city='北京 😀'),\n get_time(tz=None, n=-1.5, flags=[True, False], d={'a': (1, 2)})]", "",
     [("get_weather", '{"city": "北京 😀"}'), ("get_time", '{"tz": null, "n": -1.5, "flags": [true, false], "d": {"a": [1, 2]}}')])
case("pythonic", "Let me look. [search(q=\"a ] tricky ) string ' with \\\" quotes\", n=3)] Done.", "Let me look. Done.",
     [("search", json.dumps({"q": "a ] tricky ) string ' with \" quotes", "n": 3}))])
case("pythonic", "<|python_start|>[get_time(tz='''multi\nline''')]<|python_end|> ok", "ok", [("get_time", '{"tz": "multi\\nline"}')])
case("pythonic", "[get_time(a=true, b=null)]", "", [("get_time", '{"a": true, "b": null}')])
case("pythonic", "[get_time(tz='UTC'  # comment ]\n)]", "", [("get_time", '{"tz": "UTC"}')])
# QA: dropped, where the JSON formats keep such a number (Python's json reads Infinity back)
case("pythonic", "[get_time(x=1e999, y=-1e-999, z=[-2e400])]", "", [("get_time", '{"x": Infinity, "y": -0.0, "z": [-Infinity]}')])
case("pythonic", "See [1] and [docs](url) and [x for x in y] ok", "See [1] and [docs](url) and [x for x in y] ok", [])
case("pythonic", "[get_time(tz=os.system('x'))]", "[get_time(tz=os.system('x'))]", [])
case("pythonic", "[get_time(1)]", "[get_time(1)]", [])
case("pythonic", "[get_time(a=1)] [unknown(b=2)] [get_weather()]", "", [("get_time", '{"a": 1}'), ("get_weather", "{}")])
case("pythonic", "[f(a=[get_time(b=1)]", "[f(a=", [("get_time", '{"b": 1}')])  # unclosed outer, valid inner
case("pythonic", "[f(a=[unknown(b=1)]", "[f(a=", [])
case("pythonic", "x [get_time(b=1)", "x [get_time(b=1)", [])
case("pythonic", "<|python_start|>not a list<|python_end|>", "<|python_start|>not a list<|python_end|>", [])


@pytest.mark.parametrize("fmt,text,normal,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_and_stream_equivalence(fmt, text, normal, calls):
    assert parse_whole(fmt, text) == (normal, calls)
    assert_stream_matches(fmt, text)


# ------------------------------------------------------------------------------------------------
# seeded fuzz: random outputs built from text, valid calls and pre-commit garbage
# ------------------------------------------------------------------------------------------------

_STR_POOL = list("abc xyz09") + ['"', "\\", "/", "{", "}", "[", "]", ",", ":", ";", "'", "\n", "\t", "\x01", "é",
                                   "北", "😀", "\u0301", "\u2028", "<tool_call>", "</tool_call>", "[TOOL_CALLS]",
                                   "<|python_tag|>", CALLS_BEGIN, CALL_END, "```"]


def rand_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 2 or r < 0.45:
        kind = rng.choice(["str", "str", "int", "float", "bool", "null"])
        if kind == "str":
            return "".join(rng.choice(_STR_POOL) for _ in range(rng.randint(0, 6)))
        if kind == "int":
            return rng.choice([0, -1, 7, 10 ** 20, -123456])
        if kind == "float":
            return rng.choice([0.5, -2.25, 1e-7, 3.0, 1.5e300])
        return {"bool": rng.random() < 0.5, "null": None}.get(kind)
    if r < 0.7:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"k%d%s" % (i, rng.choice(["", "é", '"', " "])): rand_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def messy_json(rng: random.Random, v) -> str:
    """Serialize with random whitespace and escape choices (still valid JSON)."""
    ws = lambda: rng.choice(["", "", " ", "\n  ", "\t"])  # noqa: E731
    if isinstance(v, dict):
        items = [f"{ws()}{messy_json(rng, k)}{ws()}:{ws()}{messy_json(rng, x)}{ws()}" for k, x in v.items()]
        return "{" + ",".join(items) + ws() + "}"
    if isinstance(v, list):
        return "[" + ",".join(ws() + messy_json(rng, x) + ws() for x in v) + ws() + "]"
    if isinstance(v, str):
        out = []
        for ch in v:
            r = rng.random()
            if ch == "/" and r < 0.5:
                out.append("\\/")
            elif r < 0.25 or ch in '"\\' or ord(ch) < 0x20:
                s = json.dumps(ch)[1:-1]  # ASCII escape, surrogate pairs for astral chars
                if s == ch:
                    s = "\\u%04X" % ord(ch) if ord(ch) < 0x10000 else json.dumps(ch)[1:-1]
                out.append(s)
            else:
                out.append(ch)
        return '"' + "".join(out) + '"'
    if isinstance(v, float) and rng.random() < 0.3:
        return repr(v).replace("e-0", "E-").replace("e+", "e")
    return json.dumps(v)


_TEXT_POOL = ["Hi", " ", "\n", "  ", "ok.", "北京", "😀", "<", "<tool", "[", "]", "(", ")", "{", "}", ";", ",", "`",
              "<|python", "[TOOL", "<｜tool", "x = [1]", "[f(", "call", "\t"]
_GARBAGE = {
    "qwen25": ["<tool_call>", "<tool_call>{", '<tool_call>{"name": 1}</tool_call>', '<tool_call>{"x": {"name": "get_time"}}',
               '<tool_call>\n{"name": "get_time", "arguments": "bad json"}\n</tool_call>'],
    "llama3": ["<|python_tag|>", "<|python_tag|>{", "<|python_tag|>{]", '<|python_tag|>{"arguments": {}, "name": 3}'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_CALLS] [", "[TOOL_CALLS] [{}", '[TOOL_CALLS] [{"name": null}]', "[TOOL_CALLS] ]"],
    "deepseekv3": [CALLS_BEGIN, CALLS_BEGIN + CALL_BEGIN, f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n[",
                   CALL_END, CALLS_END],
    "pythonic": ["[", "[get_time(", "[get_time(a=b)]", "[get_time(a='x)]", "<|python_start|>", "[get_time(*a)]", "[1, 2]"],
}
_NAMES = ["get_weather", "get_time", "search", "unknown_fn"]


def rand_call_markup(rng: random.Random, fmt: str) -> str:
    n = rng.randint(1, 3)
    calls = []
    for _ in range(n):
        args = {f"a{i}": rand_value(rng) for i in range(rng.randint(0, 3))}
        calls.append((rng.choice(_NAMES), args))
    if fmt == "pythonic":
        body = ", ".join(f"{name}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for name, a in calls)
        return ("<|python_start|>" if rng.random() < 0.3 else "") + "[" + body + "]"
    raw = [(name, messy_json(rng, a)) for name, a in calls]
    if fmt == "qwen25":
        return "\n".join(qwen(name, a) for name, a in raw)
    if fmt == "llama3":
        return llama(*raw)
    if fmt == "mistral":
        return mistral(*raw)
    return deepseek(*raw)


# A region cut short and continued by a call that is malformed before anything of it could stream:
# the region must end after its last good call (the rest is text) in both modes.
_BAD_CONTINUATION = {
    "llama3": ("", ["; {x", '; {"name": null}', ";", '; {"arguments": {"a": 1}, "name": 2}']),
    "mistral": ("]", [", {x", ", 42]", ', {"name": null}]', ","]),
    "deepseekv3": (CALLS_END, [CALL_BEGIN + "x", f"{CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n[1]", "\n" + CALL_BEGIN,
                               f"{CALL_BEGIN}function{TOOL_SEP}unknown_fn\n```json\n{{x"]),
}


def rand_output(rng: random.Random, fmt: str) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.45:
            parts.append("".join(rng.choice(_TEXT_POOL) for _ in range(rng.randint(1, 4))))
        elif r < 0.85:
            markup = rand_call_markup(rng, fmt)
            if fmt in _BAD_CONTINUATION and rng.random() < 0.3:
                closing, tails = _BAD_CONTINUATION[fmt]
                markup = markup[: len(markup) - len(closing)] + rng.choice(tails)
            parts.append(markup)
        else:
            parts.append(rng.choice(_GARBAGE[fmt]))
    return "".join(parts)


# TOOL_PARSER_FUZZ=2000 pytest ... for a deeper (slower) run
FUZZ_N = int(os.environ.get("TOOL_PARSER_FUZZ", "100"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fuzz_stream_equals_whole(fmt):
    rng = random.Random(f"fuzz-{fmt}")
    n_calls = 0
    for _ in range(FUZZ_N):
        text = rand_output(rng, fmt)
        expected = assert_stream_matches(fmt, text, n_random=4, all_splits=len(text) < 300)
        n_calls += len(expected[1])
    assert n_calls > FUZZ_N // 3  # the corpus really exercises calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_fuzz_valid_calls_are_found(fmt):
    """Generated calls come back with exactly the generated arguments (unknown names dropped)."""
    rng = random.Random(f"calls-{fmt}")
    for _ in range(60):
        args = {f"a{i}": rand_value(rng) for i in range(rng.randint(0, 4))}
        if fmt == "pythonic":
            text = "[get_time(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")]"
        else:
            raw = messy_json(rng, args)
            text = {"qwen25": lambda: qwen("get_time", raw), "llama3": lambda: llama(("get_time", raw)),
                    "mistral": lambda: mistral(("get_time", raw)), "deepseekv3": lambda: deepseek(("get_time", raw))}[fmt]()
        normal, calls = parse_whole(fmt, "Before. " + text + " After.")
        assert normal == "Before. After."
        assert calls == [("get_time", json.dumps(args, ensure_ascii=False))]


# ------------------------------------------------------------------------------------------------
# JSON canonicalizer == json.dumps(json.loads(...)), and it rejects exactly what json rejects
# ------------------------------------------------------------------------------------------------


def canon_stream(raw: str, chunks) -> tuple[bool, str, int]:
    c = JsonCanonicalizer()
    used = 0
    try:
        for ch in chunks:
            if c.done:
                break
            used += c.feed(ch)
        c.finish()
    except ValueError:
        return False, "", 0
    return True, c.text(), used


def test_canonicalizer_matches_stdlib_on_valid_json():
    rng = random.Random(1)
    for _ in range(400):
        value = rand_value(rng)
        raw = messy_json(rng, value)
        want = dumps(json.loads(raw))
        for chunks in ([raw], list(raw), [raw[:i] for i in [len(raw) // 3]] + [raw[len(raw) // 3:]]):
            ok, got, _ = canon_stream(raw, chunks)
            assert ok and got == want, raw


def test_canonicalizer_rejects_what_stdlib_rejects():
    rng = random.Random(2)
    alphabet = list('{}[]",:\\ 0123456789.eE-+tfnulraxu') + ["\x01", "é"]
    checked = 0
    for _ in range(3000):
        raw = messy_json(rng, rand_value(rng))
        chars = list(raw)
        for _ in range(rng.randint(1, 3)):  # random mutations
            i = rng.randrange(len(chars) + 1)
            op = rng.random()
            if op < 0.4 and chars:
                del chars[min(i, len(chars) - 1)]
            elif op < 0.8:
                chars.insert(i, rng.choice(alphabet))
            else:
                chars = chars[:i]
        text = "".join(chars)
        try:
            decode_json(text)
            stdlib_ok = True
        except ValueError:
            stdlib_ok = False
        ok, got, _ = canon_stream(text, list(text))
        # the canonicalizer stops after one value; trailing junk is the caller's business
        if ok and stdlib_ok:
            assert got == dumps(decode_json(text))
        if stdlib_ok:
            assert ok, text
        elif ok:
            c = JsonCanonicalizer()
            end = c.feed(text)
            assert text[end:].strip(" \t\n\r"), text  # only if something follows the value
        checked += 1
    assert checked == 3000


def test_canonicalizer_edge_cases():
    for raw in ['"\\ud83d\\ude00"', '"\\ud83d"', '"\\ud83dx"', '"\\ud83d\\n"', '"\\ud83d\\ud83d\\ude00"', '"\\udc00"',
                "-0", "0.1000000000000000055511151231257827", "1E2", "[]", "{}", '{"":""}', "1e-400"]:
        ok, got, _ = canon_stream(raw, list(raw))
        assert ok and got == dumps(json.loads(raw)), raw
    for raw in ["Nan", "-Inf", "-N", "-", "Infinit", "01", "1.", ".5", "+1", '"\x01"', '"\\x"', '"\\u12G4"',
                "[1,]", '{"a":1,}', "{'a':1}", "tru", "[1 2]"]:
        ok, _, _ = canon_stream(raw, list(raw))
        assert not ok, raw


def test_numbers_past_float_range_keep_their_text():
    """Fuzz QA: a strict tool's unbounded `number` may be written as 1e999 (valid JSON, and the
    grammar allows it). Its float is inf, which json.dumps writes as the non-JSON "Infinity", so
    the parsers refused it and the call came back with its arguments cut at that number. SDK QA:
    NaN / Infinity / -Infinity (Python's json reads them, so vLLM's and SGLang's parsers keep such
    a call) and an int longer than Python converts cut the call the same way."""
    big = "9" * 5000
    for raw, want in (("1e400", "1e400"), ("-2E+999", "-2E+999"), ('{"a": [1e999, 1.50]}', '{"a": [1e999, 1.5]}'),
                      ('{ "x" :-1e309 ,"y":{"z":9e9999}}', '{"x": -1e309, "y": {"z": 9e9999}}'),
                      ("NaN", "NaN"), ("-Infinity", "-Infinity"), ('{"a":[NaN,Infinity ,-Infinity]}', '{"a": [NaN, Infinity, -Infinity]}'),
                      (big, big), ('{"n": -%s}' % big, '{"n": -%s}' % big)):
        ok, got, _ = canon_stream(raw, list(raw))
        assert ok and got == want == dumps(decode_json(raw)), raw
    args = '{"value": 1e999, "low": -2E+400, "list": [1.5, 1e999, NaN, -Infinity], "ok": 2.50}'
    want = '{"value": 1e999, "low": -2E+400, "list": [1.5, 1e999, NaN, -Infinity], "ok": 2.5}'
    for fmt, text in (("qwen25", "Sure. " + qwen("get_weather", args)), ("llama3", llama(("get_weather", args))),
                      ("mistral", mistral(("get_weather", args))), ("deepseekv3", deepseek(("get_weather", args)))):
        _, calls = assert_stream_matches(fmt, text, all_splits=False)
        assert calls == [("get_weather", want)], fmt
    # as a double-encoded arguments string too
    text = qwen("get_weather", json.dumps(args))
    assert assert_stream_matches("qwen25", text, all_splits=False)[1] == [("get_weather", want)]


def test_duplicate_keys_stream_decodes_to_same_value():
    """The one documented string difference: duplicates stream verbatim, json.loads keeps the last."""
    text = qwen("get_time", '{"a": 1, "b": 2, "a": 3}')
    whole = parse_whole("qwen25", text)
    streamed = run_stream("qwen25", list(text))
    assert whole == ("", [("get_time", '{"a": 3, "b": 2}')])
    assert streamed == ("", [("get_time", '{"a": 1, "b": 2, "a": 3}')])
    assert json.loads(streamed[1][0][1]) == json.loads(whole[1][0][1])


# ------------------------------------------------------------------------------------------------
# streaming behaviour details
# ------------------------------------------------------------------------------------------------


def test_arguments_stream_incrementally_and_name_comes_first():
    parser = Qwen25ToolParser()
    text = qwen("get_weather", '{"city": "San Francisco", "days": [1, 2, 3]}')
    out = [parser.parse_streaming_increment(ch, TOOLS) for ch in text]
    items = [i for r in out for i in r.calls]
    assert items[0] == ToolCallItem(tool_index=0, name="get_weather", parameters="")
    fragments = [i.parameters for i in items[1:]]
    assert len(fragments) > 10  # really incremental
    assert "".join(fragments) == '{"city": "San Francisco", "days": [1, 2, 3]}'
    # the name is sent as soon as the arguments object opens, before its content is known
    first_name_at = next(k for k, r in enumerate(out) if r.calls)
    assert text[: first_name_at + 1].endswith('"arguments": {')


def test_normal_text_is_not_held_back_needlessly():
    p = Qwen25ToolParser()
    assert p.parse_streaming_increment("Hello wor", TOOLS).normal_text == "Hello wor"
    assert p.parse_streaming_increment("ld, a <", TOOLS).normal_text == "ld, a"  # " <" may start <tool_call>
    assert p.parse_streaming_increment(" b", TOOLS).normal_text == " < b"
    assert p.parse_streaming_increment("\n\n", TOOLS).normal_text == ""  # whitespace waits for what follows
    assert p.parse_streaming_increment("<tool_ca", TOOLS).normal_text == ""
    assert p.parse_streaming_increment("ll>", TOOLS).normal_text == ""
    # The output ended right after the trigger: a call cut short, neither text nor a call (and the
    # whitespace touching it goes with it).
    assert p.finish().normal_text == ""


def test_pythonic_holds_only_candidates():
    p = PythonicToolParser()
    assert p.parse_streaming_increment("see [1", TOOLS).normal_text == "see [1"
    assert p.parse_streaming_increment("] and [get_", TOOLS).normal_text == "] and"
    r = p.parse_streaming_increment("time(tz='UTC')] bye", TOOLS)
    assert r.normal_text == " bye" and [(c.name, c.parameters) for c in r.calls] == [("get_time", ""), (None, '{"tz": "UTC"}')]


def test_truncated_streamed_call_stays_a_call_in_every_chunking():
    """Once a name was streamed it cannot be taken back: a stream cut inside the arguments keeps the
    partial call, in any chunking (the frontend's non-streaming answer is the one-chunk stream);
    SGLang's whole-text parse (``detect_and_parse``, kept for /parse_function_call) sees that it is
    truncated and drops it, as it drops any call the output ended inside."""
    text = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    for chunks in (list(text), [text], [text[:30], text[30:]]):
        assert run_stream("qwen25", chunks) == ("Hi", [("get_weather", '{"city": "Par')])
    assert parse_whole("qwen25", text) == ("Hi", [])


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "get_weather"', '<tool_call>\n{"name": "get_weather", "argu',
                                  '<tool_call>\n{"name": "get_weather", "arguments": "{\\"ci'])
def test_cut_call_with_its_name_is_a_call_when_streamed(text):
    """QA: a call cut after its name, before its arguments object began, put its markup in the
    content. A stream now ends it as a call with no arguments written, as SGLang and vLLM stream
    a name once it is known, in every chunking; an unknown name is dropped with its markup."""
    for chunks in chunkings("Hi " + text, 7, 4):
        assert run_stream("qwen25", chunks) == ("Hi", [("get_weather", "")]), chunks
        assert run_stream("qwen25", chunks, tools=TOOLS[1:]) == ("Hi", [])
    assert parse_whole("qwen25", "Hi " + text) == ("Hi", [])
    after = qwen(*w()) + "\n" + text  # after a complete call (QA's tool_choice required case)
    assert run_stream("qwen25", [after]) == ("", [("get_weather", canon(ARGS["simple"])), ("get_weather", "")])
    bare = '{"name": "get_time", "param'  # llama3's bare object: the name makes it a call
    assert run_stream("llama3", list(bare)) == run_stream("llama3", [bare]) == ("", [("get_time", "")])
    assert parse_whole("llama3", bare) == ("", [])


# Arguments that break after the call's name and the start of its arguments went out: where the
# error is found decides nothing -- the call ends at the last good character in every chunking.
_BROKEN_ARGS = ['{"zone": "UTC"]', '{"zone": tru}', '{"zone": "a\\q"}', '{"zone": 01}', '{"zone" "UTC"}',
                '{"a": [1, 2}', '{"a": {"b": "</tool_call>"]}', '{"a": "x"} junk}']


def rand_broken_call(rng: random.Random, fmt: str) -> str:
    args = rng.choice(_BROKEN_ARGS)
    name = rng.choice(_NAMES)
    return {"qwen25": lambda: qwen(name, args), "llama3": lambda: llama((name, args)),
            "mistral": lambda: mistral((name, args)), "deepseekv3": lambda: deepseek((name, args))}[fmt]()


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pythonic"])
def test_fuzz_stream_result_does_not_depend_on_chunking(fmt):
    """With calls broken after their name was streamed, streaming and the one-chunk parse the
    frontend answers non-streaming requests with (openai_frontend.tools.parse_as_streamed) agree
    on every chunking: the same calls, the same partial arguments, the same text."""
    rng = random.Random(f"broken-{fmt}")
    broken = 0
    for _ in range(FUZZ_N):
        parts = [rand_output(rng, fmt) if rng.random() < 0.7 else ""]
        for _ in range(rng.randint(1, 2)):
            parts.append(rand_broken_call(rng, fmt))
            parts.append(rand_output(rng, fmt) if rng.random() < 0.5 else " tail")
        text = "".join(parts)
        one_chunk = run_stream(fmt, [text])
        broken += any(not _is_json_object(args) for _, args in one_chunk[1])
        for chunks in chunkings(text, hash((fmt, text)) & 0xFFFF, 4, all_splits=len(text) < 200):
            assert run_stream(fmt, chunks) == one_chunk, f"chunks={chunks!r}"
    assert broken > FUZZ_N // 4  # the corpus really streams broken calls


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def test_broken_streamed_call_resyncs_after_its_block():
    text = qwen("get_weather", '{"city": Paris}') + " tail " + qwen("get_time", "{}")
    normal, calls = run_stream("qwen25", list(text))
    assert calls == [("get_weather", '{"city": '), ("get_time", "{}")]
    assert normal == "tail"


def test_finish_reset_and_reuse():
    p = Qwen25ToolParser()
    p.parse_streaming_increment("abc ", TOOLS)
    assert p.finish().normal_text == " "
    with pytest.raises(RuntimeError):
        p.parse_streaming_increment("x", TOOLS)
    p.reset()
    assert p.parse_streaming_increment("x", TOOLS).normal_text == "x"
    assert p.flush().normal_text == ""  # flush is finish


# ------------------------------------------------------------------------------------------------
# whitespace rule
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segments,expected",
    [
        (["  plain text  "], "  plain text  "),
        (["Let me check.\n\n", ""], "Let me check."),
        (["", "\nThe answer."], "The answer."),
        (["A\n", "\nB"], "A\nB"),
        (["A ", "\n", "  B  "], "A B  "),
        (["  A", ""], "  A"),
        (["\n\n", "\n", ""], ""),
        (["A", "B", "C"], "ABC"),
        (["A\n\n", " ", "\n"], "A"),
    ],
)
def test_join_segments(segments, expected):
    assert join_segments(segments) == expected


def test_whitespace_rule_end_to_end():
    text = "A\n" + qwen(*w()) + "\n" + qwen(*w()) + "\n\nB \n"
    assert parse_whole("qwen25", text)[0] == "A\nB \n"
    assert_stream_matches("qwen25", text, n_random=2)


# ------------------------------------------------------------------------------------------------
# tools, registry, structure info
# ------------------------------------------------------------------------------------------------


def test_tools_forms_and_filtering():
    text = qwen("get_time", "{}") + qwen("other", "{}")
    pyd = [SimpleNamespace(type="function", function=SimpleNamespace(name="get_time"))]
    assert parse_whole("qwen25", text, pyd)[1] == [("get_time", "{}")]
    assert parse_whole("qwen25", text, ["get_time", "other"])[1] == [("get_time", "{}"), ("other", "{}")]
    assert parse_whole("qwen25", text, None)[1] == [("get_time", "{}"), ("other", "{}")]
    assert parse_whole("qwen25", text, [])[1] == []
    assert run_stream("qwen25", list(text), None)[1] == [("get_time", "{}"), ("other", "{}")]
    assert run_stream("qwen25", list(text), [])[1] == []


def test_registry():
    assert set(FORMATS) <= set(TOOL_PARSERS)
    for alias, cls in [("hermes", Qwen25ToolParser), ("qwen", Qwen25ToolParser), ("qwen25", Qwen25ToolParser),
                       ("llama3", Llama3ToolParser), ("pythonic", PythonicToolParser),
                       ("mistral", MistralToolParser), ("deepseekv3", DeepSeekV3ToolParser)]:
        p = get_tool_parser(alias)
        assert type(p) is cls and isinstance(p, BaseToolParser)
    assert get_tool_parser("qwen25") is not get_tool_parser("qwen25")  # fresh state per output
    with pytest.raises(KeyError):
        get_tool_parser("nope")


@pytest.mark.parametrize(
    "fmt,text,expected",
    [
        ("qwen25", "x <tool_call>", True), ("qwen25", "plain", False),
        ("llama3", "<|python_tag|>{", True), ("llama3", ' {"name"', True), ("llama3", "a {", False),
        ("mistral", "[TOOL_CALLS] [", True), ("mistral", "[TOOL", False),
        ("deepseekv3", CALLS_BEGIN, True), ("deepseekv3", CALL_BEGIN, False),
        ("pythonic", "ok [get_time(", True), ("pythonic", "<|python_start|>", True), ("pythonic", "[1, 2]", False),
    ],
)
def test_has_tool_call(fmt, text, expected):
    assert get_tool_parser(fmt).has_tool_call(text) is expected


@pytest.mark.parametrize("fmt", ["qwen25", "llama3", "mistral", "deepseekv3"])
def test_structure_info_round_trips(fmt):
    """begin + JSON arguments + end (what a structural tag generates) parses back to the call."""
    parser = get_tool_parser(fmt)
    info = parser.structure_info("get_weather")
    assert info.begin.startswith(info.trigger)
    args = {"city": "北京", "q": "}\"{"}
    text = info.begin + json.dumps(args, ensure_ascii=False) + info.end
    assert parse_whole(fmt, text) == ("", [("get_weather", json.dumps(args, ensure_ascii=False))])
    assert_stream_matches(fmt, text, n_random=2)


def test_pythonic_has_no_json_structure():
    with pytest.raises(NotImplementedError):
        PythonicToolParser().structure_info("get_time")


def test_sglang_doc_example():
    """The exchange in SGLang's function-calling guide (Qwen 2.5, /parse_function_call)."""
    text = (
        "To provide you with the current weather in Boston, I will use the `get_current_weather` function.\n"
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Boston", "state": "MA", "unit": "fahrenheit"}}\n</tool_call>'
    )
    tools = [{"type": "function", "function": {"name": "get_current_weather", "parameters": {}}}]
    result = get_tool_parser("qwen25").detect_and_parse(text, tools)
    assert result.normal_text.endswith("`get_current_weather` function.")
    assert result.calls == [ToolCallItem(tool_index=0, name="get_current_weather",
                                         parameters='{"city": "Boston", "state": "MA", "unit": "fahrenheit"}')]
    assert_stream_matches("qwen25", text, tools, n_random=2)


@pytest.mark.parametrize("name", ["qwen25", "llama3", "mistral", "pythonic", "deepseekv3", "qwen3_coder"])
def test_cut_output_parses_as_its_stream_ends(name):
    # The frontend's non-streaming answer for output that max_tokens cut (openai_frontend.tools
    # .parse_as_streamed) is what a stream of it, fed in any chunking, ends with; for uncut output it is
    # the plain non-streaming parse.
    from openai_frontend.tools import ToolCallStreamer, get_parser, parse_as_streamed, parse_complete

    parser = get_tool_parser(name)
    if name == "pythonic":
        complete = '[get_time(zone="UTC")]'
    elif name == "llama3":
        complete = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}'
    elif name == "qwen3_coder":  # XML, each parameter sent once its closing tag is read
        complete = "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"
    else:
        info = parser.structure_info("get_time")
        complete = info.begin + '{"zone": "UTC"}' + info.end
    text = "Checking. " + complete
    assert parse_as_streamed(get_parser(name), text, TOOLS) == parse_complete(get_parser(name), text, TOOLS)
    rng = random.Random(3)
    partial = 0
    for cut in range(len("Checking. "), len(text)):
        piece = text[:cut]
        normal, calls = parse_as_streamed(get_parser(name), piece, TOOLS)
        partial += bool(calls) and calls[0].arguments != '{"zone": "UTC"}'  # a cut call kept as a call
        for _ in range(3):
            streamer = ToolCallStreamer(get_parser(name), TOOLS)
            streamed, i = "", 0
            while i < len(piece):
                j = i + rng.randint(1, 6)
                streamed += streamer.feed(piece[i:j])[0]
                i = j
            streamed += streamer.finish()[0]
            assert (streamed, streamer.calls) == (normal, calls), (name, piece)
    assert partial > 0 or name == "pythonic"  # pythonic streams a call only once it is complete


# QA: max_tokens cut the output inside the trigger that opens a second call: (format, output, its
# text under tool_choice auto, its calls).
_CUT_IN_TRIGGER = [
    ("qwen25", qwen(*w()) + "\n<tool_", "<tool_", [w()]),
    ("llama3", llama(w()) + "\n<|python_t", "<|python_t", [w()]),
    ("mistral", "ok " + mistral(w()) + "\n[TOOL_CALL", "ok [TOOL_CALL", [w()]),
    ("deepseekv3", "hm" + deepseek(w()) + "<｜tool▁calls", "hm<｜tool▁calls", [w()]),
    ("llama3", '{"name": "get_weat', '{"name": "get_weat', []),  # no trigger: JSON text cut short
]


def _stream_as_chat(name: str, chunks, forced: bool) -> tuple[str, list[tuple[str, str]]]:
    from openai_frontend.tools import ToolCallStreamer, get_parser

    streamer = ToolCallStreamer(get_parser(name), TOOLS, forced=forced)
    text = "".join(streamer.feed(c)[0] for c in chunks) + streamer.finish()[0]
    return text, [(c.name, c.arguments) for c in streamer.calls]


@pytest.mark.parametrize("name,text,auto_text,calls", _CUT_IN_TRIGGER,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(_CUT_IN_TRIGGER)])
def test_forced_tool_choice_gives_no_text_in_any_chunking(name, text, auto_text, calls):
    """Under a forced tool_choice the output is constrained to calls, so what a parser gives as
    text there is markup cut short (a trailing ``<tool_``): it is dropped, streamed or not. Under
    auto that tail is ambiguous (a trailing ``<`` may be text) and stays text, as in vLLM/SGLang."""
    from openai_frontend.tools import get_parser, parse_as_streamed

    calls = [(n, canon(args)) for n, args in calls]
    for forced, normal in ((True, ""), (False, auto_text)):
        whole = parse_as_streamed(get_parser(name), text, TOOLS, forced=forced)
        assert (whole[0], [(c.name, c.arguments) for c in whole[1]]) == (normal, calls), forced
        for chunks in chunkings(text, 11, 4):
            assert _stream_as_chat(name, chunks, forced) == (normal, calls), (forced, chunks)


@pytest.mark.parametrize("fmt, text", [
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud83d", "note": "\\ud83d\\ude00 ok"}}\n</tool_call>'),
    ("pythonic", "[get_weather(city='\\ud83d')]"),
])
def test_a_lone_surrogate_escape_stays_an_escape(fmt, text):
    """QA: a model writing `"\\ud83d"` (half an escaped pair) made every path fail with a 500 (the
    arguments held a lone surrogate, which UTF-8 cannot encode). It stays an escape, in the
    whole-text and the streamed arguments alike; a full pair is the character."""
    normal, calls = assert_stream_matches(fmt, text)
    (name, args), = calls
    args.encode("utf-8")
    assert "\\ud83d" in args and json.loads(args)["city"] == "\ud83d"
    if fmt == "qwen25":
        assert json.loads(args)["note"] == "\U0001F600 ok"

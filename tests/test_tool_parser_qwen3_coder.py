"""The Qwen3-Coder tool-call parser (openai_frontend/tool_parsers/qwen3_coder.py): its XML calls
typed by the tools' schemas, the same result streamed in any chunking as parsed whole, and through
the frontend the same calls streaming and not (test_frontend_unit.py, which serves the frontend;
this module stays in the unit lane). The harness is test_tool_parsers.py's, whose
test_cut_output_parses_as_its_stream_ends covers this format too."""

from __future__ import annotations

import json
import random

import pytest

from openai_frontend.tool_parsers import Qwen3CoderToolParser, get_tool_parser
from openai_frontend.tool_parsers.qwen3_coder import typed_value
from tests.test_tool_parsers import assert_stream_matches, chunkings, parse_whole, run_stream

FMT = "qwen3_coder"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "any": {}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "search"}},
]


def call(name: str, *params: tuple[str, str], close: bool = True) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n" + ("</tool_call>" if close else "")


def whole(text: str, tools=TOOLS):
    return parse_whole(FMT, text, tools)


CASES = [
    # (text, normal text, [(name, arguments)])
    ("plain text, no calls <tool and <function=x>", "plain text, no calls <tool and <function=x>", []),
    ("Let me check.\n\n" + call("get_weather", ("city", "Paris"), ("days", "3")) + "\nDone.",
     "Let me check.\n\nDone.", [("get_weather", '{"city": "Paris", "days": 3}')]),
    (call("get_time"), "", [("get_time", "{}")]),
    (call("get_weather", ("city", "北京 😀")) + call("get_time") + " after",
     "after", [("get_weather", '{"city": "北京 😀"}'), ("get_time", "{}")]),
    # several functions in one block, an unknown one among them dropped
    ("<tool_call>\n<function=get_time>\n</function>\n<function=launch>\n<parameter=x>\n1\n</parameter>\n"
     "</function>\n<function=search>\n<parameter=q>\nhi\n</parameter>\n</function>\n</tool_call>",
     "", [("get_time", "{}"), ("search", '{"q": "hi"}')]),
    # no closing tag: at the end, or text right after the function ends the block
    (call("get_time", close=False), "", [("get_time", "{}")]),
    ("<tool_call><function=get_time></function> trailing", "trailing", [("get_time", "{}")]),
    # a value keeps its own whitespace, less one newline each side, and may hold markup
    (call("get_weather", ("city", "  two\nlines\n")), "", [("get_weather", json.dumps({"city": "  two\nlines\n"}))]),
    (call("search", ("q", "<tool_call> <function=x> </function> <parameter=y>")), "",
     [("search", json.dumps({"q": "<tool_call> <function=x> </function> <parameter=y>"}))]),
    # not a call: the trigger is text, and a valid call after the garbage is still found
    ("<tool_call>oops " + call("get_time"), "<tool_call>oops", [("get_time", "{}")]),
    ("<tool_call></tool_call> ok", "<tool_call></tool_call> ok", []),
    ("<tool_call>\n<function=bad\nname>\n</function>", "<tool_call>\n<function=bad\nname>\n</function>", []),
    ("<tool_call>\n<function=>\n</function>", "<tool_call>\n<function=>\n</function>", []),
    ("stray </tool_call> tag", "stray </tool_call> tag", []),
    # a next function malformed before its name was complete: the block ends after the good one
    (call("get_time", close=False) + "<function=x<y>", "<function=x<y>", [("get_time", "{}")]),
    # cut before a name was complete (max_tokens, a stop): neither text nor a call
    ("Sure. <tool_call>", "Sure.", []),
    ("Sure. <tool_call>\n<func", "Sure.", []),
    ("Sure. <tool_call>\n<function=get_wea", "Sure.", []),
    # cut in the markup after a complete call: the fragment is dropped
    (call("get_time")[: -len("</tool_call>")] + "</tool_", "", [("get_time", "{}")]),
    (call("get_time") + "\n<tool_call>\n", "", [("get_time", "{}")]),
]


@pytest.mark.parametrize("text,normal,calls", CASES, ids=[f"case-{i}" for i in range(len(CASES))])
def test_parse_and_stream_equivalence(text, normal, calls):
    assert whole(text) == (normal, calls)
    assert_stream_matches(FMT, text, TOOLS, n_random=6, all_splits=len(text) < 400)


@pytest.mark.parametrize("raw,schema,value", [
    ("Paris", {"type": "string"}, "Paris"), ("3", {"type": "string"}, "3"),
    ("42", {"type": "integer"}, 42), ("4x", {"type": "integer"}, "4x"),
    ("2.0", {"type": "number"}, 2), ("1.5", {"type": "number"}, 1.5), ("inf", {"type": "number"}, "inf"),
    ("true", {"type": "boolean"}, True), ("False", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ("null", {"type": "string"}, None), ("NULL", {"type": "integer"}, None),
    ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}), ("{'a': (1, 2), 'b': None}", {"type": "object"},
                                                          {"a": [1, 2], "b": None}),
    ("[1, 'x']", {"type": "array"}, [1, "x"]), ("not json", {"type": "object"}, "not json"),
    ("{1, 2}", {"type": "object"}, "{1, 2}"), ("1e999", {"type": "array"}, "1e999"),
    ("7", {"type": ["integer", "null"]}, 7), ("7", {"anyOf": [{"type": "null"}, {"type": "number"}]}, 7),
    ("7", None, "7"), ("7", {}, "7"),
])
def test_values_are_typed_by_the_schema_as_vllm_types_them(raw, schema, value):
    assert typed_value(raw, schema) == value


def test_typing_follows_the_called_function_s_schema():
    text = call("get_weather", ("city", "10"), ("days", "10"), ("ratio", "0.5"), ("metric", "false"),
                ("opts", '{"x": null}'), ("tags", "['a']"), ("note", "null"), ("unlisted", "10"), ("any", "10"))
    args = {"city": "10", "days": 10, "ratio": 0.5, "metric": False, "opts": {"x": None}, "tags": ["a"], "note": None,
            "unlisted": "10", "any": "10"}
    assert whole(text) == ("", [("get_weather", json.dumps(args))])
    assert_stream_matches(FMT, text, TOOLS, n_random=4, all_splits=False)
    # Without tools nothing is typed (and nothing filtered).
    assert whole(call("anything", ("days", "10")), tools=None) == ("", [("anything", '{"days": "10"}')])


def test_each_parameter_streams_once_complete_and_the_name_comes_first():
    parser = get_tool_parser(FMT)
    assert isinstance(parser, Qwen3CoderToolParser)
    text = call("get_weather", ("city", "Paris"), ("days", "3"))
    cut = text.index("</parameter>") + len("</parameter>")
    first = parser.parse_streaming_increment(text[: text.index("<parameter=")], TOOLS)
    assert [(c.name, c.parameters) for c in first.calls] == [("get_weather", "")]
    second = parser.parse_streaming_increment(text[text.index("<parameter="):cut], TOOLS)
    assert [(c.name, c.parameters) for c in second.calls] == [(None, '{"city": "Paris"')]
    rest = parser.parse_streaming_increment(text[cut:], TOOLS)
    assert "".join(c.parameters for c in rest.calls) == ', "days": 3}'
    assert parser.has_tool_call("x <tool_call>") and not parser.has_tool_call("<function=x>")
    with pytest.raises(NotImplementedError):
        parser.structure_info("get_time")  # no JSON arguments to constrain


# -- fuzz: random outputs stream as they parse whole; broken calls stream alike in any chunking ---

_NAMES = ["get_weather", "get_time", "search", "unknown_fn"]
_TEXT = ["Hi", " ", "\n", "ok.", "北京", "😀", "<", "<tool", "</", "<function=", "}", "{", "```", "\t", "a < b"]
_VALUES = ["Paris", "  spaced  ", "multi\nline", "", "3", "-7", "2.5", "true", "null", "[1, 2]", '{"k": "v"}',
           "{'t': (1,)}", "é\"\\", "<tool_call>", "</function>"]
# Markup that forms no call, or is cut before a name was complete (it may follow a block left
# open: a "<function=NAME>" there would be the block's next call).
_GARBAGE = ["<tool_call>", "<tool_call>x", "<tool_call></tool_call>", "<tool_call>\n<function=a\nb>",
            "<tool_call>\n<function=>", "</tool_call>", "<function=a<"]
# Breaks after a call's name went out (the call stays as sent; the block is skipped).
_BROKEN = ["<tool_call>\n<function=get_time>\nnot a parameter\n</tool_call>",
           "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=x\ny>\n",
           "<tool_call>\n<function=search>\n<parameter=q>\nunfinished",
           "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\ngarbage</function></tool_call>"]


def _rand_block(rng: random.Random) -> str:
    nl = lambda: rng.choice(["\n", ""])  # noqa: E731
    functions = []
    for _ in range(1 if rng.random() < 0.8 else rng.randint(2, 3)):
        params = [(rng.choice(["city", "days", "ratio", "metric", "opts", "tags", "note", "q", "x"]),
                   rng.choice(_VALUES)) for _ in range(rng.randint(0, 3))]
        body = "".join(f"<parameter={k}>{nl()}{v}{nl()}</parameter>" + rng.choice(["\n", "", " "]) for k, v in params)
        functions.append(f"<function={rng.choice(_NAMES)}>{nl()}{body}</function>")
    sep = nl()
    return "<tool_call>" + sep + sep.join(functions) + rng.choice(["\n</tool_call>", "</tool_call>", ""])


def _rand_output(rng: random.Random, broken: bool = False) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.4:
            parts.append("".join(rng.choice(_TEXT) for _ in range(rng.randint(1, 3))))
        elif r < 0.85:
            parts.append(_rand_block(rng))
        else:
            parts.append(rng.choice(_BROKEN if broken else _GARBAGE))
    return "".join(parts)


def test_fuzz_stream_equals_whole():
    rng = random.Random("qwen3-coder")
    found = 0
    for _ in range(150):
        text = _rand_output(rng)
        found += len(assert_stream_matches(FMT, text, TOOLS, n_random=3, all_splits=len(text) < 250)[1])
    assert found > 100


def test_fuzz_a_broken_call_streams_the_same_in_every_chunking():
    """Calls broken after their name went out: streaming and the one-chunk parse the frontend
    answers non-streaming requests with agree on every chunking."""
    rng = random.Random("qwen3-coder-broken")
    broken = 0
    for _ in range(120):
        text = _rand_output(rng, broken=True)
        one_chunk = run_stream(FMT, [text], TOOLS)
        broken += any(not args.endswith("}") for _, args in one_chunk[1])
        for chunks in chunkings(text, hash(text) & 0xFFFF, 3, all_splits=len(text) < 200):
            assert run_stream(FMT, chunks, TOOLS) == one_chunk, chunks
    assert broken > 20

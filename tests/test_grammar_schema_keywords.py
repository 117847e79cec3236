"""JSON-schema keywords xgrammar 0.2.8 does not enforce are refused by name and JSON path
(backend/grammar.py, _check_enforceable); the keywords it does enforce still compile and constrain.

Each refusal rests on a finding kept here: compiled as the backend compiles it, the schema's grammar
accepts a document that jsonschema rejects (test_xgrammar_ignores_it). When an xgrammar upgrade
starts enforcing one, that test fails and its refusal can go.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from backend.grammar import (
    JSON_MAX_WHITESPACE,
    GrammarError,
    _bounded_strings,
    _check_json_schema,
)

VOCAB = 4096


def xgrammar_accepts(schema, doc: str) -> bool:
    """Whether the grammar the backend would compile for ``schema`` (without our check) accepts ``doc``."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(_bounded_strings(schema)), any_whitespace=True,
                                           max_whitespace_cnt=JSON_MAX_WHITESPACE, strict_mode=True)
    return _is_grammar_accept_string(grammar, doc)


def valid(schema, doc: str) -> bool:
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(json.loads(doc))


def refusal(schema) -> str:
    with pytest.raises(GrammarError) as info:
        _check_json_schema(schema)
    return str(info.value)


INT = {"type": "integer"}

# (schema, a document xgrammar lets through that breaks the schema, the refusal's message).
IGNORED = [
    ({"allOf": [INT, {"minimum": 10}]}, "false", r"'allOf' of more than one schema at \$ "),
    ({"not": {}}, "false", r"'not' at \$ "),
    ({"type": "integer", "not": {"const": 3}}, "3", r"'not' at \$ "),
    ({"if": INT, "then": {"minimum": 100}, "else": {"type": "string"}}, "false", r"'if' at \$ "),
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": True,
      "minItems": 3, "maxItems": 3}, "[0,0,0]", r"'uniqueItems' at \$ "),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]", r"'contains' at \$ "),
    ({"type": "array", "items": INT, "maxContains": 1, "contains": {"const": 5}}, "[5,5]", r"'maxContains' at \$ "),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}}, '{"a":1}',
     r"'dependentRequired' at \$ "),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentSchemas": {"a": {"required": ["b"]}}},
     '{"a":1}', r"'dependentSchemas' at \$ "),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {"a": INT, "b": INT},
      "dependencies": {"a": ["b"]}}, '{"a":1}', r"'dependencies' at \$ "),
    ({"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$dynamicRef": "#n"}}}, '{"c":1}',
     r"'\$dynamicRef' at \$\.properties\.c "),
    # multipleOf: only for type integer, a whole value in 1..1024, no bounds or a range of <= 10000.
    ({"type": "integer", "multipleOf": 7, "minimum": 0}, "15", r"'multipleOf' at \$ "),
    ({"type": "integer", "multipleOf": 7, "exclusiveMaximum": 30}, "15", r"'multipleOf' at \$ "),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 10000}, "15", r"'multipleOf' at \$ "),
    ({"type": "integer", "multipleOf": 1025}, "5", r"'multipleOf' at \$ "),
    ({"type": "integer", "multipleOf": 0.3}, "1", r"'multipleOf' at \$ "),
    ({"type": "number", "multipleOf": 0.5}, "1.3", r"'multipleOf' at \$ "),
    ({"type": ["integer", "number"], "multipleOf": 7}, "1.5", r"'multipleOf' at \$ "),
    # Strings: a length bound beside a pattern or a known format, a pattern beside a known format,
    # a lookahead.
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaaa"', r"'maxLength' beside 'pattern' at \$ "),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, '"a"', r"'minLength' beside 'pattern' at \$ "),
    ({"type": "string", "format": "date", "maxLength": 3}, '"2024-01-01"', r"'maxLength' beside 'format' at \$ "),
    ({"type": "string", "format": "date", "pattern": "^2024"}, '"2023-01-01"', r"'pattern' beside 'format' at \$ "),
    ({"type": "string", "pattern": "^(?!a)[a-z]+$"}, '"abc"', r"'pattern' with a lookahead at \$ "),
    # A keyword for one JSON type, in a schema without a type.
    ({"minimum": 10}, "5", r"'minimum' without a 'type' at \$ "),
    ({"maximum": 10}, "50", r"'maximum' without a 'type' at \$ "),
    ({"exclusiveMinimum": 3}, "1", r"'exclusiveMinimum' without a 'type' at \$ "),
    ({"exclusiveMaximum": 3}, "5", r"'exclusiveMaximum' without a 'type' at \$ "),
    ({"multipleOf": 7}, "15", r"'multipleOf' without a 'type' at \$ "),
    ({"minLength": 3}, '"a"', r"'minLength' without a 'type' at \$ "),
    ({"maxLength": 1}, '"abc"', r"'maxLength' without a 'type' at \$ "),
    ({"pattern": "^a$"}, '"b"', r"'pattern' without a 'type' at \$ "),
    ({"format": "date"}, '"b"', r"'format' without a 'type' at \$ "),
    ({"minItems": 2}, "[1]", r"'minItems' without a 'type' at \$ "),
    ({"maxItems": 1}, "[1,2]", r"'maxItems' without a 'type' at \$ "),
    ({"required": ["a"]}, "{}", r"'required' without a 'type' at \$ "),
    ({"minProperties": 1}, "{}", r"'minProperties' without a 'type' at \$ "),
    ({"maxProperties": 1}, '{"a":1,"b":2}', r"'maxProperties' without a 'type' at \$ "),
    ({"patternProperties": {"^x": INT}}, '{"x":"a"}', r"'patternProperties' without a 'type' at \$ "),
    ({"propertyNames": {"maxLength": 1}}, '{"abc":1}', r"'propertyNames' without a 'type' at \$ "),
    # A required name that is not a declared property.
    ({"type": "object", "properties": {"a": INT}, "required": ["b"]}, '{"a":1}',
     r"'required' name \"b\" not under 'properties' at \$ "),
    ({"type": "object", "additionalProperties": INT, "required": ["b"]}, "{}",
     r"'required' name \"b\" not under 'properties' at \$ "),
    # Keywords beside the one xgrammar compiles ($ref, const, enum, anyOf, oneOf, allOf) are dropped.
    ({"$defs": {"p": INT}, "$ref": "#/$defs/p", "maximum": 3}, "4", r"'maximum' beside '\$ref' at \$ "),
    ({"type": "integer", "anyOf": [{"minimum": 10}, {"maximum": 0}]}, '"a"', r"'type' beside 'anyOf' at \$ "),
    ({"type": "object", "properties": {"a": INT}, "anyOf": [{"required": ["a"]}]}, "5",
     r"'type' beside 'anyOf' at \$ "),
    ({"type": "integer", "allOf": [{"minimum": 10}]}, "5", r"'type' beside 'allOf' at \$ "),
    ({"type": "integer", "enum": [1, 20], "minimum": 10}, "1", r"'enum' value 1 that breaks the keywords"),
    ({"type": "string", "enum": ["abc", "a"], "maxLength": 2}, '"abc"', r"'enum' value \"abc\" that breaks"),
    ({"type": "integer", "const": "x"}, '"x"', r"'const' value \"x\" that breaks the keywords"),
    # oneOf whose schemas may overlap is compiled as anyOf.
    ({"oneOf": [INT, {"type": "number"}]}, "1", r"'oneOf' whose schemas may overlap at \$ "),
    ({"oneOf": [{"enum": [1, 2]}, {"enum": [2, 3]}]}, "2", r"'oneOf' whose schemas may overlap at \$ "),
    ({"oneOf": [{"enum": [1, "a"]}, {"type": "string"}]}, '"a"', r"'oneOf' whose schemas may overlap at \$ "),
    # References xgrammar does not follow (it logs a warning and allows any value).
    ({"$defs": {"p": {"$anchor": "P", "type": "integer"}}, "$ref": "#P"}, '"a"', r"'\$ref' \"#P\" at \$ "),
    ({"$id": "http://x/root", "$defs": {"p": {"$id": "p", "type": "integer"}}, "$ref": "p"}, '"x"',
     r"'\$ref' \"p\" at \$ "),
]


@pytest.mark.parametrize("schema, doc, message", IGNORED)
def test_xgrammar_ignores_it(schema, doc, message):
    assert not valid(schema, doc)
    assert xgrammar_accepts(schema, doc), "xgrammar now enforces this: its refusal can go"


@pytest.mark.parametrize("schema, doc, message", IGNORED)
def test_refused_by_name_and_path(schema, doc, message):
    text = refusal(schema)
    assert text.startswith("invalid json_schema: ") and text.endswith(")")
    assert re.search(message, text), text
    assert "is not supported (" in text


def test_qa_repros_name_the_keyword():
    assert refusal({"type": "integer", "multipleOf": 7, "minimum": -10**9}).startswith(
        "invalid json_schema: 'multipleOf' at $ is not supported (the grammar enforces it only for type 'integer'")
    assert refusal({"not": {}}) == "invalid json_schema: 'not' at $ is not supported (the grammar cannot enforce it)"


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"type": "object",
          "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}},
         "'uniqueItems' at $.properties.tags is not supported (the grammar cannot enforce it)"),
        ({"type": "array", "items": {"type": "object", "properties": {"a": {"not": INT}}}},
         "'not' at $.items.properties.a is not supported"),
        ({"type": "array", "prefixItems": [INT, {"type": "integer", "multipleOf": 2.5}]},
         "'multipleOf' at $.prefixItems[1] is not supported"),
        ({"anyOf": [{"type": "null"}, {"if": INT}]}, "'if' at $.anyOf[1] is not supported"),
        ({"oneOf": [{"type": "null"}, {"type": "array", "contains": INT}]},
         "'contains' at $.oneOf[1] is not supported"),
        ({"allOf": [{"type": "string", "format": "email", "minLength": 3}]},
         "'minLength' beside 'format' at $.allOf[0] is not supported"),
        ({"$defs": {"Item": {"type": "object", "properties": {"n": {"minimum": 1}}}}, "$ref": "#/$defs/Item"},
         "'minimum' without a 'type' at $.$defs.Item.properties.n is not supported"),
        ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"X": {"not": {}}},
          "$ref": "#/definitions/X"}, "'not' at $.definitions.X is not supported"),
        ({"type": "object", "additionalProperties": {"type": "array", "uniqueItems": True}},
         "'uniqueItems' at $.additionalProperties is not supported"),
        ({"type": "object", "patternProperties": {"^x-[0-9]+$": {"type": "string", "pattern": "(?=a)a"}}},
         "'pattern' with a lookahead at $.patternProperties[\"^x-[0-9]+$\"] is not supported"),
        ({"type": "object", "properties": {"a b": {"type": "object", "required": ["c"]}}},
         "'required' name \"c\" not under 'properties' at $.properties[\"a b\"] is not supported"),
        ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3}},
         "'maxLength' beside 'pattern' at $.propertyNames is not supported"),
        ({"type": "object", "properties": {"x": {"type": "integer", "anyOf": [{"minimum": 1}]}}},
         "'type' beside 'anyOf' at $.properties.x is not supported (the grammar enforces only the 'anyOf' there; "
         "move 'type' into it)"),
    ],
)
def test_nested_keywords_are_found_with_their_path(schema, message):
    assert refusal(schema).startswith(f"invalid json_schema: {message}")


ANNOTATIONS = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/person",
    "$comment": "c", "title": "Person", "description": "d", "examples": [{"name": "Al"}],
    "default": {"name": "Al"}, "deprecated": False, "readOnly": True, "writeOnly": False,
    "x-vendor": {"not": "an extension keyword is no assertion"}, "discriminator": {"propertyName": "name"},
    "type": "object",
    "properties": {
        "name": {"type": "string", "title": "Name", "description": "full name", "examples": ["Al"], "default": "Al",
                 "contentMediaType": "text/plain", "contentEncoding": "8bit"},
        "pet": {"$ref": "#/$defs/Pet", "description": "a $ref with annotations beside it", "title": "Pet"},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False, "deprecated": True},
    },
    "required": ["name"],
    "$defs": {"Pet": {"type": "string", "enum": ["cat", "dog"], "$comment": "only annotations here"}},
}


def test_annotation_keywords_are_accepted():
    _check_json_schema(ANNOTATIONS)
    assert xgrammar_accepts(ANNOTATIONS, '{"name": "Al", "pet": "cat", "tags": ["a", "a"]}')
    assert not xgrammar_accepts(ANNOTATIONS, '{"name": "Al", "pet": "cow"}')


# (schema, a document it allows, a document that breaks it): accepted by the check, and enforced.
ENFORCED = [
    ({"type": "integer", "minimum": 10}, "10", "9"),
    ({"type": "integer", "maximum": 3}, "3", "4"),
    ({"type": "integer", "exclusiveMinimum": 10}, "11", "10"),
    ({"type": "integer", "exclusiveMaximum": 3}, "2", "3"),
    ({"type": "number", "minimum": 1.5}, "1.5", "1.4"),
    ({"type": "number", "exclusiveMaximum": 1.5}, "1.4", "1.5"),
    ({"type": "integer", "multipleOf": 7}, "14", "15"),
    ({"type": ["integer", "null"], "multipleOf": 7}, "null", "15"),
    ({"type": "integer", "multipleOf": 7, "minimum": -30, "maximum": 30}, "-14", "15"),
    ({"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 9999}, "14", "15"),
    ({"type": "string", "minLength": 3}, '"abc"', '"ab"'),
    ({"type": "string", "maxLength": 3}, '"abc"', '"abcd"'),
    ({"type": "string", "pattern": "^[a-c]+$"}, '"abc"', '"abd"'),
    ({"type": "string", "format": "date"}, '"2024-01-31"', '"2024-13-01"'),
    ({"type": "string", "format": "email"}, '"a@b.com"', '"ab"'),
    ({"type": "string", "format": "password", "maxLength": 3}, '"abc"', '"abcdef"'),  # unknown format
    ({"type": ["string", "null"], "maxLength": 2}, "null", '"abc"'),
    ({"type": "array", "items": INT, "minItems": 2}, "[1,2]", "[1]"),
    ({"type": "array", "items": INT, "maxItems": 2}, "[1,2]", "[1,2,3]"),
    ({"type": "array", "items": INT}, "[1]", '["a"]'),
    ({"type": "array", "prefixItems": [INT, {"type": "string"}]}, '[1,"a"]', '["a",1]'),
    ({"type": "array", "prefixItems": [INT], "unevaluatedItems": False}, "[1]", "[1,2]"),
    ({"type": "array", "items": INT, "uniqueItems": False}, "[1,1]", '["a"]'),
    ({"type": "object", "properties": {"a": INT}, "required": ["a"]}, '{"a":1}', "{}"),
    ({"type": "object", "properties": {"a": INT}, "additionalProperties": False}, '{"a":1}', '{"a":1,"b":2}'),
    ({"type": "object", "additionalProperties": INT}, '{"b":2}', '{"b":"x"}'),
    ({"type": "object", "properties": {"a": INT, "b": INT}, "minProperties": 2}, '{"a":1,"b":2}', '{"a":1}'),
    ({"type": "object", "maxProperties": 1, "additionalProperties": True}, '{"a":1}', '{"a":1,"b":2}'),
    ({"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}}, '{"ab":1}', '{"zz":1}'),
    ({"type": "object", "propertyNames": {"maxLength": 2}}, '{"ab":1}', '{"abc":1}'),
    ({"type": "object", "patternProperties": {"^x[0-9]$": INT}}, '{"x1":1}', '{"x1":"s"}'),
    ({"type": "object", "unevaluatedProperties": INT}, '{"b":1}', '{"b":"x"}'),
    ({"properties": {"a": INT}}, '{"a":1}', '{"a":"x"}'),  # an object by its keywords
    ({"items": INT}, "[1]", '["x"]'),  # an array by its keywords
    ({"anyOf": [INT, {"type": "string"}]}, '"a"', "false"),
    ({"oneOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]}, "null", '"abcd"'),
    ({"oneOf": [{"const": "a"}, {"enum": ["b", 1]}]}, "1", '"c"'),
    ({"allOf": [{"type": "integer", "minimum": 10}]}, "10", "5"),
    ({"$defs": {"p": {"type": "integer", "maximum": 3}}, "$ref": "#/$defs/p"}, "3", "4"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"p": {"type": "integer", "maximum": 3}},
      "$ref": "#/definitions/p"}, "3", "4"),
    ({"type": "object", "properties": {"c": {"$ref": "#"}}}, '{"c":{"c":{}}}', '{"c":1}'),
    ({"const": {"a": 1}}, '{"a":1}', '{"a":2}'),
    ({"type": "string", "enum": ["a", "b"]}, '"a"', '"c"'),
    ({"type": "integer", "enum": [10, 20], "minimum": 10}, "20", "5"),
    ({"type": "string", "const": "x"}, '"x"', '"y"'),
]


@pytest.mark.parametrize("schema, good, bad", ENFORCED)
def test_enforced_keywords_compile_and_constrain(schema, good, bad):
    _check_json_schema(schema)
    assert valid(schema, good) and not valid(schema, bad)
    assert xgrammar_accepts(schema, good)
    assert not xgrammar_accepts(schema, bad)


# A pydantic discriminated union: oneOf of $refs whose required "kind" has a const per model.
UNION = {
    "$defs": {
        "Cat": {"type": "object", "title": "Cat", "required": ["kind", "lives"],
                "properties": {"kind": {"const": "cat", "type": "string"}, "lives": {"type": "integer", "maximum": 9}}},
        "Dog": {"type": "object", "title": "Dog", "required": ["kind", "name"],
                "properties": {"kind": {"enum": ["dog", "puppy"], "type": "string"}, "name": {"type": "string"}}},
    },
    "type": "object", "required": ["pet"],
    "properties": {"pet": {"discriminator": {"propertyName": "kind"},
                           "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
}


def test_one_of_with_a_discriminator_is_accepted():
    _check_json_schema(UNION)
    assert xgrammar_accepts(UNION, '{"pet": {"kind": "puppy", "name": "Rex"}}')
    assert not xgrammar_accepts(UNION, '{"pet": {"kind": "dog", "lives": 3}}')
    overlapping = json.loads(json.dumps(UNION))
    overlapping["$defs"]["Dog"]["properties"]["kind"]["enum"].append("cat")
    assert "'oneOf' whose schemas may overlap at $.properties.pet" in refusal(overlapping)


@pytest.mark.parametrize(
    "fmt, good, bad",
    [("date", "2024-01-31", "2024-1-31"), ("time", "10:00:00Z", "10:00"),
     ("date-time", "2024-01-31T10:00:00Z", "2024-01-31"), ("duration", "P1D", "1D"), ("email", "a@b.com", "ab"),
     ("hostname", "a.com", "a b"), ("ipv4", "1.2.3.4", "999.1.1.1"), ("ipv6", "::1", "x"),
     ("uuid", "123e4567-e89b-12d3-a456-426614174000", "123e4567"), ("uri", "http://a.b/c", "x y"),
     ("uri-reference", "a/b", "x y"), ("uri-template", "a{b}", "{"), ("json-pointer", "/a", "x"),
     ("relative-json-pointer", "0/a", "x")],
)
def test_known_formats_are_enforced_as_patterns(fmt, good, bad):
    schema = {"type": "string", "format": fmt}
    _check_json_schema(schema)
    assert xgrammar_accepts(schema, json.dumps(good))
    assert not xgrammar_accepts(schema, json.dumps(bad))


# Bad documents: a raw quote ending the string early, raw control characters, a lone backslash
# (unterminated), an invalid escape, and strings outside the format.
@pytest.mark.parametrize("fmt, good, bad", [
    ("json-pointer", ["", "/", "/a", "/a~0b/~1c", "/0/é 🙂"],
     ['"/a"b"', '"/a\nb"', '"/a\tb"', '"/a\x01"', '"/a\\"', '"/a\\q"', '"/a~2"']),
    ("relative-json-pointer", ["0", "1#", "12/a/~1"], ['"0/a"b"', '"0/a\nb"', '"01/a"', '"#"']),
])
def test_json_pointer_formats_keep_their_strings_json(fmt, good, bad):
    # Review (s19): xgrammar's own pattern for these formats admitted a raw quote or control
    # character, so the grammar took '"/a"b"' (no JSON), and {"ptr": "/a", "evil": "x"} under
    # additionalProperties false. They compile as the equivalent pattern, which is JSON-aware.
    schema = {"type": "string", "format": fmt}
    _check_json_schema(schema)
    for text in good:
        doc = json.dumps(text, ensure_ascii=False)
        assert valid(schema, doc) and xgrammar_accepts(schema, doc), text
    for doc in bad:
        assert not xgrammar_accepts(schema, doc), doc
    ptr = "/a" if fmt == "json-pointer" else "0/a"
    strict = {"type": "object", "properties": {"ptr": schema}, "required": ["ptr"], "additionalProperties": False}
    assert xgrammar_accepts(strict, f'{{"ptr": "{ptr}"}}')
    assert not xgrammar_accepts(strict, f'{{"ptr": "{ptr}", "evil": "x"}}')


def test_format_is_a_pattern_without_calendar_checks():
    """xgrammar 0.2.8 compiles "format": "date" to a pattern with day 01-31 in any month (documented
    in docs/STRUCTURED_OUTPUT.md), and does not enforce formats it does not know."""
    date = {"type": "string", "format": "date"}
    assert xgrammar_accepts(date, '"2024-02-30"') and xgrammar_accepts(date, '"6663-04-31"')
    assert not xgrammar_accepts(date, '"2024-13-01"') and not xgrammar_accepts(date, '"2024-01-32"')
    _check_json_schema({"type": "string", "format": "idn-email"})
    assert xgrammar_accepts({"type": "string", "format": "idn-email"}, '"x"')


# ------------------------------------------------------------------ through GrammarCompiler
from tests.test_grammar import compiler, tokenizer  # noqa: E402,F401  (the demo model's compiler)


NESTED = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
          "required": ["tags"]}
NESTED_ERROR = ("invalid json_schema: 'uniqueItems' at $.properties.tags is not supported "
                "(the grammar cannot enforce it)")


def test_compiler_refuses_with_the_keyword_and_path(compiler):
    with pytest.raises(GrammarError) as info:
        compiler.submit("json_schema", json.dumps(NESTED)).result(timeout=30)
    assert str(info.value) == NESTED_ERROR
    # The whitespace-pattern kind (guided_whitespace_pattern) checks the same way.
    with pytest.raises(GrammarError) as info:
        compiler.submit("json_schema_whitespace", json.dumps(["", json.dumps(NESTED)])).result(timeout=30)
    assert str(info.value) == NESTED_ERROR


def test_structural_tags_refuse_the_same_keywords(compiler):
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<f>", "end": "</f>",
                                                "content": {"type": "json_schema", "json_schema": NESTED}}}
    with pytest.raises(GrammarError) as info:
        compiler.submit("structural_tag", json.dumps(tag)).result(timeout=30)
    assert str(info.value) == NESTED_ERROR
    legacy = {"structures": [{"begin": "<f>", "schema": NESTED, "end": "</f>"}], "triggers": ["<f"]}
    with pytest.raises(GrammarError, match=re.escape("invalid structural_tag: structures[0].schema: 'uniqueItems' "
                                                     "at $.properties.tags is not supported")):
        compiler.submit("structural_tag", json.dumps(legacy)).result(timeout=30)


def test_supported_constraints_still_compile_and_constrain(compiler, tokenizer):
    schema = {"type": "object", "title": "Order", "description": "annotations stay accepted",
              "properties": {"n": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
                             "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                             "pet": UNION["properties"]["pet"]},
              "required": ["n", "code", "pet"], "$defs": UNION["$defs"]}

    def feeds(text: str) -> bool:
        state = compiler.matcher(compiler.submit("json_schema", json.dumps(schema)).result(timeout=30))
        return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    assert feeds('{"n": 15, "code": "ABC", "pet": {"kind": "cat", "lives": 3}}')
    assert not feeds('{"n": 16')  # multipleOf
    assert not feeds('{"n": 15, "code": "abc"')  # pattern
    assert not feeds('{"n": 15, "code": "ABC", "pet": {"kind": "cat", "name"')  # the Cat schema


def test_every_tool_choice_constraint_the_frontend_builds_compiles(compiler):
    # The frontend's own schemas for tool_choice required / named must pass the keyword check:
    # a client cannot fix a schema it did not write (QA: 'type' beside 'anyOf' with two tools).
    from openai_frontend.protocol import ChatTool, NamedToolChoice
    from openai_frontend.tool_parsers import TOOL_PARSERS
    from openai_frontend.tools import plan_tools

    def tool(name: str, parameters: dict | None) -> ChatTool:
        function = {"name": name, **({"parameters": parameters} if parameters is not None else {})}
        return ChatTool.model_validate({"type": "function", "function": function})

    tools = [tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
             tool("get_time", {"type": "object", "properties": {"tz": {"type": "string"}}}),
             tool("ping", None),
             tool("pet", {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
                          "$defs": {"P": {"type": "object", "properties": {"k": {"type": "string"}}}}})]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}})
    for parser in (None, *TOOL_PARSERS):
        for count in (1, 2, len(tools)):
            for choice in ("required", named):
                for parallel in (None, False):
                    plan = plan_tools(tools[:max(count, 2)] if choice is named else tools[:count], choice,
                                      parallel, parser)
                    kind, spec = plan.constraint
                    compiler.submit(kind, spec).result(timeout=60)  # raises GrammarError if refused

r"""Structured output: compile per-request constraints with xgrammar, one matcher per sequence.

Kinds (`SamplingParams.constraint`): ``json_schema``, ``regex``, ``ebnf`` (xgrammar's EBNF, the
GBNF dialect) and ``structural_tag`` (SGLang's legacy ``{"structures": [...], "triggers": [...]}``
or xgrammar's ``{"type": "structural_tag", "format": {...}}``).

The engine uses three things:

* ``GrammarCompiler.submit(kind, spec)`` returns a ``concurrent.futures.Future`` at once. The
  compile runs on a worker thread (xgrammar releases the GIL while it computes token masks, so
  the step loop keeps running). Compiled grammars are cached by ``(kind, spec)`` (LRU); equal
  specs submitted while one is compiling share that compile. A compile that runs longer than
  ``compile_timeout_s`` fails its future with ``GrammarError("... took longer than ...")``; the
  thread cannot be killed and finishes in the background, but it gives its worker slot back, and
  at most ``max_abandoned`` (default ``2 * max_workers``) such abandoned compiles may run at once
  (beyond that, new compiles wait in the queue, and a compile that waits longer than
  ``compile_timeout_s`` for a worker fails too). Every future therefore resolves within about
  twice ``compile_timeout_s``.
* ``GrammarCompiler.matcher(compiled)`` gives a ``GrammarState`` for one sequence.
* Per step: ``state.fill_bitmask(bitmask, row)`` before the draw (masked logits are set to -inf
  by ``kernels.apply_token_bitmask``), then ``state.accept(token)`` with the drawn token, then
  ``state.is_terminated``; with jump-forward decoding on, ``state.jump_forward_from(token, ...)``
  for the tokens the grammar now forces (and the drawn token respelled with them, where the
  tokenizer merges across the boundary).

EOS: the matcher treats the model's stop tokens (EOS) as part of the grammar. It allows a stop
token only where the grammar can end (e.g. after the closing ``}`` of a JSON document), and it
allows nothing *but* stop tokens once the grammar is complete and cannot continue. Accepting a stop
token terminates the matcher (``is_terminated`` becomes True). Stop tokens are the ids given as
``stop_token_ids``, or else the tokenizer's ``eos_token_id`` plus the ``eos_token_id`` of the
model directory's ``generation_config.json`` (the same set the engine stops on).

JSON schema settings and why:

* ``strict_mode=True`` (as vLLM and SGLang compile): an object schema that declares
  ``properties`` gets only those members unless it says ``additionalProperties``, and a
  ``prefixItems`` array gets no extra items. Every output is still valid under standard JSON Schema
  semantics (it is a subset of what the schema allows), and models do not invent keys. A schema
  that declares no properties, ``{"type": "object"}`` (OpenAI's ``json_object``) in particular,
  still allows arbitrary members with arbitrary values: xgrammar 0.2.8 applies strictness only to
  declared properties (tests check this).
* ``any_whitespace=True`` with at most ``JSON_MAX_WHITESPACE`` consecutive whitespace characters:
  models may format JSON as they were trained to (compact or indented), but a model cannot
  emit whitespace forever between two tokens of the document.
* ``minLength``/``maxLength`` on a string without a ``pattern`` or a format xgrammar knows are
  rewritten into the equivalent ``pattern`` ``^[\s\S]{min,max}$`` before compiling. xgrammar 0.2.8
  compiles length-bounded strings to a bare character class that admits raw control characters
  (U+0000-U+001F), which makes invalid JSON (mlc-ai/xgrammar#800; fixes pending in #822/#880); its ``pattern`` path is
  JSON-string aware and never emits them. Both paths count code points and neither emits escape
  sequences (``\n``, ``\"``) inside a bounded string.
* The schema is checked against its JSON Schema meta-schema first (``jsonschema``), so a typo such
  as ``"type": "strin"`` or ``"minLength": -1`` is refused with the meta-schema's message.
* Then every keyword xgrammar 0.2.8 would compile to nothing (``not``, ``if``, ``uniqueItems``,
  ``allOf`` of two schemas, a length bound beside a ``pattern``, ...) is refused with its JSON
  path (``_check_enforceable``): output would break the schema the client gave.
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import re
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, NoReturn, Optional

import torch

__all__ = ["GrammarError", "GrammarCompiler", "GrammarState", "Utf8Guard", "allocate_bitmask", "KINDS", "JSON_MAX_WHITESPACE"]

# json_schema_whitespace: a JSON schema with a whitespace regex, spec ``[pattern, schema text]``
# (backend/json_whitespace.py; SamplingParams.constraint builds it).
KINDS = ("json_schema", "json_schema_whitespace", "regex", "ebnf", "structural_tag")

# At most this many consecutive whitespace characters between JSON tokens (see module docstring).
JSON_MAX_WHITESPACE = 16


# Compile threads alive in this process. At exit we wait for them (up to EXIT_WAIT_S): a thread
# still inside xgrammar while the interpreter finalizes can crash the process (SIGSEGV/abort).
EXIT_WAIT_S = 30.0
_LIVE: "set[threading.Thread]" = set()
_LIVE_LOCK = threading.Lock()


def _join_compile_threads(timeout: float = EXIT_WAIT_S) -> bool:
    """Wait for every compile thread of the process; True if none is left."""
    deadline = time.monotonic() + timeout
    while True:
        with _LIVE_LOCK:
            live = [t for t in _LIVE if t.is_alive()]
        if not live:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        live[0].join(timeout=left)


atexit.register(_join_compile_threads)


class GrammarError(ValueError):
    """A constraint that cannot be used; the message names the kind and the problem."""


# One matcher call (a token's mask or its acceptance) past this ends the request: legitimate
# grammars take milliseconds (a large JSON schema's uncached mask included), while an ambiguous
# one (nested repetitions ambiguous_repetition cannot see: in EBNF, in xgrammar's own regex
# syntax) grows to seconds and holds up the step every request shares.
MATCH_TIME_LIMIT_S = 1.0


AMBIGUOUS_REPETITION = ("it repeats without bound a part that can match nothing (as `( *)*` and `( ?)*` do): every "
                        "way to split the text among the repetitions is a parse, and matching them all takes up to "
                        "seconds a token; write the plain form (` *`)")


def ambiguous_repetition(pattern: str) -> bool:
    """Whether a regex repeats without bound a part that can match nothing (`( *)*`,
    `(( *)*)*`, `( ?)*`, `(a|)*`): every split of a run among the repetitions, empty ones
    included, is a parse, and xgrammar's matcher tracks them all, up to seconds a token on the
    step loop every request shares (fuzz QA: 0.7 s a step, 4.6 s at worst, for `(( *)*)*`; review:
    `( ?)*` 0.5 s by 150 tokens and growing). The same language has a plain form (` *`).
    Patterns Python's parser cannot read (xgrammar's own syntax), or nested too deep to walk, are
    left to the matcher's time limit (GrammarState): False. Callers refuse with
    AMBIGUOUS_REPETITION."""
    import re._constants as sre_c
    import re._parser as sre_p

    try:
        parsed = sre_p.parse(pattern)
    except Exception:  # not Python's syntax: left to the time limit
        return False
    repeats = (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, getattr(sre_c, "POSSESSIVE_REPEAT", sre_c.MAX_REPEAT))

    def children(op: Any, av: Any) -> list:
        if op in repeats:
            return [av[2]]
        if op is sre_c.SUBPATTERN:
            return [av[3]]
        if op is sre_c.BRANCH:
            return list(av[1])
        if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
            return [av[1]]
        return []

    def nullable(sub: Any) -> bool:
        return all(item_nullable(op, av) for op, av in sub)

    def item_nullable(op: Any, av: Any) -> bool:
        if op in repeats:
            return av[0] == 0 or nullable(av[2])
        if op is sre_c.SUBPATTERN:
            return nullable(av[3])
        if op is sre_c.BRANCH:
            return any(nullable(b) for b in av[1])
        return op in (sre_c.AT, sre_c.ASSERT, sre_c.ASSERT_NOT, sre_c.GROUPREF)

    def found(sub: Any) -> bool:
        return any((op in repeats and av[1] == sre_c.MAXREPEAT and nullable(av[2]))
                   or any(found(c) for c in children(op, av)) for op, av in sub)

    try:
        return found(parsed)
    except RecursionError:  # nested past Python's stack: left to the time limit
        return False


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask [batch, ceil(vocab_size / 32)], all tokens allowed (every bit set).

    Bit ``t % 32`` of word ``t // 32`` in a row is 1 when token ``t`` is allowed.
    """
    if batch < 0 or vocab_size <= 0:
        raise ValueError(f"need batch >= 0 and vocab_size > 0, got {batch}, {vocab_size}")
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# After these lead bytes UTF-8 narrows the range of the next byte (RFC 3629): the rest would be
# overlong encodings, surrogates or code points past U+10FFFF. xgrammar 0.2.8 accepts them inside
# a length-bounded JSON string (the pattern maxLength is rewritten into): it took E0 9A 94 as
# U+0694, the text then decoded to three U+FFFD and broke the maxLength (random demo weights,
# 1 of 80 schema outputs). Its other paths (a bare regex class, an unbounded JSON string) refuse them.
_FIRST_CONTINUATION = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _ill_formed(data: bytes) -> bool:
    """Whether `data` holds a byte that can never appear in UTF-8, or a narrowed lead byte whose
    next byte is out of its range (a fragment cut at either end is fine)."""
    for i, b in enumerate(data):
        if b in (0xC0, 0xC1) or b >= 0xF5:
            return True
        rng = _FIRST_CONTINUATION.get(b)
        if rng is not None and i + 1 < len(data) and not rng[0] <= data[i + 1] <= rng[1]:
            return True
    return False


def _utf8_tail(data: bytes) -> bytes:
    """The incomplete character at the end of `data` (its lead and the continuation bytes so far),
    or b""."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # the last byte that is not a continuation byte
            length = 1 if b < 0x80 else 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return data[-back:] if back < length else b""
    return b""


class Utf8Guard:
    """Keeps constrained output well-formed UTF-8 where xgrammar does not (see
    _FIRST_CONTINUATION): token bitmasks that take out tokens no UTF-8 text contains, and, after
    a narrowed lead byte, the tokens whose first byte is outside its range. Built once per
    tokenizer; one per GrammarCompiler."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int) -> None:
        import numpy as np

        words = (vocab_size + 31) // 32
        self.token_bytes = list(decoded_vocab[:vocab_size]) + [b""] * max(0, vocab_size - len(decoded_vocab))

        def mask_without(tokens: list[int]) -> torch.Tensor:
            bits = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
            for t in tokens:
                bits[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            return torch.from_numpy(bits.view(np.int32))

        self.always = mask_without([t for t, b in enumerate(self.token_bytes) if _ill_formed(b)])
        self.after_lead = {
            lead: mask_without([t for t, b in enumerate(self.token_bytes)
                                if b and 0x80 <= b[0] <= 0xBF and not lo <= b[0] <= hi])
            for lead, (lo, hi) in _FIRST_CONTINUATION.items()
        }

    def tail_after(self, tail: bytes, token_id: int) -> bytes:
        """The incomplete character at the end of the text once `token_id` follows `tail`."""
        if not 0 <= token_id < len(self.token_bytes):
            return b""
        return _utf8_tail(tail + self.token_bytes[token_id])

    def restrict(self, bitmask: torch.Tensor, row: int, tail: bytes) -> None:
        bitmask[row].bitwise_and_(self.always)
        if len(tail) == 1 and tail[0] in self.after_lead:
            bitmask[row].bitwise_and_(self.after_lead[tail[0]])


# xgrammar's C++ errors read "[07:21:28] /project/cpp/x.cc:83: Check failed: (...) is false: msg".
_CPP_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+?:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")
_EBNF_POSITION = re.compile(r"EBNF parser error at line \d+, column \d+:\s*")


def clean_xgrammar_error(message: str, kind: str) -> str:
    lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else str(message)
    text = _CHECK_FAILED.sub("", _CPP_PREFIX.sub("", text)).strip()
    if kind == "regex":
        # xgrammar converts a regex to EBNF first; positions in that EBNF mean nothing to the client.
        text = _EBNF_POSITION.sub("", text)
    return text[:500]


def _load_json(spec: str, kind: str) -> Any:
    try:
        return json.loads(spec)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"invalid {kind}: not valid JSON: {exc}") from None


def _check_json_schema(schema: Any) -> None:
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(
            f"invalid json_schema: a schema must be a JSON object or boolean, got {type(schema).__name__}"
        )
    if isinstance(schema, bool):
        return
    try:
        import jsonschema
    except ImportError:  # xgrammar still reports what it cannot convert
        return _check_enforceable(schema)
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise GrammarError(f"invalid json_schema: {exc.message}" + (f" (at {where})" if where else "")) from None
    except Exception as exc:  # unknown $schema dialect and the like
        raise GrammarError(f"invalid json_schema: {exc}") from None
    _check_enforceable(schema)


# xgrammar 0.2.8 compiles some JSON Schema keywords to nothing (at most a warning in the server's
# log), so its output could break the schema the client gave. Every such keyword is refused here
# instead, naming it and its JSON path. Each entry was found by experiment: compile a schema with
# xgrammar and see whether its matcher accepts a document jsonschema rejects
# (tests/test_grammar_schema_keywords.py keeps every finding, and fails once xgrammar enforces one).
# Keywords that only annotate (title, description, default, examples, $comment, ...) and unknown
# keywords are accepted: they constrain nothing.
_IGNORED = frozenset({"not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                      "contains", "minContains", "maxContains", "$dynamicRef", "$recursiveRef"})
# Keywords that constrain an instance (JSON Schema 2020-12 validation and applicators, and draft 7's).
_ASSERTING = _IGNORED | frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxProperties",
    "minProperties", "required", "properties", "patternProperties", "additionalProperties", "propertyNames",
    "items", "prefixItems", "additionalItems", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf",
    "oneOf", "$ref"})
# xgrammar compiles the first of these a schema holds and drops every other keyword beside it.
_FIRST_WINS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Keywords for one JSON type: xgrammar reads them only under a "type" (or one it infers from
# properties/additionalProperties/unevaluatedProperties, or items/prefixItems/unevaluatedItems).
_TYPED = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
                    "maxLength", "pattern", "format", "minItems", "maxItems", "required", "minProperties",
                    "maxProperties", "patternProperties", "propertyNames"})
# The formats xgrammar 0.2.8 compiles to a pattern. Calendar validity is not checked (2024-02-30
# passes as a date); other formats are annotations, as JSON Schema 2020-12 has them by default.
_XGRAMMAR_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                               "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Formats whose xgrammar 0.2.8 pattern is not JSON-string aware: its "[^~]" takes a raw '"', '\\'
# or control character, so the string could end early and the document run on past the schema
# (extra keys under additionalProperties false) or stop being JSON. The same languages as a
# "pattern" (RFC 6901; a relative pointer's prefix count, then "#" or a pointer), which is.
_FORMAT_PATTERNS = {
    "json-pointer": "^(/([^/~]|~[01])*)*$",
    "relative-json-pointer": "^(0|[1-9][0-9]*)(#|(/([^/~]|~[01])*)*)$",
}
_MISSING = object()


def _check_enforceable(schema: Any) -> None:
    """Raise GrammarError naming the first keyword (and its JSON path) of ``schema`` that xgrammar
    0.2.8 would not enforce; see the tables above."""

    def refuse(what: str, path: str, why: str = "the grammar cannot enforce it") -> NoReturn:
        raise GrammarError(f"invalid json_schema: {what} at {path} is not supported ({why})")

    def resolve(ref: str) -> Any:  # as xgrammar does: '#', or '#/' and object keys (no ~ or % escapes)
        node = schema
        for part in ref[1:].split("/"):
            if part:
                if not isinstance(node, dict) or part not in node:
                    return _MISSING
                node = node[part]
        return node

    validator = None

    def satisfies(value: Any, node: dict) -> bool:
        nonlocal validator
        try:
            import jsonschema
        except ImportError:
            return False
        try:
            if validator is None:
                validator = jsonschema.validators.validator_for(schema)(schema)
            return validator.evolve(schema=node).is_valid(value)
        except Exception:  # a reference jsonschema cannot resolve: xgrammar's compile names it
            return True

    def number(node: dict, key: str) -> Optional[float]:
        v = node.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

    def visit(node: Any, path: str, default_type: Optional[str] = None) -> None:
        if not isinstance(node, dict):
            return
        for kw, value in node.items():
            if kw in _IGNORED or (kw == "uniqueItems" and value is True):
                refuse(f"'{kw}'", path)
        ref = node.get("$ref")
        if "$ref" in node and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            refuse(f"'$ref' {json.dumps(ref)}", path, "only references within the schema, '#' or '#/...', are")
        first = next((kw for kw in _FIRST_WINS if kw in node), None)
        if first is not None:
            dropped = [kw for kw in node if kw in _ASSERTING and kw != first
                       and not (kw == "uniqueItems" and node[kw] is False)]
            if first in ("const", "enum"):  # the output is one of the values: each must satisfy the rest
                values = [node["const"]] if first == "const" else node["enum"] if isinstance(node["enum"], list) else []
                bad = next((v for v in values if dropped and not satisfies(v, node)), _MISSING)
                if bad is not _MISSING:
                    text = json.dumps(bad)
                    text = text if len(text) <= 60 else text[:57] + "..."
                    refuse(f"'{first}' value {text} that breaks the keywords beside it", path,
                           f"the grammar enforces only the '{first}' there")
            elif dropped:
                refuse(f"'{dropped[0]}' beside '{first}'", path,
                       f"the grammar enforces only the '{first}' there; move '{dropped[0]}' into it")
            if first == "allOf" and isinstance(node["allOf"], list) and len(node["allOf"]) > 1:
                refuse("'allOf' of more than one schema", path, "the grammar cannot enforce it; merge them into one")
        else:
            t = node.get("type", default_type)
            types = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()
            if not types and any(k in node for k in ("properties", "additionalProperties", "unevaluatedProperties")):
                types = {"object"}
            elif not types and any(k in node for k in ("items", "prefixItems", "unevaluatedItems")):
                types = {"array"}
            elif not types:
                for kw in node:
                    if kw in _TYPED:
                        refuse(f"'{kw}' without a 'type'", path, "the grammar applies it only under a 'type'; add one")
            if "multipleOf" in node and types & {"integer", "number"}:
                m = number(node, "multipleOf")
                los = [math.ceil(v) for v in (number(node, "minimum"),) if v is not None]
                los += [math.floor(v) + 1 for v in (number(node, "exclusiveMinimum"),) if v is not None]
                his = [math.floor(v) for v in (number(node, "maximum"),) if v is not None]
                his += [math.ceil(v) - 1 for v in (number(node, "exclusiveMaximum"),) if v is not None]
                bounded = not (los or his) or bool(los and his and min(his) - max(los) + 1 <= 10000)
                if "number" in types or m is None or m != int(m) or not 1 <= m <= 1024 or not bounded:
                    refuse("'multipleOf'", path, "the grammar enforces it only for type 'integer', a whole "
                           "multipleOf from 1 to 1024, and no bounds or a range of at most 10000 integers")
            if "string" in types:
                fmt = node.get("format") if node.get("format") in _XGRAMMAR_FORMATS else None
                for kw in ("minLength", "maxLength", "pattern"):
                    keeps = "format" if fmt else "pattern" if kw != "pattern" and "pattern" in node else None
                    if kw in node and keeps:
                        refuse(f"'{kw}' beside '{keeps}'", path, f"the grammar enforces only the '{keeps}' there")
                if isinstance(node.get("pattern"), str) and _has_lookahead(node["pattern"]):
                    refuse("'pattern' with a lookahead", path, "the grammar ignores lookaheads")
                if isinstance(node.get("pattern"), str) and ambiguous_repetition(node["pattern"]):
                    refuse("'pattern' that repeats without bound a part that can match nothing (as `( *)*` "
                           "does)", path, "matching it takes up to seconds a token; write the plain form (` *`)")
            if "object" in types and isinstance(node.get("required"), list):
                declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
                for name in node["required"]:
                    if name not in declared:
                        refuse(f"'required' name {json.dumps(name)} not under 'properties'", path,
                               "the grammar requires only declared properties; declare it")
        # The subschemas xgrammar compiles: narrower than _SUBSCHEMA* (which _bounded_strings
        # copies through), whose others (not, if, contains, ...) are refused above or annotate.
        for kw in ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems"):
            visit(node.get(kw), f"{path}.{kw}")
        visit(node.get("propertyNames"), f"{path}.propertyNames", "string")
        for kw in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(node.get(kw), dict):
                for key, sub in node[kw].items():
                    name = f".{key}" if re.fullmatch(r"[A-Za-z_$][\w$-]*", key) else f"[{json.dumps(key)}]"
                    visit(sub, f"{path}.{kw}{name}")
        for kw in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if isinstance(node.get(kw), list):
                for i, sub in enumerate(node[kw]):
                    visit(sub, f"{path}.{kw}[{i}]")
        if first == "oneOf" and isinstance(node["oneOf"], list) and not _disjoint(node["oneOf"], resolve):
            refuse("'oneOf' whose schemas may overlap", path, "the grammar compiles it as 'anyOf'; use 'anyOf', "
                   "or give each schema a required property with its own 'const'")

    visit(schema, "$")


def _has_lookahead(pattern: str) -> bool:
    """Whether a regex holds ``(?=`` or ``(?!`` outside a character class (xgrammar 0.2.8 drops a
    lookahead in a JSON schema's ``pattern``, with a warning; lookbehinds it refuses)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif pattern.startswith(("(?=", "(?!"), i):
            return True
        i += 1
    return False


def _disjoint(schemas: list, resolve: Callable[[str], Any]) -> bool:
    """Whether no instance can match two of ``schemas`` (a sound, partial proof): every pair differs
    in its types, in its const/enum values, or, both objects, in the const/enum values of a
    property both require (a discriminator). xgrammar compiles a ``oneOf`` it cannot prove so as an
    ``anyOf``, which is the same only when its schemas are disjoint."""

    def deref(node: Any) -> Any:
        for _ in range(32):
            if not (isinstance(node, dict) and isinstance(node.get("$ref"), str)):
                return node
            node = resolve(node["$ref"])
        return None

    def values(node: dict) -> Optional[list]:
        if "const" in node:
            return [node["const"]]
        return node["enum"] if isinstance(node.get("enum"), list) else None

    def types(node: dict) -> Optional[set]:
        t = node.get("type")
        ts = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
        return ts | {"integer"} if ts and "number" in ts else ts  # an integer is a number

    def type_of(v: Any) -> set:
        if isinstance(v, bool):
            return {"boolean"}
        if isinstance(v, (int, float)):
            return {"integer", "number"} if float(v).is_integer() else {"number"}
        return {{type(None): "null", str: "string", list: "array", dict: "object"}.get(type(v), "object")}

    def apart(a: Any, b: Any) -> bool:
        if a is _MISSING or b is _MISSING or a is False or b is False:
            return True  # matches nothing (xgrammar refuses a false schema and a missing $ref itself)
        if not (isinstance(a, dict) and isinstance(b, dict)):
            return False
        va, vb, ta, tb = values(a), values(b), types(a), types(b)
        if va is not None and vb is not None:
            return not any(x == y for x in va for y in vb)
        if va is not None and tb is not None:
            return not any(type_of(x) & tb for x in va)
        if vb is not None and ta is not None:
            return not any(type_of(y) & ta for y in vb)
        if ta is not None and tb is not None and not ta & tb:
            return True
        if ta == tb == {"object"} and isinstance(a.get("required"), list) and isinstance(b.get("required"), list):
            pa = a.get("properties") if isinstance(a.get("properties"), dict) else {}
            pb = b.get("properties") if isinstance(b.get("properties"), dict) else {}
            for key in set(a["required"]) & set(b["required"]):
                ka, kb = deref(pa.get(key)), deref(pb.get(key))
                if isinstance(ka, dict) and isinstance(kb, dict) and values(ka) is not None and values(kb) is not None \
                        and apart(ka, kb):
                    return True
        return False

    resolved = [deref(s) for s in schemas]
    return all(apart(resolved[i], resolved[j]) for i in range(len(resolved)) for j in range(i + 1, len(resolved)))


# Keywords whose values are subschemas (JSON Schema 2020-12 and draft 7), for _bounded_strings.
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems",
              "contains", "propertyNames", "not", "if", "then", "else", "contentSchema")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def _bounded_strings(schema: Any) -> Any:
    """A copy of ``schema`` where every ``minLength``/``maxLength`` without a ``pattern`` or a format
    xgrammar knows is the equivalent ``pattern`` (see the module docstring: xgrammar#800), and so
    is each format of _FORMAT_PATTERNS (_check_enforceable refuses a length or pattern beside a
    known format). Data (enum, const, default, examples) is never touched."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = _bounded_strings(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _bounded_strings(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_bounded_strings(v) for v in out[key]]
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in _FORMAT_PATTERNS and "pattern" not in out:
        del out["format"]
        out["pattern"] = _FORMAT_PATTERNS[fmt]
    lo, hi = out.get("minLength"), out.get("maxLength")
    if (lo is not None or hi is not None) and "pattern" not in out and out.get("format") not in _XGRAMMAR_FORMATS:
        lo = int(lo) if isinstance(lo, (int, float)) else 0
        hi = str(int(hi)) if isinstance(hi, (int, float)) else ""
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{lo},{hi}}}$"
    return out


def _json_formats(fmt: Any, xgr: Any = None) -> Any:
    """Every json_schema inside a structural-tag format tree gets what a json_schema constraint
    gets: _check_enforceable, _bounded_strings, and at most JSON_MAX_WHITESPACE whitespace characters in a row (unless
    the format sets its own max_whitespace_cnt). A json_schema element may also carry a
    `whitespace_pattern` (vLLM's guided_whitespace_pattern; xgrammar's element has none): it
    becomes the grammar element of that schema with that whitespace, as a whole-output
    constraint's (the frontend puts one there for the answer after a reasoning section)."""
    if isinstance(fmt, list):
        return [_json_formats(v, xgr) for v in fmt]
    if not isinstance(fmt, dict):
        return fmt
    if fmt.get("type") == "json_schema" and "whitespace_pattern" in fmt:
        return _json_schema_element_with_whitespace(fmt, xgr)
    out = {k: _json_formats(v, xgr) for k, v in fmt.items() if k != "json_schema"}
    if "json_schema" in fmt:
        inner = fmt["json_schema"]
        if fmt.get("type") == "json_schema":
            _check_enforceable(inner)
            out["json_schema"] = _bounded_strings(inner)
            if out.get("max_whitespace_cnt") is None:
                out["max_whitespace_cnt"] = JSON_MAX_WHITESPACE
        else:
            out["json_schema"] = inner
    return out


def _json_schema_element_with_whitespace(fmt: dict, xgr: Any) -> dict:
    pattern, schema = fmt["whitespace_pattern"], fmt.get("json_schema")
    other = set(fmt) - {"type", "json_schema", "whitespace_pattern"}
    if other:
        raise GrammarError(f"invalid structural_tag: a json_schema element with a whitespace_pattern takes no "
                           f"{', '.join(sorted(other))}")
    if not isinstance(pattern, str):
        raise GrammarError("invalid whitespace_pattern: expected a string")
    if isinstance(schema, str):
        schema = _load_json(schema, "json_schema")
    return {"type": "grammar", "grammar": _json_ebnf_with_whitespace(xgr, schema, pattern)}


def _json_ebnf_with_whitespace(xgr: Any, schema: Any, pattern: str) -> str:
    """The grammar (root rule `root`) of a json_schema constraint whose whitespace between
    tokens is `pattern` (backend.json_whitespace), with the client's errors as GrammarErrors."""
    from backend.json_whitespace import WhitespacePatternError, json_schema_ebnf_with_whitespace

    _check_json_schema(schema)
    try:
        return json_schema_ebnf_with_whitespace(xgr, json.dumps(_bounded_strings(schema)), pattern,
                                                JSON_MAX_WHITESPACE, strict_mode=True)
    except WhitespacePatternError as exc:
        raise GrammarError(f"invalid whitespace_pattern: {exc}") from None
    except RuntimeError as exc:
        raise GrammarError(f"invalid json_schema: {clean_xgrammar_error(str(exc), 'json_schema')}") from None


def _generation_config_eos(tokenizer: Any) -> list[int]:
    name = getattr(tokenizer, "name_or_path", None)
    if not name:
        return []
    path = Path(str(name)) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if isinstance(eos, int):
        return [eos]
    return [t for t in eos if isinstance(t, int)] if isinstance(eos, list) else []


class DraftMask:
    """One draft position's grammar bitmask row (GrammarState.draft_masks), where the sampler
    takes a grammar: it only asks it to fill the row."""

    __slots__ = ("_row",)

    def __init__(self, row: torch.Tensor) -> None:
        self._row = row

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self._row


class GrammarState:
    """One sequence's position in its grammar (an ``xgrammar.GrammarMatcher``). Not thread-safe:
    the engine's step loop is its only user.

    The grammar's stop tokens (EOS) are allowed by ``fill_bitmask`` only where the grammar can end;
    accepting one makes ``is_terminated`` True, and the sequence should finish then.
    """

    __slots__ = ("_matcher", "_words", "_num_accepted", "_guard", "_tail", "slowest")

    def __init__(self, matcher: Any, vocab_size: int, guard: Optional[Utf8Guard] = None) -> None:
        self._matcher = matcher
        self._words = (vocab_size + 31) // 32
        self._num_accepted = 0
        self._guard = guard
        self._tail = b""  # the incomplete UTF-8 character the accepted tokens end with
        # The most CPU time one matcher call took (s; CPU time, so a busy host's descheduling
        # does not count): the engine ends a request whose grammar is so ambiguous that matching
        # one token stalls every request's step (MATCH_TIME_LIMIT_S).
        self.slowest = 0.0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32 [B, ceil(vocab/32)], as from
        ``allocate_bitmask``). Other rows are left alone. Stop tokens are set only where the grammar
        may end. A terminated matcher has no next token: xgrammar raises, and the engine ends the
        sequence at termination, so it never asks."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise ValueError(
                f"bitmask must be a 2-D CPU int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}"
            )
        if bitmask.shape[1] != self._words:
            raise ValueError(
                f"bitmask has {bitmask.shape[1]} words per row, the grammar's vocabulary needs {self._words}"
            )
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"row {row} is out of range for a bitmask of {bitmask.shape[0]} rows")
        t0 = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.slowest = max(self.slowest, time.thread_time() - t0)
        if self._guard is not None:
            self._guard.restrict(bitmask, row, self._tail)

    def accept(self, token_id: int) -> bool:
        """Advance by one token. False (and no change) if the grammar does not allow it here, or the
        grammar has already terminated."""
        if self._matcher.is_terminated():
            return False
        t0 = time.thread_time()
        ok = bool(self._matcher.accept_token(int(token_id)))
        self.slowest = max(self.slowest, time.thread_time() - t0)
        self._num_accepted += ok
        if ok and self._guard is not None:
            self._tail = self._guard.tail_after(self._tail, int(token_id))
        return ok

    def draft_masks(self, draft: list[int]) -> torch.Tensor:
        """Speculative decoding: the bitmask rows of a draft's positions, [1 + len(draft), words]
        (CPU int32). Row j allows what the grammar allows after the draft's first j tokens. The
        draft is accepted to fill them and rolled back after: the state is as it was. Past a draft
        token the grammar refuses, or a stop token that ends it, the rows repeat the last one: no
        later position's draw is used."""
        masks = torch.full((1 + len(draft), self._words), -1, dtype=torch.int32)
        tail, taken = self._tail, 0
        try:
            for j in range(len(draft) + 1):
                self.fill_bitmask(masks, j)
                if j == len(draft) or not self.accept(draft[j]):
                    masks[j + 1 :] = masks[j]
                    break
                taken += 1
                if self._matcher.is_terminated():  # a stop token: kept, it ends the sequence there
                    masks[j + 1 :] = masks[j]
                    break
        finally:
            if taken:
                self._matcher.rollback(taken)
                self._num_accepted -= taken
            self._tail = tail
        return masks

    @property
    def is_terminated(self) -> bool:
        """True once a stop token (EOS) has been accepted at a point where the grammar may end."""
        return bool(self._matcher.is_terminated())

    @property
    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token would be accepted now)."""
        return bool(self._matcher.is_completed())

    @property
    def num_accepted(self) -> int:
        return self._num_accepted

    def jump_forward_string(self) -> str:
        """The text the grammar forces next ("" if none): every continuation starts with it."""
        try:
            return self._matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            # The forced bytes start or end inside a character (the model's last token held only
            # its first byte): there is no text to tokenize, so nothing is jumped here.
            return ""

    def jump_forward(
        self, encode: Callable[[str], list[int]], limit: int, stop_before: Collection[int] = ()
    ) -> list[int]:
        """Jump-forward decoding: the tokens of the text the grammar forces next, accepted here,
        at most ``limit`` and none from ``stop_before`` onwards. The engine appends them without
        sampling.

        The forced text is tokenized on its own and its last token is left to the model: the
        tokenizer would often merge it with what follows (``"`` with ``,``, a key's last letters
        with ``":``), and a forced boundary there would hand the model a token split it never saw
        in training. Tokens are accepted one at a time and the jump stops at the first one the
        matcher refuses (a special token the text happens to spell, a tokenizer that prepends a
        space), so the grammar's state is always exactly the accepted tokens.
        """
        if limit <= 0 or self._matcher.is_terminated():
            return []
        text = self.jump_forward_string()
        if not text:
            return []
        return self._take(encode(text)[:-1][:limit], stop_before)

    def jump_forward_from(
        self,
        last_token: int,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        limit: int,
        stop_before: Collection[int] = (),
    ) -> list[int]:
        """Jump-forward decoding that may retokenize across the boundary: ``last_token`` is the
        token just accepted (not yet computed by the model), and the result is the step's tokens,
        ``[last_token or its replacement, *forced tokens]``.

        Tokenized on its own, the forced text can split where the tokenizer would merge it with
        the sampled token before it (``{`` then ``"status"`` is ``{"`` + ``status"`` in context).
        The sampled token and the forced text are therefore tokenized together; when their first
        token is a longer one that covers the sampled text, the matcher is rolled back by one
        token and the context tokenization is accepted instead (SGLang retokenizes the same way;
        here the sampled token has no K/V yet, so nothing is recomputed). Otherwise, or if the
        matcher refuses the replacement, this is ``[last_token, *jump_forward(...)]``.
        """
        if limit <= 0 or self._matcher.is_terminated():
            return [last_token]
        text = self.jump_forward_string()
        if not text:
            return [last_token]
        last_text = decode([last_token])
        forced: Optional[list[int]] = None
        # Only a token that is whole text (no partial UTF-8 on either side) can be respelled.
        if self._num_accepted and not self._tail and last_text and "\ufffd" not in last_text:
            merged = encode(last_text + text)[:-1]
            if merged and merged[0] == last_token:
                forced = merged[1:]  # the forced text as the tokenizer splits it in context
            elif merged and merged[0] not in stop_before:
                head = decode(merged[:1])
                if head.startswith(last_text) and len(head) > len(last_text):
                    self._matcher.rollback(1)
                    self._num_accepted -= 1
                    taken = self._take(merged[: limit + 1], stop_before)
                    if taken:
                        return taken
                    if not self.accept(last_token):  # the replacement was refused: undo the rollback
                        raise RuntimeError(f"the grammar refused token {last_token} after rolling it back")
        if forced is None:
            forced = encode(text)[:-1]
        return [last_token, *self._take(forced[:limit], stop_before)]

    def _take(self, tokens: list[int], stop_before: Collection[int]) -> list[int]:
        # One at a time, up to the first refusal: the matcher's state is exactly what is returned.
        taken: list[int] = []
        for token in tokens:
            if token in stop_before or not self.accept(token):
                break
            taken.append(token)
        return taken


class _Job:
    __slots__ = ("key", "future", "state", "deadline", "abandoned")

    def __init__(self, key: tuple[str, str], deadline: float) -> None:
        self.key = key
        self.future: Future = Future()
        self.state = "queued"  # queued -> running -> done
        self.deadline = deadline
        self.abandoned = False


class GrammarCompiler:
    """Compiles constraints off the caller's thread, with a cache and a per-compile time limit.

    ``vocab_size`` is the model's vocabulary (logits width), which may exceed the tokenizer's;
    ids the tokenizer does not have are never allowed. ``max_workers`` compiles run at once.
    Optional keywords: ``stop_token_ids``, the ids that end a sequence (see the module docstring
    for the default); ``max_abandoned`` (default ``2 * max_workers``), how many timed-out compiles
    may still run in the background before new compiles wait for one of them to finish.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        max_workers: int = 2,
        cache_size: int = 256,
        compile_timeout_s: float = 10.0,
        stop_token_ids: Optional[Iterable[int]] = None,
        max_abandoned: Optional[int] = None,
    ) -> None:
        import xgrammar as xgr

        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        if stop_token_ids is None:
            stops = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
            stops += _generation_config_eos(tokenizer)
        else:
            stops = list(stop_token_ids)
        self.stop_token_ids = sorted({int(t) for t in stops if 0 <= int(t) < self.vocab_size})
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        self.stop_token_ids = list(self.tokenizer_info.stop_token_ids)
        self.utf8_guard = Utf8Guard(self.tokenizer_info.decoded_vocab, self.vocab_size)
        # Our LRU is the cache; xgrammar's own (unbounded by default) is off. One xgrammar thread per
        # compile: parallelism comes from our workers, and xgrammar's internal pool threads abort
        # the process (std::terminate) if it exits while an abandoned compile still runs.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.max_workers = max_workers
        self.max_abandoned = 2 * max_workers if max_abandoned is None else max(0, int(max_abandoned))
        self.cache_size = max(0, int(cache_size))
        self.compile_timeout_s = float(compile_timeout_s)

        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._cache: "collections.OrderedDict[tuple[str, str], _Job]" = collections.OrderedDict()
        self._queue: "collections.deque[_Job]" = collections.deque()
        self._active: list[_Job] = []  # queued or running, watched for deadlines
        self._running = 0
        self._abandoned = 0
        self._closed = False
        self._watchdog: Optional[threading.Thread] = None
        self._threads: "set[threading.Thread]" = set()
        # Counters (tests, metrics).
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_timeouts = 0
        with self._lock:
            self._ensure_watchdog_locked()

    # ------------------------------------------------------------------ public
    def submit(self, kind: str, spec: str) -> Future:
        """Start compiling (or reuse a cached compile). Never blocks. The future's result is a
        compiled grammar for ``matcher``; its exception is a ``GrammarError``."""
        out: Future = Future()
        if kind not in KINDS:
            out.set_exception(GrammarError(f"unknown constraint kind {kind!r}; expected one of {', '.join(KINDS)}"))
            return out
        if not isinstance(spec, str):
            out.set_exception(GrammarError(f"invalid {kind}: the spec must be a string, got {type(spec).__name__}"))
            return out
        key = (kind, spec)
        with self._lock:
            if self._closed:
                out.set_exception(GrammarError("the grammar compiler is shut down"))
                return out
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
            else:
                job = _Job(key, time.monotonic() + self.compile_timeout_s)
                if self.cache_size:
                    self._cache[key] = job
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
                self._queue.append(job)
                self._active.append(job)
                # The watchdog thread starts the compile: starting a thread here would wait for
                # it to be scheduled, and on a busy host that took 0.4 s of the caller's time.
                self._ensure_watchdog_locked()
                self._wake.notify_all()
        _chain(job.future, out)
        return out

    def matcher(self, compiled: Any) -> GrammarState:
        """A fresh per-sequence state for a compiled grammar (the result of a ``submit`` future)."""
        if not isinstance(compiled, self._xgr.CompiledGrammar):
            raise TypeError(f"expected a compiled grammar from GrammarCompiler.submit, got {type(compiled).__name__}")
        m = self._xgr.GrammarMatcher(compiled, max_rollback_tokens=0)
        return GrammarState(m, self.vocab_size, self.utf8_guard)

    def compile(self, kind: str, spec: str, timeout: Optional[float] = None) -> Any:
        """Blocking convenience: ``submit(kind, spec).result()``."""
        return self.submit(kind, spec).result(timeout=timeout)

    def shutdown(self, wait_s: float = 0.0) -> None:
        """Fail queued compiles, stop the watchdog. Running compiles finish on their own (daemon
        threads; their futures still resolve); ``wait_s`` > 0 waits up to that long for them,
        abandoned ones included. (At interpreter exit every compile thread is waited for, up to
        ``EXIT_WAIT_S``.)"""
        try:
            self._shutdown()
        finally:
            deadline = time.monotonic() + wait_s
            while wait_s > 0:
                with self._lock:
                    live = [t for t in self._threads if t.is_alive()]
                left = deadline - time.monotonic()
                if not live or left <= 0:
                    break
                live[0].join(timeout=left)

    def _shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failed = list(self._queue)
            self._queue.clear()
            for job in failed:
                job.state = "done"
            self._active = [j for j in self._active if j.state == "running"]
            self._cache.clear()
            self._wake.notify_all()
        for job in failed:
            if not job.future.done():
                job.future.set_exception(GrammarError("the grammar compiler is shut down"))
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "cached": len(self._cache),
                "queued": len(self._queue),
                "running": self._running,
                "abandoned": self._abandoned,
                "compiles": self.num_compiles,
                "cache_hits": self.num_cache_hits,
                "timeouts": self.num_timeouts,
            }

    # ------------------------------------------------------------------ workers
    def _dispatch_locked(self) -> None:
        while self._queue and self._running < self.max_workers and self._abandoned < self.max_abandoned:
            job = self._queue.popleft()
            job.state = "running"
            job.deadline = time.monotonic() + self.compile_timeout_s
            self._running += 1
            self.num_compiles += 1
            thread = threading.Thread(target=self._run, args=(job,), name=f"grammar-compile-{job.key[0]}", daemon=True)
            with _LIVE_LOCK:
                _LIVE.add(thread)
            self._threads.add(thread)
            thread.start()

    def _run(self, job: _Job) -> None:
        try:
            self._run_job(job)
        finally:
            me = threading.current_thread()
            with _LIVE_LOCK:
                _LIVE.discard(me)
            with self._lock:
                self._threads.discard(me)

    def _run_job(self, job: _Job) -> None:
        kind, spec = job.key
        result: Any = None
        error: Optional[BaseException] = None
        try:
            result = self._compile(kind, spec)
        except GrammarError as exc:
            error = exc
        except (RuntimeError, ValueError, TypeError, KeyError) as exc:
            error = GrammarError(f"invalid {kind}: {clean_xgrammar_error(str(exc), kind)}")
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the request
            error = GrammarError(f"could not compile {kind}: {type(exc).__name__}: {clean_xgrammar_error(str(exc), kind)}")
        with self._lock:
            deliver = not job.abandoned and job.state == "running"
            if job.abandoned:
                self._abandoned -= 1
            else:
                self._running -= 1
            job.state = "done"
            if error is not None or job.abandoned:
                self._uncache_locked(job)
            if job in self._active:
                self._active.remove(job)
            if not self._closed:
                self._dispatch_locked()
            self._wake.notify_all()
        # Outside the lock: done-callbacks of the futures run here.
        if deliver:
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)

    def _uncache_locked(self, job: _Job) -> None:
        if self._cache.get(job.key) is job:
            del self._cache[job.key]

    def _ensure_watchdog_locked(self) -> None:
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, name="grammar-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        """Starts queued compiles and fails the ones past their deadline (one thread per
        compiler, for its life)."""
        while True:
            expired: list[tuple[_Job, GrammarError]] = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                for job in list(self._active):
                    if job.deadline > now or job.state == "done":
                        continue
                    self._active.remove(job)
                    self._uncache_locked(job)
                    self.num_timeouts += 1
                    kind = job.key[0]
                    if job.state == "queued":
                        self._queue.remove(job)
                        msg = (f"compiling the {kind} took longer than {self.compile_timeout_s:g} s: it waited for a "
                               f"free compile worker (other compiles are still running); try again later")
                    else:  # running: abandon the thread (it cannot be killed), free its slot
                        job.abandoned = True
                        self._running -= 1
                        self._abandoned += 1
                        msg = (f"compiling the {kind} took longer than {self.compile_timeout_s:g} s "
                               f"(compile_timeout_s); simplify the {kind}")
                    job.state = "done"
                    expired.append((job, GrammarError(msg)))
                self._dispatch_locked()
                if not expired:
                    pending = [j.deadline for j in self._active]
                    timeout = max(0.0, min(pending) - now) + 0.001 if pending else None
                    self._wake.wait(timeout=timeout)
            for job, error in expired:  # outside the lock: done-callbacks run here
                if not job.future.done():
                    job.future.set_exception(error)

    # ------------------------------------------------------------------ compile
    def _compile(self, kind: str, spec: str) -> Any:
        c = self._compiler
        if kind == "json_schema":
            schema = _load_json(spec, kind)
            _check_json_schema(schema)
            return c.compile_json_schema(
                json.dumps(_bounded_strings(schema)),
                any_whitespace=True,
                max_whitespace_cnt=JSON_MAX_WHITESPACE,
                strict_mode=True,
            )
        if kind == "json_schema_whitespace":
            return self._json_schema_with_whitespace(spec)
        if kind == "regex":
            if not spec:
                raise GrammarError("invalid regex: the pattern is empty")
            if ambiguous_repetition(spec):
                raise GrammarError(f"invalid regex: {AMBIGUOUS_REPETITION}")
            return c.compile_regex(spec)
        if kind == "ebnf":
            if not spec.strip():
                raise GrammarError("invalid ebnf: the grammar is empty")
            return c.compile_grammar(spec, root_rule_name="root")
        if kind == "structural_tag":
            return c.compile_structural_tag(self._structural_tag(spec))
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def _json_schema_with_whitespace(self, spec: str) -> Any:
        pair = _load_json(spec, "json_schema_whitespace")
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise GrammarError("invalid json_schema_whitespace: expected [pattern, schema]")
        pattern, schema_text = pair
        ebnf = _json_ebnf_with_whitespace(self._xgr, _load_json(schema_text, "json_schema"), pattern)
        return self._compiler.compile_grammar(ebnf, root_rule_name="root")

    def _structural_tag(self, spec: str) -> Any:
        from pydantic import ValidationError

        xgr = self._xgr
        obj = _load_json(spec, "structural_tag")
        if not isinstance(obj, dict):
            raise GrammarError("invalid structural_tag: expected a JSON object")
        if obj.get("type", "structural_tag") != "structural_tag":
            raise GrammarError(f"invalid structural_tag: type must be 'structural_tag', got {obj.get('type')!r}")
        try:
            if "format" in obj:  # xgrammar's format: {"type": "structural_tag", "format": {...}}
                return xgr.StructuralTag.model_validate({**obj, "format": _json_formats(obj["format"], xgr)})
            if "structures" in obj:  # SGLang's legacy format
                structures, triggers = obj.get("structures"), obj.get("triggers")
                if not isinstance(structures, list) or not structures:
                    raise GrammarError("invalid structural_tag: 'structures' must be a non-empty list")
                if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
                    raise GrammarError(
                        "invalid structural_tag: 'triggers' must be a non-empty list of non-empty strings"
                    )
                items = []
                for i, s in enumerate(structures):
                    if not isinstance(s, dict) or not all(k in s for k in ("begin", "schema", "end")):
                        raise GrammarError(f"invalid structural_tag: structures[{i}] needs 'begin', 'schema' and 'end'")
                    schema = s["schema"]
                    if isinstance(schema, str):
                        schema = _load_json(schema, "structural_tag")
                    try:
                        _check_json_schema(schema)
                    except GrammarError as exc:
                        problem = str(exc).removeprefix("invalid json_schema: ")
                        raise GrammarError(f"invalid structural_tag: structures[{i}].schema: {problem}") from None
                    if not any(s["begin"].startswith(t) for t in triggers):
                        raise GrammarError(
                            f"invalid structural_tag: structures[{i}].begin {s['begin']!r} starts with none of the triggers"
                        )
                    items.append(xgr.StructuralTagItem(begin=s["begin"], schema=schema, end=s["end"]))
                tag = xgr.StructuralTag.from_legacy_structural_tag(items, triggers)
                return xgr.StructuralTag.model_validate(_json_formats(tag.model_dump(mode="json", by_alias=True), xgr))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            raise GrammarError(f"invalid structural_tag: {loc + ': ' if loc else ''}{err.get('msg', exc)}") from None
        raise GrammarError(
            "invalid structural_tag: expected {\"type\": \"structural_tag\", \"format\": {...}} or "
            "{\"structures\": [{\"begin\", \"schema\", \"end\"}], \"triggers\": [...]}"
        )


def _chain(src: Future, dst: Future) -> None:
    def copy(f: Future) -> None:
        if dst.done():
            return
        exc = f.exception()
        if exc is not None:
            dst.set_exception(exc)
        else:
            dst.set_result(f.result())

    src.add_done_callback(copy)

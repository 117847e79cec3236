r"""A JSON schema's grammar with the whitespace between its tokens given by a request's regex.

vLLM's ``guided_whitespace_pattern`` (outlines' ``whitespace_pattern``): the regex replaces the
default "any JSON whitespace" wherever the document may have whitespace between two tokens:
``""`` gives compact JSON, ``" ?"`` at most one space, ``"[\n ]*"`` newlines and spaces.
xgrammar has no such option, so the schema's EBNF (as ``compile_json_schema`` would build it) is
rewritten: every bounded whitespace run ``whitespace_N{0, K}`` becomes one reference to the
pattern's own rules, converted from the regex by xgrammar.

The pattern may only produce JSON's four whitespace characters (space, tab, newline, carriage
return): anything else between tokens would make the output invalid JSON, which is what a JSON
constraint exists to prevent. ``\s`` also matches form feed, vertical tab and U+00A0, so it is
refused with a message that says to write ``[ \t\n\r]`` instead.
"""

from __future__ import annotations

import re
from typing import Callable

__all__ = ["MAX_PATTERN_CHARS", "WhitespacePatternError", "json_schema_ebnf_with_whitespace"]

MAX_PATTERN_CHARS = 256
_RULE = "request_whitespace"
_JSON_WHITESPACE = frozenset(" \t\n\r")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class WhitespacePatternError(ValueError):
    """The pattern cannot be used; the message says why."""


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v", "0": "\0", "a": "\a", "b": "\b", "e": "\x1b"}


def _skip_quoted(ebnf: str, i: int) -> int:
    """Index just past the string literal or character class that starts at ``i``."""
    close = '"' if ebnf[i] == '"' else "]"
    j = i + 1
    while j < len(ebnf) and ebnf[j] != close:
        j += 2 if ebnf[j] == "\\" else 1
    return j + 1


def _rewrite_names(ebnf: str, rename: Callable[[str, str, int], tuple[str, int]]) -> str:
    """Apply ``rename(name, ebnf, end) -> (text, chars after the name to drop)`` to every rule
    name, leaving string literals and character classes alone (a property named like a rule,
    ``"whitespace{0, 16}"``, is text, not a reference)."""
    out: list[str] = []
    i = 0
    while i < len(ebnf):
        c = ebnf[i]
        if c in '"[':
            j = _skip_quoted(ebnf, i)
            out.append(ebnf[i:j])
            i = j
        elif m := _IDENT.match(ebnf, i):
            text, drop = rename(m.group(0), ebnf, m.end())
            out.append(text)
            i = m.end() + drop
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _names(ebnf: str) -> list[str]:
    """The rule names referenced in ``ebnf`` (outside literals and classes)."""
    found: list[str] = []

    def collect(name: str, _ebnf: str, _end: int) -> tuple[str, int]:
        found.append(name)
        return name, 0

    _rewrite_names(ebnf, collect)
    return found


def _unescape(body: str) -> list[str]:
    """The characters of a literal's or class's body as xgrammar prints them (escapes decoded)."""
    chars: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            chars.append(c)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt == "x":
            chars.append(chr(int(body[i + 2 : i + 4], 16)))
            i += 4
        elif nxt == "u":
            chars.append(chr(int(body[i + 2 : i + 6], 16)))
            i += 6
        elif nxt == "U":
            chars.append(chr(int(body[i + 2 : i + 10], 16)))
            i += 10
        else:
            chars.append(_ESCAPES.get(nxt, nxt))
            i += 2
    return chars


def _producible_chars(ebnf: str) -> set[str]:
    """Every character a literal or class of the pattern's EBNF can produce; raises ValueError
    for a negated class (it produces nearly everything)."""
    found: set[str] = set()
    i = 0
    while i < len(ebnf):
        c = ebnf[i]
        if c not in '"[':
            i += 1
            continue
        j = _skip_quoted(ebnf, i)
        body = ebnf[i + 1 : j - 1]
        i = j
        if c == '"':
            found.update(_unescape(body))
            continue
        if body.startswith("^"):
            raise ValueError("a negated character class")
        # Ranges: an unescaped '-' between two characters of the decoded body. Decoding first
        # and marking escaped dashes keeps "[\-a]" a dash and an 'a'.
        items: list[tuple[str, bool]] = []  # (char, is an unescaped range dash)
        k = 0
        while k < len(body):
            if body[k] == "\\":
                width = {"x": 4, "u": 6, "U": 10}.get(body[k + 1], 2)
                items.append((_unescape(body[k : k + width])[0], False))
                k += width
            else:
                items.append((body[k], body[k] == "-"))
                k += 1
        n = 0
        while n < len(items):
            if n + 2 < len(items) and items[n + 1][1]:
                lo, hi = ord(items[n][0]), ord(items[n + 2][0])
                if hi - lo > 0x10000:
                    raise ValueError("a character range")
                found.update(chr(o) for o in range(lo, hi + 1))
                n += 3
            else:
                found.add(items[n][0])
                n += 1
    return found


def _pattern_rules(xgr, pattern: str) -> str:
    """The whitespace regex as EBNF rules, its root named ``_RULE``."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise WhitespacePatternError(f"it is longer than {MAX_PATTERN_CHARS} characters")
    if pattern == "":
        return f'{_RULE} ::= ""\n'
    from backend.grammar import AMBIGUOUS_REPETITION, ambiguous_repetition

    if ambiguous_repetition(pattern):
        raise WhitespacePatternError(AMBIGUOUS_REPETITION)
    try:
        ebnf = str(xgr.Grammar.from_regex(pattern))
    except Exception as exc:  # xgrammar's RuntimeError names the problem in its first line
        from backend.grammar import clean_xgrammar_error

        raise WhitespacePatternError(f"not a valid regular expression: {clean_xgrammar_error(str(exc), 'regex')[:300]}"
                                     ) from None
    try:
        extra = _producible_chars(ebnf) - _JSON_WHITESPACE
    except ValueError as exc:
        raise WhitespacePatternError(f"it contains {exc}; only JSON whitespace (space, \\t, \\n, \\r) may be produced") from None
    if extra:
        shown = ", ".join(repr(c) for c in sorted(extra)[:5])
        hint = " (\\s also matches \\f, \\v and U+00A0: write [ \\t\\n\\r])" if extra & set("\f\v\xa0") else ""
        raise WhitespacePatternError(f"it can produce {shown}, which is not JSON whitespace{hint}")
    return _rewrite_names(
        ebnf,
        lambda name, _s, _e: (_RULE + name[4:] if re.fullmatch(r"root(_\d+)*", name) else name, 0),
    )


def json_schema_ebnf_with_whitespace(xgr, schema_json: str, pattern: str, max_whitespace: int, strict_mode: bool) -> str:
    """EBNF (root rule ``root``) for documents of ``schema_json`` whose whitespace between tokens
    matches ``pattern``. A bad pattern raises WhitespacePatternError, a schema xgrammar cannot
    convert its RuntimeError, each with a message for the client."""
    rules = _pattern_rules(xgr, pattern)
    schema_ebnf = str(
        xgr.Grammar.from_json_schema(
            schema_json, any_whitespace=True, max_whitespace_cnt=max_whitespace, strict_mode=strict_mode
        )
    )
    if re.search(rf"^{_RULE}\b", schema_ebnf, re.M):
        raise WhitespacePatternError(f"the schema's grammar already has a rule named {_RULE}")
    run = "{0, %d}" % max_whitespace

    def to_pattern(name: str, ebnf: str, end: int) -> tuple[str, int]:
        if re.fullmatch(r"whitespace(_\d+)?", name) and ebnf.startswith(run, end):
            return _RULE, len(run)
        return name, 0

    rewritten = _rewrite_names(schema_ebnf, to_pattern)
    # A whitespace rule still referenced in some other form would keep the default whitespace
    # there; refuse rather than honour the pattern only in part.
    for line in rewritten.splitlines():
        body = line.partition("::=")[2]
        if any(re.fullmatch(r"whitespace(_\d+)?", name) for name in _names(body)):
            raise WhitespacePatternError("this schema's grammar uses whitespace in a form the pattern cannot replace")
    return rewritten + "\n" + rules

"""JSON helpers shared by the JSON-based tool-call formats.

Two views of the same JSON text must agree exactly:

* the non-streaming parsers decode a complete object with ``decode_json_at`` (the stdlib decoder,
  made strict) and serialize arguments with ``dumps`` (``json.dumps(..., ensure_ascii=False)``);
* the streaming parsers cannot wait for the end of the object, so ``JsonCanonicalizer`` consumes the
  raw text character by character and *writes the canonical serialization as it goes*: the text it
  has produced is always a prefix of ``dumps(decode(raw))``. Argument fragments are slices of that
  output, so their concatenation is exactly the non-streaming ``parameters`` string.

The canonicalizer accepts exactly what the strict decoder accepts: RFC 8259 JSON (no raw control
characters in strings), plus the ``NaN``, ``Infinity`` and ``-Infinity`` that Python's json module
reads, and so vLLM's and SGLang's parsers: a model that writes one keeps its call, as there (QA: it
was cut there, arguments and all, to an invalid ``{"x": ``). A number that no float or int holds
exactly as written (``1e999``, valid JSON that a grammar for an unbounded ``number`` allows and
json.dumps would write as ``Infinity``; an int of more digits than Python converts) is kept as the
model's text in both views, as are those three (``VerbatimNumber``). The one place the two serializations
can differ is an object with duplicate keys: ``dumps(decode(...))`` keeps the last value only,
while the streamed text (already sent) keeps both. Both still decode to the same value.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["JsonCanonicalizer", "JsonObject", "Member", "VerbatimNumber", "decode_json_at", "decode_json", "dumps"]


class JsonObject(dict):
    """A decoded JSON object that also remembers its (key, value) pairs in source order.

    Tool-call wrappers are interpreted with "first occurrence wins" (e.g. the first "name" key):
    that is the only rule a streaming parser can follow, because it has already acted on the first
    occurrence when a later duplicate shows up.
    """

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


class VerbatimNumber:
    """A number kept as the text it was written as: past float range (1e999), an int past
    Python's conversion limit, or NaN / Infinity / -Infinity."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __float__(self) -> float:
        return float(self.text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerbatimNumber) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"VerbatimNumber({self.text!r})"


def _float(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else VerbatimNumber(text)


def _int(text: str) -> Any:
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        return VerbatimNumber(text)


def _number_text(value: Any) -> str:
    return value.text if isinstance(value, VerbatimNumber) else json.dumps(value)


_DECODER = json.JSONDecoder(
    object_pairs_hook=JsonObject, parse_float=_float, parse_int=_int, parse_constant=VerbatimNumber
)


def decode_json_at(text: str, pos: int) -> tuple[Any, int]:
    """Decode one JSON value starting exactly at ``text[pos]``: (value, end). Raises ValueError."""
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError as exc:  # absurdly deep nesting
        raise ValueError("JSON nested too deeply") from exc


def decode_json(text: str) -> Any:
    """Decode a whole string that must be exactly one JSON value (surrounding JSON whitespace ok)."""
    value, end = decode_json_at(text, _WS_RE.match(text, 0).end())
    if _WS_RE.match(text, end).end() != len(text):
        raise ValueError("extra data after JSON value")
    return value


# A code point JSON can escape but UTF-8 cannot carry: a lone surrogate (`"\ud83d"` without its
# pair). Decoded strings hold a pair as one character, so any surrogate left is a lone one.
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _escape_surrogate(m: "re.Match[str]") -> str:
    return f"\\u{ord(m.group()):04x}"


def dumps(value: Any) -> str:
    """The canonical argument serialization (what SGLang sends as ``parameters``), kept to valid
    UTF-8: a lone surrogate the model wrote as an escape stays one (it failed the response, 500)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except TypeError:  # an VerbatimNumber somewhere inside (rare): write it out by hand
        text = _dumps_with_literals(value)
    return _SURROGATE_RE.sub(_escape_surrogate, text) if _SURROGATE_RE.search(text) else text


def _dumps_with_literals(value: Any) -> str:
    """json.dumps(value, ensure_ascii=False) with each VerbatimNumber written as its text."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_dumps_with_literals(v)}"
                               for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dumps_with_literals(v) for v in value) + "]"
    if isinstance(value, VerbatimNumber):
        return value.text
    return json.dumps(value, ensure_ascii=False)


@dataclass
class Member:
    """A member of the top-level object, located in the canonical output."""

    key: str
    start: int = -1  # canonical offset where the value starts (-1: not started yet)
    end: int = -1  # canonical offset just past the value (-1: not finished yet)
    first: str = ""  # first character of the value ('{', '"', '[', digit, ...)


JSON_WS = " \t\n\r"
_WS_RE = re.compile(r"[ \t\n\r]*")
_PLAIN_RE = re.compile(r'[^"\\\x00-\x1f]+')  # string content that needs no (re-)escaping
_NUMBER_CHARS_RE = re.compile(r"[-+0-9.eE]+")
_WORDS = {"t": "true", "f": "false", "n": "null", "N": "NaN", "I": "Infinity"}  # and "-Infinity", from "-"
_NUMBER_RE = re.compile(r"-?(?:0|[1-9][0-9]*)(?P<frac>\.[0-9]+)?(?P<exp>[eE][-+]?[0-9]+)?")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")

# What the parser expects next (outside strings and number/literal tokens).
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _COMMA_OR_CLOSE = range(6)


def _canonical_char(ch: str) -> str:
    # json.dumps(ensure_ascii=False) escapes only '"', '\\' and C0 controls; reuse it for those.
    # A lone surrogate stays an escape, as in dumps.
    if "\ud800" <= ch <= "\udfff":
        return f"\\u{ord(ch):04x}"
    return json.dumps(ch, ensure_ascii=False)[1:-1]


class JsonSyntaxError(ValueError):
    pass


class JsonCanonicalizer:
    """Push parser for one JSON value that emits ``dumps(decode(raw))`` incrementally.

    ``feed(s, pos)`` consumes characters of ``s`` from ``pos`` and returns the index after the last
    one consumed; it stops right after the value is complete (``done``). Invalid input raises
    ``ValueError`` at the first character that cannot continue a valid JSON value, which is how the
    streaming parsers find malformed tool calls as early as possible.

    Numbers and literals are emitted once complete (``1`` may still become ``12``); string content is
    emitted character by character. ``members`` locates the top-level object's members in the output.
    """

    def __init__(self) -> None:
        self._done_text = ""  # joined output
        self._parts: list[str] = []  # output not yet joined
        self.length = 0  # total canonical characters produced
        self.done = False
        self.members: list[Member] = []
        self._stack: list[str] = []  # open containers: '{' or '['
        self._expect = _VALUE
        self._in_string = False
        self._key_chars: Optional[list[str]] = None  # decoded chars of a top-level key being read
        self._string_is_key = False
        self._escape: Optional[str] = None  # pending escape sequence text, starting with '\\'
        self._high_surrogate: Optional[int] = None  # \uD8xx waiting for a \uDCxx partner
        self._token = ""  # number or literal being read
        self._token_kind = ""  # "", "number", or the literal word (_WORDS, "-Infinity")

    # -- output ---------------------------------------------------------------------------------
    def text(self) -> str:
        """The canonical text produced so far."""
        if self._parts:
            self._done_text += "".join(self._parts)
            self._parts.clear()
        return self._done_text

    def _emit(self, s: str) -> None:
        self._parts.append(s)
        self.length += len(s)

    # -- structure ------------------------------------------------------------------------------
    def _at_top_member(self) -> bool:
        return len(self._stack) == 1 and self._stack[0] == "{"

    def _start_value(self, first: str) -> None:
        if self._at_top_member():
            member = self.members[-1]
            member.start, member.first = self.length, first

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        if self._at_top_member():
            self.members[-1].end = self.length
        self._expect = _COMMA_OR_CLOSE

    def _close(self, ch: str) -> None:
        self._stack.pop()
        self._emit(ch)
        self._value_done()

    # -- strings --------------------------------------------------------------------------------
    def _put(self, decoded: str, canonical: str) -> None:
        if self._key_chars is not None:
            self._key_chars.append(decoded)
        self._emit(canonical)

    def _put_char(self, ch: str) -> None:
        self._put(ch, _canonical_char(ch))

    def _flush_surrogate(self) -> None:
        if self._high_surrogate is not None:
            self._put_char(chr(self._high_surrogate))  # a lone surrogate stays a lone surrogate
            self._high_surrogate = None

    def _end_string(self) -> None:
        self._flush_surrogate()
        self._in_string = False
        self._emit('"')
        if self._string_is_key:
            if self._key_chars is not None:
                self.members.append(Member("".join(self._key_chars)))
                self._key_chars = None
            self._expect = _COLON
        else:
            self._value_done()

    def _escape_char(self, ch: str) -> None:
        esc = self._escape + ch
        if len(esc) == 2:
            if ch == "u":
                self._escape = esc
                return
            if ch not in _SIMPLE_ESCAPES:
                raise JsonSyntaxError(f"invalid escape \\{ch}")
            self._escape = None
            self._flush_surrogate()
            self._put_char(_SIMPLE_ESCAPES[ch])
            return
        if ch not in _HEX:
            raise JsonSyntaxError("invalid \\uXXXX escape")
        if len(esc) < 6:
            self._escape = esc
            return
        self._escape = None
        code = int(esc[2:], 16)
        if self._high_surrogate is not None:
            if 0xDC00 <= code <= 0xDFFF:  # the stdlib decoder joins \uD83D\uDE00 into one char
                high, self._high_surrogate = self._high_surrogate, None
                self._put_char(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                return
            self._flush_surrogate()
        if 0xD800 <= code <= 0xDBFF:
            self._high_surrogate = code
        else:
            self._put_char(chr(code))

    def _feed_string(self, s: str, pos: int) -> int:
        n = len(s)
        while pos < n:
            ch = s[pos]
            if self._escape is not None:
                self._escape_char(ch)
                pos += 1
                continue
            if ch == "\\":
                self._escape = "\\"
                pos += 1
                continue
            self._flush_surrogate()
            if ch == '"':
                self._end_string()
                return pos + 1
            m = _PLAIN_RE.match(s, pos)
            if m is None:
                raise JsonSyntaxError("invalid control character in string")
            run = m.group()
            self._put(run, run)
            pos = m.end()
        return pos

    # -- numbers and literals -------------------------------------------------------------------
    def _finish_number(self) -> None:
        tok = self._token
        m = _NUMBER_RE.fullmatch(tok)
        if m is None:
            raise JsonSyntaxError(f"invalid number {tok!r}")
        value: Any = _float(tok) if (m.group("frac") or m.group("exp")) else _int(tok)
        self._token_kind, self._token = "", ""
        self._emit(_number_text(value))
        self._value_done()

    def _feed_token(self, s: str, pos: int) -> int:
        if self._token_kind == "number":
            m = _NUMBER_CHARS_RE.match(s, pos)
            if m is not None:
                self._token += m.group()
                pos = m.end()
            if pos < len(s):  # a non-number character ends the token
                if self._token == "-" and s[pos] == "I":
                    self._token_kind = "-Infinity"  # the word reader goes on from "-"
                    return pos
                self._finish_number()
            return pos
        word = self._token_kind
        ch = s[pos]
        if word[len(self._token)] != ch:
            raise JsonSyntaxError(f"invalid literal starting {self._token + ch!r}")
        self._token += ch
        if self._token == word:
            self._token_kind, self._token = "", ""
            self._emit(word)
            self._value_done()
        return pos + 1

    # -- main loop ------------------------------------------------------------------------------
    def feed(self, s: str, pos: int = 0) -> int:
        n = len(s)
        while pos < n and not self.done:
            if self._in_string:
                pos = self._feed_string(s, pos)
                continue
            if self._token_kind:
                pos = self._feed_token(s, pos)
                continue
            ch = s[pos]
            if ch in JSON_WS:
                pos = _WS_RE.match(s, pos).end()
                continue
            expect = self._expect
            if expect == _VALUE or expect == _VALUE_OR_CLOSE:
                if ch == "]" and expect == _VALUE_OR_CLOSE:
                    self._close("]")
                elif ch == "{" or ch == "[":
                    self._start_value(ch)
                    self._stack.append(ch)
                    self._emit(ch)
                    self._expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
                elif ch == '"':
                    self._start_value(ch)
                    self._in_string, self._string_is_key = True, False
                    self._emit('"')
                elif ch == "-" or "0" <= ch <= "9":
                    self._start_value(ch)
                    self._token_kind = "number"
                    continue  # the token reader consumes it
                elif ch in _WORDS:
                    self._start_value(ch)
                    self._token_kind = _WORDS[ch]
                    continue
                else:
                    raise JsonSyntaxError(f"unexpected {ch!r}, expected a value")
            elif expect == _KEY or expect == _KEY_OR_CLOSE:
                if ch == '"':
                    self._in_string, self._string_is_key = True, True
                    self._key_chars = [] if self._at_top_member() else None
                    self._emit('"')
                elif ch == "}" and expect == _KEY_OR_CLOSE:
                    self._close("}")
                else:
                    raise JsonSyntaxError(f"unexpected {ch!r}, expected a key")
            elif expect == _COLON:
                if ch != ":":
                    raise JsonSyntaxError(f"unexpected {ch!r}, expected ':'")
                self._emit(": ")
                self._expect = _VALUE
            else:  # _COMMA_OR_CLOSE
                top = self._stack[-1]
                if ch == ",":
                    self._emit(", ")
                    self._expect = _KEY if top == "{" else _VALUE
                elif (ch == "}" and top == "{") or (ch == "]" and top == "["):
                    self._close(ch)
                else:
                    raise JsonSyntaxError(f"unexpected {ch!r}, expected ',' or a closing bracket")
            pos += 1
        return pos

    def finish(self) -> None:
        """End of input: completes a bare top-level number, else raises if the value is unfinished."""
        if not self.done and self._token_kind == "number" and not self._stack:
            self._finish_number()
        if not self.done:
            raise JsonSyntaxError("unexpected end of JSON input")

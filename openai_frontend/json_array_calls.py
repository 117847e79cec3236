"""The frontend's own tool-call format: `[{"name": "f", "parameters": {...}}, ...]`.

`tool_choice` "required" or a named function, without a model-format parser, constrains
generation with SGLang's json_schema for this array (`openai_frontend.tools.json_array_schema`).
This module reads it back, with the interface of `openai_frontend.tool_parsers`:

* `scan_json_array_calls` parses a whole text, possibly cut short (`detect_and_parse`);
* `JsonArrayToolParser.parse_streaming_increment` reads the same grammar one chunk at a time and
  looks at each character once. (It used to rescan the whole buffer per chunk, so a call with a
  few thousand tokens of arguments cost seconds of the frontend's event loop.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["JsonArrayToolParser", "scan_json_array_calls"]

_WS = " \t\r\n"
_LITERAL_END = ",}] \t\r\n"
ARGS_KEYS = ("parameters", "arguments")


@dataclass
class _Item:
    tool_index: int
    name: Optional[str]
    parameters: str


@dataclass
class _Result:
    normal_text: str
    calls: list[_Item] = field(default_factory=list)


# ------------------------------------------------------------------------------ whole text


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def _scan_string(s: str, i: int) -> tuple[int, bool]:
    """s[i] == '"': (index after the closing quote, complete)."""
    i += 1
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1, True
        i += 1
    return n, False


def _scan_value(s: str, i: int) -> tuple[int, bool]:
    """Any JSON value starting at s[i]: (end index, complete)."""
    n = len(s)
    if i >= n:
        return n, False
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        depth = 0
        while i < n:
            c = s[i]
            if c == '"':
                i, ok = _scan_string(s, i)
                if not ok:
                    return n, False
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1, True
            i += 1
        return n, False
    j = i
    while j < n and s[j] not in _LITERAL_END:
        j += 1
    return j, j < n  # a literal/number is complete once a delimiter follows


def _json_str(raw: str) -> Optional[str]:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def scan_json_array_calls(s: str) -> Optional[list[tuple[Optional[str], Optional[tuple[int, int, bool]], bool]]]:
    """Parse a (possibly partial) `[{"name": .., "parameters": ..}, ...]`.

    Returns None when the text is not such an array, else one entry per object seen:
    (name or None while incomplete, parameters span (start, end, complete) or None, object complete).
    """
    i = _skip_ws(s, 0)
    if i >= len(s):
        return []
    if s[i] != "[":
        return None
    i += 1
    out: list[tuple[Optional[str], Optional[tuple[int, int, bool]], bool]] = []
    n = len(s)
    while True:
        i = _skip_ws(s, i)
        if i >= n or s[i] == "]":
            return out
        if s[i] == ",":
            i += 1
            continue
        if s[i] != "{":
            return out
        i += 1
        name: Optional[str] = None
        params: Optional[tuple[int, int, bool]] = None
        complete = False
        while True:
            i = _skip_ws(s, i)
            if i >= n:
                break
            if s[i] == "}":
                i += 1
                complete = True
                break
            if s[i] == ",":
                i += 1
                continue
            if s[i] != '"':
                break
            key_end, ok = _scan_string(s, i)
            if not ok:
                break
            key = _json_str(s[i:key_end])
            i = _skip_ws(s, key_end)
            if i >= n or s[i] != ":":
                break
            i = _skip_ws(s, i + 1)
            if i >= n:
                break
            end, ok = _scan_value(s, i)
            if key == "name" and ok:
                name = _json_str(s[i:end])
            elif key in ARGS_KEYS:
                params = (i, end, ok)
            i = end
            if not ok:
                break
        out.append((name, params, complete))
        if not complete:
            return out


# ------------------------------------------------------------------------------ streaming

# Where the streaming reader is in the grammar.
_START, _ARRAY, _MEMBER, _KEY, _COLON, _VALUE, _STRING, _CONTAINER, _LITERAL, _DONE, _PASS = range(11)
_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["{}\[\]]')


class JsonArrayToolParser:
    """Parser (same interface as tool_parsers') for `[{"name": "f", "parameters": {...}}, ...]`.

    Streaming gives what a rescan of the whole text at every chunk would give (the test checks
    it against `scan_json_array_calls` on random chunkings): a call's name once its string is
    complete, its raw argument text as it arrives and only after its name, nothing after a
    malformed part or a call without a name, and text that is not an array passed through.
    """

    def __init__(self) -> None:
        self._state = _START
        self._lead = ""  # whitespace before the array: text if no array follows
        self._k = -1  # index of the object being read
        self._key: Optional[str] = None
        self._raw: list[str] = []  # the current key, or the current value if it is the name
        self._name: Optional[str] = None
        self._args_pending: list[str] = []  # arguments that came before the name
        self._named = 0  # objects whose name went out
        self._blocked = False  # an object ended without a name: later calls wait for it forever
        self._escape = False
        self._depth = 0
        self._in_string = False

    def detect_and_parse(self, text: str, tools: Any) -> _Result:
        calls = scan_json_array_calls(text)
        if not calls:
            return _Result(normal_text=text)
        items = []
        for k, (name, params, _) in enumerate(calls):
            if name is None:
                continue
            args = text[params[0]:params[1]] if params else "{}"
            items.append(_Item(k, name, args))
        return _Result(normal_text="", calls=items) if items else _Result(normal_text=text)

    def flush(self) -> _Result:
        """Only whitespace came: it is text."""
        lead, self._lead = self._lead, ""
        return _Result(normal_text=lead if self._state == _START else "")

    def parse_streaming_increment(self, new_text: str, tools: Any) -> _Result:
        if self._state == _PASS:
            return _Result(normal_text=new_text)
        if self._state == _DONE:
            return _Result(normal_text="")
        if self._state == _START:
            rest = new_text.lstrip(_WS)
            if not rest:
                self._lead += new_text
                return _Result(normal_text="")
            if rest[0] != "[":  # not the constrained format: hand the text back as content
                text, self._lead = self._lead + new_text, ""
                self._state = _PASS
                return _Result(normal_text=text)
            self._lead = ""
            self._state = _ARRAY
            new_text = rest[1:]
        items: list[_Item] = []
        self._read(new_text, items)
        return _Result(normal_text="", calls=items)

    # Strings and values are consumed as whole runs (kept for the name, sent for arguments),
    # whitespace inside them included; between tokens it is skipped.
    def _read(self, s: str, items: list[_Item]) -> None:
        i, n = 0, len(s)
        while i < n and self._state != _DONE:
            state = self._state
            if state in (_STRING, _CONTAINER, _LITERAL):
                j = self._scan(s, i)
                self._value_text(s[i:j], items)
                i = j
                continue
            if state == _KEY:
                j = self._string_end(s, i)
                self._raw.append(s[i:j])
                if self._state == _KEY:  # the key string continues in the next chunk
                    return
                self._key = _json_str('"' + "".join(self._raw))
                i = j
                continue
            c = s[i]
            if c in _WS:
                i += 1
                continue
            if state == _ARRAY:
                if c == "{":
                    self._k += 1
                    self._name = None
                    self._args_pending = []
                    self._state = _MEMBER
                elif c != ",":  # "]" ends the array; anything else is not the format
                    self._state = _DONE
            elif state == _MEMBER:
                if c == "}":
                    if self._name is None:
                        self._blocked = True
                    self._state = _ARRAY
                elif c == '"':
                    self._raw = []
                    self._escape = False
                    self._state = _KEY
                elif c != ",":
                    self._state = _DONE
            elif state == _COLON:
                self._state = _VALUE if c == ":" else _DONE
            elif state == _VALUE:
                self._raw = []
                self._escape = False
                if c == '"':
                    self._state = _STRING
                elif c in "{[":
                    self._state = _CONTAINER
                    self._depth = 1
                    self._in_string = False
                else:
                    self._state = _LITERAL
                    continue  # the literal's first character is read by _scan
                self._value_text(c, items)
            i += 1

    def _close_quote(self, s: str, i: int) -> int:
        """Position after the closing quote of the string being read, or -1 if it goes on past
        `s` (an escape cut at the end of `s` carries over in `_escape`)."""
        n = len(s)
        while i < n:
            if self._escape:
                self._escape = False
                i += 1
                continue
            m = _STRING_STOP.search(s, i)
            if m is None:
                return -1
            i = m.end()
            if m.group() == '"':
                return i
            self._escape = True
        return -1

    def _string_end(self, s: str, i: int) -> int:
        """Position after the key or string value being read (the state moves on), or len(s)."""
        j = self._close_quote(s, i)
        if j < 0:
            return len(s)
        self._state = _MEMBER if self._state == _STRING else _COLON
        return j

    def _scan(self, s: str, i: int) -> int:
        """Position after the value being read ends (state back to _MEMBER), or len(s)."""
        n = len(s)
        if self._state == _STRING:
            return self._string_end(s, i)
        if self._state == _LITERAL:
            j = i
            while j < n and s[j] not in _LITERAL_END:
                j += 1
            if j < n:
                self._state = _MEMBER  # the delimiter is read as part of the object
            return j
        while i < n:  # a container
            if self._in_string:
                i = self._close_quote(s, i)
                if i < 0:
                    return n
                self._in_string = False
                continue
            m = _CONTAINER_STOP.search(s, i)
            if m is None:
                return n
            i = m.end()
            c = m.group()
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._state = _MEMBER
                    return i
        return n

    def _value_text(self, text: str, items: list[_Item]) -> None:
        """Characters of the current member's value; the state says whether it has ended."""
        ended = self._state == _MEMBER
        if self._key == "name":
            self._raw.append(text)
            if ended:
                self._name = _json_str("".join(self._raw))
                if self._name is not None and not self._blocked and self._named == self._k:
                    self._named += 1
                    items.append(_Item(self._k, self._name, ""))
                    if self._args_pending:
                        self._emit_args("".join(self._args_pending), items)
                        self._args_pending = []
        elif self._key in ARGS_KEYS and text:
            if self._named > self._k:
                self._emit_args(text, items)
            else:
                self._args_pending.append(text)

    def _emit_args(self, text: str, items: list[_Item]) -> None:
        if items and items[-1].tool_index == self._k and items[-1].name is None:
            items[-1].parameters += text
        else:
            items.append(_Item(self._k, None, text))

"""Pythonic tool calls (Llama 3.2 / 3.3 / 4): ``[get_weather(city="Paris"), get_time(tz="CET")]``.

A region is a Python list of calls with keyword arguments whose values are literals, optionally
wrapped in ``<|python_start|>`` ... ``<|python_end|>``. It may appear anywhere in the text.

Precisely, a ``[`` starts a candidate when it is followed by ``name(`` (whitespace allowed); the
candidate extends to the matching ``]`` (found by a small scanner that knows Python strings and
comments); it is a region when ``ast`` parses it as a non-empty list of calls whose arguments are
all literals (``ast`` only parses -- nothing is evaluated). JSON spellings ``true``/``false``/
``null`` are accepted too. Anything else is text, and scanning resumes after the ``[``.

Streaming buffers a candidate until its ``]`` and then emits each call's name and complete
arguments: Python literals cannot be converted to JSON before they are complete, and a list may
still prove invalid at its last character.
"""

from __future__ import annotations

import ast
import re
import warnings
from typing import Any, Optional

from .base import BaseToolParser, find_trigger, logger, partial_trigger_len
from .json_stream import dumps

START, END = "<|python_start|>", "<|python_end|>"
_PY_WS = "[ \\t\\r\\n\\f]*"
_IDENT = r"[^\W\d]\w*"
# after the optional start tag: "[" name "(" -- the shortest text that commits to buffering
_HEAD_RE = re.compile(rf"(?:{re.escape(START)}[ \t\r\n]*)?\[{_PY_WS}{_IDENT}{_PY_WS}\(")
_HEAD_PARTIAL_RE = re.compile(
    rf"(?:{re.escape(START)}[ \t\r\n]*)?(?:\[{_PY_WS}(?:{_IDENT}{_PY_WS})?)?"
)
_HEAD_SEARCH_RE = re.compile(rf"\[{_PY_WS}{_IDENT}{_PY_WS}\(")
_END_RE = re.compile(rf"[ \t\r\n]*{re.escape(END)}")
_END_PARTIAL_RE = re.compile(rf"[ \t\r\n]*(?:{'|'.join(re.escape(END[:k]) for k in range(1, len(END)))})?")

_CLOSED, _NEED_MORE, _FAILED = "closed", "need_more", "failed"
_PAIRS = {"(": ")", "[": "]", "{": "}"}
_STRING_PLAIN = re.compile(r"[^\\'\"\n]+")


class _BracketScanner:
    """Finds the ``]`` matching the opening ``[``, skipping Python strings and comments."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.quote = ""  # open string delimiter: ' " ''' or """
        self.comment = False

    def feed(self, s: str, pos: int, final: bool) -> tuple[str, int]:
        """Scan ``s`` from ``pos``: (status, position reached). CLOSED: position after ``]``."""
        n = len(s)
        while pos < n:
            ch = s[pos]
            if self.comment:
                j = s.find("\n", pos)
                if j < 0:
                    return (_FAILED if final else _NEED_MORE), n
                self.comment = False
                pos = j + 1
            elif self.quote:
                q = self.quote
                if ch == "\\":
                    if pos + 1 >= n:
                        return (_FAILED if final else _NEED_MORE), pos
                    pos += 2
                elif s.startswith(q, pos):
                    self.quote = ""
                    pos += len(q)
                elif len(q) == 3 and ch == q[0] and not final and q.startswith(s[pos:]):
                    return _NEED_MORE, pos  # maybe the closing triple quote
                elif ch == "\n" and len(q) == 1:
                    return _FAILED, pos  # unterminated single-quoted string
                else:
                    m = _STRING_PLAIN.match(s, pos)
                    pos = m.end() if m else pos + 1
            elif ch in "'\"":
                if s.startswith(ch * 3, pos):
                    self.quote = ch * 3
                    pos += 3
                elif not final and (ch * 3).startswith(s[pos:]):
                    return _NEED_MORE, pos  # '' could still become '''
                else:
                    self.quote = ch
                    pos += 1
            elif ch == "#":
                self.comment = True
                pos += 1
            elif ch in _PAIRS:
                self.stack.append(ch)
                pos += 1
            elif ch in ")]}":
                if not self.stack or _PAIRS[self.stack[-1]] != ch:
                    return _FAILED, pos
                self.stack.pop()
                pos += 1
                if not self.stack:
                    return _CLOSED, pos
            else:
                pos += 1
        return (_FAILED if final else _NEED_MORE), pos


class _NotLiteral(ValueError):
    pass


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST) -> Any:
    """A JSON-compatible value from a literal expression node (no evaluation)."""
    if isinstance(node, ast.Constant):
        v = node.value
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):  # 1e999 too: written as Infinity, as the JSON formats read it (json.dumps)
            return v
        raise _NotLiteral(f"unsupported constant {v!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _literal(node.operand)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _NotLiteral("sign on a non-number")
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                raise _NotLiteral("dict keys must be strings")
            out[k.value] = _literal(v)
        return out
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral(f"not a literal: {type(node).__name__}")


def parse_call_list(src: str) -> Optional[list[tuple[str, dict[str, Any]]]]:
    """[(name, arguments)] if ``src`` is a non-empty Python list of literal-argument calls."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escape sequences in string literals
            tree = ast.parse(src, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    node = tree.body
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for el in node.elts:
        if not (isinstance(el, ast.Call) and isinstance(el.func, ast.Name)) or el.args:
            return None
        args: dict[str, Any] = {}
        try:
            for kw in el.keywords:
                if kw.arg is None:  # **kwargs
                    return None
                args[kw.arg] = _literal(kw.value)
        except (_NotLiteral, RecursionError):
            return None
        calls.append((el.func.id, args))
    return calls


# Streaming states.
_TEXT, _HEAD, _LIST, _AFTER = range(4)


class PythonicToolParser(BaseToolParser):
    triggers = (START, "[")

    def has_tool_call(self, text: str) -> bool:
        return START in text or _HEAD_SEARCH_RE.search(text) is not None

    # structure_info: not supported -- the arguments are Python, not JSON, so a structural tag
    # with a JSON schema between "[name(" and ")]" would force invalid calls.

    # ---------------------------------------------------------------- non-streaming
    def _parse_complete(self, text: str, names: Optional[frozenset[str]]):
        segments: list[str] = []
        calls: list[tuple[str, str]] = []
        seg_start = pos = 0
        while True:
            start, tlen = find_trigger(text, self.triggers, pos)
            if start < 0:
                break
            region = self._complete_region(text, start)
            if region is None:
                pos = start + tlen
                continue
            end, found = region
            segments.append(text[seg_start:start])
            calls += [(name, dumps(args)) for name, args in found if self._known(name, names)]
            seg_start = pos = end
        segments.append(text[seg_start:])
        return segments, calls

    @staticmethod
    def _known(name: str, names: Optional[frozenset[str]]) -> bool:
        if names is None or name in names:
            return True
        logger.warning("model called undefined function %r; dropped", name)
        return False

    def _complete_region(self, text: str, start: int):
        head = _HEAD_RE.match(text, start)
        if head is None:
            return None
        list_start = text.index("[", start)
        status, end = _BracketScanner().feed(text, list_start, final=True)
        if status != _CLOSED:
            return None
        found = parse_call_list(text[list_start:end])
        if found is None:
            return None
        m = _END_RE.match(text, end)
        return (m.end() if m else end), found

    # ---------------------------------------------------------------- streaming
    def reset(self) -> None:
        super().reset()
        self._state = _TEXT
        self._trigger_len = 0
        self._raw = ""  # the candidate region so far
        self._list_start = 0
        self._scanner: Optional[_BracketScanner] = None

    def _advance(self, final: bool) -> None:
        steps = {_TEXT: self._step_text, _HEAD: self._step_head, _LIST: self._step_list, _AFTER: self._step_after}
        while steps[self._state](final):
            pass

    def _step_text(self, final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        idx, tlen = find_trigger(buf, self.triggers)
        if idx >= 0:
            self._text(buf[:idx])
            self._buf = buf[idx:]
            self._trigger_len = tlen
            self._raw = ""
            self._state = _HEAD
            return True
        hold = 0 if final else partial_trigger_len(buf, self.triggers)
        self._text(buf[:len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _not_a_region(self) -> bool:
        raw = self._raw + self._buf
        self._text(raw[:self._trigger_len])
        self._buf = raw[self._trigger_len:]
        self._raw = ""
        self._state = _TEXT
        return True

    def _step_head(self, final: bool) -> bool:
        m = _HEAD_RE.match(self._buf)
        if m is None:
            if not final and _HEAD_PARTIAL_RE.fullmatch(self._buf):
                return False
            return self._not_a_region()
        self._list_start = self._buf.index("[")
        self._scanner = _BracketScanner()
        self._state = _LIST
        return True

    def _step_list(self, final: bool) -> bool:
        # the scanner resumes where it stopped: self._raw holds what it has consumed
        buf = self._raw + self._buf
        pos = max(len(self._raw), self._list_start)
        status, pos = self._scanner.feed(buf, pos, final)
        self._raw, self._buf = buf[:pos], buf[pos:]
        if status == _NEED_MORE:
            return False
        if status == _FAILED:
            return self._not_a_region()
        found = parse_call_list(self._raw[self._list_start:])
        if found is None:
            return self._not_a_region()
        self._region_start()
        for name, args in found:
            if self._allowed(name):
                self._call_args(self._start_call(name), dumps(args))
        self._raw = ""
        self._state = _AFTER
        return True

    def _step_after(self, final: bool) -> bool:
        m = _END_RE.match(self._buf)
        if m is not None:
            self._buf = self._buf[m.end():]
        elif not final and _END_PARTIAL_RE.fullmatch(self._buf):
            return False
        self._region_end()
        self._state = _TEXT
        return True

"""Qwen3-Coder: XML-style calls, one ``<tool_call>`` block each (several functions in one block are
read too, as vLLM reads them)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags less one newline on each side, typed by the
called function's JSON schema as vLLM's and SGLang's Qwen3-Coder parsers type it: a string; an
integer or number (``int`` when a number is integral); a boolean (``true``/``false``; anything
else stays the text); otherwise JSON, else a Python literal, else the text. ``null`` is null for
every type. A parameter the schema does not name, or any parameter when no tools are given, stays
a string. The arguments are a JSON object of the parameters in the order written.

Streaming commits a call at ``<function=NAME>`` and sends each parameter once its closing tag has
been read (a value's type is only known whole), then ``}`` at ``</function>``: the fragments
concatenate to exactly the non-streamed arguments. A call the output ends inside, or whose markup
breaks after its name went out, stays a call with the parameters sent so far (the arguments then
lack their ``}``; base.py's contract), and the stream resumes after its ``</tool_call>``. There
are no JSON arguments to constrain, so a forced tool_choice uses the JSON-array constraint (as
with pythonic) and strict tools under auto are refused (``openai_frontend/tools.py``).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Optional, Sequence

from .base import _KEEP_TOOLS, BaseToolParser, ParseResult, StreamingParseResult, partial_trigger_len

TRIGGER = "<tool_call>"
FUNC = "<function="
PARAM = "<parameter="
PARAM_END = "</parameter>"
FUNC_END = "</function>"
CLOSE = "</tool_call>"
_WS = " \t\r\n"
# A function's or a parameter's name: up to the ">" that ends its tag, on one line.
_NAME = re.compile(r"([^<>\n]*)(>?)")
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float", "double", "decimal")


def _schemas(tools: Optional[Sequence[Any]]) -> Optional[dict[str, dict[str, Any]]]:
    """Each function's parameter schemas by name (its JSON schema's `properties`)."""
    if tools is None:
        return None
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else getattr(tool, "function", tool)
        if isinstance(fn, dict):
            name, params = fn.get("name"), fn.get("parameters")
        else:
            name, params = getattr(fn, "name", None), getattr(fn, "parameters", None)
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(name, str):
            out[name] = props if isinstance(props, dict) else {}
    return out


def _type_of(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "string"
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None:
        for alternative in schema.get("anyOf") or schema.get("oneOf") or ():
            found = _type_of(alternative)
            if found != "null":
                return found
        return "string"
    return str(kind).strip().lower()


def typed_value(value: str, schema: Any) -> Any:
    """A parameter's text as its schema types it (see the module docstring)."""
    if value.lower() == "null":
        return None
    kind = _type_of(schema)
    if kind in _STRING_TYPES:
        return value
    if kind == "integer" or kind.startswith(_INT_PREFIXES):
        try:
            return int(value.strip())
        except ValueError:
            return value
    if kind.startswith(_NUMBER_PREFIXES):
        try:
            number = float(value.strip())
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        lowered = value.strip().lower()
        return lowered == "true" if lowered in ("true", "false") else value
    try:
        parsed = json.loads(value)
    except ValueError:
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return value
    try:  # what JSON cannot hold (a set, 1e999) stays the text; a tuple is a list
        return json.loads(json.dumps(parsed, allow_nan=False))
    except (TypeError, ValueError):
        return value


def _strip_newlines(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _is_prefix(tail: str, *tokens: str) -> bool:
    """`tail` may still become one of `tokens` (it is a proper prefix of one)."""
    return any(len(tail) < len(t) and t.startswith(tail) for t in tokens)


def _tag_name(text: str, pos: int) -> tuple[str, Optional[str], int]:
    """The name of a tag whose "<function=" / "<parameter=" ends at `pos`: ("ok", name, end),
    ("more", None, pos) when its ">" has not come yet, ("bad", None, pos) when it cannot be one."""
    m = _NAME.match(text, pos)
    if not m.group(2):
        return ("more" if m.end() == len(text) else "bad"), None, pos
    name = m.group(1).strip()
    return ("ok", name, m.end()) if name else ("bad", None, pos)


class Qwen3CoderToolParser(BaseToolParser):
    triggers = (TRIGGER,)

    def reset(self) -> None:
        super().reset()
        self._schemas: Optional[dict[str, dict[str, Any]]] = None
        self._schemas_of: Any = _KEEP_TOOLS  # the tools _schemas was read from
        self._state = "text"  # text | head | args | after | skip
        self._call: Optional[int] = None  # the committed call's index; None: a dropped function
        self._function = ""
        self._first = True

    # -- the tools' schemas travel with their names ----------------------------------------------
    def _read_schemas(self, tools: Optional[Sequence[Any]]) -> None:
        if tools is not self._schemas_of:  # a stream passes the same list with every chunk
            self._schemas, self._schemas_of = _schemas(tools), tools

    def detect_and_parse(self, text: str, tools: Optional[Sequence[Any]]) -> ParseResult:
        self._read_schemas(tools)
        return super().detect_and_parse(text, tools)

    def parse_streaming_increment(self, new_text: str, tools: Optional[Sequence[Any]]) -> StreamingParseResult:
        self._read_schemas(tools)
        return super().parse_streaming_increment(new_text, tools)

    def finish(self, tools: Optional[Sequence[Any]] = _KEEP_TOOLS) -> StreamingParseResult:
        if tools is not _KEEP_TOOLS:
            self._read_schemas(tools)
        return super().finish(tools)

    flush = finish

    def _argument(self, function: str, name: str, raw: str, first: bool) -> str:
        schema = (self._schemas or {}).get(function, {}).get(name)
        value = typed_value(_strip_newlines(raw), schema)
        return ("{" if first else ", ") + json.dumps(name, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)

    # -- whole text (SGLang's semantics: markup that forms no call is text) -----------------------
    def _parse_complete(self, text: str, names: Optional[frozenset[str]]) -> tuple[list[str], list[tuple[str, str]]]:
        self._names = names
        segments, calls, current, pos = [], [], [], 0
        while True:
            i = text.find(TRIGGER, pos)
            if i < 0:
                current.append(text[pos:])
                break
            current.append(text[pos:i])
            found, end = self._block(text, i + len(TRIGGER))
            if found is None:  # not a call: the trigger is text, and what follows is read again
                current.append(TRIGGER)
                pos = i + len(TRIGGER)
                continue
            segments.append("".join(current))
            current = []
            calls.extend((name, args) for name, args in found if self._allowed(name))
            pos = end
        segments.append("".join(current))
        return segments, calls

    def _block(self, text: str, pos: int) -> tuple[Optional[list[tuple[str, str]]], int]:
        """The functions of the block whose trigger ends at `pos`, and where the block ends; None
        when its first function is malformed. A function the text ends inside is dropped."""
        found: list[tuple[str, str]] = []

        def malformed() -> tuple[Optional[list[tuple[str, str]]], int]:
            # The block ends after its last good function; with none, the trigger is text.
            return found or None, pos

        while True:
            q = _skip_ws(text, pos)
            if found and text.startswith(CLOSE, q):
                return found, q + len(CLOSE)
            if q == len(text) or _is_prefix(text[q:], FUNC, *((CLOSE,) if found else ())):
                return found, len(text)  # cut before a function's name was complete: dropped
            if not text.startswith(FUNC, q):
                return malformed()
            status, name, r = _tag_name(text, q + len(FUNC))
            if status == "more":
                return found, len(text)
            if status == "bad":
                return malformed()
            parts: list[str] = []
            while True:
                s = _skip_ws(text, r)
                if text.startswith(FUNC_END, s):
                    r = s + len(FUNC_END)
                    break
                if s == len(text) or _is_prefix(text[s:], FUNC_END, PARAM):
                    return found, len(text)
                if not text.startswith(PARAM, s):
                    return malformed()
                status, key, v = _tag_name(text, s + len(PARAM))
                if status == "more":
                    return found, len(text)
                if status == "bad":
                    return malformed()
                e = text.find(PARAM_END, v)
                if e < 0:
                    return found, len(text)
                parts.append(self._argument(name, key, text[v:e], not parts))
                r = e + len(PARAM_END)
            found.append((name, "".join(parts) + "}" if parts else "{}"))
            pos = r

    # -- streaming ------------------------------------------------------------------------------
    def _advance(self, final: bool) -> None:
        steps = {"text": self._step_text, "head": self._step_head, "args": self._step_args,
                 "after": self._step_after, "skip": self._step_skip}
        while steps[self._state](final):
            pass

    def _step_text(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(TRIGGER)
        if i < 0:
            keep = 0 if final else partial_trigger_len(buf, self.triggers)
            self._text(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._text(buf[:i])
        self._buf = buf[i:]
        self._state = "head"
        return True

    def _step_head(self, final: bool) -> bool:
        """At a trigger: a call once its first function's name is complete; the trigger is text
        when what follows cannot be one."""
        buf = self._buf
        q = _skip_ws(buf, len(TRIGGER))
        tail = buf[q:]
        if tail.startswith(FUNC):
            status, name, end = _tag_name(buf, q + len(FUNC))
        else:
            status, name, end = ("more" if q == len(buf) or _is_prefix(tail, FUNC) else "bad"), None, q
        if status == "more":
            if final:  # cut before the name was complete: neither text nor a call
                self._region_start()
                self._region_end()
                self._buf = ""
            return False
        if status == "bad":
            self._text(TRIGGER)
            self._buf = buf[len(TRIGGER):]
            self._state = "text"
            return True
        self._region_start()
        self._begin_function(name)
        self._buf = buf[end:]
        return True

    def _begin_function(self, name: str) -> None:
        self._function = name
        self._call = self._start_call(name) if self._allowed(name) else None
        self._first = True
        self._state = "args"

    def _emit(self, fragment: str) -> None:
        if self._call is not None:
            self._call_args(self._call, fragment)

    def _step_args(self, final: bool) -> bool:
        buf = self._buf
        s = _skip_ws(buf, 0)
        tail = buf[s:]
        if tail.startswith(FUNC_END):
            self._emit("{}" if self._first else "}")
            self._buf = tail[len(FUNC_END):]
            self._state = "after"
            return True
        if tail.startswith(PARAM):
            status, key, v = _tag_name(buf, s + len(PARAM))
            if status == "bad":
                return self._broken()
            e = buf.find(PARAM_END, v) if status == "ok" else -1
            if e < 0:
                return self._wait_or_cut(final)
            self._emit(self._argument(self._function, key, buf[v:e], self._first))
            self._first = False
            self._buf = buf[e + len(PARAM_END):]
            return True
        if s == len(buf) or _is_prefix(tail, FUNC_END, PARAM):
            return self._wait_or_cut(final)
        return self._broken()

    def _wait_or_cut(self, final: bool) -> bool:
        if final:  # the output ended inside the call: it stays as sent
            self._region_end()
            self._buf = ""
            self._state = "text"
        return False

    def _broken(self) -> bool:
        """Markup broken after the call went out: it stays as sent, and the block is skipped."""
        self._state = "skip"
        return True

    def _step_after(self, final: bool) -> bool:
        """After a function: the block's close, another function of the same block, or (no
        close) the end of the block."""
        buf = self._buf
        q = _skip_ws(buf, 0)
        tail = buf[q:]
        if tail.startswith(CLOSE):
            self._buf = tail[len(CLOSE):]
            self._end_block()
            return True
        if tail.startswith(FUNC):
            status, name, end = _tag_name(buf, q + len(FUNC))
            if status == "ok":
                self._begin_function(name)
                self._buf = buf[end:]
                return True
            if status == "more":
                return self._cut_markup(final)
            self._end_block()  # a malformed next function: the block ends after the last good one
            return True
        if q == len(buf) or _is_prefix(tail, CLOSE, FUNC):
            return self._cut_markup(final)
        self._end_block()
        return True

    def _cut_markup(self, final: bool) -> bool:
        if final:  # the output ended inside the block's markup after a complete call: dropped
            self._buf = ""
            self._end_block()
        return False

    def _end_block(self) -> None:
        self._region_end()
        self._state = "text"

    def _step_skip(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(CLOSE)
        if i >= 0:
            self._buf = buf[i + len(CLOSE):]
            self._end_block()
            return True
        if final:
            self._buf = ""
            self._end_block()
            return False
        keep = partial_trigger_len(buf, (CLOSE,))
        self._buf = buf[len(buf) - keep:]
        return False

"""Function calling: the tool_choice constraint, and tool calls parsed out of generated text.

Parsers come from `openai_frontend.tool_parsers` (`get_tool_parser(name)`; model-specific formats:
qwen25/hermes, llama3, pythonic, mistral, deepseekv3). On top of them:

* `tool_choice="required"` / a named function constrain generation. When the configured parser
  describes its format (`structure_info(name)` -> begin/end strings), the constraint is an xgrammar
  `structural_tag` in the model's own format, and the output is parsed by that parser. Otherwise
  (no parser, or a format without JSON arguments such as pythonic) the constraint is SGLang's
  `json_schema` for a JSON array `[{"name": ..., "parameters": {...}}]`, parsed by
  `openai_frontend.json_array_calls.JsonArrayToolParser`.
* `ToolCallStreamer` turns a parser's streaming items into OpenAI `delta.tool_calls` entries: the
  first entry of a call carries id, type and function.name; later ones carry argument fragments.
  Under a forced tool_choice (`ToolPlan.forced`) it gives no text: content is null, as OpenAI's.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence

from openai_frontend.errors import APIError, bad_request
from openai_frontend.json_array_calls import JsonArrayToolParser
from openai_frontend.protocol import ChatTool, NamedToolChoice

JSON_ARRAY = "json_array"  # the built-in format used with the json_schema constraint


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Nine letters and digits, vLLM's ids for Mistral: Mistral's chat templates (and
    mistral-common) refuse any other id in the history, so an agent's next turn, which sends the
    calls back, was a 400 (QA)."""
    return "".join(random.choices(_ALNUM, k=9))


_ALNUM = string.ascii_letters + string.digits


def call_id_maker(parser_name: Optional[str]) -> Callable[[], str]:
    """Tool-call ids in the form the server's chat template takes back (its tool-call parser
    names the model family)."""
    return mistral_call_id if parser_name == "mistral" else new_call_id


def tools_as_dicts(tools: Sequence[ChatTool]) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in tools]


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------


@dataclass
class ParsedCall:
    name: str
    arguments: str
    id: str = field(default="", compare=False)  # made up for the response, not parsed


def get_parser(name: str) -> Any:
    """A fresh (stateful) parser for one choice: the format's parser, or the JSON-array one."""
    if name == JSON_ARRAY:
        return JsonArrayToolParser()
    try:
        from openai_frontend.tool_parsers import get_tool_parser
    except ImportError as exc:  # the package is optional at import time of the frontend
        raise APIError(500, f"tool-call parsers are not available: {exc}") from None
    try:
        return get_tool_parser(name)
    except (KeyError, ValueError) as exc:
        # KeyError's str() quotes its message; the message already names the parser.
        detail = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
        raise bad_request(detail, param="tool_call_parser") from None


def parse_complete(parser: Any, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ParsedCall]]:
    """Non-streaming parse: (normal text, calls)."""
    result = parser.detect_and_parse(text, tools)
    calls = [ParsedCall(c.name, c.parameters if isinstance(c.parameters, str) else json.dumps(c.parameters))
             for c in result.calls if c.name]
    return result.normal_text or "", calls


def parse_as_streamed(
    parser: Any, text: str, tools: list[dict[str, Any]], forced: bool = False,
    call_id: Callable[[], str] = new_call_id,
) -> tuple[str, list[ParsedCall]]:
    """Non-streaming parse of a whole output: exactly what a stream of it ends with.

    A stream sends a call's name as soon as it is complete and its arguments as they come, and
    cannot take them back. So a call that max_tokens or a stop cut short, or whose arguments turn
    out malformed after its name went out, stays a call in the stream with the arguments written
    so far (OpenAI's API, too, may return arguments that are not valid JSON; clients must check
    them). ``parse_complete`` would give that markup back as text, and the two modes would
    differ exactly there. Running the streaming parser over the whole text as one chunk makes
    the modes agree by construction; for well-formed output it equals ``parse_complete``.
    """
    streamer = ToolCallStreamer(parser, tools, forced=forced, call_id=call_id)
    normal, _ = streamer.feed(text)
    tail, _ = streamer.finish()
    return normal + tail, streamer.calls


class ToolCallStreamer:
    """Per-choice streaming state: parser items -> OpenAI tool_call deltas (dicts).

    `forced`: the constraint allows nothing but calls, so whatever the parser gives as text is the
    constrained markup cut short (max_tokens or a stop inside it, e.g. a trailing `<tool_`), never
    the model's words; it is dropped, in both modes alike."""

    def __init__(self, parser: Any, tools: list[dict[str, Any]], parallel: bool = True,
                 forced: bool = False, call_id: Callable[[], str] = new_call_id) -> None:
        self.parser = parser
        self.call_id = call_id
        self.tools = tools
        self.parallel = parallel
        self.forced = forced
        self.calls: list[ParsedCall] = []
        self._by_tool_index: dict[int, int] = {}

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        result = self.parser.parse_streaming_increment(text, self.tools)
        return self._text(result.normal_text), self._deltas(result.calls)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Whatever the parser still holds at the end of the stream (if it can flush)."""
        flush = getattr(self.parser, "flush", None)
        if flush is None:
            return "", []
        result = flush()
        if result is None:
            return "", []
        return self._text(result.normal_text), self._deltas(result.calls)

    def _text(self, normal: Optional[str]) -> str:
        return "" if self.forced else normal or ""

    def _deltas(self, items: Sequence[Any]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for item in items:
            args = item.parameters or ""
            if not isinstance(args, str):
                args = json.dumps(args)
            if item.name:
                k = len(self.calls)
                self._by_tool_index[item.tool_index] = k
                self.calls.append(ParsedCall(item.name, args, self.call_id()))
                if k > 0 and not self.parallel:
                    continue
                deltas.append({
                    "index": k,
                    "id": self.calls[k].id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": args},
                })
            elif args:
                k = self._by_tool_index.get(item.tool_index, len(self.calls) - 1)
                if k < 0:
                    continue  # arguments before any name: nothing to attach them to
                self.calls[k].arguments += args
                if k > 0 and not self.parallel:
                    continue
                if deltas and deltas[-1]["index"] == k:
                    # One entry per call per chunk, as OpenAI streams them: a client that reads
                    # one entry for an index would otherwise lose this fragment.
                    deltas[-1]["function"]["arguments"] += args
                else:
                    deltas.append({"index": k, "function": {"arguments": args}})
        return deltas


# ---------------------------------------------------------------------------------------------
# The built-in JSON-array format (json_schema-constrained tool calls)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# tool_choice -> (parser name, constraint)
# ---------------------------------------------------------------------------------------------


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "default", "enum", "examples"})
# Keywords whose values map names to schemas: the names are not keywords.
_SCHEMA_MAPS = frozenset({"$defs", "definitions", "dependentSchemas", "patternProperties", "properties"})
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _rebased(node: Any, base: str) -> Any:
    """A copy of a function's parameters schema for the place ``base`` (a local JSON pointer) in
    a wrapping schema: every local ``$ref`` ("#", "#/...") is resolved against the wrapping
    document, so it must name the same node there. Other refs (another document, an anchor) are
    left for the grammar compiler to refuse, as before."""
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(v, base) for name, v in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def _defs_key(name: str, taken: Collection[str]) -> str:
    """A `$defs` key for a function's parameters: its name when that needs no JSON-pointer
    escaping (xgrammar resolves none), made unique."""
    base = name if _PLAIN_KEY.fullmatch(name) else "function"
    key, n = base, 1
    while key in taken:
        n += 1
        key = f"{base}_{n}"
    return key


def json_array_schema(tools: Sequence[ChatTool], single: bool) -> dict[str, Any]:
    """SGLang's json_schema for required / named tool_choice.

    Each function's parameters go under the wrapper's `$defs`, their local refs rebased there: a
    "#" inside them (a recursive schema) means that function's parameters, not the array."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        key = _defs_key(tool.function.name, defs)
        defs[key] = _rebased(_parameters(tool), f"#/$defs/{key}")
        items.append({
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": {"$ref": f"#/$defs/{key}"},
            },
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1}
    # Every branch is an object already; xgrammar enforces no keyword beside anyOf (grammar.py
    # refuses one there), so the branches stand alone.
    schema["items"] = items[0] if len(items) == 1 else {"anyOf": items}
    if single:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


def _info_field(info: Any, key: str) -> Optional[str]:
    if isinstance(info, dict):
        return info.get(key)
    return getattr(info, key, None)


def _call_tags(parser: Any, tools: Sequence[ChatTool]) -> Optional[tuple[list[dict[str, Any]], list[str]]]:
    """(an xgrammar tag per tool: one call in the parser's own format, its arguments under the
    tool's schema; the strings that begin a call), or None when the parser cannot describe its
    format with JSON arguments."""
    structure_info = getattr(parser, "structure_info", None)
    if structure_info is None:
        return None
    tags: list[dict[str, Any]] = []
    triggers: list[str] = []
    try:
        for tool in tools:
            info = structure_info(tool.function.name)
            begin, end = _info_field(info, "begin"), _info_field(info, "end")
            trigger = _info_field(info, "trigger") or begin
            if not begin or end is None or not begin.startswith(trigger):
                return None
            tags.append({
                "type": "tag",
                "begin": begin,
                "content": {"type": "json_schema", "json_schema": _parameters(tool)},
                "end": end,
            })
            if trigger not in triggers:
                triggers.append(trigger)
    except NotImplementedError:
        return None
    return tags, triggers


def structural_tag(parser: Any, tools: Sequence[ChatTool], single: bool, parallel: bool) -> Optional[dict[str, Any]]:
    """An xgrammar structural tag forcing tool calls in the parser's own format, or None when the
    parser cannot describe its format with JSON arguments.

    A named function (`single`): exactly that one call. `required`: one or more calls (one when
    not `parallel`) to the declared functions, separated by newlines, and nothing else: no text
    before, between or after them (a model that has called its tools ends its turn)."""
    found = _call_tags(parser, tools)
    if found is None:
        return None
    tags = found[0]
    if single:
        return {"type": "structural_tag", "format": tags[0]}
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }


def strict_auto_tag(parser: Any, tools: Sequence[ChatTool], parallel: bool) -> Optional[dict[str, Any]]:
    """For tool_choice auto with strict tools: text is free until the model begins a call, which
    must then be a call to one of `tools` with arguments valid under its schema (OpenAI's strict
    function calling; SGLang constrains auto the same way when a tool is strict). None when the
    parser cannot describe its format with JSON arguments."""
    found = _call_tags(parser, tools)
    if found is None:
        return None
    tags, triggers = found
    triggered = {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": not parallel}
    if getattr(parser, "bare_object_start", False) and len(triggers) == 1:
        return {"type": "structural_tag", "format": _bare_start_format(parser, tags, triggers[0], triggered, parallel)}
    return {"type": "structural_tag", "format": triggered}


# Leading whitespace as the parsers skip it: every character str.lstrip strips (none is above
# U+3000), as regex escapes (xgrammar's character classes take no raw newline).
_WS_CHARS = "".join(f"\\u{ord(c):04x}" for c in map(chr, range(0x3001)) if c.isspace())
_LEADING_WS = f"[{_WS_CHARS}]*"


def _bare_start_format(parser: Any, tags: list[dict[str, Any]], trigger: str, triggered: dict[str, Any],
                       parallel: bool) -> dict[str, Any]:
    """Llama 3's calls under strict auto: a call is either marked (the trigger, <|python_tag|>,
    anywhere) or a bare JSON object at the very start of the output, which has no trigger to
    wait for (SGLang leaves it unconstrained). So the output is one of: calls from the start,
    bare or marked (with parallel calls, more after its separator, then free text with marked
    calls); text that starts with anything but a call, then free text with marked calls; or
    nothing. A '<' may start text, except as the start of '<|' (the trigger's)."""
    bare = [{**t, "begin": t["begin"][len(trigger):]} for t in tags]
    ws = {"type": "regex", "pattern": _LEADING_WS}

    def calls_from_start(first: list[dict[str, Any]]) -> list[dict[str, Any]]:
        one = {"type": "or", "elements": first}
        if not parallel:
            return [one]
        more = {"type": "star", "content": {"type": "sequence", "elements": [
            {"type": "regex", "pattern": parser.separator_regex}, {"type": "or", "elements": bare + tags}]}}
        after = {"type": "sequence", "elements": [
            {"type": "regex", "pattern": f"{_LEADING_WS}([^;<{_WS_CHARS}]|<[^|])"}, triggered]}
        return [one, more, {"type": "or", "elements": [ws, after]}]

    text_first = {"type": "sequence", "elements": [
        {"type": "regex", "pattern": f"{_LEADING_WS}([^{{<{_WS_CHARS}]|<[^|])"}, triggered]}
    return {"type": "or", "elements": [
        {"type": "sequence", "elements": [ws, *calls_from_start(bare)]},
        {"type": "sequence", "elements": [ws, *calls_from_start(tags)]},
        text_first,
        ws,
    ]}


@dataclass
class ToolPlan:
    """How one chat request handles tools."""

    parser_name: Optional[str]  # None: no parsing (no tools, or tool_choice none)
    constraint: Optional[tuple[str, str]]  # (sampling key, value) or None
    template_tools: Optional[list[dict[str, Any]]]  # tools given to the chat template
    tools: list[dict[str, Any]]  # tools given to the parser
    parallel: bool
    forced: bool = False  # tool_choice required or a named function: the output is calls only
    call_id: Callable[[], str] = new_call_id


def forces_call(tool_choice: Any) -> bool:
    """Whether `tool_choice` (required, or a named function) constrains generation to calls."""
    return tool_choice not in (None, "none", "auto")


def plan_tools(
    tools: Optional[Sequence[ChatTool]],
    tool_choice: Any,
    parallel_tool_calls: Optional[bool],
    configured_parser: Optional[str],
    exclude_tools_when_none: bool = False,
) -> ToolPlan:
    parallel = parallel_tool_calls is not False
    if not tools:
        if forces_call(tool_choice):
            raise bad_request("tool_choice requires tools", param="tool_choice")
        return ToolPlan(None, None, None, [], parallel)
    as_dicts = tools_as_dicts(tools)
    choice = tool_choice if tool_choice is not None else "auto"
    if choice == "none":  # nothing parsed or constrained; the template sees the tools (vLLM's default)
        return ToolPlan(None, None, None if exclude_tools_when_none else as_dicts, [], parallel)
    if choice == "auto":
        if not configured_parser:
            raise bad_request(
                '"auto" tool choice requires the server to be started with --tool-call-parser', param="tool_choice"
            )
        constraint = None
        strict = [i for i, t in enumerate(tools) if t.function.strict]
        if strict:
            tag = strict_auto_tag(get_parser(configured_parser), tools, parallel)
            if tag is None:
                raise bad_request(
                    f"strict function calling with tool_choice auto is not supported by the {configured_parser} "
                    "tool-call parser (its calls are not JSON arguments); use tool_choice required or a named "
                    "function, or strict false",
                    param=f"tools[{strict[0]}].function.strict",
                )
            constraint = ("structural_tag", json.dumps(tag, ensure_ascii=False))
        return ToolPlan(configured_parser, constraint, as_dicts, as_dicts, parallel,
                        call_id=call_id_maker(configured_parser))
    if isinstance(choice, NamedToolChoice):
        selected = [t for t in tools if t.function.name == choice.function.name]
        if not selected:
            raise bad_request(f"tool_choice names a function not in tools: '{choice.function.name}'", param="tool_choice")
        single = True
    elif choice == "required":
        selected, single = list(tools), False
    else:
        raise bad_request(f"invalid tool_choice {choice!r}", param="tool_choice")
    if configured_parser:
        tag = structural_tag(get_parser(configured_parser), selected, single, parallel)
        if tag is not None:
            constraint = ("structural_tag", json.dumps(tag, ensure_ascii=False))
            return ToolPlan(configured_parser, constraint, as_dicts, as_dicts, parallel, forced=True,
                            call_id=call_id_maker(configured_parser))
    schema = json_array_schema(selected, single or not parallel)
    constraint = ("json_schema", json.dumps(schema, ensure_ascii=False))
    return ToolPlan(JSON_ARRAY, constraint, as_dicts, as_dicts, parallel, forced=True,
                    call_id=call_id_maker(configured_parser))

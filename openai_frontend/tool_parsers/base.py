"""Shared types and the streaming machinery of the tool-call parsers (SGLang-style detectors).

Contract shared by every format
===============================

A model output is read as text segments and *tool-call regions* (a format's markup around one or
more calls). Both ``detect_and_parse`` (whole text) and ``parse_streaming_increment`` (chunks, split
anywhere) produce the same result:

* ``calls``: one ``ToolCallItem`` per call, ``tool_index`` = 0, 1, 2... in output order.
  ``parameters`` is ``json.dumps(arguments, ensure_ascii=False)`` of a JSON object. Streaming
  sends, per call, an item with ``name`` and ``parameters=""`` first, then argument fragments
  (``name=None``) whose concatenation is exactly the non-streaming ``parameters``.
* Calls to functions not in ``tools`` are dropped (logged), their markup still consumed, as SGLang
  does. ``tools=None`` means "do not filter".
* Markup that does not form a valid call (bad JSON, missing name, truncated, ...) is *normal text*,
  never an exception. Parsing resumes right after the format's trigger token, so a valid region
  nested in the garbage is still found (identically in both modes). The exceptions are cuts: where
  the output ends inside the markup that follows a region's complete call (``</tool_``, a dangling
  separator, a cut close), or inside a call after its trigger (its opening markup, its object)
  with no error in what came, the fragment is dropped, since a max_tokens or stop cut there leaves
  neither text nor a call (llama3's bare ``{`` without a trigger counts as a call only once its
  name is written). A cut inside the trigger token itself (``<tool_``) is text: at the very end of
  the output it may as well be text (a trailing ``<``), and vLLM and SGLang keep it so. Under a
  forced tool_choice the frontend drops all text (``openai_frontend.tools.ToolCallStreamer``).
  A stream ends a cut call whose name was written in full as a call, with the arguments written
  (none, if its arguments object had not begun); ``detect_and_parse`` drops it (the JSON
  formats: ``JsonToolCallParser._cut_markup``, ``_cut_call``).
* ``normal_text`` is the text outside regions joined by ``join_segments``: whitespace touching a
  region is dropped (SGLang strips the text before a call), except that the whitespace in front of
  a group of regions is kept when more text follows it, so ``"A\\n<call/>\\nB"`` gives ``"A\\nB"``.
  Text with no region at all is returned unchanged.

Streaming must therefore hold back (1) a suffix that may be the start of a trigger token and (2)
trailing whitespace, which is only emitted once non-space text follows it. ``finish()`` (alias
``flush()``) releases whatever is still held at the end of the stream.

Once a call's name has been streamed it cannot be taken back. So the streaming parser commits a call
(sends its name) as soon as the name and the start of its arguments are known, and never takes it
back: a committed call that then turns out malformed, or that the stream stops inside, stays a call
with the arguments written up to the error (see each format's ``resync`` for what follows). This
is decided per character, so the result does not depend on how the text was chunked
(``JsonToolCallParser._fail_at_error``). ``detect_and_parse`` keeps SGLang's whole-text semantics
(that markup is text) for ``/parse_function_call``; the frontend's non-streaming chat responses
run the streaming parser over the whole output (``openai_frontend.tools.parse_as_streamed``), so
streaming and non-streaming responses always agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from pydantic import BaseModel

logger = logging.getLogger("openai_frontend.tool_parsers")

__all__ = [
    "BaseToolParser",
    "ParseResult",
    "StreamingParseResult",
    "StructureInfo",
    "ToolCallItem",
    "join_segments",
    "tool_names",
]


class ToolCallItem(BaseModel):
    """One parsed call (non-streaming) or one streaming delta of a call (as in SGLang)."""

    tool_index: int
    name: Optional[str] = None
    parameters: str = ""  # JSON text (a fragment of it when streaming)


class ParseResult(BaseModel):
    normal_text: str = ""
    calls: list[ToolCallItem] = []


class StreamingParseResult(ParseResult):
    """The increment produced by one ``parse_streaming_increment`` / ``finish`` call."""


@dataclass(frozen=True)
class StructureInfo:
    """What surrounds one call's JSON arguments (for xgrammar structural tags); ``trigger`` is the
    text that opens the format's tool-call markup."""

    begin: str
    end: str
    trigger: str


def tool_names(tools: Optional[Iterable[Any]]) -> Optional[frozenset[str]]:
    """Function names from OpenAI tool dicts, pydantic tools (``.function.name``) or plain names."""
    if tools is None:
        return None
    names = set()
    for tool in tools:
        if isinstance(tool, str):
            names.add(tool)
            continue
        fn = tool.get("function", tool) if isinstance(tool, dict) else getattr(tool, "function", tool)
        name = fn.get("name") if isinstance(fn, dict) else getattr(fn, "name", None)
        if name:
            names.add(name)
    return frozenset(names)


def join_segments(segments: Sequence[str]) -> str:
    """The normal text for text ``segments`` that surrounded ``len(segments) - 1`` regions."""
    if len(segments) == 1:
        return segments[0]
    last = len(segments) - 1
    out: list[str] = []
    pending_ws = ""  # whitespace before the current group of regions, restored if text follows
    for i, seg in enumerate(segments):
        if i > 0:
            seg = seg.lstrip()
        core = seg.rstrip() if i < last else seg
        if core:
            out.append(pending_ws)
            out.append(core)
            pending_ws = seg[len(core):]
    return "".join(out)


class _TextSink:
    """Streaming counterpart of ``join_segments``: applies the whitespace rule incrementally."""

    def __init__(self) -> None:
        self._out: list[str] = []
        self._held = ""  # trailing whitespace of the current segment, not yet emitted
        self._pending_ws = ""  # whitespace in front of the current region group
        self._after_region = False  # only whitespace seen since the last region
        self._segment_has_text = False

    def text(self, s: str) -> None:
        if not s:
            return
        if self._after_region:
            s = s.lstrip()
            if not s:
                return
            self._after_region = False
            self._out.append(self._pending_ws)
            self._pending_ws = ""
        t = self._held + s
        core = t.rstrip()
        if core:
            self._out.append(core)
            self._segment_has_text = True
        self._held = t[len(core):]

    def region_start(self) -> None:
        if not self._after_region:  # first region of a group
            self._pending_ws = self._held if self._segment_has_text else ""
        self._held = ""
        self._after_region = True
        self._segment_has_text = False

    def region_end(self) -> None:
        self._after_region = True

    def finish(self) -> None:
        if not self._after_region:
            self._out.append(self._held)
        self._held = ""

    def take(self) -> str:
        s = "".join(self._out)
        self._out.clear()
        return s


_KEEP_TOOLS: Any = object()


class BaseToolParser:
    """Base of all format parsers. One instance parses one output (it is stateful when streaming).

    Subclasses implement ``_parse_complete`` (non-streaming: segments + calls) and ``_advance``
    (streaming: consume ``self._buf`` as far as it can be decided), using the helpers below to emit
    text and calls.
    """

    #: tokens whose presence means the text may contain a tool call (SGLang's bot_token)
    triggers: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget all streaming state (to reuse the instance for another output)."""
        self._buf = ""
        self._names: Optional[frozenset[str]] = None
        self._sink = _TextSink()
        self._items: list[ToolCallItem] = []
        self._n_calls = 0
        self._finished = False

    # -- public API -----------------------------------------------------------------------------
    def has_tool_call(self, text: str) -> bool:
        """Whether ``text`` contains the start of this format's tool-call markup."""
        return any(t in text for t in self.triggers)

    def detect_and_parse(self, text: str, tools: Optional[Sequence[Any]]) -> ParseResult:
        """Parse a complete output."""
        segments, found = self._parse_complete(text, tool_names(tools))
        calls = [ToolCallItem(tool_index=i, name=name, parameters=args) for i, (name, args) in enumerate(found)]
        return ParseResult(normal_text=join_segments(segments), calls=calls)

    def parse_streaming_increment(self, new_text: str, tools: Optional[Sequence[Any]]) -> StreamingParseResult:
        """Feed the next chunk of output; returns what became certain because of it."""
        if self._finished:
            raise RuntimeError("parser already finished; call reset() to reuse it")
        self._names = tool_names(tools)
        self._buf += new_text
        self._advance(final=False)
        return self._take()

    def finish(self, tools: Optional[Sequence[Any]] = _KEEP_TOOLS) -> StreamingParseResult:
        """End of stream: resolve everything still held back. ``tools`` defaults to the last ones."""
        if self._finished:
            return StreamingParseResult()
        if tools is not _KEEP_TOOLS:
            self._names = tool_names(tools)
        self._advance(final=True)
        self._sink.finish()
        self._finished = True
        return self._take()

    flush = finish

    def structure_info(self, tool_name: str) -> StructureInfo:
        """begin/end around one call's JSON arguments, to force a call of ``tool_name``."""
        raise NotImplementedError(f"{type(self).__name__} has no JSON-arguments structure")

    # -- for subclasses -------------------------------------------------------------------------
    def _parse_complete(
        self, text: str, names: Optional[frozenset[str]]
    ) -> tuple[list[str], list[tuple[str, str]]]:
        raise NotImplementedError

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    def _allowed(self, name: str) -> bool:
        if self._names is None or name in self._names:
            return True
        logger.warning("model called undefined function %r; dropped", name)
        return False

    def _text(self, s: str) -> None:
        self._sink.text(s)

    def _region_start(self) -> None:
        self._sink.region_start()

    def _region_end(self) -> None:
        self._sink.region_end()

    def _start_call(self, name: str) -> int:
        index = self._n_calls
        self._n_calls += 1
        self._items.append(ToolCallItem(tool_index=index, name=name, parameters=""))
        return index

    def _call_args(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self._items[-1] if self._items else None
        if last is not None and last.tool_index == index and last.name is None:
            last.parameters += fragment  # one fragment per call per increment
        else:
            self._items.append(ToolCallItem(tool_index=index, name=None, parameters=fragment))

    def _take(self) -> StreamingParseResult:
        items, self._items = self._items, []
        return StreamingParseResult(normal_text=self._sink.take(), calls=items)


def find_trigger(text: str, triggers: Sequence[str], pos: int = 0) -> tuple[int, int]:
    """Earliest occurrence of any trigger at or after ``pos``: (index, trigger length) or (-1, 0)."""
    best, best_len = -1, 0
    for t in triggers:
        i = text.find(t, pos)
        if i >= 0 and (best < 0 or i < best):
            best, best_len = i, len(t)
    return best, best_len


def partial_trigger_len(text: str, triggers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a trigger."""
    best = 0
    for t in triggers:
        for k in range(min(len(text), len(t) - 1), best, -1):
            if text.endswith(t[:k]):
                best = k
                break
    return best

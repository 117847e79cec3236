"""Engine for the formats whose calls are JSON objects inside fixed markup (qwen25, llama3, mistral,
deepseekv3). A format is declared with a few *patterns* instead of its own state machine:

    region := open  call  (separator call)*  close?          (separator=None: one call per region)
    call   := call_prefix  OBJECT  call_suffix?

``OBJECT`` is a wrapper ``{"name": ..., "arguments"|"parameters": {...}}``, or, with ``args_only``,
the arguments object itself (the name comes from a ``call_prefix`` capture). Optional parts are
all-or-nothing. A region is the longest prefix of well-formed calls: if call k > 1 is malformed the
region ends after call k - 1 and the rest is text; if the first one is, the trigger is text. A call
the end of the output cuts short (no error before the end) is not text: it is dropped (see
``_cut_call`` for what a stream keeps of it).

Patterns are tuples of: ``WS`` (JSON whitespace, greedy), a literal string, or ``Until(term)``
(captures everything up to the first ``term``). The non-streaming parser runs them as regular
expressions over the whole text; the streaming parser matches them against its buffer with a
three-way answer (matched / needs more text / failed). Keeping these two implementations separate
lets the equivalence tests cross-check them.

Streaming a call: the name item is sent (the call is *committed*) once the name is known, allowed,
and the arguments object has started -- for wrappers that means the first "name" member came before
the first "arguments"/"parameters" member and the latter's value starts with '{'. Arguments then
flow as canonical JSON fragments. Anything else (arguments before name, unknown name, string/null
arguments) is buffered until the object ends and decided exactly as ``detect_and_parse`` decides.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional, Union

from .base import BaseToolParser, find_trigger, partial_trigger_len
from .json_stream import JsonCanonicalizer, JsonObject, decode_json, decode_json_at, dumps

logger = logging.getLogger("openai_frontend.tool_parsers")

ARGS_KEYS = ("arguments", "parameters")


class _Ws:
    def __repr__(self) -> str:
        return "WS"


WS = _Ws()


class Until:
    """Capture everything up to (and consume) the first ``term``."""

    def __init__(self, term: str) -> None:
        self.term = term


Item = Union[_Ws, str, Until]
Pattern = tuple[Item, ...]

MATCHED, NEED_MORE, FAILED = "matched", "need_more", "failed"
_WS_RE = re.compile(r"[ \t\n\r]*")


def pattern_regex(pattern: Pattern, suffix: str = "") -> "re.Pattern[str]":
    """The regular expression for a pattern (non-streaming side)."""
    parts = []
    for item in pattern:
        if item is WS:
            parts.append(r"[ \t\n\r]*")
        elif isinstance(item, Until):
            t = re.escape(item.term)
            parts.append(rf"((?:(?!{t}).)*){t}")
        else:
            parts.append(re.escape(item))
    return re.compile("".join(parts) + suffix, re.DOTALL)


def match_prefix(pattern: Pattern, buf: str, final: bool) -> tuple[str, int, list[str]]:
    """Match ``pattern`` at the start of ``buf`` (streaming side): (status, end, captures).

    NEED_MORE means ``buf`` ends while it could still become a match; never returned when ``final``.
    """
    pos, caps, n = 0, [], len(buf)
    for item in pattern:
        if item is WS:
            pos = _WS_RE.match(buf, pos).end()
            if pos == n and not final:
                return NEED_MORE, pos, caps  # the next item needs a character we do not have yet
        elif isinstance(item, Until):
            i = buf.find(item.term, pos)
            if i < 0:
                return (FAILED if final else NEED_MORE), pos, caps
            caps.append(buf[pos:i])
            pos = i + len(item.term)
        else:
            got = buf[pos:pos + len(item)]
            if got != item:
                if not final and pos + len(got) == n and item.startswith(got):
                    return NEED_MORE, pos, caps
                return FAILED, pos, caps
            pos += len(item)
    return MATCHED, pos, caps


# -- interpreting a complete call object (shared by both modes: it is the *definition*) ----------


def object_cut(text: str, p: int) -> tuple[bool, bool]:
    """Whether the JSON value at ``text[p]`` is cut short by the end of ``text`` (no error in it),
    and whether a "name" member was written in full before the cut."""
    canon = JsonCanonicalizer()
    try:
        canon.feed(text[p:], 0)
    except ValueError:
        return False, False
    if canon.done:
        return False, False
    return True, any(m.key == "name" and m.end >= 0 and m.first == '"' for m in canon.members)


def interpret_wrapper(value: Any) -> Optional[tuple[str, Any]]:
    """(name, arguments dict) for a valid call wrapper, else None. First occurrence of a key wins."""
    if not isinstance(value, JsonObject):
        return None
    name = next((v for k, v in value.pairs if k == "name"), None)
    if not isinstance(name, str):
        return None
    args = next((v for k, v in value.pairs if k in ARGS_KEYS), None)
    if args is None:  # absent or null: no arguments
        args = {}
    elif isinstance(args, str):  # arguments double-encoded as a JSON string
        try:
            args = decode_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, args


class _ObjectStream:
    """One call object being streamed: raw JSON in, commit decision and argument fragments out."""

    def __init__(self, args_only: bool, fixed_name: Optional[str]) -> None:
        self.canon = JsonCanonicalizer()
        self.raw: list[str] = []
        self.args_only = args_only
        self.fixed_name = fixed_name  # args_only: the name captured from the markup
        self.index = -1  # tool_index once committed
        self.uncommittable = False  # name known but not allowed
        self._args_member = None
        self._sent = 0  # canonical argument characters already sent

    @property
    def committed(self) -> bool:
        return self.index >= 0

    def feed(self, s: str) -> int:
        end = self.canon.feed(s, 0)
        self.raw.append(s[:end])  # to decide the object when it ends, or replay it to an error
        return end

    def commit_name(self) -> Optional[str]:
        """The name to announce if the call can be committed now, else None."""
        if self.args_only:
            return self.fixed_name if self.canon.length else None
        name_member = args_member = None
        for m in self.canon.members:
            if m.key == "name" and name_member is None:
                name_member = m
            elif m.key in ARGS_KEYS and args_member is None:
                args_member = m
                break  # a name after the arguments is too late to stream them
        if name_member is None or args_member is None or name_member.end < 0 or name_member.first != '"':
            return None
        if args_member.first != "{":
            return None
        self._args_member = args_member
        text = self.canon.text()
        return decode_json(text[name_member.start:name_member.end])

    def cut_name(self) -> Optional[str]:
        """The call's name, if written in full, of an object the output ended inside."""
        if self.args_only:
            return self.fixed_name
        m = next((m for m in self.canon.members if m.key == "name"), None)
        if m is None or m.end < 0 or m.first != '"':
            return None
        return decode_json(self.canon.text()[m.start:m.end])

    def fragment(self) -> str:
        """Canonical argument text produced since the last call."""
        if self.args_only:
            start, end = 0, self.canon.length
        else:
            m = self._args_member
            start, end = m.start, (m.end if m.end >= 0 else self.canon.length)
        if end - start <= self._sent:
            return ""
        out = self.canon.text()[start + self._sent:end]
        self._sent += len(out)
        return out


# Streaming states.
_TEXT, _OPEN, _FIRST, _OBJECT, _SUFFIX, _NEXT, _SKIP = range(7)


class JsonToolCallParser(BaseToolParser):
    """Base class for JSON-object formats; subclasses only declare their markup."""

    open: Pattern = ()  # starts with the trigger literal
    call_prefix: Pattern = ()
    call_suffix: Optional[Pattern] = None
    separator: Optional[Pattern] = None
    close: Optional[Pattern] = None
    allow_empty: bool = False  # region may be ``open close`` with no call (mistral ``[]``)
    bare_object_start: bool = False  # an output starting with '{' is a region (llama3)
    args_only: bool = False
    name_capture: int = -1  # which call_prefix capture is the function name (args_only)
    resync: Optional[str] = None  # after a broken streamed call, skip up to this (None: to the end)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        obj = (WS, "{")
        cls._re_open = pattern_regex(cls.open)
        cls._re_first = pattern_regex(cls.call_prefix + (WS,), r"(?=\{)")
        cls._re_suffix = pattern_regex(cls.call_suffix) if cls.call_suffix else None
        cls._re_next = pattern_regex(cls.separator + cls.call_prefix + (WS,), r"(?=\{)") if cls.separator is not None else None
        cls._re_close = pattern_regex(cls.close) if cls.close else None
        cls._first_alts = [("call", cls.call_prefix + obj)] + ([("close", cls.close)] if cls.allow_empty else [])
        cls._next_alts = ([("call", cls.separator + cls.call_prefix + obj)] if cls.separator is not None else []) + (
            [("close", cls.close)] if cls.close else []
        )
        # What may follow a call: its suffix (optional), then another call or the region's close;
        # once the suffix is read, only the latter.
        cls._after_suffix = [pattern for _, pattern in cls._next_alts]
        with_suffix = [cls.call_suffix + a for a in cls._after_suffix + [()]] if cls.call_suffix else []
        cls._after_object = [c for c in with_suffix + cls._after_suffix if c]

    @staticmethod
    def _cut_markup(rest: str, continuations: list[Pattern]) -> bool:
        """Whether ``rest``, the end of the output after a region's last call, is the markup that
        may follow there cut short (``</tool_``, a separator, the close): the calls are complete,
        so the fragment is neither text nor a call. Both parsing modes drop it, so they stay equal."""
        return any(match_prefix(c, rest, final=False)[0] == NEED_MORE for c in continuations)

    def has_tool_call(self, text: str) -> bool:
        return super().has_tool_call(text) or (self.bare_object_start and text.lstrip().startswith("{"))

    # =============================== non-streaming ==============================================
    def _parse_complete(self, text: str, names: Optional[frozenset[str]]) -> tuple[list[str], list[tuple[str, str]]]:
        segments: list[str] = []
        calls: list[tuple[str, str]] = []
        seg_start = pos = 0
        bare = self.bare_object_start
        while True:
            start, tlen = -1, 0
            if bare:  # only the very beginning of the output may be a bare object
                bare = False
                i = len(text) - len(text.lstrip())
                if text[i:i + 1] == "{":
                    start = i
            if start < 0:
                start, tlen = find_trigger(text, self.triggers, pos)
                if start < 0:
                    break
            region = self._complete_region(text, start, tlen == 0, names)
            if region is None:  # not a call: the trigger is text, look again after it
                pos = start + max(1, tlen)
                continue
            end, found = region
            segments.append(text[seg_start:start])
            calls.extend(found)
            seg_start = pos = end
        segments.append(text[seg_start:])
        return segments, calls

    def _complete_region(self, text: str, start: int, bare: bool, names: Optional[frozenset[str]]):
        found: list[tuple[str, str]] = []
        p = start
        if not bare:
            m = self._re_open.match(text, p)
            if m is None:
                return (len(text), []) if match_prefix(self.open, text[p:], final=False)[0] == NEED_MORE else None
            p = m.end()
        m = self._re_first.match(text, p)
        if m is not None:
            obj = self._complete_object(text, m.end(), m.groups(), names)
            if obj is None:
                cut, named = object_cut(text, m.end())
                # A bare object (llama3) cut before a name is JSON text cut short, not a call.
                return (len(text), []) if cut and (named or not bare) else None
            p = obj[0]
            found += obj[1]
        elif self.allow_empty and self._re_close.match(text, p):
            return self._re_close.match(text, p).end(), []
        elif any(match_prefix(pattern, text[p:], final=False)[0] == NEED_MORE for _, pattern in self._first_alts):
            return len(text), []
        else:
            return None
        while True:
            continuations = self._after_object
            if self._re_suffix is not None and (m := self._re_suffix.match(text, p)):
                p = m.end()
                continuations = self._after_suffix
            if self._re_next is not None and (m := self._re_next.match(text, p)):
                obj = self._complete_object(text, m.end(), m.groups(), names)
                if obj is not None:
                    p = obj[0]
                    found += obj[1]
                    continue
                if object_cut(text, m.end())[0]:
                    p = len(text)
                break  # the region ends after the last good call
            if self._re_close is not None and (m := self._re_close.match(text, p)):
                return m.end(), found
            if p < len(text) and self._cut_markup(text[p:], continuations):
                p = len(text)
            break
        return p, found

    def _complete_object(self, text: str, p: int, caps: tuple, names: Optional[frozenset[str]]):
        """(end, [call] or [] if dropped) for the object at ``text[p]``, or None if invalid."""
        try:
            value, end = decode_json_at(text, p)
        except ValueError:
            return None
        call = self._interpret(value, caps[self.name_capture].strip() if self.args_only else None)
        if call is None:
            return None
        name, args = call
        if names is not None and name not in names:
            logger.warning("model called undefined function %r; dropped", name)
            return end, []
        return end, [(name, dumps(args))]

    def _interpret(self, value: Any, fixed_name: Optional[str]) -> Optional[tuple[str, Any]]:
        if self.args_only:
            return (fixed_name, value) if isinstance(value, dict) else None
        return interpret_wrapper(value)

    # =============================== streaming ==================================================
    def reset(self) -> None:
        super().reset()
        self._state = _TEXT
        self._at_start = True  # nothing but whitespace seen yet (bare_object_start)
        self._trigger_len = 0
        self._raw: list[str] = []  # raw text since the last point the region could end at
        self._confirmed = False  # the current region holds a call (it cannot be text any more)
        self._obj: Optional[_ObjectStream] = None

    def _advance(self, final: bool) -> None:
        steps = {
            _TEXT: self._step_text, _OPEN: self._step_open, _FIRST: self._step_first,
            _OBJECT: self._step_object, _SUFFIX: self._step_suffix, _NEXT: self._step_next,
            _SKIP: self._step_skip,
        }
        while steps[self._state](final):
            pass

    def _consume(self, n: int, keep: bool = True) -> None:
        """Move ``n`` buffered characters into the region (``keep``: they may still be rolled back)."""
        if keep:
            self._raw.append(self._buf[:n])
        self._buf = self._buf[n:]

    def _step_text(self, final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        if self._at_start and self.bare_object_start:
            rest = buf.lstrip()
            if not rest:
                self._text(buf)
                self._buf = ""
                return False
            self._text(buf[:len(buf) - len(rest)])
            self._buf = rest
            self._at_start = False
            if rest[0] == "{":
                self._begin_region(0)
                self._state = _FIRST
                return True
            buf = rest
        idx, tlen = find_trigger(buf, self.triggers)
        if idx >= 0:
            self._text(buf[:idx])
            self._buf = buf[idx:]
            self._begin_region(tlen)
            self._state = _OPEN
            return True
        hold = 0 if final else partial_trigger_len(buf, self.triggers)
        self._text(buf[:len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _begin_region(self, trigger_len: int) -> None:
        self._trigger_len = trigger_len
        self._raw = []
        self._confirmed = False

    def _confirm(self) -> None:
        if not self._confirmed:
            self._confirmed = True
            self._region_start()

    def _end_region(self) -> None:
        self._region_end()
        self._raw = []
        self._obj = None
        self._state = _TEXT

    def _rollback(self) -> bool:
        """The call being read is not valid: end the region before it, or if it was the first,
        give the trigger back as text and rescan everything after it."""
        raw = "".join(self._raw) + self._buf
        self._raw = []
        self._obj = None
        if self._confirmed:
            self._end_region()
            self._buf = raw
        else:
            t = max(1, self._trigger_len)
            self._text(raw[:t])
            self._buf = raw[t:]
            self._state = _TEXT
        return True

    def _step_open(self, final: bool) -> bool:
        status, end, _ = match_prefix(self.open, self._buf, final)
        if status == NEED_MORE:
            return False
        if status == FAILED:
            if final and match_prefix(self.open, self._buf, final=False)[0] == NEED_MORE:
                return self._cut_call(None)
            return self._rollback()
        self._consume(end)
        self._state = _FIRST
        return True

    def _alternatives(self, alts, final: bool) -> Optional[tuple[str, int, list[str]]]:
        """First alternative that matches; None = wait; ("", 0, []) = none can match."""
        for kind, pattern in alts:
            status, end, caps = match_prefix(pattern, self._buf, final)
            if status == MATCHED:
                return kind, end, caps
            if status == NEED_MORE:
                return None
        return "", 0, []

    def _start_object(self, end: int, caps: list[str]) -> None:
        self._consume(end - 1)  # everything before the '{'
        name = caps[self.name_capture].strip() if self.args_only else None
        self._obj = _ObjectStream(self.args_only, name)
        self._state = _OBJECT

    def _step_first(self, final: bool) -> bool:
        alt = self._alternatives(self._first_alts, final)
        if alt is None:
            return False
        kind, end, caps = alt
        if kind == "call":
            self._start_object(end, caps)
        elif kind == "close":  # empty region, e.g. "[TOOL_CALLS] []"
            self._consume(end, keep=False)
            self._confirm()
            self._end_region()
        elif final and self._alternatives(self._first_alts, final=False) is None:
            return self._cut_call(None)
        else:
            return self._rollback()
        return True

    def _step_object(self, final: bool) -> bool:
        obj = self._obj
        if self._buf:
            try:
                used = obj.feed(self._buf)
            except ValueError:
                return self._fail_at_error()
            self._consume(used, keep=not obj.committed)
            self._try_commit()
        if obj.canon.done:
            return self._object_done()
        if final:
            return self._object_failed() if obj.committed else self._cut_call(obj)
        return False

    def _try_commit(self, emit: bool = True) -> None:
        obj = self._obj
        if not obj.committed and not obj.uncommittable:
            name = obj.commit_name()
            if name is not None:
                if self._names is None or name in self._names:
                    self._confirm()
                    obj.index = self._start_call(name)
                    self._raw = []  # committed: there is no going back
                else:  # unknown function: decided (dropped) when the object ends
                    obj.uncommittable = True
        if emit and obj.committed:
            self._call_args(obj.index, obj.fragment())

    def _fail_at_error(self) -> bool:
        """The buffer holds an error in the call's JSON: end the call where a stream cut one
        character at a time would have.

        Replaying the object character by character up to the error decides the two things a
        coarser chunk would otherwise hide: whether the name and the start of the arguments came
        before the error (then the call is committed, as a finer stream would have sent it), and
        how much of the arguments to send. So a malformed call ends the same in every chunking,
        and a non-streaming parse (one chunk) gives what a token-by-token stream gave. Only
        malformed calls pay for the replay.
        """
        old = self._obj
        obj = _ObjectStream(old.args_only, old.fixed_name)
        obj.feed("".join(old.raw))  # accepted before: cannot fail
        if old.committed:
            obj.commit_name()
            obj.index, obj._sent = old.index, old._sent
        obj.uncommittable = old.uncommittable
        self._obj = obj
        stop = len(self._buf)
        for i, ch in enumerate(self._buf):
            try:
                obj.feed(ch)
            except ValueError:
                stop = i
                break
            self._try_commit(emit=False)
        self._consume(stop, keep=not obj.committed)
        if obj.committed:
            self._call_args(obj.index, obj.fragment())
        return self._object_failed()

    def _object_done(self) -> bool:
        obj = self._obj
        if not obj.committed:  # decide exactly as detect_and_parse does
            value = decode_json_at("".join(obj.raw), 0)[0]
            call = self._interpret(value, obj.fixed_name)
            if call is None:
                return self._rollback()
            name, args = call
            self._confirm()
            if self._allowed(name):
                self._call_args(self._start_call(name), dumps(args))
        self._obj = None
        self._raw = []  # the region may end here now
        self._state = _SUFFIX
        return True

    def _cut_call(self, obj: Optional[_ObjectStream]) -> bool:
        """The output ended inside a call's markup before the call could stream (a max_tokens or
        stop cut): the markup is not text. A name written in full (and allowed) makes it a call
        with no arguments written, as SGLang and vLLM stream a name once it is known."""
        name = obj.cut_name() if obj is not None else None
        if name is None and self._trigger_len == 0 and not self._confirmed:
            return self._rollback()  # a bare object (llama3) cut before a name: JSON text cut short
        self._confirm()
        if name is not None and self._allowed(name):
            self._start_call(name)
        self._buf = ""
        self._end_region()
        return False

    def _object_failed(self) -> bool:
        if not self._obj.committed:
            return self._rollback()
        logger.warning("streamed tool call is malformed or truncated; skipping the rest of it")
        self._obj = None
        self._raw = []
        self._state = _SKIP
        return True

    def _drop_cut_markup(self, final: bool, continuations: list[Pattern]) -> bool:
        """At the end of the output, a region's markup cut short after its last call (see
        _cut_markup): dropped, and the region ends."""
        if final and self._buf and self._cut_markup(self._buf, continuations):
            self._buf = ""
            self._end_region()
            return True
        return False

    def _step_suffix(self, final: bool) -> bool:
        if self._drop_cut_markup(final, self._after_object):
            return False
        if self.call_suffix:
            status, end, _ = match_prefix(self.call_suffix, self._buf, final)
            if status == NEED_MORE:
                return False
            if status == MATCHED:
                self._consume(end, keep=False)
        self._state = _NEXT
        return True

    def _step_next(self, final: bool) -> bool:
        if self._drop_cut_markup(final, self._after_suffix):
            return False
        alt = self._alternatives(self._next_alts, final)
        if alt is None:
            return False
        kind, end, caps = alt
        if kind == "call":
            self._start_object(end, caps)
        else:
            if kind == "close":
                self._consume(end, keep=False)
            self._end_region()
        return True

    def _step_skip(self, final: bool) -> bool:
        if self.resync is None:
            self._buf = ""
            return False
        i = self._buf.find(self.resync)
        if i >= 0:
            self._buf = self._buf[i + len(self.resync):]
            self._end_region()
            return True
        keep = 0 if final else partial_trigger_len(self._buf, (self.resync,))
        self._buf = self._buf[len(self._buf) - keep:]
        return False

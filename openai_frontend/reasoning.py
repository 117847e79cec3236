"""Reasoning parsers: a thinking model's output split into `reasoning_content` and `content`.

vLLM's and SGLang's `--reasoning-parser NAME`. Each format is a pair of markers around the
reasoning section (``<think>`` ... ``</think>`` for DeepSeek-R1 and Qwen3) and whether the section
is already open when the output starts (DeepSeek-R1's and Qwen3-thinking's chat templates end
the prompt with ``<think>``, so the model's output starts inside it).

One incremental splitter serves streaming and non-streaming (the whole output as one chunk), so
the two always agree, whatever the chunking. Rules:

* An output that starts (after whitespace) with an opening marker is reasoning up to the closing
  marker. An output that does not is all content, unless the format starts inside the section.
  In that case it is reasoning up to the closing marker, or to the end if the marker never comes.
* Whitespace at both ends of the reasoning, and at the start of the content after the closing
  marker, is dropped (``<think>\\n...\\n</think>\\n\\n`` is how these models lay it out).
* After the closing marker everything is content: tool calls are parsed from it.

Streaming holds back only what might still turn out to be a marker or whitespace to drop.

Structured output (``response_format``, ``guided_*``, ``tool_choice`` required or named) constrains
the content, not the reasoning, as in vLLM and SGLang: ``constrain_after_reasoning`` wraps the
request's constraint in an xgrammar structural tag that lets the model think freely up to the
closing marker first (or, for a format that need not think, answer directly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Optional

from openai_frontend.tool_parsers.base import find_trigger, partial_trigger_len

__all__ = ["ReasoningFormat", "ReasoningStreamer", "get_reasoning_format", "split_reasoning", "FORMAT_NAMES",
           "constrain_after_reasoning", "ConstraintError", "for_prompt"]


@dataclass(frozen=True)
class ReasoningFormat:
    starts: tuple[str, ...]
    ends: tuple[str, ...]
    starts_in_reasoning: bool
    # The generation prompt ended with the closing marker (thinking switched off): a constraint
    # holds from the first token, with no reasoning section before it.
    closed_in_prompt: bool = False


_THINK = ("<think>",), ("</think>",)
_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat(*_THINK, starts_in_reasoning=True),
    "qwen3": ReasoningFormat(*_THINK, starts_in_reasoning=False),
    "qwen3_thinking": ReasoningFormat(*_THINK, starts_in_reasoning=True),
    "glm45": ReasoningFormat(*_THINK, starts_in_reasoning=False),
    "kimi": ReasoningFormat(("◁think▷",), ("◁/think▷",), starts_in_reasoning=False),
    "granite": ReasoningFormat(
        ("Here is my thought process:", "Here's my thought process:"),
        ("Here is my response:", "Here's my response:"),
        starts_in_reasoning=False,
    ),
}
FORMAT_NAMES = tuple(sorted(_FORMATS))


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format for vLLM's (`deepseek_r1`) or SGLang's (`deepseek-r1`) spelling of a name."""
    fmt = _FORMATS.get(name.strip().lower().replace("-", "_"))
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    return fmt


def for_prompt(fmt: ReasoningFormat, prompt_tail: Optional[str]) -> ReasoningFormat:
    """The format as the chat template's generation prompt leaves it. A template that ends the
    prompt with the opening marker (Qwen3-Thinking-2507's and Qwen3.5's ``<think>\\n``, newer
    DeepSeek-R1 ones) starts the output inside the section, whichever parser the server names
    (`qwen3` took such an output for content, `</think>` and all); one that ends it with the
    closing marker (Qwen3's `enable_thinking: false`, DeepSeek-V3.1's `thinking: false`) starts
    it in the content, and a constraint then holds from its first token. Otherwise, or when the
    tail is not known (None), the parser's rule."""
    if prompt_tail is None:
        return fmt
    tail = prompt_tail.rstrip()
    if tail.endswith(fmt.starts):
        return fmt if fmt.starts_in_reasoning else replace(fmt, starts_in_reasoning=True)
    if tail.endswith(fmt.ends):
        return replace(fmt, starts_in_reasoning=False, closed_in_prompt=True)
    return fmt


class ReasoningStreamer:
    """Per-choice splitter: ``feed(text)`` and, at the end, ``finish()``, each returning the
    (reasoning, content) text that is settled."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self._fmt = fmt
        self._mode = "start"  # start -> reasoning -> content, or start -> content
        self._buf = ""
        self._skip_ws = False
        self.saw_reasoning = False

    @property
    def in_reasoning(self) -> bool:
        return self._mode in ("start", "reasoning")

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _enter(self, mode: str) -> None:
        self._mode = mode
        self._skip_ws = True
        if mode == "reasoning":
            self.saw_reasoning = True

    def _drain(self, final: bool) -> tuple[str, str]:
        fmt = self._fmt
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._mode == "start":
                head = self._buf.lstrip()
                opened = next((m for m in fmt.starts if head.startswith(m)), None)
                if opened is not None:
                    self._buf = head[len(opened):]
                    self._enter("reasoning")
                    continue
                if not final and (not head or any(m.startswith(head) for m in fmt.starts)):
                    break  # still might open
                if fmt.starts_in_reasoning:
                    self._enter("reasoning")
                else:
                    self._mode = "content"  # no reasoning: the output is content as it is
                continue
            if self._skip_ws:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._skip_ws = False
            if self._mode == "content":
                content.append(self._buf)
                self._buf = ""
                break
            # reasoning: up to the earliest closing marker
            i, n = find_trigger(self._buf, fmt.ends)
            if i >= 0:
                reasoning.append(self._buf[:i].rstrip())
                self._buf = self._buf[i + n:]
                self._enter("content")
                continue
            if final:
                reasoning.append(self._buf.rstrip())
                self._buf = ""
                break
            keep = partial_trigger_len(self._buf, fmt.ends)
            settled = self._buf[: len(self._buf) - keep].rstrip()
            reasoning.append(settled)
            self._buf = self._buf[len(settled):]
            break
        return "".join(reasoning), "".join(content)


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[Optional[str], str]:
    """(reasoning or None when the output had no reasoning section, content) of a whole output."""
    s = ReasoningStreamer(fmt)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2 if s.saw_reasoning else None), c1 + c2


class ConstraintError(ValueError):
    """A constraint that cannot follow a reasoning section; the message says why."""


# Whitespace the models put between the closing marker and the answer ("</think>\n\n").
_GAP = {"type": "regex", "pattern": "[ \\n]{0,4}"}


def _json(key: str, value: Any) -> Any:
    # Without a reasoning parser the engine parses the text and refuses it as a 400; here it is
    # parsed first, and a JSONDecodeError would be a 500.
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as exc:
        raise ConstraintError(f"invalid {key}: not valid JSON: {exc}") from None


def _element(key: str, value: Any, whitespace: Optional[str] = None) -> dict[str, Any]:
    """The engine constraint (its sampling-parameter key and value) as a structural-tag element.
    `whitespace`: a json_schema's whitespace pattern, which the engine's element also takes."""
    if key == "json_schema":
        element = {"type": "json_schema", "json_schema": _json(key, value)}
        return element if whitespace is None else {**element, "whitespace_pattern": whitespace}
    if key == "regex":
        return {"type": "regex", "pattern": value}
    if key == "ebnf":
        return {"type": "grammar", "grammar": value}
    if key == "guided_choice":
        return {"type": "grammar", "grammar": "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)}
    if key == "structural_tag":
        tag = _json(key, value)
        if isinstance(tag, dict) and "format" in tag:
            return tag["format"]
        if isinstance(tag, dict) and isinstance(tag.get("structures"), list) and isinstance(tag.get("triggers"), list):
            # SGLang's legacy form, read as xgrammar reads it (from_legacy_structural_tag): text
            # until a trigger, then one of the structures. The engine checks the parts.
            return {"type": "triggered_tags", "triggers": tag["triggers"], "tags": [
                {"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                 "content": {"type": "json_schema", "json_schema": _json(key, s.get("schema"))}}
                if isinstance(s, dict) else s for s in tag["structures"]]}
        raise ConstraintError('structural_tag must be {"type": "structural_tag", "format": {...}} or SGLang\'s '
                              '{"structures": [...], "triggers": [...]}')
    raise ConstraintError(f"unknown constraint {key!r}")


def constrain_after_reasoning(fmt: ReasoningFormat, key: str, value: Any, whitespace: Optional[str] = None) -> str:
    """A structural tag (JSON text) that leaves the reasoning section free and then applies the
    constraint to the content (a json_schema with the request's JSON `whitespace` pattern)."""
    think = {"type": "tag", "begin": "" if fmt.starts_in_reasoning else fmt.starts[0],
             "content": {"type": "any_text"}, "end": fmt.ends[0]}
    answer = _element(key, value, whitespace)
    fmt_obj: dict[str, Any] = {"type": "sequence", "elements": [think, _GAP, answer]}
    if fmt.closed_in_prompt:
        # QA: the prompt had closed the section, yet the or() below let the model open another
        # and write free text under a JSON schema (vLLM holds the grammar from the first token).
        fmt_obj = answer
    elif not fmt.starts_in_reasoning:
        fmt_obj = {"type": "or", "elements": [fmt_obj, answer]}
    return json.dumps({"type": "structural_tag", "format": fmt_obj}, ensure_ascii=False)

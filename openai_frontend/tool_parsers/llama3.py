"""Llama 3.x JSON tool calls: ``<|python_tag|>{"name": ..., "parameters": {...}}``.

Depending on the prompt the model may omit ``<|python_tag|>``; then only an output that *starts*
with ``{`` (after whitespace) is read as calls, as in SGLang. Several calls are separated by ``;``.
Both ``"parameters"`` (Meta's template) and ``"arguments"`` are accepted.
"""

from __future__ import annotations

import json

from .base import StructureInfo
from .json_calls import WS, JsonToolCallParser


class Llama3ToolParser(JsonToolCallParser):
    triggers = ("<|python_tag|>",)
    open = ("<|python_tag|>",)
    separator = (WS, ";")
    bare_object_start = True
    # between calls: ';' with whitespace around it (the grammar's spelling of `separator`)
    separator_regex = r"[ \t\n]*;[ \t\n]*"
    resync = None  # no closing markup: a broken streamed call ends the tool calls

    def structure_info(self, tool_name: str) -> StructureInfo:
        return StructureInfo(
            begin='<|python_tag|>{"name": ' + json.dumps(tool_name, ensure_ascii=False) + ', "parameters": ',
            end="}",
            trigger="<|python_tag|>",
        )

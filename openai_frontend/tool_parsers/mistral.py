"""Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` -- one JSON array of calls."""

from __future__ import annotations

import json

from .base import StructureInfo
from .json_calls import WS, JsonToolCallParser


class MistralToolParser(JsonToolCallParser):
    triggers = ("[TOOL_CALLS]",)
    open = ("[TOOL_CALLS]", WS, "[")
    separator = (WS, ",")
    close = (WS, "]")  # optional: a truncated array still yields its complete calls
    allow_empty = True  # "[TOOL_CALLS] []"
    resync = None

    def structure_info(self, tool_name: str) -> StructureInfo:
        return StructureInfo(
            begin='[TOOL_CALLS] [{"name": ' + json.dumps(tool_name, ensure_ascii=False) + ', "arguments": ',
            end="}]",
            trigger="[TOOL_CALLS]",
        )

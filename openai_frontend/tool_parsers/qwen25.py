"""Qwen 2.5 / Qwen 3 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Each call is its own ``<tool_call>`` block; several blocks may follow each other. The closing tag is
optional (a stream cut right after the object still yields the call); whitespace around the object
is free.
"""

from __future__ import annotations

import json

from .base import StructureInfo
from .json_calls import WS, JsonToolCallParser


class Qwen25ToolParser(JsonToolCallParser):
    triggers = ("<tool_call>",)
    open = ("<tool_call>",)
    call_suffix = (WS, "</tool_call>")
    resync = "</tool_call>"  # a broken streamed call: resume after its block

    def structure_info(self, tool_name: str) -> StructureInfo:
        return StructureInfo(
            begin='<tool_call>\n{"name": ' + json.dumps(tool_name, ensure_ascii=False) + ', "arguments": ',
            end="}\n</tool_call>",
            trigger="<tool_call>",
        )

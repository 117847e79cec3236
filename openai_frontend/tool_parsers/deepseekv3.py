"""DeepSeek V3: special tokens around each call, the arguments in a fenced JSON block::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The name is taken from the markup (up to the newline), the JSON object is the arguments.
"""

from __future__ import annotations

from .base import StructureInfo
from .json_calls import WS, JsonToolCallParser, Until

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(JsonToolCallParser):
    triggers = (CALLS_BEGIN,)
    open = (CALLS_BEGIN,)
    call_prefix = (WS, CALL_BEGIN, Until(TOOL_SEP), Until("\n"), "```json")
    call_suffix = (WS, "```", WS, CALL_END)
    separator = ()  # calls simply follow each other
    close = (WS, CALLS_END)
    args_only = True
    name_capture = 1  # captures: (type, name)
    resync = CALLS_END

    def structure_info(self, tool_name: str) -> StructureInfo:
        return StructureInfo(
            begin=f"{CALLS_BEGIN}{CALL_BEGIN}function{TOOL_SEP}{tool_name}\n```json\n",
            end=f"\n```{CALL_END}{CALLS_END}",
            trigger=CALLS_BEGIN,
        )

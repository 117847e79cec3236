"""Tool-call parsers: model-specific formats -> OpenAI tool calls (SGLang-compatible behaviour).

``get_tool_parser(name)`` returns a fresh, stateful parser for one output; ``TOOL_PARSERS`` maps
every accepted name (including aliases) to its class. See ``base`` for the contract all formats
share: streaming and non-streaming parsing give the same result.
"""

from __future__ import annotations

from .base import BaseToolParser, ParseResult, StreamingParseResult, StructureInfo, ToolCallItem, join_segments
from .deepseekv3 import DeepSeekV3ToolParser
from .json_calls import JsonToolCallParser
from .llama3 import Llama3ToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .qwen25 import Qwen25ToolParser
from .qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[BaseToolParser]] = {
    "qwen25": Qwen25ToolParser,
    "qwen": Qwen25ToolParser,
    "hermes": Qwen25ToolParser,
    "llama3": Llama3ToolParser,
    "llama32": Llama3ToolParser,
    "pythonic": PythonicToolParser,
    "mistral": MistralToolParser,
    "deepseekv3": DeepSeekV3ToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}


def get_tool_parser(name: str) -> BaseToolParser:
    """A new parser instance for the format ``name``; KeyError lists the known names."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        raise KeyError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
    return cls()


__all__ = [
    "BaseToolParser",
    "DeepSeekV3ToolParser",
    "JsonToolCallParser",
    "Llama3ToolParser",
    "MistralToolParser",
    "ParseResult",
    "PythonicToolParser",
    "Qwen25ToolParser",
    "Qwen3CoderToolParser",
    "StreamingParseResult",
    "StructureInfo",
    "TOOL_PARSERS",
    "ToolCallItem",
    "get_tool_parser",
    "join_segments",
]

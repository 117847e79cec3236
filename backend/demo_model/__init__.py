"""Deterministic builder of the default demo model (tiny random Qwen2, HF format).

`python -m backend.demo_model --out models/demo [--seed 0]`
"""

from backend.demo_model.builder import (
    ADDED_TOKENS,
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    DemoModelSpec,
    build_demo_model,
    chat_template,
    is_current,
)

__all__ = [
    "ADDED_TOKENS",
    "ENDOFTEXT",
    "IM_END",
    "IM_START",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "DemoModelSpec",
    "build_demo_model",
    "chat_template",
    "is_current",
]

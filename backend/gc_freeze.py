"""Keep the garbage collector's full passes off the serving path.

A process that has imported torch (and the tokenizer, FastAPI, pydantic...) and loaded a model
tracks a quarter of a million objects that live as long as it does. Python's oldest-generation
collection walks every one of them: 100-160 ms on a 2-core machine, during which the engine's
step loop (or the frontend's event loop) stands still and every running stream stalls. Freezing
what exists once start-up is done moves those objects out of the collector's sight, as vLLM and
SGLang do after start-up; objects made while serving are collected as usual.

Only for processes that serve until they exit: an object frozen here that later becomes cyclic
garbage is never freed. LLM_GC_FREEZE=0 turns it off (to compare, or to chase a leak).
"""

from __future__ import annotations

import gc
import os


def freeze_startup_heap() -> int:
    """Collect once, then freeze every tracked object; returns how many were frozen (0 if off)."""
    if os.environ.get("LLM_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

"""SGLang-compatible custom logit processors: `CustomLogitProcessor.to_str()` in, a callable out.

A serialized processor is a dill pickle of a class: loading it runs code chosen by the client.
The engine therefore refuses them unless started with enable_custom_logit_processor (SGLang's
--enable-custom-logit-processor), and even then only trusted clients should reach it.

Processors written against SGLang subclass `sglang.srt.sampling.custom_logit_processor
.CustomLogitProcessor`; unpickling them imports that module. Without SGLang installed, this module
registers itself under that name so those pickles load (the base class is all they need).
"""

from __future__ import annotations

import json
import sys
import threading
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any, Optional

import torch

SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"
_MAX_SERIALIZED_CHARS = 1 << 20


class CustomLogitProcessorError(ValueError):
    pass


class CustomLogitProcessor(ABC):
    """Base class: `__call__(logits [R, V], custom_param_list: list[dict]) -> logits`."""

    @classmethod
    def to_str(cls) -> str:
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: Optional[list[dict[str, Any]]] = None) -> torch.Tensor:
        raise NotImplementedError


_install_lock = threading.Lock()


def _install_sglang_alias() -> None:
    with _install_lock:
        try:
            __import__(SGLANG_MODULE)
            return
        except ImportError:
            pass
        import types

        parts = SGLANG_MODULE.split(".")
        for k in range(1, len(parts)):
            name = ".".join(parts[:k])
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules[SGLANG_MODULE] = sys.modules[__name__]


@lru_cache(maxsize=64)
def load_processor(serialized: str) -> Any:
    """The processor instance for a `to_str()` string (cached: clients resend the same one)."""
    if len(serialized) > _MAX_SERIALIZED_CHARS:
        raise CustomLogitProcessorError("custom_logit_processor is too large")
    try:
        data = json.loads(serialized)
        blob = bytes.fromhex(data["callable"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CustomLogitProcessorError(
            f"custom_logit_processor must be CustomLogitProcessor.to_str() output: {exc}"
        ) from None
    _install_sglang_alias()
    import dill

    try:
        obj = dill.loads(blob)
    except Exception as exc:
        raise CustomLogitProcessorError(f"custom_logit_processor could not be loaded: {type(exc).__name__}: {exc}") from None
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise CustomLogitProcessorError("custom_logit_processor is not callable")
    return obj

"""vLLM's per-request `logits_processors`: server-side callables named by qualified name.

A request lists processors as ``"package.module.name"`` or as a constructor object
``{"qualname": ..., "args": [...], "kwargs": {...}}`` (the object is called with them and the
result is the processor). Importing a name runs server code chosen by the client, so, as vLLM's
``--logits-processor-pattern``, nothing is allowed unless the engine's ``logits_processor_pattern``
is set, and then only names it matches (``re.match``, as vLLM).

A processor is called per sequence and step, before every other transform, with the output token
ids so far and the row's logits: ``fn(output_ids, logits)``, or ``fn(prompt_ids, output_ids,
logits)`` when it takes three parameters (vLLM's two signatures); it returns the new logits row.
Each of a request's ``n`` samples gets its own instances, so a stateful processor sees one
sequence.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any, Callable, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LogitsProcessorError", "ProcessorSpec", "RowProcessor", "build_processors", "MAX_PROCESSORS"]

MAX_PROCESSORS = 16


class LogitsProcessorError(ValueError):
    """A processor that cannot be loaded or failed; the message says which and why."""


class ProcessorSpec(BaseModel):
    """vLLM's constructor object."""

    model_config = ConfigDict(extra="forbid")
    qualname: str = Field(min_length=1, max_length=256)
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class RowProcessor:
    """One loaded processor with the calling convention its signature asks for."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self._fn = fn
        self._with_prompt = _num_params(fn) == 3

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        out = self._fn(list(prompt_ids), list(output_ids), logits) if self._with_prompt else self._fn(
            list(output_ids), logits)
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
            raise LogitsProcessorError(f"it must return a tensor shaped like its input logits {tuple(logits.shape)}")
        return out


def _num_params(fn: Callable[..., Any]) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature take the two-argument form
        return 2


def _resolve(qualname: str) -> Any:
    module_name, _, attr = qualname.rpartition(".")
    if not module_name:
        raise LogitsProcessorError(f"logits processor '{qualname}' must be a qualified name (module.name)")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as exc:
        raise LogitsProcessorError(f"logits processor '{qualname}' cannot be loaded: {exc}") from None


def build_processors(specs: Sequence[Any], pattern: Optional[str]) -> list[RowProcessor]:
    """Fresh processor instances for one sequence. Raises LogitsProcessorError."""
    if pattern is None:
        raise LogitsProcessorError(
            "logits processors are disabled on this server (start it with logits_processor_pattern=<regex> "
            "matching the allowed processors)")
    out = []
    for raw in specs:
        spec = ProcessorSpec(qualname=raw) if isinstance(raw, str) else ProcessorSpec.model_validate(raw)
        if not re.match(pattern, spec.qualname):
            raise LogitsProcessorError(
                f"logits processor '{spec.qualname}' does not match the server's logits_processor_pattern")
        obj = _resolve(spec.qualname)
        if not isinstance(raw, str):
            try:
                obj = obj(*spec.args, **spec.kwargs)
            except Exception as exc:  # noqa: BLE001 - the constructor is the client's choice of code
                raise LogitsProcessorError(
                    f"logits processor '{spec.qualname}' could not be constructed: {type(exc).__name__}: {exc}"
                ) from None
        if not callable(obj):
            raise LogitsProcessorError(f"logits processor '{spec.qualname}' is not callable")
        out.append(RowProcessor(spec.qualname, obj))
    return out

"""A request's sampling parameters, named and validated as SGLang names them.

Every name in SGLang's `SamplingParams` / `GenerateReqInput` is known here: a name we implement
is validated, a name we do not implement yet is rejected with an error that says so. Nothing is
silently ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SamplingParamsError(ValueError):
    """Bad sampling parameters; the message names the parameter."""


# Known SGLang/vLLM names that this engine does not implement (yet). They get a clear error.
UNSUPPORTED: dict[str, str] = {
    "frequency_penalty": "frequency_penalty is not supported yet",
    "presence_penalty": "presence_penalty is not supported yet",
    "repetition_penalty": "repetition_penalty is not supported yet",
    "min_new_tokens": "min_new_tokens is not supported yet",
    "stop_regex": "stop_regex is not supported yet",
    "json_schema": "json_schema (structured output) is not supported yet",
    "regex": "regex (structured output) is not supported yet",
    "ebnf": "ebnf (structured output) is not supported yet",
    "structural_tag": "structural_tag (structured output) is not supported yet",
    "n": "n > 1 is not supported yet",
    "custom_params": "custom_params requires custom_logit_processor, which is not supported",
    "custom_logit_processor": "custom_logit_processor is not supported",
    "return_logprob": "return_logprob is not supported yet",
    "top_logprobs_num": "top_logprobs_num is not supported yet",
    "token_ids_logprob": "token_ids_logprob is not supported yet",
    "logprob_start_len": "logprob_start_len is not supported yet",
    "return_text_in_logprobs": "return_text_in_logprobs is not supported yet",
    "lora_path": "LoRA adapters are not supported",
    "image_data": "image input is not supported",
    "audio_data": "audio input is not supported",
    "input_embeds": "input_embeds is not supported",
    "return_hidden_states": "return_hidden_states is not supported",
    "return_routed_experts": "return_routed_experts is not supported (no MoE models)",
    "routed_experts_start_len": "routed_experts_start_len is not supported (no MoE models)",
}

# Values of an unsupported parameter that mean "off" are accepted: clients often send defaults.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,),
    "n": (1,),
    "return_logprob": (False,),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "return_text_in_logprobs": (False,),
    "logprob_start_len": (-1,),
    "top_logprobs_num": (0,),
}


class SamplingParams(BaseModel):
    """The parameters the engine implements. Defaults are SGLang's constant ("openai") defaults."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Union[None, str, list[str]]) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @model_validator(mode="after")
    def _check_ranges(self) -> "SamplingParams":
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


# Which sampling defaults a model's generation_config.json may set, under HF's names.
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p")


def load_model_defaults(model_path: Union[str, Path]) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json (SGLang's --sampling-defaults model)."""
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return {}
    cfg = json.loads(path.read_text())
    defaults = {k: cfg[k] for k in _GENERATION_CONFIG_KEYS if cfg.get(k) is not None}
    if cfg.get("do_sample") is False:
        defaults["temperature"] = 0.0
    if defaults.get("top_k") == 0:  # HF's "off"
        defaults["top_k"] = -1
    return defaults


def parse_sampling_params(raw: dict[str, Any], defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
    """Validate a request's parameters on top of the server's defaults.

    Raises SamplingParamsError naming the offending parameter.
    """
    merged: dict[str, Any] = dict(defaults or {})
    for key, value in raw.items():
        if value is None:
            continue
        if key in UNSUPPORTED:
            if value in _OFF_VALUES.get(key, ()):
                continue
            raise SamplingParamsError(f"unsupported parameter '{key}': {UNSUPPORTED[key]}")
        merged[key] = value
    unknown = [k for k in merged if k not in SamplingParams.model_fields]
    if unknown:
        raise SamplingParamsError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    try:
        return SamplingParams(**merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        msg = err.get("msg", str(exc)).removeprefix("Value error, ")
        raise SamplingParamsError(f"invalid sampling parameter {loc + ': ' if loc else ''}{msg}") from None


def sampling_defaults_mode() -> str:
    """`model` (generation_config.json) or `openai` (constant defaults), as SGLang's flag."""
    return os.environ.get("LLM_SAMPLING_DEFAULTS", "model")

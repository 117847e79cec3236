"""A request's sampling parameters, named and validated as SGLang names them.

Every name in SGLang's `SamplingParams` / `GenerateReqInput` is known here: a name we implement
is validated, a name we do not implement yet is rejected with an error that says so. Nothing is
silently ignored.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, ValidationError, field_validator, model_validator

from backend.model_files import read_json


class SamplingParamsError(ValueError):
    """Bad sampling parameters; the message names the parameter."""


# Known SGLang/vLLM names that are not sampling parameters here (not implemented, or request inputs
# of their own). They get a clear error.
UNSUPPORTED: dict[str, str] = {
    "image_data": "image input is not supported",
    "audio_data": "audio input is not supported",
    "video_data": "video input is not supported",
    "input_embeds": "it is the prompt, not a sampling parameter (the input tensor input_embeds, /generate's input_embeds)",
    "return_routed_experts": "return_routed_experts is not supported (no MoE models)",
    "routed_experts_start_len": "routed_experts_start_len is not supported (no MoE models)",
}

# TensorRT-LLM backend names a request body of its users carries (the generate endpoint's keys and
# gRPC parameters arrive as sampling parameters), each pointing at what does the job here.
UNSUPPORTED.update({
    "beam_width": "beam_width (TensorRT-LLM) is not supported here: beam search runs through the frontend "
                  "(use_beam_search with n as the width)",
    "exclude_input_in_output": "the output never includes the prompt (exclude_input_in_output false is not supported)",
    "return_log_probs": "use return_logprob (SGLang's name), with top_logprobs_num",
    "return_context_logits": "logits are not returned: use return_logprob with logprob_start_len for the prompt",
    "return_generation_logits": "logits are not returned: use return_logprob with top_logprobs_num",
    "num_return_sequences": "use n",
    "end_id": "use stop_token_ids (the model's EOS ids stop generation unless ignore_eos)",
    "pad_id": "there is no padding to set: sequences are not padded into batches",
    "min_length": "use min_new_tokens (SGLang's name, an EOS floor) or min_tokens (vLLM's, stops too)",
})

# Values of an unsupported parameter that mean "off" are accepted: clients often send defaults.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "return_routed_experts": (False,),
    "routed_experts_start_len": (0,),
    "beam_width": (1,),
    "exclude_input_in_output": (True,),
    "return_log_probs": (False,),
    "return_context_logits": (False,),
    "return_generation_logits": (False,),
    "num_return_sequences": (1,),
}

# The structured-output constraints a request may carry (at most one).
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")

# Bounds that keep one request from monopolising the server (issue: input safety).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_N = 64
MAX_TOP_LOGPROBS = 64
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_WHITESPACE_PATTERN_CHARS = 256
MAX_LOGITS_PROCESSORS = 16
MAX_PREDICTION_CHARS = 128 * 1024
MAX_PREDICTION_TOKENS = 32 * 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024  # a salt is a secret of ~43 characters (256 bits, base64)


# Temperatures below this are greedy (SGLang's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-6

# Parameters are strict (a JSON string is no number, a number no boolean: "8" and true are
# refused for max_new_tokens, as OpenAI refuses them), except where JSON itself puts numbers in
# strings: an object's keys (logit_bias's token ids).
JsonKeyInt = Annotated[int, Strict(False)]


class ThinkingBudget(BaseModel):
    """vLLM's thinking_token_budget, with the server's reasoning markers (the OpenAI frontend
    adds them from its reasoning parser): at most `budget` tokens inside the reasoning section,
    then `end` is forced (backend/thinking_budget.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    budget: int = Field(ge=0)
    starts: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(min_length=1, max_length=4)
    end: str = Field(min_length=1, max_length=64)
    inside: bool = False  # the prompt opened the section: the output starts inside it


class SamplingParams(BaseModel):
    """The parameters the engine implements. Defaults are SGLang's constant ("openai") defaults."""

    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False, strict=True)

    # None: up to the end of the context (SGLang's and vLLM's meaning of an absent limit).
    max_new_tokens: Optional[int] = 128
    # SGLang's min_new_tokens holds back EOS and stop_token_ids only: a stop string may still
    # end the output before it (its docs say so). vLLM's min_tokens holds back the stop strings
    # too. Both are kept, each with its own meaning; a request gives at most one.
    min_new_tokens: int = 0
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # SGLang's repetition_penalty scales the tokens generated so far; vLLM's (and HF's) the
    # prompt's too. This picks vLLM's: the OpenAI endpoints set it on every request, so the
    # model's default penalty (generation_config.json) counts the prompt there as well.
    repetition_penalty_counts_prompt: bool = False
    # vLLM's length default, which the OpenAI endpoints ask for: with max_new_tokens null, the
    # model's generation_config.json max_new_tokens (a default, capped by the context's room, never
    # refused), else the room. SGLang ignores that file's value, and so does /generate.
    max_new_tokens_from_model: bool = False
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    stop_regex: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    # SGLang's no_stop_trim leaves the text untouched: a matched stop string stays, with the
    # rest of the token that completed it. vLLM's include_stop_str_in_output keeps the stop
    # string and cuts what follows it. Either keeps a matched stop token's text.
    no_stop_trim: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    # Structured output (xgrammar); at most one. structural_tag is a JSON document.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    structural_tag: Optional[str] = None
    # vLLM's (guided_)whitespace_pattern: a regex for the whitespace between the tokens of a
    # json_schema document (backend/json_whitespace.py).
    whitespace_pattern: Optional[str] = None
    # Logprobs, as SGLang's GenerateReqInput names them.
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    # SGLang's return_hidden_states: the final-norm hidden state of every position the model
    # runs for this request, in meta_info["hidden_states"] (backend/outputs.py has the layout).
    return_hidden_states: bool = False
    # The prompt's token ids (after truncate_prompt_tokens) in meta_info["prompt_token_ids"] of
    # each sample's first response: vLLM's return_token_ids needs them, and a client that sent
    # text (or a chat) has no other way to get the ids the model saw.
    return_prompt_token_ids: bool = False
    # OpenAI's logit_bias (token id -> bias added to its logit, -100..100) and vLLM's
    # allowed_token_ids (every other token is excluded), applied to the model's logits first.
    logit_bias: Optional[dict[JsonKeyInt, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    # vLLM's bad_words: the output never ends a token sequence that spells one of these words
    # (with or without a leading space); the engine tokenizes them into bad_word_ids.
    bad_words: Optional[list[str]] = None
    _bad_word_ids: list[list[int]] = PrivateAttr(default_factory=list)
    # vLLM's truncate_prompt_tokens: only the prompt's last k tokens are used.
    truncate_prompt_tokens: Optional[int] = None
    # vLLM's priority: lower is scheduled earlier; not 0 only on a server with
    # scheduling_policy "priority".
    priority: int = 0
    # SGLang's CustomLogitProcessor.to_str() and its per-request parameters.
    custom_logit_processor: Optional[str] = None
    custom_params: Optional[dict[str, Any]] = None
    # SGLang's lora_path: the name (or path) of a LoRA adapter the engine loaded (lora_modules).
    lora_path: Optional[str] = None
    # vLLM's cache_salt: folded into the start of the prompt's prefix-cache hash chain, so only
    # requests with the same salt share cached blocks. In a multi-tenant deployment a tenant's
    # salt keeps others from learning, by timing a cache hit, which prompts it sent.
    cache_salt: Optional[str] = None
    # vLLM's logits_processors: qualified names or {"qualname", "args", "kwargs"} constructor
    # objects, loaded by the engine when its logits_processor_pattern allows them
    # (backend/logits_processors.py).
    logits_processors: Optional[list[Union[str, dict[str, Any]]]] = None
    thinking_budget: Optional[ThinkingBudget] = None
    # OpenAI's Predicted Outputs (`prediction.content`): text the output is expected to largely
    # repeat, or its token ids. Its tokens are drafted and verified as speculative decoding
    # verifies any draft (backend/predicted_outputs.py), so the output is the one decoding
    # without it would give.
    prediction: Optional[Union[str, list[int]]] = None

    @field_validator("stop", "stop_regex", mode="before")
    @classmethod
    def _str_as_list(cls, v: Union[None, str, list[str]]) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bad_words_forms(cls, v: Any) -> Any:
        # vLLM sends a list (default []); TensorRT-LLM's generate-endpoint bodies a string, "" for none.
        if v == "" or v == []:
            return None
        return [v] if isinstance(v, str) else v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_as_list(cls, v: Any) -> Any:
        return [] if v is None else v

    @field_validator("prediction", mode="before")
    @classmethod
    def _prediction_forms(cls, v: Any) -> Any:
        # SGLang's /generate passes sampling_params through, so OpenAI's object comes here as the
        # chat route's text does; one message for every other shape, not pydantic's per-branch pair.
        if isinstance(v, dict) and v.get("type") == "content" and set(v) == {"type", "content"}:
            content = v["content"]
            if isinstance(content, str):
                return content
            if isinstance(content, list) and all(
                    isinstance(p, dict) and set(p) == {"type", "text"} and p["type"] == "text"
                    and isinstance(p["text"], str) for p in content):
                return "".join(p["text"] for p in content)
        elif v is None or isinstance(v, str) or (isinstance(v, list) and all(type(t) is int for t in v)):
            return v
        raise ValueError('must be text, a list of token ids, or {"type": "content", "content": text or text parts}')

    @field_validator("json_schema", "structural_tag", mode="before")
    @classmethod
    def _json_as_text(cls, v: Any) -> Any:
        # Clients send schemas as objects as often as as strings.
        return json.dumps(v) if isinstance(v, (dict, list)) else v

    @model_validator(mode="after")
    def _check_ranges(self) -> "SamplingParams":
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        for name in ("min_new_tokens", "min_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
            if self.max_new_tokens is not None and value > self.max_new_tokens:
                raise ValueError(f"{name} must be at most max_new_tokens={self.max_new_tokens}, got {value}")
        if self.min_new_tokens and self.min_tokens:
            raise ValueError("give min_new_tokens (SGLang's: stop strings may end the output before it) or "
                             "min_tokens (vLLM's: they may not), not both")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0  # as SGLang: below float precision, sampling would be greedy anyway
        if self.top_k >= 2**31:
            self.top_k = -1  # at least the vocabulary: no cut (and no int32 overflow in the sampler)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if len(self.stop) + len(self.stop_regex) > MAX_STOP_STRINGS:
            raise ValueError(f"stop and stop_regex may hold at most {MAX_STOP_STRINGS} strings together")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop + self.stop_regex):
            raise ValueError(f"stop strings and stop regexes are limited to {MAX_STOP_STRING_CHARS} characters")
        for pattern in self.stop_regex:
            try:
                if re.compile(pattern).match(""):
                    raise ValueError(f"stop_regex {pattern!r} matches the empty string")
            except re.error as exc:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:  # any int64, as vLLM and OpenAI
            raise ValueError(f"seed must be a 64-bit signed integer, in [-2**63, 2**63), got {self.seed}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            # named by the second, as the frontend names an OpenAI request's second constraint
            raise ValueError(f"{given[1]} may not be given with {given[0]}: only one of json_schema, regex, ebnf, "
                             "structural_tag may be given")
        if isinstance(self.prediction, str) and len(self.prediction) > MAX_PREDICTION_CHARS:
            raise ValueError(f"prediction is longer than {MAX_PREDICTION_CHARS} characters")
        if isinstance(self.prediction, list):
            if len(self.prediction) > MAX_PREDICTION_TOKENS:
                raise ValueError(f"prediction has more than {MAX_PREDICTION_TOKENS} token ids")
            if any(t < 0 for t in self.prediction):
                raise ValueError("prediction token ids must be non-negative")
        if given and len(getattr(self, given[0])) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{given[0]} is longer than {MAX_CONSTRAINT_CHARS} characters")
        if self.whitespace_pattern is not None:
            if self.json_schema is None:
                raise ValueError("whitespace_pattern applies only to a json_schema constraint (guided_json, "
                                 "response_format json_object / json_schema)")
            if len(self.whitespace_pattern) > MAX_WHITESPACE_PATTERN_CHARS:
                raise ValueError(f"whitespace_pattern is longer than {MAX_WHITESPACE_PATTERN_CHARS} characters")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}")
        if self.logprob_start_len < -1:
            raise ValueError(f"logprob_start_len must be -1 (output only) or >= 0, got {self.logprob_start_len}")
        if self.token_ids_logprob is not None and any(t < 0 for t in self.token_ids_logprob):
            raise ValueError("token_ids_logprob must be non-negative token ids")
        if self.bad_words is not None:
            if len(self.bad_words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
            if any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words):
                raise ValueError(f"bad_words must be words of 1 to {MAX_BAD_WORD_CHARS} characters, not blank")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string if provided")
        if self.cache_salt is not None and len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise ValueError(f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters")
        if self.custom_params is not None and self.custom_logit_processor is None:
            raise ValueError("custom_params needs custom_logit_processor")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            if any(t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be non-negative token ids")
            if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")
        if self.logits_processors is not None:
            if not 1 <= len(self.logits_processors) <= MAX_LOGITS_PROCESSORS:
                raise ValueError(f"logits_processors must list 1 to {MAX_LOGITS_PROCESSORS} processors")
            for item in self.logits_processors:
                name = item if isinstance(item, str) else item.get("qualname")
                if not isinstance(name, str) or not name:
                    raise ValueError("each of logits_processors must be a qualified name or an object with 'qualname'")
                if isinstance(item, dict) and set(item) - {"qualname", "args", "kwargs"}:
                    raise ValueError("a logits_processors constructor object has only qualname, args and kwargs")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            if any(t < 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be non-negative token ids")
            # A set: repeats would only cost the sampler work on every step.
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        return self

    @property
    def min_output_tokens(self) -> int:
        """Output tokens before EOS or a stop token may be drawn."""
        return max(self.min_new_tokens, self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> Optional[tuple[str, str]]:
        """(kind, spec) of the structured-output constraint, if any."""
        if self.json_schema is not None and self.whitespace_pattern is not None:
            return "json_schema_whitespace", json.dumps([self.whitespace_pattern, self.json_schema])
        for kind in CONSTRAINT_KINDS:
            spec = getattr(self, kind)
            if spec is not None:
                return kind, spec
        return None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Logprobs of prompt tokens were asked for (SGLang's logprob_start_len >= 0)."""
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def needs_prompt_rows(self) -> bool:
        """The prompt's own positions produce output (prompt logprobs, hidden states): the prompt
        is run even with max_new_tokens 0."""
        return self.wants_prompt_logprobs or self.return_hidden_states

    @property
    def restricts_tokens(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words shape this request's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def bad_word_ids(self) -> list[list[int]]:
        """bad_words as token sequences (set by the engine, which has the tokenizer)."""
        return self._bad_word_ids

    def set_bad_word_ids(self, ids: list[list[int]]) -> None:
        self._bad_word_ids = ids

    @property
    def processes_rows(self) -> bool:
        """Whether per-sequence processors (logits_processors, the thinking budget) follow this
        request's tokens one step at a time: no drafts, no jump-forward, the rows' token ids."""
        return bool(self.logits_processors) or self.thinking_budget is not None

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def _guided_choice_ebnf(choices: Any) -> str:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise SamplingParamsError("guided_choice must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _response_format(fmt: Any) -> dict[str, Any]:
    """OpenAI/vLLM response_format -> the constraint parameter it means."""
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise SamplingParamsError("response_format must be an object with a 'type'")
    kind = fmt["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise SamplingParamsError("response_format.json_schema must be an object")
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            raise SamplingParamsError("response_format.json_schema.schema is required")
        return {"json_schema": schema}
    if kind == "structural_tag":
        return {"structural_tag": fmt}
    raise SamplingParamsError(
        f"response_format.type must be one of text, json_object, json_schema, structural_tag; got {kind!r}"
    )


# vLLM's names for the same constraints (its OpenAI server extras), and SGLang's newer
# sampling_seed for seed.
def _map_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    if (v := out.pop("sampling_seed", None)) is not None:
        if out.get("seed") is not None and out["seed"] != v:
            raise SamplingParamsError("invalid sampling parameter sampling_seed: it differs from seed (its older "
                                      "name): give one of them")
        out["seed"] = v
    mapped: dict[str, Any] = {}
    if (v := out.pop("guided_json", None)) is not None:
        mapped["json_schema"] = v
    if (v := out.pop("guided_regex", None)) is not None:
        mapped["regex"] = v
    if (v := out.pop("guided_grammar", None)) is not None:
        mapped["ebnf"] = v
    if (v := out.pop("guided_choice", None)) is not None:
        mapped["ebnf"] = _guided_choice_ebnf(v)
    if (v := out.pop("response_format", None)) is not None:
        mapped.update(_response_format(v))
    if (v := out.pop("guided_whitespace_pattern", None)) is not None:
        if out.get("whitespace_pattern") is not None:
            raise SamplingParamsError("give whitespace_pattern or guided_whitespace_pattern, not both")
        out["whitespace_pattern"] = v
    if out.get("guided_decoding_backend") not in (None, "auto", "xgrammar"):
        raise SamplingParamsError("unsupported parameter 'guided_decoding_backend': structured output always uses xgrammar")
    out.pop("guided_decoding_backend", None)
    clash = [k for k in mapped if out.get(k) is not None]
    if clash or len(mapped) > 1:
        raise SamplingParamsError("only one structured-output constraint may be given per request")
    out.update(mapped)
    return out


# Which sampling defaults a model's generation_config.json may set, under HF's names.
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_model_defaults(model_path: Union[str, Path]) -> dict[str, Any]:
    """Sampling defaults from the model's generation_config.json (SGLang's --sampling-defaults model)."""
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return {}
    cfg = read_json(path)
    defaults = {k: cfg[k] for k in _GENERATION_CONFIG_KEYS if cfg.get(k) is not None}
    if cfg.get("do_sample") is False:
        defaults["temperature"] = 0.0
    if defaults.get("top_k") == 0:  # HF's "off"
        defaults["top_k"] = -1
    try:
        parse_sampling_params({}, defaults)
    except SamplingParamsError as exc:
        # Refused at load: served, it would fail every request with an error that blames the
        # request for a value its client never sent.
        raise ValueError(f"{path}: a sampling default is invalid ({exc}); fix the file, or start the "
                         "engine with sampling_defaults=openai to ignore it") from None
    return defaults


def load_default_max_tokens(model_path: Union[str, Path]) -> Optional[int]:
    """generation_config.json's `max_new_tokens`: vLLM's default `max_tokens` for an OpenAI request
    that sets none (a default, not a ceiling: vllm-project/vllm#34063). SGLang ignores it, and so
    does /generate (its default stays 128): requests ask for it (max_new_tokens_from_model)."""
    path = Path(model_path) / "generation_config.json"
    if not path.exists():
        return None
    value = read_json(path).get("max_new_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_sampling_params(raw: dict[str, Any], defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
    """Validate a request's parameters on top of the server's defaults.

    Raises SamplingParamsError naming the offending parameter.
    """
    merged: dict[str, Any] = dict(defaults or {})
    for key, value in _map_aliases(raw).items():
        if value is None and key != "max_new_tokens":  # an explicit null limit: the whole context
            continue
        if key in UNSUPPORTED:
            if any(value == off and type(value) is type(off) for off in _OFF_VALUES.get(key, ())):
                continue  # (typed: True == 1 is no beam_width)
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
        if loc:
            text = f"invalid sampling parameter {loc}: {msg}"
        elif msg.split(" ", 1)[0] in SamplingParams.model_fields:  # "temperature must be >= 0, ..."
            text = f"invalid sampling parameter {msg}"
        else:  # a check across fields ("only one of ..."): no word of it is a parameter's name
            text = f"invalid sampling parameters: {msg}"
        raise SamplingParamsError(text) from None


def sampling_defaults_mode() -> str:
    """`model` (generation_config.json) or `openai` (constant defaults), as SGLang's flag."""
    return os.environ.get("LLM_SAMPLING_DEFAULTS", "model")

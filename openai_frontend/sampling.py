"""OpenAI / vLLM request parameters -> the engine's SGLang `sampling_parameters` dict.

Only parameters that differ from the engine's defaults are sent. A parameter this server does not
implement is refused with a 400 that names it (`errors.unsupported`); nothing is silently
ignored. Range checks of values the engine owns (temperature, top_p, ...) are left to the engine,
whose errors come back as 400s with its message.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from openai_frontend.errors import APIError, bad_request, model_not_found, unsupported
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.settings import Settings
from openai_frontend.tools import forces_call

MAX_TOP_LOGPROBS = 20
# OpenAI's values (the SDK's ReasoningEffort); the chat template decides what each means.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_STOP_TOKEN_IDS = 256
# OpenAI's default verbosity: the model answers at the length it was trained to, which is all
# this server can do, so "medium" is honoured and "low"/"high" are refused.
DEFAULT_VERBOSITY = "medium"

# Constraint keys sent to the engine in sampling_parameters (xgrammar semantics; guided_choice
# is vLLM's, which the engine turns into a grammar); one at most.
CONSTRAINT_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "guided_choice")

AnyRequest = Union[ChatCompletionRequest, CompletionRequest]


def _dumps(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def check_stop(stop: Any, stop_token_ids: Any, settings: Settings) -> None:
    """The input-safety limits on stop strings (the engine checks their length and types)."""
    if stop is not None and not isinstance(stop, (str, list)):
        raise bad_request("stop must be a string or a list of strings", param="stop")
    if stop_token_ids is not None and not isinstance(stop_token_ids, list):
        raise bad_request("stop_token_ids must be a list of token ids", param="stop_token_ids")
    count = 1 if isinstance(stop, str) else len(stop or ())
    if count > settings.max_stop_strings:
        raise bad_request(f"at most {settings.max_stop_strings} stop strings are allowed, got {count}", param="stop")
    if stop_token_ids is not None and len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", param="stop_token_ids")


def check_custom_logit_processor(value: Any, settings: Settings) -> None:
    if value and not settings.enable_custom_logit_processor:
        raise unsupported(
            "custom_logit_processor",
            "custom logit processors are disabled (start the frontend with --enable-custom-logit-processor)",
        )


def check_unsupported(req: AnyRequest, settings: Settings) -> None:
    """400 for every known parameter this server does not implement, when it is set."""
    max_n = settings.max_n
    if req.n > max_n:
        raise bad_request(f"n must be at most {max_n}, got {req.n}", param="n")
    check_stop(req.stop, req.stop_token_ids, settings)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise unsupported("stream_options.include_obfuscation", "stream events carry no obfuscation padding here; "
                          "send false or leave it out")
    if req.prompt_logprobs is not None:
        if req.stream:
            raise bad_request("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        if not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="prompt_logprobs")
    whitespace = whitespace_pattern(req)
    if whitespace is not None:
        found = constraint_from_request(req)
        if found is None or found[0] != "json_schema":
            raise bad_request(f"{whitespace[0]} needs a JSON constraint (response_format json_object or "
                              "json_schema, guided_json, structured_outputs json or json_object)", param=whitespace[0])
    if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise unsupported("guided_decoding_backend", "the engine's grammar backend is xgrammar")
    check_custom_logit_processor(req.custom_logit_processor, settings)
    if req.custom_params is not None and not req.custom_logit_processor:
        raise bad_request("custom_params needs custom_logit_processor", param="custom_params")
    if req.return_hidden_states and req.use_beam_search:
        raise unsupported("return_hidden_states", "not with use_beam_search")
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
    else:
        _check_completion(req)


def _check_chat(req: ChatCompletionRequest) -> None:
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                              "(send add_generation_prompt: false)", param="continue_final_message")
        if not req.messages or req.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs a final assistant message", param="continue_final_message")
    if req.mm_processor_kwargs is not None:
        raise unsupported("mm_processor_kwargs")
    if req.functions is not None or req.function_call is not None:
        raise unsupported("functions" if req.functions is not None else "function_call", "use tools / tool_choice")
    if req.audio is not None:
        raise unsupported("audio")
    if req.modalities is not None and list(req.modalities) != ["text"]:
        raise unsupported("modalities", "only text output is supported")
    if req.prediction is not None:
        prediction_text(req.prediction)
        if req.use_beam_search:
            raise unsupported("prediction", "not with use_beam_search")
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                              f"{req.reasoning_effort!r}", param="reasoning_effort")
        given = (req.chat_template_kwargs or {}).get("reasoning_effort", req.reasoning_effort)
        if given != req.reasoning_effort:
            raise bad_request("reasoning_effort and chat_template_kwargs.reasoning_effort differ", param="reasoning_effort")
    if req.service_tier not in (None, "auto", "default"):
        raise unsupported("service_tier")
    if req.store:
        raise unsupported("store")
    if req.web_search_options is not None:
        raise unsupported("web_search_options")
    if req.verbosity not in (None, DEFAULT_VERBOSITY):
        raise unsupported("verbosity", f"only '{DEFAULT_VERBOSITY}' (the model as trained); the length is set by "
                                       "max_completion_tokens here")
    if req.prompt_cache_retention not in (None, "in_memory"):
        raise unsupported("prompt_cache_retention", "the prefix cache is in memory only")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")


def prediction_text(prediction: Any) -> str:
    """OpenAI's Predicted Outputs: {"type": "content", "content": a string or text parts}."""
    if not isinstance(prediction, dict) or prediction.get("type") != "content" or set(prediction) - {"type", "content"}:
        raise bad_request('prediction must be {"type": "content", "content": ...}', param="prediction")
    content = prediction.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and set(p) == {"type", "text"}
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad_request("prediction.content must be a string or a list of text parts", param="prediction")


def _check_completion(req: CompletionRequest) -> None:
    if req.suffix:
        raise unsupported("suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")


def constraint_param(req: AnyRequest) -> Optional[str]:
    """The request parameter that gives its structured-output constraint, for error messages."""
    found = _constraints(req)
    return found[0][0] if found else None


def constraint_from_request(req: AnyRequest) -> Optional[tuple[str, Any]]:
    """The structured-output constraint the request asks for: (key, value) or None."""
    found = _constraints(req)
    if len(found) > 1:
        names = ", ".join(p for p, _, _ in found)
        raise bad_request(f"only one structured-output constraint may be given, got: {names}", param=found[1][0])
    return (found[0][1], found[0][2]) if found else None


def _constraints(req: AnyRequest) -> list[tuple[str, str, Any]]:
    """Every structured-output constraint the request gives: (its parameter, the engine's key, value)."""
    found: list[tuple[str, str, Any]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            _only_fields(rf, ("type",), "response_format")
            found.append(("response_format", "json_schema", '{"type": "object"}'))
        elif kind == "json_schema":
            _only_fields(rf, ("type", "json_schema"), "response_format")
            found.append(("response_format", "json_schema", _dumps(_json_schema_format(rf.get("json_schema")))))
        elif kind == "structural_tag":  # the engine's structural-tag parser checks the rest
            found.append(("response_format", "structural_tag", json.dumps(rf, ensure_ascii=False)))
        elif kind == "text":
            _only_fields(rf, ("type",), "response_format")
        else:
            raise bad_request(f"unknown response_format type {kind!r}", param="response_format")
    if req.guided_json is not None:
        found.append(("guided_json", "json_schema", _dumps(req.guided_json)))
    if req.json_schema is not None:
        found.append(("json_schema", "json_schema", _dumps(req.json_schema)))
    if req.guided_regex is not None:
        found.append(("guided_regex", "regex", req.guided_regex))
    if req.regex is not None:
        found.append(("regex", "regex", req.regex))
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise bad_request("guided_choice must not be empty", param="guided_choice")
        found.append(("guided_choice", "guided_choice", list(req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", "ebnf", req.guided_grammar))
    if req.ebnf is not None:
        found.append(("ebnf", "ebnf", req.ebnf))
    if req.structural_tag is not None:
        found.append(("structural_tag", "structural_tag", _dumps(req.structural_tag)))
    so = req.structured_outputs
    if so is not None:
        where = "structured_outputs"
        if so.json_ is not None:
            found.append((f"{where}.json", "json_schema", _dumps(so.json_)))
        if so.json_object:
            found.append((f"{where}.json_object", "json_schema", '{"type": "object"}'))
        if so.regex is not None:
            found.append((f"{where}.regex", "regex", so.regex))
        if so.choice is not None:
            if not so.choice:
                raise bad_request(f"{where}.choice must not be empty", param=f"{where}.choice")
            found.append((f"{where}.choice", "guided_choice", list(so.choice)))
        if so.grammar is not None:
            found.append((f"{where}.grammar", "ebnf", so.grammar))
        if so.structural_tag is not None:
            found.append((f"{where}.structural_tag", "structural_tag", _dumps(so.structural_tag)))
    return found


def whitespace_pattern(req: AnyRequest) -> Optional[tuple[str, str]]:
    """(the parameter that gave it, the pattern) of the JSON whitespace the request asks for:
    vLLM's guided_whitespace_pattern, or structured_outputs' whitespace_pattern or
    disable_any_whitespace (no whitespace: the pattern "")."""
    given: list[tuple[str, str]] = []
    if req.guided_whitespace_pattern is not None:
        given.append(("guided_whitespace_pattern", req.guided_whitespace_pattern))
    so = req.structured_outputs
    if so is not None and so.whitespace_pattern is not None:
        given.append(("structured_outputs.whitespace_pattern", so.whitespace_pattern))
    if so is not None and so.disable_any_whitespace:
        given.append(("structured_outputs.disable_any_whitespace", ""))
    if len(given) > 1:
        raise bad_request(f"{given[1][0]} may not be given with {given[0][0]}: both set the JSON whitespace",
                          param=given[1][0])
    return given[0] if given else None


def _only_fields(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """A field the type does not take is refused, not ignored: `{"type": "text", "json_schema":
    ...}` would otherwise drop the schema and answer free text."""
    for key in obj:
        if key not in allowed:
            raise bad_request(f"{where}.{key} is not a field of response_format type {obj.get('type')!r} "
                              f"(allowed: {', '.join(allowed)})", param=f"{where}.{key}")


def _json_schema_format(spec: Any) -> Any:
    """The schema of OpenAI's `response_format.json_schema` ({name, description, schema, strict}),
    checked as OpenAI and vLLM check it: `name` is required."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with name and schema", param=where)
    _only_fields(spec, ("name", "description", "schema", "schema_", "strict"), where)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request(f"{where}.name is required (a non-empty string)", param=f"{where}.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise bad_request(f"{where}.description must be a string", param=f"{where}.description")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request(f"{where}.strict must be a boolean", param=f"{where}.strict")
    schema = spec.get("schema", spec.get("schema_"))
    if schema is None:
        raise bad_request("response_format json_schema requires json_schema.schema", param="response_format")
    return schema


def adapter_for(req: AnyRequest, adapters: tuple[str, ...]) -> Optional[str]:
    """The LoRA adapter a request asks for: its `model` (vLLM) or `lora_path` (SGLang)."""
    by_model = req.model if req.model in adapters else None
    if req.lora_path and by_model and req.lora_path != by_model:
        raise bad_request(f"model '{req.model}' and lora_path '{req.lora_path}' name different adapters",
                          param="lora_path")
    return req.lora_path or by_model


# The engine names parameters as SGLang does; an OpenAI client sent them under these names.
_OPENAI_NAMES = {
    "min_new_tokens": "min_tokens",
    "top_logprobs_num": "top_logprobs",
    "whitespace_pattern": "guided_whitespace_pattern",
}


def openai_param(exc: APIError, req: AnyRequest) -> APIError:
    """`exc` with its `param` under the name the OpenAI request used."""
    if exc.param == "lora_path" and exc.status_code == 400 and req.model and not req.lora_path:
        # The adapter came from `model`, and the engine no longer has it (another frontend
        # worker unloaded it): to this client the model does not exist, as vLLM answers.
        return model_not_found(req.model)
    if exc.param == "max_new_tokens":
        exc.param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
        exc.message = exc.message.replace("max_new_tokens", exc.param)
    elif exc.param in CONSTRAINT_KEYS:
        # The engine names the constraint by its kind; the request gave it under one of several
        # names (response_format, guided_json, json_schema, ...).
        given = _constraints(req)
        if given:
            exc.param = given[0][0]
        elif getattr(req, "tools", None) and forces_call(getattr(req, "tool_choice", None)):
            # The constraint is built from the tools' parameters.
            exc.message = exc.message.replace(f"invalid {exc.param}:", "invalid tools (a function's parameters):", 1)
            exc.param = "tools"
    elif exc.param == "whitespace_pattern":
        # The request's own pattern; else one inside the structural tag it gave (QA: named
        # guided_whitespace_pattern, which that client never sent).
        given = whitespace_pattern(req)
        tags = [param for param, kind, _ in _constraints(req) if kind == "structural_tag"]
        exc.param = given[0] if given else tags[0] if tags else _OPENAI_NAMES[exc.param]
    elif exc.param in _OPENAI_NAMES:
        exc.param = _OPENAI_NAMES[exc.param]
    elif (exc.param is None and exc.message == "the prompt is empty") or exc.param == "input_ids":
        # the engine's or preprocessing's words for the prompt the request gave
        exc.param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    return exc


def build_sampling_params(req: AnyRequest) -> dict[str, Any]:
    """The SGLang sampling parameters of the request (`n` travels in EngineRequest.n)."""
    sp: dict[str, Any] = {}
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        # As vLLM (and OpenAI): a completion with echo may ask for no tokens, to score its prompt.
        scoring = max_tokens == 0 and not isinstance(req, ChatCompletionRequest) and req.echo
        if not scoring:
            also = "" if isinstance(req, ChatCompletionRequest) else " (0 only with echo, to score the prompt)"
            raise bad_request(f"{param} must be at least 1{also}, got {max_tokens}", param=param)
    # None: as vLLM, the model's generation_config max_new_tokens, capped by the context's room
    # (the engine knows both), or up to the end of the context (the engine's own default: 128).
    sp["max_new_tokens"] = max_tokens
    if max_tokens is None:
        sp["max_new_tokens_from_model"] = True
    if req.temperature is not None:
        sp["temperature"] = req.temperature
    if req.top_p is not None:
        sp["top_p"] = req.top_p
    if req.top_k is not None:
        sp["top_k"] = -1 if req.top_k == 0 else req.top_k  # vLLM: 0 or -1 disables top-k
    if req.min_p is not None:
        sp["min_p"] = req.min_p
    if req.frequency_penalty:
        sp["frequency_penalty"] = req.frequency_penalty
    if req.presence_penalty:
        sp["presence_penalty"] = req.presence_penalty
    # Sent even at its neutral value: an explicit 1.0 must win over the model's default.
    if req.repetition_penalty is not None:
        sp["repetition_penalty"] = req.repetition_penalty
    # vLLM's meaning, whether the value is the request's or the model's default: prompt tokens
    # count as repeated too (the engine's own, SGLang's, counts only generated ones).
    sp["repetition_penalty_counts_prompt"] = True
    if req.min_tokens:
        if max_tokens is not None and req.min_tokens > max_tokens:
            raise bad_request(f"min_tokens must be less than or equal to {param}={max_tokens}, got {req.min_tokens}",
                              param="min_tokens")
        sp["min_tokens"] = req.min_tokens  # vLLM's: stop strings wait for it too
    if req.seed is not None:
        sp["seed"] = req.seed
    if req.stop is not None and req.stop != []:
        # "" reaches the engine, which refuses an empty stop string as it does [""].
        sp["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_regex:
        sp["stop_regex"] = [req.stop_regex] if isinstance(req.stop_regex, str) else list(req.stop_regex)
    if req.stop_token_ids:
        sp["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        sp["ignore_eos"] = True
    if not req.skip_special_tokens:
        sp["skip_special_tokens"] = False
    if not req.spaces_between_special_tokens:
        sp["spaces_between_special_tokens"] = False
    # SGLang's no_stop_trim (the text untouched) keeps more than vLLM's flag (the stop string,
    # not what follows it in its token); the protocol sets vLLM's flag for either (beam search).
    if req.no_stop_trim:
        sp["no_stop_trim"] = True
    elif req.include_stop_str_in_output:
        sp["include_stop_str_in_output"] = True
    # Log probabilities: SGLang's request-level names, carried in sampling_parameters.
    # The engine sends token texts, so no local tokenizer is needed for them.
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs:
            sp["return_logprob"] = True
            if req.top_logprobs:
                sp["top_logprobs_num"] = req.top_logprobs
    elif req.logprobs is not None:
        sp["return_logprob"] = True
        if req.logprobs:
            sp["top_logprobs_num"] = req.logprobs
        if req.echo:  # the echoed prompt's tokens get logprobs too (max_tokens 0 scores a prompt)
            sp["logprob_start_len"] = 0
    if req.prompt_logprobs is not None:  # vLLM's: every prompt token's logprob, rank, top k
        sp["return_logprob"] = True
        sp["logprob_start_len"] = 0
        sp["top_logprobs_num"] = max(sp.get("top_logprobs_num", 0), req.prompt_logprobs)
    if sp.get("return_logprob") and not req.return_tokens_as_token_ids:
        sp["return_text_in_logprobs"] = True
    if req.return_hidden_states:
        sp["return_hidden_states"] = True
    if req.return_token_ids:  # the output's ids come with every chunk; the prompt's on request
        sp["return_prompt_token_ids"] = True
    if req.cache_salt is not None:  # "" reaches the engine, which refuses it
        sp["cache_salt"] = req.cache_salt
    if req.logit_bias:
        sp["logit_bias"] = dict(req.logit_bias)
    if req.allowed_token_ids is not None:
        sp["allowed_token_ids"] = list(req.allowed_token_ids)
    if req.bad_words:
        sp["bad_words"] = list(req.bad_words)
    if req.truncate_prompt_tokens is not None:
        sp["truncate_prompt_tokens"] = req.truncate_prompt_tokens
    if req.priority:
        sp["priority"] = req.priority
    if req.logits_processors:  # the engine loads them if its logits_processor_pattern allows
        sp["logits_processors"] = list(req.logits_processors)
    if req.custom_logit_processor:
        sp["custom_logit_processor"] = req.custom_logit_processor
        if req.custom_params is not None:
            sp["custom_params"] = req.custom_params
    constraint = constraint_from_request(req)
    if constraint is not None:
        sp[constraint[0]] = constraint[1]
    whitespace = whitespace_pattern(req)
    if whitespace is not None:
        sp["whitespace_pattern"] = whitespace[1]
    if isinstance(req, ChatCompletionRequest) and req.prediction is not None:
        text = prediction_text(req.prediction)
        if text:
            sp["prediction"] = text
    return sp

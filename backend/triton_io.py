"""The llm model's tensor contract, on numpy arrays so it is testable without a Triton server.

Inputs follow what users of Triton LLM ensembles know (the TensorRT-LLM / vLLM backend names
they share); `sampling_parameters` is a JSON object of SGLang sampling parameters, and request
parameters are sampling parameters too. A scalar tensor and another source that give one
parameter must agree (a request that gives two values is refused); `stop_words` and `stop` both apply.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, Optional

import numpy as np

from backend.host_limits import usable_cpus
from backend.outputs import RequestOutput
from backend.sampling_params import SamplingParams, SamplingParamsError
from backend.triton_utils import PYTHON_BACKEND_PARAMETERS

# Scalar input tensor -> SGLang sampling parameter name.
SCALAR_INPUTS: dict[str, str] = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "random_seed": "seed",
}
LLM_INPUTS = ("input_ids", "input_embeds", "stream", "stop_words", "sampling_parameters", "abort_request_id",
              "abort_client", "abort_all", "lora_update", "reset_prefix_cache", "engine_info", *SCALAR_INPUTS)


def error_message(exc: Exception, arrays: Mapping[str, Any]) -> str:
    """What a refused request is told: the message as raised when it already names each
    parameter as the client sent it (InputConflict), else named_as_sent."""
    return str(exc) if getattr(exc, "as_sent", False) else named_as_sent(str(exc), arrays)


def named_as_sent(message: str, arrays: Mapping[str, Any]) -> str:
    """An error message about a request, each sampling parameter that came from a scalar input
    tensor of another name (max_tokens, random_seed) named as that tensor: the name the client
    sent, as the frontend names max_tokens on its OpenAI routes and max_new_tokens on /generate."""
    for tensor, name in SCALAR_INPUTS.items():
        if tensor != name and tensor in arrays:
            message = re.sub(rf"\b{name}\b", tensor, message)
    return message


class InputConflict(SamplingParamsError):
    """Two ways of giving one parameter disagree; the message names each as the client sent it."""

    as_sent = True


def _same(raw: dict[str, Any], name: str, value: Any, source: str, where: Mapping[str, str]) -> None:
    # An input tensor once overrode the parameter given as well, without a word (QA: a stop,
    # max_new_tokens or seed request parameter beside a TensorRT-LLM body's tensors did nothing).
    if name not in raw or raw[name] == value:
        return
    given = raw[name]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (given, value))
    # Only a float may be near: an FP32 tensor's 0.7 is 0.699999988. Whole numbers (a seed, a
    # limit) must match exactly.
    floats = numbers and any(isinstance(v, float) for v in (given, value))
    if not (floats and math.isclose(given, value, rel_tol=1e-6)):
        raise InputConflict(f"{source} ({value!r}) and {name} {where.get(name, '')} ({raw[name]!r}) differ: "
                            "give it once")


def _scalar(arr: np.ndarray, name: str = "input") -> Any:
    value = arr.reshape(-1)
    if value.size != 1:
        raise SamplingParamsError(f"{name}: expected a single value, got shape {list(arr.shape)}")
    item = value[0]
    if isinstance(item, bytes):
        return _text(item, name)
    if isinstance(item, str):
        return item
    item = item.item()
    if isinstance(item, float) and not math.isfinite(item):
        raise SamplingParamsError(f"{name} must be a finite number, got {item}")
    return item


def _text(value: Any, name: str = "input") -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise SamplingParamsError(f"{name} is not valid UTF-8") from None
    return str(value)


# Request parameters that name the request instead of setting how it samples (request_name).
NAME_PARAMETERS = ("rid", "id")


def _parameters(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        params = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return params if isinstance(params, dict) else {}


def request_parameters(text: str) -> dict[str, Any]:
    """The sampling parameters a request carries as Triton request parameters (the generate
    endpoint's JSON keys that are not inputs, gRPC's `parameters`; an ensemble forwards them to
    its steps). Triton's own (`triton_*`) are left to Triton, and the request's name to
    request_name."""
    return {k: v for k, v in _parameters(text).items() if not k.startswith("triton_") and k not in NAME_PARAMETERS}


def request_name(triton_id: str, parameters: str = "") -> tuple[str, bool]:
    """(the name an `abort_request_id` finds the request by, whether its client chose that name
    with a `rid` (SGLang's name) or `id` request parameter); ("", False) without one. The name is
    the Triton request id, or the parameter's. Triton's HTTP generate endpoint gives a request no
    id, and Triton 2.51 does not pass the cancellation of an ensemble stream to the llm step, so
    an HTTP client that drops an ensemble stream can stop it only by a name it chose (QA)."""
    # Most requests carry no such key: their parameters are not parsed a second time.
    given = {k: v for k, v in _parameters(parameters).items() if k in NAME_PARAMETERS} if 'id"' in parameters else {}
    for key, value in given.items():
        if not isinstance(value, str) or not value:
            raise SamplingParamsError(f"{key} must be a non-empty string, got {value!r}")
    names = set(given.values()) | ({triton_id} if triton_id else set())
    if len(names) > 1:
        named = [f"the Triton request id {triton_id!r}"] if triton_id else []
        named += [f"{k} {v!r}" for k, v in given.items()]
        raise InputConflict(f"the request is named twice, differently: {' and '.join(named)}; name it once")
    return (names.pop() if names else ""), bool(given)


def parse_llm_inputs(arrays: dict[str, np.ndarray], parameters: str = "") -> tuple[list[int], dict[str, Any], bool]:
    """(prompt ids, raw sampling parameters, stream) from the llm model's input tensors and its
    request parameters (`parameters`, the JSON of `request.parameters()`): a request parameter is
    a sampling parameter, as if given in sampling_parameters, so an unknown one is refused, not
    ignored."""
    if "input_ids" not in arrays and "input_embeds" not in arrays:
        raise SamplingParamsError("input 'input_ids' (or 'input_embeds') is required")
    ids = arrays["input_ids"].reshape(-1).astype(np.int64).tolist() if "input_ids" in arrays else []
    raw: dict[str, Any] = {}
    if "sampling_parameters" in arrays:
        text = _scalar(arrays["sampling_parameters"], "sampling_parameters")
        if text:
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SamplingParamsError(f"sampling_parameters is not valid JSON: {exc}") from None
            if not isinstance(raw, dict):
                raise SamplingParamsError("sampling_parameters must be a JSON object")
    extra = request_parameters(parameters)
    twice = sorted(k for k in extra if k in raw)
    if twice:
        raise InputConflict(
            f"{', '.join(twice)} given both as a request parameter and in sampling_parameters: give it once")
    where = {**{k: "in sampling_parameters" for k in raw}, **{k: "as a request parameter" for k in extra}}
    raw.update(extra)
    for tensor, name in SCALAR_INPUTS.items():
        if tensor in arrays:
            value = _scalar(arrays[tensor], tensor)
            if tensor == "random_seed" and isinstance(value, int) and 2**63 <= value < 2**64:
                # A UINT64 tensor, as TensorRT-LLM's seed: the upper half is the int64 seeds of the
                # same bits (vLLM and SGLang seeds are int64).
                value -= 2**64
            _same(raw, name, value, f"the input {tensor}", where)
            raw[name] = value
    if "stop_words" in arrays:
        # Empty strings pad a batch's lists to one length: skipped, as TensorRT-LLM's
        # preprocessing (to_word_list_format) skips them.
        words = [w for w in (_text(x, "stop_words") for x in arrays["stop_words"].reshape(-1)) if w]
        if words:
            # Beside a `stop` parameter (a TensorRT-LLM body always carries stop_words): both apply.
            given = raw.get("stop")
            if given is None or isinstance(given, (str, list)):  # anything else is validation's to refuse
                given = [given] if isinstance(given, str) else given or []
                raw["stop"] = list(dict.fromkeys([*words, *given]))
    if "stream" in arrays:
        stream = bool(_scalar(arrays["stream"], "stream"))
        _same(raw, "stream", stream, "the input stream", where)
        raw.pop("stream", None)
    else:
        stream = raw.pop("stream", False)
        if not isinstance(stream, bool):  # bool("false") is True
            raise SamplingParamsError(f"stream must be true or false, got {stream!r}")
    return ids, raw, stream


def llm_output_arrays(out: RequestOutput, params: SamplingParams) -> dict[str, np.ndarray]:
    meta: dict[str, Any] = {
        "index": out.index,
        "stop_reason": out.stop_reason,
        **({"matched_eos": True} if out.matched_eos else {}),
        "num_preemptions": out.num_preemptions,
        "cached_tokens": out.cached_tokens,
    }
    if out.accepted_prediction_tokens is not None:
        meta["accepted_prediction_tokens"] = out.accepted_prediction_tokens
        meta["rejected_prediction_tokens"] = out.rejected_prediction_tokens
    if out.spec:
        meta.update(out.spec)
    if out.logprobs:
        meta.update(out.logprobs)
    if out.prompt_token_ids is not None:
        meta["prompt_token_ids"] = out.prompt_token_ids
    arrays = {
        "output_ids": np.asarray(out.new_token_ids, dtype=np.int32),
        "detok_ids": np.asarray(out.window_ids, dtype=np.int32),
        "detok_prefix_len": np.asarray([out.prefix_len], dtype=np.int32),
        "finish_reason": np.asarray([out.finish_reason or ""], dtype=object),
        "meta_info": np.asarray([json.dumps(meta)], dtype=object),
        "prompt_tokens": np.asarray([out.prompt_tokens], dtype=np.int32),
        "completion_tokens": np.asarray([out.completion_tokens], dtype=np.int32),
    }
    # Detokenization hints for postprocessing, left out when they hold its default: every tensor
    # of a streamed response costs the llm stub, the ensemble and postprocessing a copy.
    if out.trim:
        arrays["detok_trim"] = np.asarray([out.trim], dtype=np.int32)
    if not params.skip_special_tokens:
        arrays["skip_special_tokens"] = np.asarray([False], dtype=bool)
    if not params.spaces_between_special_tokens:
        arrays["spaces_between_special_tokens"] = np.asarray([False], dtype=bool)
    return arrays


def setting_flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


# LLM_* variables read elsewhere than the llm model's settings: the other models, the kernels,
# the tests and the debug switches.
_OTHER_LLM_ENV = frozenset({
    "LLM_MODEL_PATH", "LLM_CHAT_TEMPLATE", "LLM_TRUST_REQUEST_CHAT_TEMPLATE", "LLM_GC_FREEZE", "LLM_DECODE_SPLITS", "LLM_QUERY_TILE",
    "LLM_TEST_DEVICE", "LLM_PAGED_DECODE", "LLM_CPU_SAMPLING", "LLM_CPU_ATTENTION", "LLM_SAMPLING_DEFAULTS",
})


def unknown_llm_env(env: Mapping[str, str]) -> list[str]:
    """The LLM_* environment variables that name no setting: a typo (LLM_MAX_NUM_SEQ) was ignored
    without a word (QA)."""
    known = {f"LLM_{name.upper()}" for name in LLM_SETTINGS} | _OTHER_LLM_ENV
    return sorted(name for name in env if name.startswith("LLM_") and name not in known)


def unknown_llm_params(params: Mapping[str, str]) -> list[str]:
    """config.pbtxt parameters of the llm model that name no setting (QA: a typo, max_num_seq,
    was ignored, and made LLM_MAX_NUM_SEQ look known). The model refuses to load with them.
    The Python backend's own (EXECUTION_ENV_PATH, FORCE_CPU_ONLY_INPUT_TENSORS) are Triton's."""
    return sorted(name for name in params if name not in LLM_SETTINGS and name not in PYTHON_BACKEND_PARAMETERS)


# The EngineConfig fields an llm setting sets, and how to read the setting's text.
ENGINE_SETTINGS: dict[str, Any] = {
    "device": str,
    "dtype": str,
    "block_size": int,
    "num_kv_blocks": int,
    "kv_cache_memory_mb": int,
    "gpu_memory_utilization": float,
    "kv_cache_dtype": str,
    "calculate_kv_scales": setting_flag,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_prefill_tokens_while_decoding": int,
    "prefill_context_unit": int,
    "prefill_tokens_per_decode": int,
    "prefill_cap_queue_ratio": float,
    "flat_prefill_tokens": int,
    "max_model_len": int,
    "speculative_config": str,  # JSON text, validated by EngineConfig
    "scheduling_policy": str,
    "sampling_defaults": str,
    "logprobs_mode": str,
    "seed": int,
    "max_waiting_requests": int,
    "enable_prefix_caching": setting_flag,
    "enable_custom_logit_processor": setting_flag,
    "logits_processor_pattern": str,
    "lora_modules": str,
    "torch_threads": int,
    "cuda_graphs": setting_flag,
    "enable_jump_forward": setting_flag,
}


# The llm model's own settings, read by model_repository/llm/1/model.py before the engine exists.
SERVING_SETTINGS = ("model_path", "engine_process", "stream_interval", "allow_runtime_lora_updating",
                    "max_responses_per_step", "response_senders")
LLM_SETTINGS = frozenset(ENGINE_SETTINGS) | frozenset(SERVING_SETTINGS)


def engine_config_overrides(params: dict[str, str], env: dict[str, str]) -> dict[str, Any]:
    """EngineConfig fields from config.pbtxt parameters; env LLM_<NAME> wins; 'auto' means default."""
    out: dict[str, Any] = {}
    for name, cast in ENGINE_SETTINGS.items():
        value = read_setting(params, env, name, cast)
        if value is not None:
            out[name] = value
    return out


_KINDS = {int: "an integer", float: "a number", setting_flag: "a boolean (true/false, 1/0, yes/no, on/off)"}


def read_setting(params: dict[str, str], env: Mapping[str, str], name: str, cast: Any = str,
                 minimum: Optional[float] = None, maximum: Optional[float] = None) -> Any:
    """llm_setting read as `cast` (None when unset): a value it cannot read, or below `minimum`,
    is an error naming the setting; with several LLM_* variables set, a bare int() message did
    not say which (QA)."""
    value = llm_setting(params, env, name)
    if value is None:
        return None
    where = f"{name} (env LLM_{name.upper()} or the config.pbtxt parameter)"
    try:
        out = cast(value)
    except ValueError:
        raise ValueError(f"{where}: expected {_KINDS.get(cast, 'a valid value')}, got {value!r}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{where}: must be at least {minimum:g}, got {value!r}")
    if maximum is not None and out > maximum:
        raise ValueError(f"{where}: must be at most {maximum:g}, got {value!r}")
    return out


def llm_setting(params: dict[str, str], env: Mapping[str, str], name: str) -> Optional[str]:
    """One llm model setting: env LLM_<NAME> wins over the config.pbtxt parameter; unset, empty
    or 'auto' is None (the default). An empty variable (`docker -e X=`, compose's `${X:-}`) is
    unset: the parameter applies (QA: it replaced the parameter with the default)."""
    value = env.get(f"LLM_{name.upper()}") or params.get(name)
    return None if value is None or value == "" or value == "auto" else value


def server_torch_threads(cores: Optional[int] = None) -> int:
    """CPU threads for the engine inside tritonserver: all usable CPUs but one (the affinity
    mask, capped by a container's CPU quota: backend/host_limits.py). The server process and
    the postprocessing stubs handle every streamed response while the engine computes; with as
    many torch threads as cores, one of them is always descheduled and the others spin at its
    barrier (measured on 2 cores: 0.54x the in-process engine at concurrency 1; one thread 0.96x)."""
    return max(1, (cores or usable_cpus()) - 1)


def oversubscribed_threads(threads: int, cores: Optional[int] = None) -> Optional[str]:
    """A warning when torch_threads is more than the CPUs this process may use: allowed (a
    benchmark may want it) but never faster, as each parallel region waits at its barrier for
    the threads that have no core (settings QA: nothing said so)."""
    cores = cores or usable_cpus()
    if threads <= cores:
        return None
    return f"torch_threads {threads} is more than the {cores} CPU(s) this process may use; the extra threads only wait"


def parse_abort_request_id(arr: np.ndarray) -> str:
    return str(_scalar(arr, "abort_request_id"))


def parse_abort_client(arr: np.ndarray) -> tuple[str, Optional[str]]:
    """The llm model's `abort_client` control input: a JSON object {"frontend": id, "rid": id or
    null} (backend/request_index.py). Returns (frontend, rid); raises SamplingParamsError."""
    try:
        cmd = json.loads(_scalar(arr, "abort_client"))
    except ValueError as exc:
        raise SamplingParamsError(f"abort_client must be a JSON object: {exc}") from None
    if not isinstance(cmd, dict) or not isinstance(cmd.get("frontend"), str) or not cmd["frontend"]:
        raise SamplingParamsError('abort_client needs "frontend": the id of the frontend whose requests to abort')
    rid = cmd.get("rid")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise SamplingParamsError('abort_client.rid must be a non-empty string, or null for all of them')
    unknown = sorted(set(cmd) - {"frontend", "rid"})
    if unknown:
        raise SamplingParamsError(f"abort_client: unknown field(s) {', '.join(unknown)}")
    return cmd["frontend"], rid


CONTROL_INPUTS = ("abort_request_id", "abort_client", "abort_all", "lora_update", "reset_prefix_cache", "engine_info")
_SWITCHES = ("abort_all", "reset_prefix_cache", "engine_info")  # BOOL: false is the same as not sent


def control_input(arrays: dict[str, np.ndarray]) -> Optional[str]:
    """Which control input the request carries, or None for a generation. A control comes alone
    in its request: one sent with a prompt or another control is refused, not acted on while the
    rest is dropped. A switch set to false is taken out of `arrays` (a client that fills every
    optional input with its default sends one with each generation)."""
    for name in _SWITCHES:
        if name in arrays and not bool(_scalar(arrays[name], name)):
            del arrays[name]
    present = [name for name in CONTROL_INPUTS if name in arrays]
    if not present:
        return None
    others = sorted(set(arrays) - {present[0]})
    if others:
        raise SamplingParamsError(f"{present[0]} comes alone in its request; it was sent with {', '.join(others)}")
    return present[0]


def control(engine: Any, kind: str, arrays: dict[str, np.ndarray],
            serving: Optional[dict[str, Any]] = None, serving_stats: Optional[dict[str, Any]] = None) -> np.ndarray:
    """The one response's `meta_info` for a control request (`kind` from control_input, not
    abort_request_id). Raises ValueError with the reason. `serving` / `serving_stats`: the
    model's own settings, resolved, and counters, reported by `engine_info` with the engine's."""
    if kind == "lora_update":
        return lora_update(engine, arrays["lora_update"])
    if kind == "reset_prefix_cache":
        meta = {"forgotten_blocks": engine.reset_prefix_cache().result(30.0)}
    elif kind == "engine_info":
        meta = engine.info()
        meta["config"].update(serving or {})
        meta["stats"].update(serving_stats or {})
    else:
        raise ValueError(f"not a control input with a response: {kind}")
    return meta_array(meta)


def meta_array(meta: dict[str, Any]) -> np.ndarray:
    """A control response's `meta_info` output: the JSON object as one BYTES element."""
    return np.array([json.dumps(meta).encode()], dtype=np.object_)


def refuse_lora_changes(arrays: dict[str, np.ndarray]) -> None:
    """Unless the server allows runtime LoRA updating, lora_update may only list."""
    try:
        op = json.loads(_scalar(arrays["lora_update"], "lora_update")).get("op")
    except (ValueError, AttributeError):
        return  # malformed: lora_update says why
    if op != "list":
        raise SamplingParamsError(
            "lora_update: runtime LoRA updating is off on this server (llm parameter allow_runtime_lora_updating, "
            "env LLM_ALLOW_RUNTIME_LORA_UPDATING=1; scripts/serve.sh --allow-runtime-lora-updating)")


def lora_update(engine: Any, arr: np.ndarray) -> np.ndarray:
    """The llm model's `lora_update` control input: a JSON object {"op": "load", "name", "path"},
    {"op": "unload", "name"} or {"op": "list"}. Returns the `meta_info` output: the adapters
    loaded afterwards, {"loaded_adapters": {name: path}}. Raises ValueError with the reason."""
    try:
        cmd = json.loads(_scalar(arr, "lora_update"))
    except ValueError as exc:
        raise SamplingParamsError(f"lora_update must be a JSON object: {exc}") from None
    op = cmd.get("op") if isinstance(cmd, dict) else None
    if op == "load":
        engine.load_lora(str(cmd.get("name") or ""), str(cmd.get("path") or ""))
    elif op == "unload":
        engine.unload_lora(str(cmd.get("name") or ""))
    elif op != "list":
        raise SamplingParamsError('lora_update.op must be "load", "unload" or "list"')
    return meta_array({"loaded_adapters": engine.lora_adapters()})

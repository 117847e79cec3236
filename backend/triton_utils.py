"""Helpers shared by the Triton models: paths, config parameters, and the pre/postprocessing
tensor contracts on numpy arrays (so they are testable without a Triton server).

No import of triton_python_backend_utils here: the model.py files own that.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np

from backend.detokenizer import decode_delta
from backend.tokenizer import encode_prompt, refuse_chat_only

MODEL_PATH_ENV = "LLM_MODEL_PATH"
DEFAULT_MODEL_PATH = "models/demo"
CHAT_TEMPLATE_ENV = "LLM_CHAT_TEMPLATE"

TRUST_REQUEST_CHAT_TEMPLATE_ENV = "LLM_TRUST_REQUEST_CHAT_TEMPLATE"

# config.pbtxt parameters Triton's Python backend reads itself, in any Python model: a conda-pack
# environment to run the stub in, and whether inputs may stay in GPU memory. Not ours to refuse.
PYTHON_BACKEND_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})
PREPROCESSING_PARAMETERS = frozenset({"model_path", "chat_template", "trust_request_chat_template"})
POSTPROCESSING_PARAMETERS = frozenset({"model_path"})
# Other stacks' names for a parameter here (TensorRT-LLM's preprocessing and postprocessing).
_PARAMETER_ALIASES = {"tokenizer_dir": "model_path"}

PREPROCESSING_INPUTS = (
    "text_input", "messages", "tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "chat_template", "add_special_tokens", "input_ids", "input_embeds",
)
POSTPROCESSING_INPUTS = (
    "detok_ids",
    "detok_prefix_len",
    "detok_trim",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "finish_reason",
)


# $0 the server, $1 the stub, $2 the model. Polls once a second while both live. The server
# gone: kill the stub. The stub a zombie for 3 polls (it died and the server never reaped it,
# which is what 2.51 does with a stub killed under it): stop the server, SIGKILL after 5 s.
# A stub that exits as the server unloads it is reaped at once, and the watcher just ends.
_WATCHER = (
    'z=0; '
    'while kill -0 "$0" 2>/dev/null && kill -0 "$1" 2>/dev/null; do '
    '  case "$(sed "s/.*) //" /proc/"$1"/stat 2>/dev/null)" in Z*) z=$((z+1));; *) z=0;; esac; '
    '  if [ "$z" -ge 3 ]; then '
    '    echo "the $2 stub (pid $1) died and tritonserver 2.51 cannot restart it: stopping the server" >&2; '
    '    kill -TERM "$0" 2>/dev/null; sleep 5; kill -9 "$0" 2>/dev/null; exit 0; '
    '  fi; '
    '  sleep 1; '
    'done; '
    'kill -0 "$0" 2>/dev/null || kill -9 "$1" 2>/dev/null'
)


def exit_with_server(model: str = "model") -> Optional[subprocess.Popen]:
    """Makes this Python-backend stub and tritonserver die together.

    When tritonserver is killed (a crash, SIGKILL, the OOM killer), the 2.51 stub's health
    thread notices and destroys the stub, but its destructor waits for the GIL, which the main
    thread holds while it waits on the dead server for ever: the stub, with the model's weights
    and KV cache, outlives the server indefinitely (seen here after SIGKILL under load). No
    thread of this process can help, since it would need that GIL; a one-line shell watcher
    outside the process can, at no cost while the server lives.

    The other way round, a killed stub is never restarted by 2.51 (server#5381): its streams
    hang, later requests fail or hang, and the server still reports ready. The watcher then
    stops the server, so that whatever supervises it (scripts/serve.sh exits with it) restarts
    a working one, as vLLM's server exits when its engine dies.
    """
    try:
        return subprocess.Popen(
            ["/bin/sh", "-c", _WATCHER, str(os.getppid()), str(os.getpid()), model],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
    except OSError:  # no /bin/sh: the stub keeps Triton's own behaviour
        return None


class OpenRequests:
    """How many requests a decoupled model has taken whose final response has not been sent.
    Triton holds a model until every one of its requests got its final flag: engine_info
    reports this count, so an idle model showing more than 0 points at a response that never
    went out (and not at the server) when a model will not unload."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def add(self, delta: int) -> None:
        with self._lock:
            self._count += delta

    @property
    def count(self) -> int:
        return self._count


class GuardedSender:
    """A decoupled request's response sender whose cancellation may be polled from any thread.

    Triton 2.51 releases a request's response factory once its final response is sent, and an
    `is_cancelled()` after that dereferences the freed factory in the server: tritonserver died
    with SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled when a poll thread asked a stream
    that had just finished. So polls and the final send share a lock, and once the final
    response is on its way every poll answers False without asking the server.
    """

    __slots__ = ("_sender", "_final_flag", "_lock", "_closed", "_open")

    def __init__(self, sender: Any, final_flag: int, open_requests: Optional[OpenRequests] = None) -> None:
        self._sender = sender
        self._final_flag = final_flag
        self._lock = threading.Lock()
        self._closed = False
        self._open = open_requests
        if open_requests is not None:
            open_requests.add(1)

    def is_cancelled(self) -> bool:
        with self._lock:
            return False if self._closed else bool(self._sender.is_cancelled())

    def send(self, response: Any, final: bool) -> None:
        """Sends a response; once the final one is sent, later ones are dropped. Two paths can
        end a request: the engine process died during add_request, its proxy ended the request
        with an error and the call raised too, and execute() answered that. A second final
        response raised in the stub, out of execute(), and cost the batch's other requests theirs."""
        if not final:
            if not self._closed:
                self._sender.send(response, flags=0)
            return
        with self._lock:  # waits for a poll in flight; none starts after this
            was_closed, self._closed = self._closed, True
        if was_closed:
            return
        self._sender.send(response, flags=self._final_flag)
        if self._open is not None:  # counted once it went out
            self._open.add(-1)


def repo_root() -> Path:
    """The repository root (this file is backend/triton_utils.py)."""
    return Path(__file__).resolve().parents[1]


def resolve_path(value: str | Path) -> Path:
    """An absolute path; relative paths are taken from the repository root, not the cwd
    (tritonserver's cwd is wherever it was started)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else repo_root() / path


def _model_config(args: Mapping[str, Any]) -> dict[str, Any]:
    config = args["model_config"]
    return json.loads(config) if isinstance(config, str) else config


def config_parameters(args: Mapping[str, Any]) -> dict[str, str]:
    """The `parameters` of a model's config.pbtxt as {key: string_value}, from initialize(args)."""
    return {k: v.get("string_value", "") for k, v in (_model_config(args).get("parameters") or {}).items()}


def instance_count(args: Mapping[str, Any]) -> int:
    """How many instances of this model Triton starts, from its normalized config: each group's
    count, once per GPU listed for a KIND_GPU group (Triton fills the list with every visible GPU
    when the config names none). Passive instances count: they are loaded all the same."""
    return _instances(_model_config(args))


def _instances(config: Mapping[str, Any]) -> int:
    groups = config.get("instance_group") or []
    return sum(int(g.get("count", 1)) * max(1, len(g.get("gpus") or [])) for g in groups) or 1


def check_serving_config(args: Mapping[str, Any], model: str, *, parameters: Optional[frozenset[str]] = None,
                         one_instance: Optional[str] = None, decoupled: Optional[str] = None) -> None:
    """Refuses at load, with the reasons given, a config.pbtxt edited into one this model cannot
    serve correctly although Triton would run it: parameters it does not read (`parameters`: those
    it does; Triton passes any on without a word, and TensorRT-LLM's `tokenizer_dir` set in
    preprocessing was ignored), a second instance (`one_instance`: why there must be one; Triton
    would route requests to either, silently), or a transaction policy that is not decoupled
    (`decoupled`: why it must be)."""
    config = _model_config(args)
    problems = []
    unknown = sorted(set(config.get("parameters") or {}) - parameters - PYTHON_BACKEND_PARAMETERS) if parameters else []
    if unknown:
        named = [f"{n} (here: {_PARAMETER_ALIASES[n]})" if n in _PARAMETER_ALIASES else n for n in unknown]
        problems.append(f"unknown parameter(s) {', '.join(named)} (it reads {', '.join(sorted(parameters))})")
    if one_instance is not None and (n := _instances(config)) != 1:
        problems.append(f"its instance_group gives {n} instances; it must have exactly one "
                        f"(instance_group [ {{ count: 1, kind: KIND_CPU }} ]): {one_instance}")
    policy = config.get("model_transaction_policy") or {}
    if decoupled is not None and not policy.get("decoupled", False):
        problems.append(f"it must be decoupled (model_transaction_policy {{ decoupled: true }}): {decoupled}")
    if problems:
        raise ValueError(f"{model} config.pbtxt: " + "; ".join(problems))


def model_path_from_config(args: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> Path:
    """The HF model directory: $LLM_MODEL_PATH, else the `model_path` parameter, else models/demo."""
    env = os.environ if env is None else env
    value = env.get(MODEL_PATH_ENV) or config_parameters(args).get("model_path") or DEFAULT_MODEL_PATH
    return resolve_path(value)


def chat_template_from_config(args: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The chat template that replaces the model's (vLLM's --chat-template): $LLM_CHAT_TEMPLATE,
    else the `chat_template` parameter; a .jinja file's path (relative: from the repository root)
    or the template itself. None: the model's own."""
    env = os.environ if env is None else env
    value = env.get(CHAT_TEMPLATE_ENV) or config_parameters(args).get("chat_template") or ""
    if not value.strip():
        return None
    if "{{" in value or "{%" in value:
        return value
    path = resolve_path(value)
    if not path.is_file():
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    return path.read_text()


def trust_request_chat_template(args: Mapping[str, Any], env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether a request may bring its own chat template (vLLM's --trust-request-chat-template):
    $LLM_TRUST_REQUEST_CHAT_TEMPLATE, else the `trust_request_chat_template` parameter; off by
    default. Templates render in transformers' sandboxed Jinja environment either way, but a
    template is code: an operator opts in."""
    env = os.environ if env is None else env
    value = env.get(TRUST_REQUEST_CHAT_TEMPLATE_ENV) or config_parameters(args).get("trust_request_chat_template") or ""
    return value.strip().lower() in ("1", "true", "yes", "on")


# ---- numpy views of Triton tensors -------------------------------------------------------


def _scalar(arrays: Mapping[str, np.ndarray], name: str) -> Any:
    """The single element of a [1] tensor, or None when absent/empty; bytes -> str."""
    arr = arrays.get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size == 0:
        return None
    if flat.size != 1:
        raise ValueError(f"input '{name}' must hold one element, got shape {list(np.shape(arr))}")
    item = flat[0]
    if isinstance(item, (bytes, bytearray)):
        try:
            return item.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"input '{name}' is not valid UTF-8") from None
    return item.item() if isinstance(item, np.generic) else item


def _ids(arrays: Mapping[str, np.ndarray], name: str) -> Optional[np.ndarray]:
    arr = arrays.get(name)
    return None if arr is None else np.asarray(arr).reshape(-1)


def preprocess_arrays(
    tokenizer: Any, arrays: Mapping[str, np.ndarray], trust_request_template: bool = False
) -> dict[str, np.ndarray]:
    """preprocessing: {text_input | messages (+tools, ...) | input_ids | input_embeds} -> {prompt_ids}.

    With input_embeds, prompt_ids is empty: the llm step reads the embeddings (the ensemble
    passes them to it directly) and checks them against the model.
    """
    agp = _scalar(arrays, "add_generation_prompt")
    template = _scalar(arrays, "chat_template") or None
    if template is not None and not trust_request_template:
        raise ValueError(
            "chat_template: this server does not accept chat templates in requests (start it with "
            f"{TRUST_REQUEST_CHAT_TEMPLATE_ENV}=1 or the preprocessing parameter trust_request_chat_template)"
        )
    if "input_embeds" in arrays:
        given = (("text_input", _scalar(arrays, "text_input")), ("messages", _scalar(arrays, "messages")),
                 ("input_ids", _ids(arrays, "input_ids")))
        others = [name for name, value in given if value is not None and len(value) > 0]
        if others:
            raise ValueError(f"give either input_embeds or {others[0]}, not both")
        # As encode_prompt refuses them with text or ids (QA: accepted and dropped here).
        refuse_chat_only(
            "input_embeds",
            tools=_scalar(arrays, "tools") or None,
            chat_template_kwargs=_scalar(arrays, "chat_template_kwargs") or None,
            documents=_scalar(arrays, "documents") or None,
            chat_template=template,
            add_generation_prompt=None if agp is None else bool(agp),
            continue_final_message=bool(_scalar(arrays, "continue_final_message")),
        )
        shape = list(np.shape(arrays["input_embeds"]))
        if len(shape) != 2 or 0 in shape:
            raise ValueError(f"input_embeds must have the shape [num_tokens, hidden_size], got {shape}")
        return {"prompt_ids": np.zeros(0, dtype=np.int32)}
    ids = encode_prompt(
        tokenizer,
        text=_scalar(arrays, "text_input"),
        messages=_scalar(arrays, "messages"),
        input_ids=_ids(arrays, "input_ids"),
        tools=_scalar(arrays, "tools") or None,
        chat_template_kwargs=_scalar(arrays, "chat_template_kwargs") or None,
        add_generation_prompt=None if agp is None else bool(agp),
        continue_final_message=bool(_scalar(arrays, "continue_final_message")),
        documents=_scalar(arrays, "documents") or None,
        chat_template=template,
        add_special_tokens=None if (ast := _scalar(arrays, "add_special_tokens")) is None else bool(ast),
    )
    return {"prompt_ids": np.asarray(ids, dtype=np.int32)}


def postprocess_arrays(tokenizer: Any, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """postprocessing: one llm response -> its `text_output`.

    A non-empty finish_reason marks the last response: its window is decoded with final=True,
    so text held back for an incomplete character is flushed. The ensemble takes the other
    outputs (ids, finish_reason, token counts, meta_info) from llm directly.
    """
    window = _ids(arrays, "detok_ids")
    prefix_len = _scalar(arrays, "detok_prefix_len")
    if window is None or prefix_len is None:
        raise ValueError("inputs 'detok_ids' and 'detok_prefix_len' are required")
    limit = len(tokenizer)
    # Checked here, not left to the tokenizer: a negative id was its OverflowError (a 500), one
    # past the vocabulary silently no text (QA, a client calling postprocessing itself).
    if window.size and (int(window.min()) < 0 or int(window.max()) >= limit):
        raise ValueError(f"detok_ids out of range [0, {limit})")
    if not 0 <= int(prefix_len) <= window.size:
        raise ValueError(f"detok_prefix_len must be in [0, {window.size}] (the ids in detok_ids), got {int(prefix_len)}")
    finish_reason = _scalar(arrays, "finish_reason") or ""
    skip = _scalar(arrays, "skip_special_tokens")
    spaces = _scalar(arrays, "spaces_between_special_tokens")
    text = decode_delta(
        tokenizer,
        window,
        int(prefix_len),
        skip_special_tokens=True if skip is None else bool(skip),
        spaces_between_special_tokens=True if spaces is None else bool(spaces),
        final=bool(finish_reason),
    )
    trim = int(_scalar(arrays, "detok_trim") or 0)
    if trim < 0:
        raise ValueError(f"detok_trim must be >= 0, got {trim}")
    if trim > 0:  # a matched stop string at the end of this response's text
        text = text[: max(len(text) - trim, 0)]
    return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}


def input_arrays(request: Any, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The request's input tensors among `names` as numpy arrays; absent optional inputs are left out.

    One pass over request.inputs(): pb_utils.get_input_tensor_by_name builds the whole input
    list again for every name it is asked (ten per postprocessing call, once per streamed token).
    """
    wanted = set(names)
    return {t.name(): t.as_numpy() for t in request.inputs() if t.name() in wanted}


def respond_each(
    pb_utils: Any,
    requests: list,
    names: tuple[str, ...],
    transform: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
    model: str,
) -> list:
    """`execute` of a one-response-per-request model: each request's inputs through `transform`.

    A ValueError is the request's own fault (INVALID_ARG); anything else is INTERNAL. Either way
    only that request gets the error, never the others of the batch.
    """
    errors = pb_utils.TritonError
    responses = []
    for request in requests:
        try:
            outputs = transform(input_arrays(request, names))
            tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        except ValueError as exc:
            error = errors(str(exc), errors.INVALID_ARG)
            responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
        except Exception as exc:
            error = errors(f"{model} internal error: {type(exc).__name__}: {exc}", errors.INTERNAL)
            responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
    return responses

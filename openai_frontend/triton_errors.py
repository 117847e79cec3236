"""Triton's errors as the frontend's HTTP errors (APIError): what a stream, a gRPC call or a unary
infer call failed with.

gRPC UNAVAILABLE and lost connections, a model that is not ready, and the engine's "overloaded"
-> 503 with Retry-After; INVALID_ARGUMENT and the engine's refusals of a request -> 400, naming
the parameter where the message does (a request past the context -> OpenAI's context-length
error); Triton's full request queue -> 429; a deadline -> 504; the rest -> 500.
"""

from __future__ import annotations

import re
from typing import Optional

import grpc
from tritonclient.utils import InferenceServerException

from openai_frontend.errors import APIError, context_exceeded, timed_out, unavailable

_ENSEMBLE_PREFIX = "in ensemble "


# preprocessing's words for a missing or empty prompt, in the ensemble's tensor names; the
# frontend's clients sent a prompt, messages or text.
_NO_PROMPT = "exactly one of text_input, messages, input_ids, input_embeds is required"
_EMPTY_PROMPT = "the prompt is empty"


def _clean(message: str) -> str:
    # "in ensemble 'ensemble', <the step's message>" -> "<the step's message>"
    if message.startswith(_ENSEMBLE_PREFIX):
        _, sep, rest = message.partition(", ")
        if sep:
            message = rest
    # "the prompt is empty (text_input given empty)": the tensor is not the client's name for it
    return _EMPTY_PROMPT if message == _NO_PROMPT or message.startswith(_EMPTY_PROMPT) else message


# "unsupported parameter 'x'", "invalid sampling parameter x: ...", "x must be ...",
# "x: ...", "priority 3 needs ...", "logits processor 'm.f' ..." -> x,
# "LoRA adapter 'a' is not loaded" -> lora_path (the engine's name for it), "stop_token_ids token ids
# must ..." -> stop_token_ids, "invalid regex: ..." -> regex, "chat_template_kwargs may not set ..." ->
# chat_template_kwargs, a prompt token out of range or a prompt past the context -> input_ids,
# "logprob_start_len 3 must be ..." -> logprob_start_len, "messages[1].refusal must be ..." (the chat
# template's input, checked in preprocessing) -> messages
_PARAM_RE = re.compile(
    r"parameter '([A-Za-z_][A-Za-z0-9_]*)'"
    r"|invalid sampling parameter ([A-Za-z_][A-Za-z0-9_]*)"
    r"|unknown sampling parameter\(s\): ([A-Za-z_][A-Za-z0-9_]*)"
    r"|^([a-z_][a-z0-9_]*) must "
    r"|^([a-z_][a-z0-9_]*): "
    r"|^(priority) -?\d"
    r"|^([a-z_][a-z0-9_]*) -?\d+ must "
    r"|^the (prompt) has \d+ tokens, but the context is"
    r"|^logits (processor) '"
    r"|^(custom_logit_processor) failed: "
    r"|^prompt logprobs \((logprob_start_len) "
    r"|^LoRA (adapter) '"
    r"|^([a-z_][a-z0-9_]*) token ids must "
    r"|^invalid (json_schema|regex|ebnf|structural_tag|whitespace_pattern)\b"
    r"|^([a-z_][a-z0-9_]*) may not "
    r"|^(input_ids) out of range"
    r"|^prompt token (id) \d+ is out of range"
    r"|^Duplicate request (ID) detected"
    r"|^(messages)\[\d+\]"
)
_PARAM_ALIASES = {"processor": "logits_processors", "adapter": "lora_path", "id": "input_ids", "ID": "rid",
                  "prompt": "input_ids"}


def _param(msg: str) -> Optional[str]:
    match = _PARAM_RE.search(msg)
    if not match:
        return None
    name = next(g for g in match.groups() if g)
    return _PARAM_ALIASES.get(name, name)


def _overloaded(msg: str) -> APIError:
    """A 503 for the engine's overload refusal, which says so itself (and to retry later)."""
    if not msg.lower().startswith("the server is overloaded"):
        msg = f"The server is overloaded, retry later: {msg}"
    return unavailable(msg[:1].upper() + msg[1:], code="overloaded")


_PROMPT_PAST_CONTEXT = re.compile(r"^the prompt has (\d+) tokens, but the context is (\d+) tokens")
_LIMIT_PAST_CONTEXT = re.compile(r"^max_new_tokens must be at most \d+: the context is (\d+) tokens and the prompt has (\d+); got (\d+)")


def _context_exceeded(msg: str, param: Optional[str]) -> Optional[APIError]:
    """The engine's refusal of a request past the model's context, as errors.context_exceeded
    words it, the engine's own sentence after."""
    if m := _PROMPT_PAST_CONTEXT.match(msg):
        return context_exceeded(int(m[2]), int(m[1]), detail=msg, param=param)
    if m := _LIMIT_PAST_CONTEXT.match(msg):
        return context_exceeded(int(m[1]), int(m[2]), int(m[3]), detail=msg, param=param)
    return None


def _invalid_request(msg: str) -> APIError:
    """A 400 for a refusal of the request, naming its parameter where the message does."""
    param = _param(msg)
    return _context_exceeded(msg, param) or APIError(400, msg, param=param)


_MODEL_UNAVAILABLE = "Triton model unavailable: "


def model_unavailable(failure: APIError) -> bool:
    """The server does not serve the model now (not loaded, loading, stopping): map_stream_error's 503."""
    return failure.status_code == 503 and failure.message.startswith(_MODEL_UNAVAILABLE)


def map_stream_error(message: str) -> APIError:
    """An error the server sent inside the stream (the model's or the ensemble's).

    A stream error carries only a message (no status code), so the kind is read from it."""
    msg = _clean(message)
    low = msg.lower()
    param = _param(msg)
    if (context := _context_exceeded(msg, param)) is not None:
        return context
    if param is not None:
        # A refusal naming the request's parameter is the request's fault, even where the value
        # it repeats reads "overloaded" or "model ... not found" (a LoRA or processor name): a
        # 503 there would have the SDK retry what can never succeed.
        return APIError(400, msg, param=param)
    if "overloaded" in low:
        return _overloaded(msg)
    if ("unknown model" in low or "is not ready" in low or "shutting down" in low or "server is stopping" in low
            or ("model" in low and "not found" in low)):
        return unavailable(f"{_MODEL_UNAVAILABLE}{msg}")
    if "internal error" in low or "stub process" in low or ("model instance" in low and "crash" in low):
        return APIError(500, msg)
    return APIError(400, msg)


# What grpc reports when the connection to the server is lost mid-call: an outage to retry, not
# a server error. A crashed tritonserver can surface as UNKNOWN "Stream removed" rather than
# UNAVAILABLE (grpc/grpc#34076), and a stream whose request is written as the connection drops
# fails in grpc.aio with INTERNAL "Internal error from Core" (the failed batch operation; seen
# in tests/test_faults.py's restart test).
_TRANSPORT_LOST = ("connect", "stream removed", "socket closed", "connection reset", "rst_stream", "goaway",
                   "broken pipe", "end of tcp stream", "internal error from core")


def connection_lost(code_name: str, details: str) -> bool:
    """`code_name` is the gRPC status name (UNAVAILABLE, ...), as both error kinds carry it."""
    if code_name.endswith("UNAVAILABLE"):
        return True
    return code_name.endswith(("UNKNOWN", "INTERNAL")) and any(s in details.lower() for s in _TRANSPORT_LOST)


def rpc_status(err: grpc.RpcError) -> tuple[Optional[grpc.StatusCode], str]:
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    return code, details


def map_rpc_error(err: grpc.RpcError) -> APIError:
    code, details = rpc_status(err)
    if connection_lost(code.name if code else "", details):
        if "overloaded" in details.lower():
            return _overloaded(_clean(details))
        return unavailable(f"Triton server unavailable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return _invalid_request(_clean(details))
    if code == grpc.StatusCode.NOT_FOUND:
        return unavailable(f"Triton model unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return timed_out(f"Triton request timed out: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _queue_full(details)
    if code == grpc.StatusCode.CANCELLED:
        return unavailable(f"Triton cancelled the request: {details}")
    return APIError(500, f"Triton error ({code.name if code else 'unknown'}): {details}")


def _queue_full(message: str) -> APIError:
    """429: Triton's own request queue is full (max_queue_size); come back later."""
    return APIError(429, message, headers={"Retry-After": "1"})


def map_infer_error(exc: InferenceServerException) -> APIError:
    """A failed unary infer call (tritonclient wraps the gRPC status in its exception)."""
    status = str(exc.status() or "")
    msg = _clean(exc.message() or str(exc))
    if "INVALID_ARGUMENT" in status:
        return _invalid_request(msg)
    if connection_lost(status, msg) or "NOT_FOUND" in status or "unknown model" in msg.lower():
        return unavailable(f"Triton model unavailable: {msg}")
    if "DEADLINE_EXCEEDED" in status:
        return timed_out(f"Triton request timed out: {msg}")
    if "RESOURCE_EXHAUSTED" in status:
        return _queue_full(msg)
    return APIError(500, f"Triton error ({status or 'unknown'}): {msg}")

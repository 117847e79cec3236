"""Streaming calls to the llm / ensemble models over tritonclient gRPC.

`stream_generate` yields one dict of output arrays per response until the final one; the
iterator's close() (or leaving a `with`/for loop early, an exception, Ctrl-C, or no response
within `timeout`) cancels the request on the server, which frees its KV blocks.

Cancelling the gRPC stream is not enough for the `ensemble`: Triton 2.51 does not pass an
ensemble's cancellation on to its running decoupled `llm` step, which would generate on to its
end. So a request left early is also aborted explicitly, as the OpenAI frontend does: a second
request to the engine model (`abort_model`, default "llm") carrying only `abort_request_id`, the
Triton request id of the stream's request (the ensemble gives its steps its own request id).
The abort is best effort: its failure is logged and never replaces the error that ended the
stream. It is harmless for `--model llm`, whose cancellation reaches the engine anyway.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import uuid
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

log = logging.getLogger(__name__)

# The tensor types of the inputs our models accept (config.pbtxt), so callers may pass
# plain Python values.
INPUT_DTYPES: dict[str, Any] = {
    "text_input": np.object_,
    "messages": np.object_,
    "tools": np.object_,
    "chat_template_kwargs": np.object_,
    "chat_template": np.object_,
    "documents": np.object_,
    "sampling_parameters": np.object_,
    "abort_request_id": np.object_,
    "abort_client": np.object_,
    "lora_update": np.object_,
    "stop_words": np.object_,
    "add_generation_prompt": np.bool_,
    "continue_final_message": np.bool_,
    "add_special_tokens": np.bool_,
    "reset_prefix_cache": np.bool_,
    "abort_all": np.bool_,
    "engine_info": np.bool_,
    "stream": np.bool_,
    "input_ids": np.int32,
    "input_embeds": np.float32,
    "max_tokens": np.int32,
    "top_k": np.int32,
    "temperature": np.float32,
    "top_p": np.float32,
    "min_p": np.float32,
    "random_seed": np.uint64,
}
_LIST_INPUTS = ("input_ids", "stop_words")


def to_array(name: str, value: Any) -> np.ndarray:
    dtype = INPUT_DTYPES.get(name)
    if not isinstance(value, np.ndarray):
        value = list(value) if name in _LIST_INPUTS else [value]
        if dtype is not None and np.issubdtype(dtype, np.integer):
            _check_range(name, value, dtype)
        return np.asarray(value, dtype=dtype)
    if dtype is not None and np.issubdtype(dtype, np.integer) and value.dtype.kind in "iuf" and value.size:
        _check_range(name, value.reshape(-1).tolist() if value.dtype.kind == "f" else [value.min(), value.max()],
                     dtype)
    return value if dtype is None else value.astype(dtype)


def _check_range(name: str, values: Sequence[Any], dtype: Any) -> None:
    # numpy 1.x casts an integer past the tensor's type by wrapping it: 2**32 + 5 was sent as
    # token 5, and 5e9 was refused under the wrapped value's name. A float is cast too (5e9
    # wrapped, 2.5 truncated): only a whole one in range goes.
    info = np.iinfo(dtype)
    for v in values:
        if isinstance(v, (float, np.floating)) and not float(v).is_integer():
            raise ValueError(f"{name} must be a whole number for {np.dtype(dtype).name}: {v}")
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
                and not info.min <= v <= info.max:
            raise ValueError(f"{name} out of range for {np.dtype(dtype).name} [{info.min}, {info.max}]: {v}")


def make_inputs(values: dict[str, Any]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in values.items():
        arr = to_array(name, value)
        tensor = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return inputs


def _decode(arr: Optional[np.ndarray]) -> Any:
    if arr is None:
        return None
    if arr.dtype == np.object_:
        items = [v.decode("utf-8") if isinstance(v, bytes) else v for v in arr.reshape(-1)]
        return items[0] if len(items) == 1 else items
    return arr


class StreamTimeout(TimeoutError, queue.Empty):
    """No response within the stream's timeout. A TimeoutError; also a queue.Empty, which is
    what callers caught before it had a message."""


def _stream_error(error: Any, url: str) -> Exception:
    """The exception for an error the stream's callback reported, naming the server when it
    cannot be reached (gRPC UNAVAILABLE: nothing listens there, or it went away)."""
    if not isinstance(error, InferenceServerException):
        return RuntimeError(str(error))
    if error.status() == "StatusCode.UNAVAILABLE":
        return InferenceServerException(msg=f"cannot reach Triton at {url}: {error.message()}",
                                        status=error.status(), debug_details=error.debug_details())
    return error


def _may_still_run(error: Any, answered: bool, engine_model: str) -> bool:
    """Whether the engine may still be generating for a stream that ended with `error`.

    An error after responses came may leave the request running: a transport error, and also
    the server's own error when an ensemble step failed (Triton 2.51 does not stop the ensemble's
    other steps: after a failed postprocessing step the llm request generates on to max_tokens).
    Before any response, only a step's internal error (say postprocessing's, on the first
    response) does; a refusal, or nothing listening at the URL, leaves nothing to abort. Nor does
    the engine model's stub gone (another step's dead stub leaves the engine's request running)."""
    message = str(error).lower()
    if f"stub process '{engine_model.lower()}_" in message:
        return False
    return answered or "internal error" in message


def _send(client: grpcclient.InferenceServerClient, answers: "queue.Queue[tuple[Any, Any]]", url: str,
          **request: Any) -> None:
    """async_stream_infer, raising the reason when the stream already failed."""
    try:
        client.async_stream_infer(**request)
    except InferenceServerException as exc:
        # "The stream is no longer in valid state": the stream already failed (nothing
        # listening at the URL, say) and its callback holds the reason.
        try:
            _, error = answers.get(timeout=5.0)
        except queue.Empty:
            raise exc from None
        raise _stream_error(error, url) from None


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait while a request left early is cancelled and aborted (at most the
    abort's timeout): a second Ctrl-C there skipped the abort and left the request running in
    the engine (QA: two within 1 ms). A signal that came meanwhile is delivered afterwards. Only
    the main thread can change handlers; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
        except (ValueError, OSError):  # pragma: no cover - not the main interpreter
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if caught:
            signal.raise_signal(caught[0])


class TritonStreamClient:
    """Each `stream_generate` call opens its own connection and bidirectional stream.

    `abort_model`: the engine model that a request left early is aborted on (see the module
    docstring); None or "" sends no abort. `abort_timeout`: seconds to wait for its answer.
    """

    def __init__(self, url: str = "localhost:8001", abort_model: Optional[str] = "llm",
                 abort_timeout: float = 5.0) -> None:
        self.url = url
        self.abort_model = abort_model
        self.abort_timeout = abort_timeout

    def stream_generate(
        self, model: str, values: dict[str, Any], timeout: float = 300.0, outputs: Optional[list[str]] = None,
        request_id: Optional[str] = None,
    ) -> Iterator[dict[str, Any]]:
        """Yield each response's outputs (name -> decoded value) until the final response.

        `timeout`: seconds to wait for each response; past it the request is cancelled and
        aborted, and StreamTimeout("no response within ... s"), a TimeoutError, is raised.
        `request_id`: the Triton request id (a fresh one by default), which the abort names.
        """
        request_id = request_id or uuid.uuid4().hex
        client = grpcclient.InferenceServerClient(self.url)
        responses: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        sent = finished = answered = False
        try:
            _send(client, responses, self.url, model_name=model, inputs=make_inputs(values), request_id=request_id,
                  enable_empty_final_response=True)
            sent = True
            while True:
                try:
                    result, error = responses.get(timeout=timeout)
                except queue.Empty:
                    raise StreamTimeout(f"no response within {timeout:g} s") from None
                if error is not None:
                    finished = not _may_still_run(error, answered, self.abort_model or "llm")
                    raise _stream_error(error, self.url)
                answered = True
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                is_final = bool(final and final.bool_param)
                names = outputs or [o.name for o in response.outputs]
                data = {name: _decode(result.as_numpy(name)) for name in names}
                if response.outputs or not is_final:
                    yield data
                if is_final:
                    finished = True
                    return
        finally:
            # Leaving early (break, exception, close(), timeout) cancels the request server-side
            # and, the ensemble's cancellation not reaching the engine, aborts it there.
            with _signals_held():
                try:
                    client.stop_stream(cancel_requests=not finished)
                    if sent and not finished:
                        self._abort(client, request_id)
                finally:
                    client.close()

    def abort(self, request_id: str) -> None:
        """Have the engine model (`abort_model`) abort the request(s) with this Triton request
        id; raises on failure. A request that has not reached it yet is aborted on arrival."""
        client = grpcclient.InferenceServerClient(self.url)
        try:
            self._send_abort(client, request_id)
        finally:
            client.close()

    def _abort(self, client: grpcclient.InferenceServerClient, request_id: str) -> None:
        """Best effort: a failure is logged, never raised (it must not hide why the stream ended)."""
        if not self.abort_model:
            return
        try:
            self._send_abort(client, request_id)
        except Exception as exc:  # noqa: BLE001 - best effort by design
            log.warning("abort of request %s on model %s failed: %s", request_id, self.abort_model, exc)

    def _send_abort(self, client: grpcclient.InferenceServerClient, request_id: str) -> None:
        if not self.abort_model:
            raise ValueError("no abort_model to send the abort to")
        answers: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        done = False
        try:
            _send(client, answers, self.url, model_name=self.abort_model,
                  inputs=make_inputs({"abort_request_id": request_id}), request_id=f"abort.{request_id}",
                  enable_empty_final_response=True)
            try:
                _, error = answers.get(timeout=self.abort_timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer to the abort within {self.abort_timeout:g} s") from None
            if error is not None:
                raise _stream_error(error, self.url)
            done = True
        finally:
            client.stop_stream(cancel_requests=not done)

    def generate(self, model: str, values: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """Stream and aggregate: concatenated text and ids, the last finish reason and counts."""
        text: list[str] = []
        ids: list[np.ndarray] = []
        last: dict[str, Any] = {}
        count = 0
        for chunk in self.stream_generate(model, values, timeout=timeout):
            count += 1
            if chunk.get("text_output") is not None:
                text.append(chunk["text_output"])
            if chunk.get("output_ids") is not None:
                ids.append(np.asarray(chunk["output_ids"]).reshape(-1))
            last = chunk
        return {
            **last,
            "text_output": "".join(text),
            "output_ids": np.concatenate(ids).tolist() if ids else [],
            "num_responses": count,
        }

"""Streaming calls to the llm / ensemble models over tritonclient gRPC.

`stream_generate` yields one dict of output arrays per response until the final one; the
iterator's close() (or leaving a `with`/for loop early) cancels the request on the server,
which frees its KV blocks.
"""

from __future__ import annotations

import queue
import uuid
from typing import Any, Iterator, Optional

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

# The tensor types of the inputs our models accept (config.pbtxt), so callers may pass
# plain Python values.
INPUT_DTYPES: dict[str, Any] = {
    "text_input": np.object_,
    "messages": np.object_,
    "tools": np.object_,
    "chat_template_kwargs": np.object_,
    "sampling_parameters": np.object_,
    "stop_words": np.object_,
    "add_generation_prompt": np.bool_,
    "continue_final_message": np.bool_,
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
    if isinstance(value, np.ndarray):
        return value if dtype is None else value.astype(dtype)
    if name in _LIST_INPUTS:
        return np.asarray(list(value), dtype=dtype)
    return np.asarray([value], dtype=dtype)


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


class TritonStreamClient:
    """One gRPC connection; each `stream_generate` call opens its own bidirectional stream."""

    def __init__(self, url: str = "localhost:8001") -> None:
        self.url = url

    def stream_generate(
        self, model: str, values: dict[str, Any], timeout: float = 300.0, outputs: Optional[list[str]] = None
    ) -> Iterator[dict[str, Any]]:
        client = grpcclient.InferenceServerClient(self.url)
        responses: "queue.Queue[tuple[Any, Any]]" = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        finished = False
        try:
            client.async_stream_infer(
                model_name=model,
                inputs=make_inputs(values),
                request_id=uuid.uuid4().hex,
                enable_empty_final_response=True,
            )
            while True:
                result, error = responses.get(timeout=timeout)
                if error is not None:
                    finished = True
                    raise error if isinstance(error, InferenceServerException) else RuntimeError(str(error))
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
            # Leaving early (break, exception, close()) cancels the request server-side.
            client.stop_stream(cancel_requests=not finished)
            client.close()

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

"""POST /v1/embeddings: OpenAI's embeddings API over the engine's final-norm hidden states.

A generative model has no pooler of its own, and vLLM serves embeddings only from a model it runs
for them (`--runner pooling`; Qwen3-Embedding, say, pools its last token and normalizes). Here the
engine runs each input for one token with return_hidden_states (the prompt is computed, not read
from the prefix cache), and the prompt's rows are pooled as `--embeddings-pooling` says:
`last`, the last prompt token's row (how decoder embedders such as Qwen3-Embedding and
e5-mistral are trained), or `mean`, the rows' average; then L2-normalized, as OpenAI's
embeddings are. `dimensions` keeps the first N components and normalizes again (Matryoshka
embeddings). Off, the default, the route is a 400 saying so: a chat model is not used as an
embedder unasked.
"""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Union

import numpy as np
from starlette.responses import Response

from openai_frontend.common import Context, json_response
from openai_frontend.engine_types import EngineRequest
from openai_frontend.errors import APIError, bad_request
from openai_frontend.protocol import EmbeddingRequest

POOLINGS = ("off", "last", "mean")
MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs

Input = Union[str, list[int]]


def split_inputs(value: Any) -> list[Input]:
    """The request's `input` as a list of texts or token-id lists (OpenAI's four forms)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a non-empty string, list of strings, list of token ids, or list of "
                          "token-id lists", param="input")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]
    if len(value) > MAX_INPUTS:
        raise bad_request(f"input holds {len(value)} items; at most {MAX_INPUTS}", param="input")
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise bad_request(f"input[{i}] must not be empty", param="input")
        elif not (isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item)):
            raise bad_request(f"input[{i}] must be a non-empty string or a non-empty list of token ids", param="input")
    return value


def pooled(rows: list[list[float]], pooling: str, dimensions: Union[int, None]) -> list[float]:
    """The rows pooled, cut to `dimensions`, L2-normalized (in float64: a long prompt's mean is
    thousands of rows)."""
    vector = np.asarray(rows[-1] if pooling == "last" else rows, dtype=np.float64)
    if pooling != "last":
        vector = vector.mean(axis=0)
    if dimensions is not None:
        vector = vector[:dimensions]
    norm = float(np.linalg.norm(vector))
    return (vector / norm if norm > 0 else vector).tolist()


def encoded(vector: list[float], encoding_format: str) -> Union[list[float], str]:
    if encoding_format == "base64":  # OpenAI's: little-endian float32, base64
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class EmbeddingsHandler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def __call__(self, req: EmbeddingRequest, request_id: str) -> Response:
        pooling = self.ctx.settings.embeddings_pooling
        if pooling == "off":
            raise bad_request("This server serves a generative model and pools no embeddings: start the frontend "
                              "with --embeddings-pooling last (or mean) to serve them from its hidden states",
                              param="model")
        model = self.ctx.check_model(req.model)
        inputs = split_inputs(req.input)
        if req.dimensions is not None and req.dimensions < 1:
            raise bad_request(f"dimensions must be at least 1, got {req.dimensions}", param="dimensions")
        try:
            results = await asyncio.gather(*(self._embed(item, f"{request_id}-{i}") for i, item in enumerate(inputs)))
        except APIError as exc:
            if exc.param in ("input_ids", "text_input", "prompt"):  # the engine's names for `input`
                exc.param = "input"
            raise
        hidden = len(results[0][0][-1])
        if req.dimensions is not None and req.dimensions > hidden:
            raise bad_request(f"dimensions {req.dimensions} is more than the model's {hidden}", param="dimensions")
        data = [{"object": "embedding", "index": i,
                 "embedding": encoded(pooled(rows, pooling, req.dimensions), req.encoding_format)}
                for i, (rows, _) in enumerate(results)]
        tokens = sum(n for _, n in results)
        return json_response({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _embed(self, item: Input, request_id: str) -> tuple[list[list[float]], int]:
        """The prompt's final-norm hidden rows, and its token count."""
        request = EngineRequest(
            sampling_params={"max_new_tokens": 1, "temperature": 0, "return_hidden_states": True},
            text_input=item if isinstance(item, str) else None, input_ids=None if isinstance(item, str) else item,
            request_id=request_id, stream=False)
        rows: Any = None
        tokens = 0
        async for chunk in self.ctx.client.generate(request):
            entries = chunk.hidden_states()
            if rows is None and entries:
                rows = entries[0]  # the prompt's rows come first (backend/outputs.py)
            tokens = chunk.prompt_tokens or tokens
        if not (isinstance(rows, list) and rows and isinstance(rows[0], list)):
            raise APIError(500, "the engine sent no hidden states for the input")
        return rows, tokens

"""The only module that talks to Triton: gRPC streaming calls to the `ensemble` model.

One `TritonLLMClient` (one gRPC channel, created lazily in the serving event loop and reused by
every request) is shared by the whole process; every generation opens its own bidirectional
stream (`stream_infer`) with one request and `triton_enable_empty_final_response`, and yields an
`EngineChunk` per response until the final flag. The `n` samples of a request share that stream
(the engine interleaves them; `meta_info.index` tells them apart). Leaving the iteration early
(client disconnect, error, `aclose()`) cancels the gRPC call and, with `abort_model`, sends the
engine an explicit abort (Triton 2.51 does not pass an ensemble's cancellation on to its running
decoupled step).

Responses are decoded straight from the protobuf raw contents (no numpy per chunk): this runs
once per streamed token.

Errors are mapped to HTTP statuses by triton_errors.py. The channel reconnects by itself (short
backoff) when tritonserver comes back. A stream that goes silent while tritonserver is stopping
is ended with a 503 (STOPPING_SILENCE_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import sys
import uuid
from typing import Any, AsyncIterator, Optional, Sequence

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from openai_frontend.engine_types import EngineChunk, EngineRequest
from openai_frontend.errors import APIError, unavailable
from openai_frontend.router import Router, RouterConfig, conversation_opening, routing_key
from openai_frontend.triton_errors import (
    connection_lost, map_infer_error, map_rpc_error, map_stream_error, model_unavailable, rpc_status,
)

log = logging.getLogger(__name__)

_LITTLE = sys.byteorder == "little"
# How long a cancelled stream waits for its abort to reach the engine model (one gRPC call,
# milliseconds; longer only when tritonserver is unreachable, and then the abort goes on alone).
ABORT_WAIT_S = 2.0
# A stream that has heard nothing for STOPPING_SILENCE_S since its last response while the server
# says it (or its model) is not ready is ended with a 503. Triton 2.51 stopping on SIGTERM keeps an
# ensemble stream open through its exit timeout but passes none of its responses on: the client
# waited until it gave up (QA: > 90 s), where a killed server ends the stream at once. Streams that
# still receive (a drain, an unload) are left alone. Checked every STOPPING_CHECK_S while streams
# are open.
STOPPING_SILENCE_S = 3.0
STOPPING_CHECK_S = 1.0


def _bytes_input(name: str, value: str) -> InferInput:
    tensor = InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
    return tensor


def _bool_input(name: str, value: bool) -> InferInput:
    tensor = InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=np.bool_))
    return tensor


def build_inputs(request: EngineRequest) -> list[InferInput]:
    """The ensemble's input tensors for one request (see docs/ARCHITECTURE.md)."""
    inputs = prompt_inputs(request)
    inputs.append(_bool_input("stream", request.stream))
    sp = request.sampling_params
    if request.n != 1:
        sp = {**sp, "n": request.n}
    inputs.append(_bytes_input("sampling_parameters", json.dumps(sp, ensure_ascii=False)))
    return inputs


def prompt_inputs(request: EngineRequest) -> list[InferInput]:
    """The prompt's tensors: what the ensemble hands to preprocessing (same names)."""
    inputs: list[InferInput] = []
    if request.input_ids is not None:
        ids = np.asarray(request.input_ids, dtype=np.int32)
        tensor = InferInput("input_ids", [int(ids.size)], "INT32")
        tensor.set_data_from_numpy(ids)
        inputs.append(tensor)
    elif request.input_embeds is not None:
        rows = np.asarray(request.input_embeds, dtype=np.float32)
        tensor = InferInput("input_embeds", list(rows.shape), "FP32")
        tensor.set_data_from_numpy(rows)
        inputs.append(tensor)
    elif request.messages is not None:
        inputs.append(_bytes_input("messages", json.dumps(request.messages, ensure_ascii=False)))
        if request.tools:
            inputs.append(_bytes_input("tools", json.dumps(request.tools, ensure_ascii=False)))
        if request.chat_template_kwargs:
            inputs.append(_bytes_input("chat_template_kwargs", json.dumps(request.chat_template_kwargs, ensure_ascii=False)))
        if request.add_generation_prompt is not None:
            inputs.append(_bool_input("add_generation_prompt", request.add_generation_prompt))
        if request.continue_final_message:
            inputs.append(_bool_input("continue_final_message", True))
        if request.documents is not None:
            inputs.append(_bytes_input("documents", json.dumps(request.documents, ensure_ascii=False)))
        if request.chat_template is not None:
            inputs.append(_bytes_input("chat_template", request.chat_template))
    elif request.text_input is not None:
        inputs.append(_bytes_input("text_input", request.text_input))
    else:
        raise APIError(400, "one of text_input, messages, input_ids, input_embeds is required")
    if request.add_special_tokens is not None and request.input_ids is None and request.input_embeds is None:
        inputs.append(_bool_input("add_special_tokens", request.add_special_tokens))
    return inputs


# ---------------------------------------------------------------------------------------------
# Response decoding (hot path)
# ---------------------------------------------------------------------------------------------


def _decode_bytes_first(raw: bytes) -> str:
    """First element of a serialized BYTES tensor (4-byte little-endian length + data)."""
    if len(raw) < 4:
        return ""
    (n,) = struct.unpack_from("<I", raw, 0)
    return raw[4 : 4 + n].decode("utf-8", errors="replace")


def _decode_int32(raw: bytes) -> list[int]:
    if _LITTLE:
        return memoryview(raw).cast("i").tolist()
    return np.frombuffer(raw, dtype="<i4").tolist()


def _first_int(raw: bytes) -> int:
    return struct.unpack_from("<i", raw, 0)[0] if len(raw) >= 4 else 0


_FIELDS = ("text_output", "output_ids", "finish_reason", "prompt_tokens", "completion_tokens", "meta_info")


class _Layout:
    """Where each output sits in a response (the same for every response of a stream)."""

    __slots__ = ("n", "first", "last", "idx")

    def __init__(self, outputs: Any) -> None:
        names = [o.name for o in outputs]
        self.n = len(names)
        self.first = names[0]
        self.last = names[-1]
        self.idx = tuple(names.index(f) if f in names else -1 for f in _FIELDS)

    def matches(self, outputs: Any) -> bool:
        return len(outputs) == self.n and outputs[0].name == self.first and outputs[-1].name == self.last


class ResponseDecoder:
    """ModelInferResponse -> EngineChunk, for one stream.

    Reading every output's name costs more than decoding the values (a protobuf wrapper per
    output), so the layout is learnt from the first response and only spot-checked afterwards.
    """

    __slots__ = ("_layout",)

    def __init__(self) -> None:
        self._layout: Optional[_Layout] = None

    def __call__(self, response: Any) -> EngineChunk:
        outputs = response.outputs
        raw = response.raw_output_contents
        if len(raw) != len(outputs):  # contents not in raw form: slow generic path
            return _decode_generic(response)
        layout = self._layout
        if layout is None or not layout.matches(outputs):
            layout = self._layout = _Layout(outputs)
        t, i, f, p, c, m = layout.idx
        return EngineChunk(
            _decode_bytes_first(raw[t]) if t >= 0 else "",
            _decode_int32(raw[i]) if i >= 0 else [],
            (_decode_bytes_first(raw[f]) or None) if f >= 0 else None,
            _first_int(raw[p]) if p >= 0 else 0,
            _first_int(raw[c]) if c >= 0 else 0,
            _decode_bytes_first(raw[m]) if m >= 0 else "",
        )


def decode_response(response: Any) -> EngineChunk:
    """An EngineChunk from one ModelInferResponse protobuf."""
    return ResponseDecoder()(response)


def _decode_generic(response: Any) -> EngineChunk:
    from tritonclient.grpc import InferResult

    result = InferResult(response)

    def first(name: str, default: Any) -> Any:
        arr = result.as_numpy(name)
        if arr is None or arr.size == 0:
            return default
        item = arr.reshape(-1)[0]
        return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item.item()

    ids = result.as_numpy("output_ids")
    return EngineChunk(
        text=first("text_output", ""),
        token_ids=[] if ids is None else ids.reshape(-1).tolist(),
        finish_reason=first("finish_reason", "") or None,
        prompt_tokens=int(first("prompt_tokens", 0)),
        completion_tokens=int(first("completion_tokens", 0)),
        meta_raw=first("meta_info", ""),
    )


# The mark on the Triton id of a request whose client named it: the llm model runs such a name
# once at a time per frontend id (backend/request_index.py, NAMED_SUFFIX, the same string).
NAMED_SUFFIX = "rid-"
# The mark (after NAMED_SUFFIX, if both) of a batch item (EngineRequest.batch_item): only such an
# id answers an abort for its batch's id (BATCH_ITEM_SUFFIX in backend/request_index.py).
BATCH_ITEM_SUFFIX = "b-"


def _batch_item_of(client_id: str, rid: Optional[str]) -> bool:
    """Whether `client_id`, a batch item's, is prompt i of the batch request `rid` (its streams
    are `<rid>_<i>` on /generate, as SGLang names them, and `<rid>-<i>` on /v1/completions). The
    llm model applies the same rule to `abort_client` (backend/request_index.py, names_client)."""
    return (bool(rid) and client_id[len(rid) : len(rid) + 1] in ("_", "-") and client_id.startswith(rid)
            and client_id[len(rid) + 1 :].isdigit())


class ResponseReader:
    """A gRPC response stream read by a task of its own, so that no read is ever cancelled.

    grpc.aio (1.85) leaks a read when the task awaiting it is cancelled: the batch's op array,
    and the received message with the transport read buffer it pins (8 to 64 KB; grpc/grpc#43360).
    A client disconnect cancels the HTTP handler's task, which used to await the read itself: the
    frontend grew by ~1.4 KB of native memory per disconnected stream. Consumers here wait on a
    queue instead; `close()` cancels the call in gRPC core, which ends a read in flight with the
    call rather than abandoning it.
    """

    __slots__ = ("_responses", "_queue", "_task", "_reading", "_abandoned", "_ended")

    # Responses read ahead of the consumer: beyond these, gRPC's flow control holds the rest.
    READ_AHEAD = 8

    def __init__(self, responses: Any) -> None:
        self._responses = responses  # tritonclient's iterator: cancel() cancels the call
        self._queue: asyncio.Queue = asyncio.Queue(self.READ_AHEAD)
        self._reading = False
        self._abandoned = False
        self._ended: Optional[BaseException] = None
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        responses = self._responses
        while True:
            self._reading = True
            try:
                item: Any = await responses.__anext__()
            except StopAsyncIteration as exc:
                item = exc
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this task cancelled (the loop closing), not the call
                item = exc  # the call was cancelled (cancel(), close()): grpc.aio raises this
            except Exception as exc:
                item = exc
            finally:
                self._reading = False
            if self._abandoned:
                return
            await self._queue.put(item)
            if isinstance(item, BaseException):
                return

    def __aiter__(self) -> "ResponseReader":
        return self

    async def __anext__(self) -> Any:
        if self._ended is not None:
            raise self._ended
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._ended = StopAsyncIteration() if isinstance(item, StopAsyncIteration) else item
            raise item
        return item

    def cancel(self) -> None:
        """Cancel the call; the consumer then reads how it ended (grpc.aio: CancelledError)."""
        self._responses.cancel()

    def close(self) -> None:
        """Cancel the call for a consumer that has gone: nothing more is queued."""
        self._abandoned = True
        self._responses.cancel()
        if not self._reading:
            self._task.cancel()  # waiting for queue space, not for gRPC


def _retrieve_exception(task: asyncio.Future) -> None:
    """A done callback: a shielded call whose awaiter left raises to nobody (no asyncio warning)."""
    if not task.cancelled():
        task.exception()


# How long a one-response llm call may take to end after its answer (it ends at once).
CALL_END_WAIT_S = 2.0


async def _until_the_call_ends(responses: ResponseReader) -> None:
    """Read a one-response call until the server ends it. Triton 2.51 answers an abort (its reply
    goes out after the aborted stream's last response) and ends the call a moment later; a
    channel closed in between (the frontend shutting down) left a request behind that kept `llm`
    loaded through tritonserver's whole exit timeout (a bare-tritonserver repro: 12 of 28 stops
    with the channel closed at once, 0 of 8 with each call read to its end)."""
    try:
        async with asyncio.timeout(CALL_END_WAIT_S):
            async for _ in responses:
                pass
    except TimeoutError:
        responses.close()
    except grpc.RpcError:
        pass


def _may_still_run(failure: APIError, message: str, answered: bool, engine_model: str) -> bool:
    """Whether llm may still be generating for a stream that ended with `failure`.

    Triton 2.51 does not stop an ensemble's running steps when one of them fails: after a failed
    postprocessing step the stream ends with that error while its llm request generates on to
    max_tokens (seen with a failure injected mid-stream), so such a stream is aborted like a
    disconnected one. Not a request refused before it ran (an error before any response, other
    than a step's internal one), nor one whose engine model's stub is gone (nothing left to abort
    there; another step's dead stub leaves it running)."""
    if f"stub process '{engine_model.lower()}_" in message.lower():
        return False
    return answered or failure.status_code == 500


def _is_final(response: Any) -> bool:
    params = response.parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


# The tritonclient defaults, plus a short reconnect backoff: after tritonserver restarts, the
# channel is back within a second or two instead of gRPC's default of up to two minutes.
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.enable_retries", 0),
]


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------


class _OpenStream:
    """A stream in flight, as the stopping watch sees it."""

    __slots__ = ("responses", "server", "last", "ended_by_watch")

    def __init__(self, responses: Any, server: "_Server") -> None:
        self.responses = responses
        self.server = server
        # When it last received a response (loop time). None before the first: a request not
        # streamed (one response at its end) is silent by design, and a stopping server does
        # answer those, with an error ("Server is stopping, ...").
        self.last: Optional[float] = None
        self.ended_by_watch = False


def _cancelled_from_outside() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


# What the frontend may send and what it reads back. A model without them fails requests
# ("unexpected inference input") or, `llm` itself, answers /generate's ids with empty text (QA:
# --triton-model llm did both): the frontend's client requires them all (`serves_frontend`);
# as a library, a client calls any model, and a request is checked for its own inputs only.
ENSEMBLE_INPUTS = ("text_input", "messages", "tools", "chat_template_kwargs", "add_generation_prompt",
                   "continue_final_message", "documents", "chat_template", "add_special_tokens", "input_ids",
                   "input_embeds", "stream", "sampling_parameters")
ENSEMBLE_OUTPUTS = _FIELDS


Tensors = tuple[frozenset, frozenset]  # a model's input names, output names


def model_tensors(metadata: dict[str, Any]) -> Tensors:
    """The input and output names in a model's Triton metadata (get_model_metadata as JSON)."""
    return (frozenset(t.get("name") for t in metadata.get("inputs") or []),
            frozenset(t.get("name") for t in metadata.get("outputs") or []))


def contract_problem(model: str, tensors: Tensors, inputs: Sequence[str] = ENSEMBLE_INPUTS,
                     outputs: Sequence[str] = ENSEMBLE_OUTPUTS) -> Optional[str]:
    """Why `model` (its tensors) cannot take `inputs` and give `outputs`, or None. Given only a
    request's inputs (no outputs): why it cannot take that request."""
    has_in, has_out = tensors
    missing = [f"no {kind} {', '.join(names)}" for kind, names in (
        ("output", [n for n in outputs if n not in has_out]),
        ("input", [n for n in inputs if n not in has_in])) if names]
    if not missing:
        return None
    if not outputs:
        return f"Triton model '{model}' cannot take this request: it has {' and '.join(missing)}"
    return (f"Triton model '{model}' is not one this frontend can call: it has {' and '.join(missing)}. The frontend "
            "calls the ensemble (preprocessing -> llm -> postprocessing), or a model with the same inputs and "
            "outputs; --triton-model names it")


class _Server:
    """One tritonserver the client sends requests to, as the client last saw it."""

    __slots__ = ("url", "index", "client", "in_flight", "requests", "ready", "checked", "tensors", "contract_error",
                 "probe")

    def __init__(self, url: str, index: int) -> None:
        self.url = url
        self.index = index  # in the client's list, as the router numbers servers
        self.client: Optional[grpcclient_aio.InferenceServerClient] = None
        self.in_flight = 0  # this process's streams on it
        self.requests = 0  # and all it ever sent there
        # Its model's readiness when last asked (None: not asked yet), and when (loop time).
        # Routing skips one seen not ready, and asks again at most every RECHECK_S.
        self.ready: Optional[bool] = None
        self.checked = 0.0
        # Its model's tensors, read once, and again once it was seen not ready; for the frontend's
        # client, the verdict on them (contract_problem).
        self.tensors: Optional[Tensors] = None
        self.contract_error: Optional[str] = None
        self.probe: Optional[asyncio.Task] = None


# How often a server seen not ready (or unreachable) is asked again while requests go elsewhere.
RECHECK_S = 2.0


class TritonLLMClient:
    """Async client of the ensemble model over gRPC. Create once per process.

    The gRPC channel binds to the event loop that first uses it, so it is created lazily on the
    first call (inside the server's loop).

    `url` may name several tritonservers serving the same model (one per GPU: data
    parallelism). Each generation then goes to one of them, chosen by `router`
    (openai_frontend/router.py); tokenize / detokenize go to any ready one; aborts, LoRA updates
    and prefix-cache resets go to all of them.
    """

    def __init__(
        self,
        url: str | Sequence[str] = "localhost:8001",
        model_name: str = "ensemble",
        *,
        stream_timeout: Optional[float] = None,
        ready_timeout: float = 2.0,
        abort_model: Optional[str] = None,
        frontend_id: Optional[str] = None,
        preprocessing_model: str = "preprocessing",
        postprocessing_model: str = "postprocessing",
        serves_frontend: bool = False,
        router: Optional[RouterConfig] = None,
        router_memory_path: Optional[str] = None,
    ) -> None:
        urls = [url] if isinstance(url, str) else list(url)
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"Triton URLs: at least one, each once (got {urls})")
        self._servers = [_Server(u, i) for i, u in enumerate(urls)]
        self.url = ", ".join(urls)
        # With several servers and a shared memory file, what each was sent is known to every
        # --workers process (router_memory.py).
        self.router = Router(len(urls), router or RouterConfig(), names=urls,
                             memory_path=router_memory_path if len(urls) > 1 else None)
        self.serves_frontend = serves_frontend
        self.model_name = model_name
        self.preprocessing_model = preprocessing_model
        self.postprocessing_model = postprocessing_model
        self.stream_timeout = stream_timeout
        self.ready_timeout = ready_timeout
        self.abort_model = abort_model
        self.frontend_id = frontend_id or uuid.uuid4().hex[:12]
        self._aborts: set[asyncio.Task] = set()
        # The Triton request id of every stream in flight, by the request id the client knows
        # (SGLang's /abort_request names the latter).
        self._streams: dict[str, set[str]] = {}
        # The names client-named requests in flight go by: the request's, and with n > 1 its
        # samples' `<rid>_<i>` (SGLang names them so, and refuses a second request under any).
        self._claimed: set[str] = set()
        # How many of the streams under a client id are batch items (EngineRequest.batch_item).
        self._batch_items: dict[str, int] = {}
        # Requests held by id (hold): their abort events, each with whether it is a batch item.
        self._held: dict[str, dict[asyncio.Event, bool]] = {}
        self.out_of_order_responses = 0  # see _out_of_order
        self._open: dict[str, _OpenStream] = {}  # by Triton request id, for _watch_stopping
        self._stopping_watch: Optional[asyncio.Task] = None

    def _get(self, server: Optional[_Server] = None) -> grpcclient_aio.InferenceServerClient:
        server = server or self._servers[0]
        if server.client is None:
            server.client = grpcclient_aio.InferenceServerClient(server.url, channel_args=CHANNEL_ARGS)
        return server.client

    async def close(self) -> None:
        if self._stopping_watch is not None:
            self._stopping_watch.cancel()
        for server in self._servers:
            if server.probe is not None:
                server.probe.cancel()
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)
        for server in self._servers:
            if server.client is not None:
                client, server.client = server.client, None
                await client.close()

    def server_counts(self) -> Optional[dict[str, dict[str, int]]]:
        """With several servers, per server for /metrics: generations sent, in flight, whether
        routing takes it (up), and the prompt chunks routed there and, of those, ones it had been
        sent before."""
        if len(self._servers) == 1:
            return None
        router = self.router
        return {s.url: {"requests": s.requests, "in_flight": s.in_flight, "up": int(s.ready is not False),
                        "prompt_chunks": router.prompt_chunks[s.index],
                        "prompt_chunks_matched": router.prompt_chunks_matched[s.index]}
                for s in self._servers}

    def _each(self, texts: Sequence[tuple[_Server, Optional[str]]]) -> Optional[str]:
        """One message from per-server ones: as it is with one server; else each prefixed with
        its server's URL."""
        found = [(server, text) for server, text in texts if text]
        if len(self._servers) == 1:
            return found[0][1] if found else None
        return "; ".join(f"{server.url}: {text}" for server, text in found) or None

    @property
    def contract_error(self) -> Optional[str]:
        """For the frontend's client, once the model's tensors are read: why the model cannot
        serve the frontend (on each server where it cannot), or None."""
        return self._each([(s, s.contract_error) for s in self._servers])

    async def is_ready(self) -> bool:
        """The model is ready on some server, and (the frontend's client) one the frontend can
        call: contract_error says why not."""
        return any(await asyncio.gather(*(self._check(s) for s in self._servers)))

    async def _check(self, server: _Server) -> bool:
        server.checked = asyncio.get_running_loop().time()
        try:
            ready = bool(await self._get(server).is_model_ready(self.model_name, client_timeout=self.ready_timeout))
            if not ready:  # it may come back as another model (a reload): read it again then
                server.tensors = server.contract_error = None
            elif self.serves_frontend:
                await self._read_tensors(server)
            ready = ready and not server.contract_error
        except (InferenceServerException, grpc.RpcError, OSError) as exc:
            log.debug("readiness check of %s failed: %s", server.url, exc)
            ready = False
        if ready:
            server.ready = True
        else:
            self._went_down(server)
        return ready

    def _mark_down(self, server: _Server) -> None:
        """Seen failing now: routing skips it, and asks it again RECHECK_S later."""
        self._went_down(server)
        server.checked = asyncio.get_running_loop().time()

    def _went_down(self, server: _Server) -> None:
        """Not ready now. The router forgets what it had sent there: a server that comes back has
        most likely restarted with an empty cache, and a chat that moved to another server
        meanwhile has its history there now, which a tie with the stale memory could undo."""
        if server.ready is not False:
            self.router.forget(server.index)
        server.ready = False

    async def not_ready_reason(self) -> Optional[str]:
        """Why the model is not ready, from Triton's repository index: no model of that name (and
        the names it has), or its state and Triton's reason (a failed load says why), or that
        Triton does not answer. With several servers, each one's where it is not ready."""
        servers = [s for s in self._servers if len(self._servers) == 1 or not s.ready]
        reasons = await asyncio.gather(*(self._not_ready_reason(s) for s in servers))
        return self._each(list(zip(servers, reasons)))

    async def _not_ready_reason(self, server: _Server) -> str:
        try:
            index = await self._get(server).get_model_repository_index(as_json=True, client_timeout=self.ready_timeout)
        except (InferenceServerException, grpc.RpcError, OSError) as exc:
            return f"Triton does not answer: {exc}"
        models = index.get("models") or []
        mine = [m for m in models if m.get("name") == self.model_name]
        if not mine:
            names = sorted({str(m.get("name")) for m in models})
            return f"Triton has no model of that name (it has: {', '.join(names) or 'none'})"
        states = [f"{m.get('state') or 'UNKNOWN'}" + (f": {m['reason']}" if m.get("reason") else "") for m in mine]
        return "; ".join(states)

    async def _read_tensors(self, server: _Server) -> Tensors:
        """The model's input and output names on `server`, read once. Raises what the call raised
        (nothing is remembered then)."""
        if server.tensors is None:
            metadata = await self._get(server).get_model_metadata(self.model_name, as_json=True,
                                                                  client_timeout=self.ready_timeout)
            server.tensors = model_tensors(metadata)
            if self.serves_frontend and (problem := contract_problem(self.model_name, server.tensors)):
                server.contract_error = problem
                log.error("%s: %s", server.url, problem)
        return server.tensors

    async def _request_problem(self, server: _Server, inputs: list[InferInput]) -> Optional[str]:
        """Why the model on `server` cannot take this request: the frontend's whole contract, or
        (a library client) the request's own inputs. None when it can, or when the tensors cannot
        be read (the call itself then says what is wrong)."""
        try:
            tensors = await self._read_tensors(server)
        except (InferenceServerException, grpc.RpcError, OSError) as exc:
            log.debug("model metadata unavailable on %s: %s", server.url, exc)
            return None
        if self.serves_frontend:
            return server.contract_error
        return contract_problem(self.model_name, tensors, inputs=[t.name() for t in inputs], outputs=())

    def _eligible(self) -> list[_Server]:
        """The servers a request may go to: those not seen failing (a server seen not ready is
        asked again in the background, at most every RECHECK_S); all of them when none is left,
        so that the request's own error says what is wrong."""
        if len(self._servers) == 1:
            return self._servers
        now = asyncio.get_running_loop().time()
        for server in self._servers:
            if server.ready is False and server.probe is None and now - server.checked >= RECHECK_S:
                server.probe = asyncio.ensure_future(self._probe(server))
        return [s for s in self._servers if s.ready is not False] or self._servers

    def _untried(self, tried: list[_Server]) -> list[_Server]:
        """The eligible servers a failed request has not been sent to yet."""
        return [s for s in self._eligible() if s not in tried]

    async def _probe(self, server: _Server) -> None:
        try:
            await self._check(server)
        finally:
            server.probe = None

    def _route(self, request: EngineRequest, eligible: list[_Server]) -> _Server:
        key = routing_key(request)
        index = self.router.choose(key, [s.in_flight for s in self._servers], [s.index for s in eligible],
                                   opening=conversation_opening(request, key) if self.router.places_by_opening else None)
        return self._servers[index]

    async def _serving(self, server: _Server) -> Optional[bool]:
        """Whether the server says it is ready and so is its model; None when it gave no answer
        (a timeout under load is no answer). Triton 2.51, stopping, answers both calls with
        UNAVAILABLE "Server exiting": a not-ready answer, not a lost connection."""
        client = self._get(server)
        try:
            return (bool(await client.is_server_ready(client_timeout=self.ready_timeout))
                    and bool(await client.is_model_ready(self.model_name, client_timeout=self.ready_timeout)))
        except InferenceServerException as exc:
            if "UNAVAILABLE" in str(exc.status() or ""):
                return False
            log.debug("readiness check failed: %s", exc)
            return None
        except (grpc.RpcError, OSError) as exc:
            log.debug("readiness check failed: %s", exc)
            return None

    async def _watch_stopping(self) -> None:
        """While streams are open: end those silent for STOPPING_SILENCE_S once their server says
        it or its model is not ready (see STOPPING_SILENCE_S)."""
        loop = asyncio.get_running_loop()
        try:
            while self._open:
                await asyncio.sleep(STOPPING_CHECK_S)
                now = loop.time()
                silent = [o for o in self._open.values()
                          if o.last is not None and now - o.last >= STOPPING_SILENCE_S and not o.ended_by_watch]
                for server in {o.server for o in silent}:
                    if await self._serving(server) is not False:
                        continue
                    self._mark_down(server)
                    mine = [o for o in silent if o.server is server]
                    log.warning("Triton server %s or model %s not ready: ending %d stream(s) silent for %.0f s or "
                                "more", server.url, self.model_name, len(mine), STOPPING_SILENCE_S)
                    for stream in mine:
                        stream.ended_by_watch = True
                        stream.responses.cancel()
        finally:
            self._stopping_watch = None

    @property
    def server_urls(self) -> list[str]:
        """The tritonservers, in the router's numbering."""
        return [s.url for s in self._servers]

    def generate_at(self, index: int, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """`request` on server `index` of server_urls, wherever the router would send it, and
        with no retry elsewhere: a probe of that one server (/health_generate)."""
        return self._generate_on(self._servers[index], request)

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        """The ensemble's responses for `request` until the final one.

        Closing the iterator before the end (or cancelling the task consuming it) cancels the
        gRPC stream, which cancels the request in Triton.

        With several servers: one that fails before the request got any response (its
        connection, or its model not ready) is marked not ready (routing skips it until it
        answers again), and the request goes to another one.
        """
        if len(self._servers) == 1:
            return self._generate_on(self._servers[0], request)
        return self._generate_routed(request)

    async def _generate_routed(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        tried: list[_Server] = []
        while True:
            server = self._route(request, self._untried(tried) or self._servers)
            tried.append(server)
            answered = False
            try:
                # Closed with this generator (a consumer's aclose()), not when collected: its
                # cleanup sends the engine its abort.
                async with contextlib.aclosing(self._generate_on(server, request)) as chunks:
                    async for chunk in chunks:
                        answered = True
                        yield chunk
                return
            except APIError as exc:
                if answered or server.ready is not False or not self._untried(tried):
                    raise
                log.warning("Triton server %s failed before answering request %s (%s): sending it to another server",
                            server.url, request.request_id or "-", exc.message)

    async def _generate_on(self, server: _Server, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        inputs = build_inputs(request)
        if problem := await self._request_problem(server, inputs):
            raise APIError(500, problem)
        claims = self._claims(request)  # claimed below with the stream, with no await between
        # Unique per stream (client-supplied ids may repeat), traceable to the client's id, and
        # abortable by it from any process sharing this frontend id (abort_requests). A name the
        # client chose is marked (NAMED_SUFFIX): the llm model then refuses a second one while it
        # runs, sent by another of this frontend's processes (backend/request_index.py).
        mark = (NAMED_SUFFIX if request.client_named else "") + (BATCH_ITEM_SUFFIX if request.batch_item else "")
        request_id = f"{request.request_id or 'anon'}@{self.frontend_id}.{mark}{uuid.uuid4().hex[:8]}"
        done = asyncio.Event()
        payload = {
            "model_name": self.model_name,
            "inputs": inputs,
            "request_id": request_id,
            "parameters": {"triton_enable_empty_final_response": True},
        }

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield payload
            # Keep our side of the stream open until the final response: the server then
            # never sees a half-closed stream with a request still in flight.
            await done.wait()

        try:
            responses = ResponseReader(self._get(server).stream_infer(requests(), stream_timeout=self.stream_timeout))
        except InferenceServerException as exc:
            raise unavailable(f"Triton server unavailable: {exc.message()}") from None
        loop = asyncio.get_running_loop()
        watched = self._open[request_id] = _OpenStream(responses, server)
        if self._stopping_watch is None:
            self._stopping_watch = asyncio.ensure_future(self._watch_stopping())
        streams = self._streams.setdefault(request.request_id, set())
        streams.add(request_id)
        self._claimed |= claims
        server.in_flight += 1
        self.router.note_load(server.index, server.in_flight)
        server.requests += 1
        if request.batch_item:
            self._batch_items[request.request_id] = self._batch_items.get(request.request_id, 0) + 1
        decode = ResponseDecoder()
        multi = request.n > 1
        seen = [0] * request.n  # completion_tokens so far, per sample: must never go down
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    text = error.message() if isinstance(error, InferenceServerException) else str(error)
                    failure = map_stream_error(text)
                    finished = not _may_still_run(failure, text, watched.last is not None, self.abort_model or "llm")
                    if watched.last is None and model_unavailable(failure):
                        self._mark_down(server)  # not serving the model (loading, stopping): skipped until it is
                        # It may come back as another model (a reload): its tensors are read again.
                        server.tensors = server.contract_error = None
                    raise failure
                watched.last = loop.time()
                response = result.get_response()
                final = _is_final(response)
                if response.outputs:
                    chunk = decode(response)
                    index = 0
                    if multi:
                        index = chunk.meta.get("index", 0)
                        index = chunk.index = index if isinstance(index, int) and 0 <= index < request.n else 0
                    if chunk.completion_tokens < seen[index]:
                        self._out_of_order(request_id, seen[index], chunk.completion_tokens)
                    else:
                        seen[index] = chunk.completion_tokens
                    yield chunk
                if final:
                    finished = True
                    return
            finished = True
            raise APIError(502, "Triton closed the stream before the final response")
        except asyncio.CancelledError:
            if not watched.ended_by_watch or _cancelled_from_outside():
                raise
            finished = True
            raise self._stopped_error(server) from None
        except grpc.RpcError as exc:
            if watched.ended_by_watch:
                finished = True
                raise self._stopped_error(server) from None
            # Ended on our side (its deadline: --stream-timeout): the request runs on in the engine
            # unless aborted below, as for a disconnect (QA: it generated to its length for a
            # client that had its 504). A lost connection has nothing to abort on.
            code, details = rpc_status(exc)
            finished = connection_lost(code.name if code else "", details)
            if finished and not (code == grpc.StatusCode.UNAVAILABLE and "overloaded" in details.lower()):
                self._mark_down(server)  # routing skips it until it answers again
            raise map_rpc_error(exc) from None
        finally:
            done.set()
            del self._open[request_id]
            server.in_flight -= 1
            self.router.note_load(server.index, server.in_flight)
            self._claimed -= claims
            if request.batch_item:
                left = self._batch_items.pop(request.request_id) - 1
                if left:
                    self._batch_items[request.request_id] = left
            streams.discard(request_id)
            if not streams and self._streams.get(request.request_id) is streams:
                del self._streams[request.request_id]
            if not finished:
                responses.close()
                if self.abort_model:
                    task = asyncio.ensure_future(self._abort(request_id, server))
                    self._aborts.add(task)
                    task.add_done_callback(self._aborts.discard)
                    # Waited for, within a bound: at a forced shutdown (a second Ctrl-C) uvicorn
                    # skips the lifespan's close(), and asyncio.run then finishes only the tasks it
                    # cancels, this stream's among them: an abort left to run alone went down with
                    # the loop, and the engine generated on for a client that was gone.
                    await asyncio.wait({task}, timeout=ABORT_WAIT_S)

    def _claims(self, request: EngineRequest) -> set[str]:
        """The names a client-named request goes by: its id and, with n > 1, its samples'
        `<rid>_<i>` (SGLang names them so, and refuses a second request under any while it runs).
        Raises the 400 when one is taken; the caller claims them (adds them to _claimed)."""
        if not request.client_named:
            return set()
        rid = request.request_id or ""
        claims = {rid} | ({f"{rid}_{i}" for i in range(request.n)} if request.n > 1 else set())
        taken = sorted(claims & self._claimed) or ([rid] if rid in self._streams or rid in self._held else [])
        if taken:
            raise APIError(400, f"Duplicate request ID detected: {taken[0]}", param="rid")
        return claims

    @contextlib.asynccontextmanager
    async def hold(self, request: EngineRequest) -> AsyncIterator[asyncio.Event]:
        """Hold `request`'s id for work made of many engine requests, one after another (a beam
        search's steps, which carry the same id): a client-named id is claimed as a stream's is,
        and an /abort_request naming it (its rid, its batch's, or abort_all) sets the event
        yielded, also between two steps, when no stream of it is in flight to be aborted."""
        claims = self._claims(request)
        self._claimed |= claims
        aborted = asyncio.Event()
        held = self._held.setdefault(request.request_id, {})
        held[aborted] = request.batch_item
        try:
            yield aborted
        finally:
            self._claimed -= claims
            del held[aborted]
            if not held and self._held.get(request.request_id) is held:
                del self._held[request.request_id]

    def _stopped_error(self, server: _Server) -> APIError:
        which = f"Triton server {server.url}" if len(self._servers) > 1 else "Triton server"
        return unavailable(f"{which} is stopping (it or model '{self.model_name}' is not ready) and the "
                           f"stream got no response for {STOPPING_SILENCE_S:.0f} s")

    async def abort_requests(self, rid: Optional[str] = None, abort_all: bool = False) -> int:
        """End in-flight requests early, as SGLang's /abort_request does: each one finishes
        normally with finish_reason "abort" (what it generated so far is kept). `rid` names a
        request by the id its client knows (and a batch's prompts, see _batch_item_of); `abort_all`
        takes every request of this frontend. Returns the number of streams aborted (a held request,
        a beam search, counts once).

        This process's own streams are aborted by their Triton ids, which also stops one still
        in the ensemble's preprocessing step (the engine remembers such an abort). Then the
        engine aborts what runs under this frontend id from other processes: the other
        --workers, and replicas given the same --frontend-id."""
        if not self.abort_model:
            raise APIError(400, "aborting requests needs the frontend's --abort-model (the engine model)")

        def named(client_id: str, batch_item: bool) -> bool:
            return abort_all or client_id == rid or (batch_item and _batch_item_of(client_id, rid))

        targets = [triton_id for client_id, ids in self._streams.items()
                   if named(client_id, client_id in self._batch_items) for triton_id in ids]
        # A held request (hold) counts once, not as its steps in flight.
        held = [(client_id, event) for client_id, events in self._held.items()
                for event, batch_item in events.items() if named(client_id, batch_item)]
        for _, event in held:
            event.set()
        held_ids = {client_id for client_id, _ in held}
        count = len(held) + sum(len(ids) for client_id, ids in self._streams.items()
                                if client_id not in held_ids and named(client_id, client_id in self._batch_items))
        await asyncio.gather(*(self._abort(triton_id, self._open[triton_id].server) for triton_id in targets))
        command = json.dumps({"frontend": self.frontend_id, "rid": None if abort_all else rid})
        answers = await self._llm_control_all([_bytes_input("abort_client", command)], "abort_client", 10)
        return count + sum(int(meta["aborted"]) for meta in answers)

    async def tokenize(self, request: EngineRequest) -> list[int]:
        """The prompt's token ids as the server computes them for generation: the
        `preprocessing` model itself (chat template, tools and the server's template included)."""
        result = await self._infer(self.preprocessing_model, prompt_inputs(request), "prompt_ids")
        return [int(t) for t in result.reshape(-1)]

    async def detokenize(
        self, token_ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True,
        validate: bool = True,
    ) -> str:
        """`token_ids` as text (special tokens included unless skipped): the `postprocessing`
        model decoding them as one final window, as it decodes a generation's output."""
        if validate:
            # preprocessing checks the ids against the tokenizer (a 400 naming the bad ones); the
            # tokenizer itself would decode an unknown id to nothing.
            await self.tokenize(EngineRequest(sampling_params={}, input_ids=list(token_ids)))
        ids = np.asarray(token_ids, dtype=np.int32)
        window = InferInput("detok_ids", [int(ids.size)], "INT32")
        window.set_data_from_numpy(ids)
        prefix = InferInput("detok_prefix_len", [1], "INT32")
        prefix.set_data_from_numpy(np.array([0], dtype=np.int32))
        inputs = [window, prefix, _bool_input("skip_special_tokens", skip_special_tokens),
                  _bool_input("spaces_between_special_tokens", spaces_between_special_tokens),
                  _bytes_input("finish_reason", "stop")]
        result = await self._infer(self.postprocessing_model, inputs, "text_output")
        value = result.reshape(-1)[0]
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    async def _infer(self, model: str, inputs: list[InferInput], output: str) -> np.ndarray:
        # The call runs in a task of its own, shielded: a cancellation of this task (a client
        # disconnect during a beam search's tokenize) would otherwise reach the task awaiting
        # gRPC's batch, which grpc.aio leaks (see ResponseReader). The call itself, a few
        # milliseconds' work in the server, is left to finish.
        # With several servers, one whose connection fails is marked not ready and the call
        # (idempotent) goes to another.
        tried: list[_Server] = []
        while True:
            server = min(self._untried(tried) or self._servers, key=lambda s: s.in_flight)
            tried.append(server)
            call = asyncio.ensure_future(self._get(server).infer(model, inputs, outputs=[InferRequestedOutput(output)],
                                                                 client_timeout=self.stream_timeout))
            call.add_done_callback(_retrieve_exception)
            try:
                result = await asyncio.shield(call)
            except InferenceServerException as exc:
                status, msg = str(exc.status() or ""), exc.message() or str(exc)
                if len(self._servers) > 1 and connection_lost(status, msg):
                    self._mark_down(server)
                    if self._untried(tried):
                        continue
                raise map_infer_error(exc) from None
            except grpc.RpcError as exc:
                raise map_rpc_error(exc) from None
            return result.as_numpy(output)

    def _out_of_order(self, request_id: str, before: int, now: int) -> None:
        """Triton delivered a stream's responses out of order (seen with an ensemble whose
        postprocessing step has several instances: each response is a separate postprocessing
        request, forwarded as it completes). The text is then scrambled: counted and logged."""
        self.out_of_order_responses += 1
        log.warning("Triton request %s: response with completion_tokens=%d after one with %d "
                    "(responses out of order; is the ensemble's postprocessing running >1 instance?)",
                    request_id, now, before)

    async def lora_update(self, command: dict[str, Any]) -> dict[str, str]:
        """Send the llm model a `lora_update` control request ({"op": "load" | "unload" | "list",
        "name", "path"}); returns the adapters it serves afterwards, name -> path."""
        # Loading reads the adapter's weights: a generous timeout. Every server serves every
        # adapter, or requests naming it fail on some: a load or unload fails when a server
        # cannot answer it. A list is read from the servers that answer.
        listing = command.get("op") == "list"
        answers = await self._llm_control_all([_bytes_input("lora_update", json.dumps(command))], "lora_update", 120,
                                              every=not listing, with_url=True)
        loaded = [dict(meta["loaded_adapters"]) for meta in answers]
        if all(other == loaded[0] for other in loaded[1:]):
            return loaded[0]
        each = "; ".join(f"{meta['url']}: {', '.join(sorted(a)) or 'none'}" for meta, a in zip(answers, loaded))
        if not listing:
            raise APIError(500, f"the Triton servers serve different LoRA adapters: {each}")
        # A server restarted since (its runtime adapters gone): only those every server has are usable.
        log.warning("the Triton servers serve different LoRA adapters (%s): listing those all of them serve", each)
        return {name: path for name, path in loaded[0].items() if all(name in other for other in loaded[1:])}

    async def reset_prefix_cache(self) -> int:
        """Have the engine forget the cached KV blocks no request holds; returns how many (on all
        the servers that answer)."""
        answers = await self._llm_control_all([_bool_input("reset_prefix_cache", True)], "reset_prefix_cache", 30)
        return sum(int(meta["forgotten_blocks"]) for meta in answers)

    async def engine_info(self) -> dict[str, Any]:
        """The engine's effective configuration and counters (the llm model's `engine_info`).
        With several servers: one's configuration, the counters summed over all that answer, and
        each one's own under `data_parallel`."""
        inputs = [_bool_input("engine_info", True)]
        if len(self._servers) == 1:
            return await self._llm_control(inputs, "engine_info", 30)
        answers = await self._llm_control_all(inputs, "engine_info", 30, with_url=True)
        info = {key: value for key, value in answers[0].items() if key != "url"}
        info["stats"] = _summed([meta.get("stats") or {} for meta in answers])
        info["data_parallel"] = [{"url": meta["url"], "stats": meta.get("stats") or {}} for meta in answers]
        return info

    async def _llm_control_all(self, inputs: list[InferInput], what: str, timeout: float, *, every: bool = False,
                               with_url: bool = False) -> list[dict[str, Any]]:
        """A control request to the llm model of every server: the answers of those that answer
        (each with its "url" when asked), in server order. A server that is unavailable is left
        out, unless `every` (or none answers): its error is raised then."""
        results = await asyncio.gather(*(self._llm_control(inputs, what, timeout, s) for s in self._servers),
                                       return_exceptions=True)
        answers, failures = [], []
        for server, result in zip(self._servers, results):
            if isinstance(result, BaseException):
                failures.append((server, result))
            else:
                answers.append({**result, "url": server.url} if with_url else result)
        for server, failure in failures:
            down = isinstance(failure, APIError) and failure.status_code == 503
            if every or not down or not answers:
                if len(self._servers) > 1 and isinstance(failure, APIError):
                    failure.message = f"{server.url}: {failure.message}"
                raise failure
            log.warning("%s request: Triton server %s did not answer: %s", what, server.url, failure)
        return answers

    async def _llm_control(self, inputs: list[InferInput], what: str, timeout: float,
                           server: Optional[_Server] = None) -> dict[str, Any]:
        """One control request to the llm model; its answer is the final response's meta_info."""
        meta = await self._llm_request(inputs, what, timeout, f"{what}.{uuid.uuid4().hex}", server)
        if meta is None:
            raise unavailable(f"the llm model sent no answer to the {what} request")
        return meta

    async def _llm_request(self, inputs: list[InferInput], what: str, timeout: float,
                           request_id: str, server: Optional[_Server] = None) -> Optional[dict[str, Any]]:
        """A one-response request to the llm model: its meta_info, or None when the final
        response carries none."""
        payload = {
            "model_name": self.abort_model or "llm",
            "inputs": inputs,
            "request_id": request_id,
            "parameters": {"triton_enable_empty_final_response": True},
        }

        async def one() -> AsyncIterator[dict[str, Any]]:
            yield payload

        answer: Optional[dict[str, Any]] = None
        responses = ResponseReader(self._get(server).stream_infer(one()))
        try:
            async with asyncio.timeout(timeout):
                async for result, error in responses:
                    if error is not None:
                        raise map_stream_error(error.message() if isinstance(error, InferenceServerException)
                                               else str(error))
                    meta = result.as_numpy("meta_info")
                    if meta is not None:
                        text = meta.reshape(-1)[0]
                        answer = json.loads(text.decode() if isinstance(text, bytes) else text)
                        break
                    if _is_final(result.get_response()):
                        break
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from None
        except TimeoutError:
            responses.close()
            raise unavailable(f"the llm model did not answer the {what} request") from None
        except BaseException:
            responses.close()
            raise
        await _until_the_call_ends(responses)
        return answer

    async def _abort(self, request_id: str, server: Optional[_Server] = None) -> None:
        """Ask the engine model to drop `request_id`.

        Triton propagates an ensemble's cancellation only to steps not yet scheduled, so the
        decoupled `llm` step already generating never sees it (sender.is_cancelled() stays
        False). With `abort_model` set, a cancelled stream is followed by a request to that
        model carrying only `abort_request_id` (the ensemble passes its request id to its steps).
        """
        try:
            await self._llm_request([_bytes_input("abort_request_id", request_id)], "abort", 10,
                                    f"abort.{request_id}", server)
        except (APIError, InferenceServerException) as exc:
            log.warning("abort of %s on %s failed: %s", request_id, (server or self._servers[0]).url, exc)


def _summed(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Engine counters of several servers added up (per-position lists position by position)."""
    total: dict[str, Any] = {}
    for one in stats:
        for key, value in one.items():
            if isinstance(value, (list, tuple)):
                have = total.get(key) or []
                total[key] = [(have[i] if i < len(have) else 0) + (value[i] if i < len(value) else 0)
                              for i in range(max(len(have), len(value)))]
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
            else:
                total.setdefault(key, value)
    return total

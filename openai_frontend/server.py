"""The FastAPI app: routes, auth, request ids and OpenAI-style errors.

`create_app(settings, client=None)` builds the app; `client` defaults to a `TritonLLMClient` on
`settings.triton_url` / `settings.triton_model` (tests pass a fake one).

Routes: POST /v1/chat/completions, /v1/completions, /v1/responses (and /v1/responses/{id}/cancel,
/v1/responses/input_tokens), /v1/conversations (and /{id}, /{id}/items), /generate,
/parse_function_call, /separate_reasoning, /tokenize, /detokenize, /load_lora_adapter,
/unload_lora_adapter (and their /v1/ forms, with --allow-runtime-lora-updating);
GET /v1/models, /v1/models/{id}, /v1/responses/{id} (and DELETE) and its /input_items,
/v1/conversations/{id} (and DELETE), its /items and /items/{item_id} (and DELETE), /health,
/get_model_info, /metrics, /openapi.json.

* Errors are OpenAI bodies `{"error": {"message", "type", "param", "code"}}`: 400 for invalid
  requests (FastAPI's 422 is turned into 400), 401 bad API key, 404 unknown model/route,
  413 body too large, 503 (+ Retry-After) when Triton is unreachable, the model not ready or the
  engine overloaded.
* `--api-key`: every route except /health and /metrics needs `Authorization: Bearer <key>`
  (hmac.compare_digest).
* `X-Request-Id`: echoed on every response; generated when absent; used in completion ids and
  in the Triton request id. As in vLLM, a client's header wins over the body's `request_id`.
* A client disconnect cancels the request's engine streams, before or during the response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_frontend.chat import ChatHandler
from openai_frontend.common import Context, error_event, json_response
from openai_frontend.completions import CompletionHandler
from openai_frontend.engine_types import EngineClient, EngineRequest
from openai_frontend.errors import APIError, bad_request, model_not_found, unavailable
from openai_frontend.generate import GenerateHandler
from openai_frontend.metrics import FrontendMetrics, SharedMetrics, endpoint_label
from openai_frontend.protocol import (
    ConversationCreateRequest,
    ConversationItemsRequest,
    ConversationUpdateRequest,
    EmbeddingRequest,
    ResponsesInputTokensRequest,
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    ParseFunctionCallRequest,
    ResponsesRequest,
    SeparateReasoningRequest,
    UnloadLoraAdapterRequest,
    TokenizeRequest,
)
from openai_frontend import request_context
from openai_frontend.reasoning import get_reasoning_format, split_reasoning
from openai_frontend.conversations import Conversations
from openai_frontend.embeddings import EmbeddingsHandler
from openai_frontend.response_store import ResponseStore
from openai_frontend.responses import ResponsesHandler
from openai_frontend.sampling import openai_param
from openai_frontend.settings import Settings
from openai_frontend.streams import DONE_EVENT, run_until_disconnect
from openai_frontend.tokenization import detokenize, tokenize
from openai_frontend.tokenizer import ModelFiles
from openai_frontend.validation_errors import validation_message
from openai_frontend.tools import get_parser, tools_as_dicts

log = logging.getLogger("openai_frontend")

PUBLIC_PATHS = frozenset({"/health", "/health_generate", "/ping", "/metrics"})


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body too large (limit {limit} bytes)")


def _bearer_key(auth: bytes) -> Optional[bytes]:
    """The key of an `Authorization: Bearer <key>` header, the scheme in any case and the spaces
    around the key not counted (RFC 7235); None for no header or another scheme."""
    scheme, _, key = auth.strip().partition(b" ")
    key = key.strip()
    return key if scheme.lower() == b"bearer" and key else None


def _api_key_error(auth: bytes) -> APIError:
    """OpenAI's three answers: no key, a header that is not Bearer auth, a wrong key."""
    if not auth.strip():
        return APIError(401, "You didn't provide an API key. Send it in an Authorization header with Bearer "
                        "auth (Authorization: Bearer YOUR_KEY).")
    if _bearer_key(auth) is None:
        return APIError(401, "The Authorization header must use Bearer auth: Authorization: Bearer YOUR_KEY.",
                        code="invalid_api_key")
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


class FrontDoorMiddleware:
    """Pure ASGI (no per-request task like BaseHTTPMiddleware, streaming untouched): request id,
    metrics, API key (constant-time comparison), request body size limit."""

    def __init__(self, app: ASGIApp, api_key: Optional[str], metrics: FrontendMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.metrics = metrics
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id: Optional[bytes] = None
        auth: bytes = b""
        length: Optional[bytes] = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value
            elif name == b"authorization":
                auth = value
            elif name == b"content-length":
                length = value
        state = scope.setdefault("state", {})
        if not request_id or len(request_id) > 256:
            request_id = uuid.uuid4().hex.encode()
        else:
            state["request_id_from_client"] = True
        rid_header = (b"x-request-id", request_id)
        state["request_id"] = request_id.decode("latin-1")
        request_context.bind(state)
        path = scope["path"]
        endpoint = endpoint_label(path)
        metrics = self.metrics
        metrics.request_started(endpoint)
        t0 = time.perf_counter()
        status = 500  # unless a response starts

        async def reply(code: int, err: APIError, extra: tuple = ()) -> None:
            nonlocal status
            status = code
            body = err.json().encode()
            await send({
                "type": "http.response.start",
                "status": code,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *extra,
                    rid_header,
                ],
            })
            await send({"type": "http.response.body", "body": body})

        try:
            # Constant-time on the key (a length differs at once, as with any compare_digest).
            if self.key is not None and path not in PUBLIC_PATHS \
                    and not hmac.compare_digest(_bearer_key(auth) or b"", self.key):
                await reply(401, _api_key_error(auth), ((b"www-authenticate", b"Bearer"),))
                return
            limit = self.max_body
            if length is not None:
                try:
                    too_large = int(length) > limit
                except ValueError:
                    too_large = False
                if too_large:
                    await reply(413, APIError(413, f"Request body too large (limit {limit} bytes)", param="body"))
                    return
            received = 0

            async def limited_receive() -> Message:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > limit:
                        raise BodyTooLarge(limit)
                return message

            started = complete = sse = False

            async def send_with_id(message: Message) -> None:
                nonlocal status, started, complete, sse
                if message["type"] == "http.response.start":
                    status, started = message["status"], True
                    sse = any(k == b"content-type" and v.startswith(b"text/event-stream")
                              for k, v in message.get("headers", []))
                    # The route may have taken the id from the body (`request_id`, `rid`).
                    rid = state["request_id"].encode("latin-1")
                    message["headers"] = [*message.get("headers", []), (b"x-request-id", rid)]
                elif message["type"] == "http.response.body" and not message.get("more_body", False):
                    complete = True
                await send(message)

            try:
                await self.app(scope, limited_receive, send_with_id)
            except asyncio.CancelledError:
                # uvicorn cancels what is still running when it stops for good (a second Ctrl-C,
                # --graceful-shutdown-timeout run out); its own answer was a plain-text 500, or a
                # stream cut off without a word. The streams' aborts went out as they unwound.
                err = unavailable("the server is shutting down")
                if not started:
                    await reply(503, err, ((b"retry-after", b"1"), (b"connection", b"close")))
                elif sse and not complete:
                    await send({"type": "http.response.body", "body": error_event(err) + DONE_EVENT})
                else:
                    raise
            except Exception as exc:
                # Answered here, not by an exception handler: Starlette's outermost middleware
                # re-raises after sending a handler's 500, and uvicorn then drops the connection, so
                # a pooled client's next request on it failed (QA: ECONNRESET).
                if started:  # a response went out: only the log is left to do
                    log.exception("unhandled error on %s after its response started (request %s)", path,
                                  request_context.request_id())
                    if not complete:
                        raise  # half a response: the connection cannot be reused
                    return
                log.exception("unhandled error on %s (request %s)", path, request_context.request_id())
                await reply(500, APIError(500, f"Internal server error: {exc}"))
        finally:
            metrics.request_finished(endpoint, status, time.perf_counter() - t0)




def _request_id(request: Request, *body_ids: Optional[str], body_first: bool = False) -> str:
    """The client's X-Request-Id header, else the body's id, else the generated one (vLLM's
    order); `body_first` (/generate): the body's id before the header, as SGLang's rid names the
    request, its abort and its duplicate check."""
    state = request.scope.get("state", {})
    from_header = bool(state.get("request_id_from_client"))
    if body_first or not from_header:
        for rid in body_ids:
            if rid:
                if not from_header and rid.isascii() and rid.isprintable() and len(rid) <= 256:
                    state["request_id"] = rid  # echoed in the response header
                return rid
    return state.get("request_id") or uuid.uuid4().hex


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run a handler, cancelling it (and so its engine streams) if the client goes away before
    the response starts. Once a stream has started, SSEResponse does the same."""
    disconnected, response = await run_until_disconnect(request.receive, work)
    if disconnected:
        log.info("client disconnected before the response started; request %s cancelled",
                 request_context.request_id())
        return Response(status_code=499)
    return response


def create_app(settings: Settings, client: Optional[EngineClient] = None) -> FastAPI:
    if settings.tool_call_parser:
        get_parser(settings.tool_call_parser)  # an unknown name fails here, not on the first request
    if settings.reasoning_parser:
        get_reasoning_format(settings.reasoning_parser)
    settings.check_lora_modules()  # ValueError: an adapter named as the served model, or twice
    owns_client = client is None
    if client is None:
        from openai_frontend.triton_client import TritonLLMClient

        client = TritonLLMClient(
            settings.triton_urls, settings.triton_model,
            stream_timeout=settings.stream_timeout, abort_model=settings.abort_model,
            frontend_id=settings.frontend_id, serves_frontend=True, router=settings.router_config(),
            router_memory_path=settings.router_memory_path,
        )
    ctx = Context(settings=settings, client=client, files=ModelFiles(settings.tokenizer_path))
    created = int(time.time())

    shared = SharedMetrics(ctx.metrics, settings.metrics_dir) if settings.metrics_dir else None

    def client_counts() -> dict[str, Any]:
        """The engine client's own counts for /metrics (TritonLLMClient has them; fakes do not)."""
        servers = getattr(ctx.client, "server_counts", None)
        return {"out_of_order": getattr(ctx.client, "out_of_order_responses", None),
                "servers": servers() if servers is not None else None}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        publisher = asyncio.ensure_future(shared.run(client_counts)) if shared else None
        yield
        await responses.runs.close()
        if publisher is not None:
            publisher.cancel()
            shared.publish(**client_counts())
        if owns_client:
            await client.close()

    app = FastAPI(title="triton-llm OpenAI frontend", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(
        FrontDoorMiddleware, api_key=settings.api_key, metrics=ctx.metrics, max_body_bytes=settings.max_body_bytes
    )

    chat = ChatHandler(ctx)
    def store(name: str, size: int, max_mb: int) -> ResponseStore:
        return ResponseStore(size, os.path.join(settings.metrics_dir, name) if settings.metrics_dir else None,
                             max_bytes=max_mb << 20)

    responses = ResponsesHandler(
        ctx, chat, store("responses", settings.responses_store_size, settings.responses_store_max_mb),
        Conversations(store("conversations", settings.conversations_store_size, settings.conversations_store_max_mb)))
    completions = CompletionHandler(ctx)
    embeddings = EmbeddingsHandler(ctx)
    generate = GenerateHandler(ctx)

    # -- errors ------------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        headers = exc.headers
        if headers and "Retry-After" in headers:
            headers = {**headers, "Retry-After": str(settings.retry_after_s)}
        if exc.status_code >= 500:  # the server's side (Triton unreachable, an engine failure): once a request
            log.warning("%s %s: %d %s (request %s)", request.method, request.url.path, exc.status_code, exc.message,
                        request_context.request_id())
        return json_response(exc.body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param = validation_message(exc.errors())
        content_type = request.headers.get("content-type", "")
        if param is None and "json" not in content_type.lower() and await request.body():
            # FastAPI reads the body as JSON only when it is declared so; `curl -d` declares a form,
            # and a client may declare nothing (QA: it got pydantic's words about a dictionary).
            declared = f"'{content_type}'" if content_type else "no Content-Type"
            message = (f"The request body must be a JSON object sent with 'Content-Type: application/json' "
                       f"(this request declared {declared})")
        return json_response(bad_request(message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"Unknown route: {request.method} {request.url.path}"
        # The size check of a body sent without a length (chunked) names it as the up-front one does.
        err = APIError(exc.status_code, message, param="body" if isinstance(exc, BodyTooLarge) else None)
        return json_response(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    # -- models and health -------------------------------------------------------------------

    def model_card(max_len: Optional[int]) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": ctx.model_name,
            "object": "model",
            "created": created,
            "owned_by": "triton-llm",
            "root": settings.tokenizer_path or settings.triton_model,
            "parent": None,
        }
        if max_len is not None:
            card["max_model_len"] = max_len
        return card

    def adapter_card(name: str) -> dict[str, Any]:
        # vLLM lists a LoRA adapter as a model whose parent is the base model.
        return {"id": name, "object": "model", "created": created, "owned_by": "triton-llm", "root": name,
                "parent": ctx.model_name}

    @app.get("/v1/models")
    async def list_models() -> Response:
        await ctx.refresh_adapters()
        cards = [model_card(await ctx.max_model_len())] + [adapter_card(n) for n in ctx.adapter_names()]
        return json_response({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        await ctx.refresh_adapters(model_id, verify=True)
        if model_id in ctx.adapter_names():
            return json_response(adapter_card(model_id))
        if model_id not in ctx.settings.model_aliases:  # the names requests may give it
            raise model_not_found(model_id)
        return json_response(model_card(await ctx.max_model_len()))

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name for the same check
    @app.post("/ping")
    async def health() -> Response:
        if await ctx.client.is_ready():
            return Response(status_code=200)
        if problem := getattr(ctx.client, "contract_error", None):  # ready, but not a model this frontend can call
            raise APIError(500, problem)
        why = getattr(ctx.client, "not_ready_reason", None)
        reason = await why() if why is not None else None
        raise unavailable(f"Triton model '{settings.triton_model}' at {settings.triton_url} is not ready"
                          + (f": {reason}" if reason else ""))

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """SGLang's: 200 once one token went through the whole path (ensemble and engine). With
        several tritonservers each is probed at once, as routing would hide one that no longer
        generates behind the others: 200 while any does (requests are served through it), with
        each one's result in the body; 503 when none does."""
        rid = _request_id(request)
        urls = getattr(ctx.client, "server_urls", None) or []

        async def one_token(index: Optional[int]) -> Optional[str]:
            probe = EngineRequest(sampling_params={"max_new_tokens": 1, "temperature": 0}, input_ids=[0],
                                  request_id=f"health-{rid}" + (f"-{index}" if index is not None else ""), stream=False)

            async def drain() -> None:
                async for _ in ctx.client.generate(probe) if index is None else ctx.client.generate_at(index, probe):
                    pass

            try:
                await asyncio.wait_for(drain(), settings.health_generate_timeout)
            except APIError as exc:
                return exc.message
            except TimeoutError:
                return "no answer in time"
            return None

        if len(urls) < 2:
            if reason := await one_token(None):
                raise unavailable(f"the engine did not generate a token: {reason}")
            return Response(status_code=200)
        reasons = await asyncio.gather(*(one_token(i) for i in range(len(urls))))
        if all(reasons):
            raise unavailable("no server generated a token: " + "; ".join(f"{u}: {r}" for u, r in zip(urls, reasons)))
        return json_response({"servers": {u: r or "ok" for u, r in zip(urls, reasons)}})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = (shared or ctx.metrics).render(**client_counts())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> Response:
        """SGLang's (both its names): how this server runs. The frontend's settings (no secrets)
        and the engine's effective configuration ("auto" resolved: KV blocks, context length,
        device, dtype) with its counters; and SGLang's `internal_states`, whose
        `avg_spec_accept_length` (once drafts were verified: tokens per verifying step) SGLang's
        benchmarks read."""
        frontend = {k: v for k, v in dataclasses.asdict(settings).items() if k != "api_key"}
        frontend["served_model_name"] = ctx.model_name
        engine = await ctx.client.engine_info()
        state: dict[str, Any] = {}
        stats = engine.get("stats") or {}
        if stats.get("spec_drafts_total"):
            state["avg_spec_accept_length"] = 1 + stats["spec_accepted_tokens_total"] / stats["spec_drafts_total"]
        return json_response({"frontend": frontend, "engine": engine, "internal_states": [state]})

    @app.get("/get_model_info")
    async def model_info() -> Response:
        return json_response({
            "model_path": settings.tokenizer_path or ctx.model_name,
            "tokenizer_path": settings.tokenizer_path,
            "is_generation": True,
            "served_model_name": ctx.model_name,
        })

    # -- generation --------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        try:
            return await cancel_on_disconnect(request, chat(body, _request_id(request, body.request_id, body.rid)))
        except APIError as exc:
            raise openai_param(exc, body) from None

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, responses(body, _request_id(request, body.request_id)))

    @app.post("/v1/responses/input_tokens")
    async def count_input_tokens(body: ResponsesInputTokensRequest) -> Response:
        return await responses.input_tokens(body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        return responses.retrieve(response_id, request.query_params)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> Response:
        return responses.list_input_items(response_id, request.query_params)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return await responses.cancel(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return await responses.delete(response_id)

    conversations = responses.conversations

    @app.post("/v1/conversations")
    async def create_conversation(body: ConversationCreateRequest) -> Response:
        return json_response(conversations.create(body.items, body.metadata))

    @app.get("/v1/conversations/{conversation_id}")
    async def get_conversation(conversation_id: str) -> Response:
        return json_response(conversations.retrieve(conversation_id))

    @app.post("/v1/conversations/{conversation_id}")
    async def update_conversation(conversation_id: str, body: ConversationUpdateRequest) -> Response:
        return json_response(conversations.update(conversation_id, body.metadata))

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str) -> Response:
        return json_response(conversations.delete(conversation_id))

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_conversation_items(conversation_id: str, body: ConversationItemsRequest,
                                     request: Request) -> Response:
        return json_response(conversations.add_items(conversation_id, body.items, request.query_params))

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_conversation_items(conversation_id: str, request: Request) -> Response:
        return json_response(conversations.list_items(conversation_id, request.query_params))

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_conversation_item(conversation_id: str, item_id: str, request: Request) -> Response:
        return json_response(conversations.item(conversation_id, item_id, request.query_params))

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_conversation_item(conversation_id: str, item_id: str) -> Response:
        return json_response(conversations.delete_item(conversation_id, item_id))

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await cancel_on_disconnect(request, embeddings(body, _request_id(request)))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        try:
            return await cancel_on_disconnect(
                request, completions(body, _request_id(request, body.request_id, body.rid))
            )
        except APIError as exc:
            raise openai_param(exc, body) from None

    @app.post("/generate")
    async def generate_route(body: GenerateRequest, request: Request) -> Response:
        # One string rid names the request as the body's request_id does on the OpenAI routes (a
        # batch's list of rids names its prompts one by one).
        rid = body.rid if isinstance(body.rid, str) else None
        try:
            return await cancel_on_disconnect(request, generate(body, _request_id(request, rid, body_first=True)))
        except APIError as exc:
            if exc.param == "input_ids" and body.input_ids is None:
                # the engine's name for the prompt, which this request gave as text or embeddings
                exc.param = "text" if body.text is not None else "input_embeds"
            raise

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> Response:
        return json_response(await tokenize(ctx, body))

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> Response:
        return json_response(await detokenize(ctx, body))

    @app.post("/parse_function_call")
    async def parse_function_call(body: ParseFunctionCallRequest) -> Response:
        name = body.tool_call_parser or settings.tool_call_parser
        if not name:
            raise bad_request("tool_call_parser is required (the server has no --tool-call-parser)", param="tool_call_parser")
        parser = get_parser(name)
        result = parser.detect_and_parse(body.text, tools_as_dicts(body.tools))
        calls = [
            {"tool_index": c.tool_index, "name": c.name, "parameters": c.parameters}
            for c in result.calls
        ]
        return json_response({"normal_text": result.normal_text, "calls": calls})

    async def lora_update(command: dict[str, Any]) -> dict[str, str]:
        if not settings.allow_runtime_lora_updating:
            raise bad_request("runtime LoRA updating is disabled (start the frontend with "
                              "--allow-runtime-lora-updating)", param="lora_name")
        if command["op"] == "load":
            # The base model's names stay the base model's: an adapter named so would hide it.
            error = settings.lora_name_error(command["name"], ctx.adapter_names())
            if error:
                raise bad_request(error, param="lora_name")
        try:
            loaded = await ctx.client.lora_update(command)
        except APIError as exc:
            if exc.param == "lora_path" and exc.message.endswith("is already loaded"):
                # The name is at fault, as where this worker's own list knew it (QA: the param
                # depended on which worker answered).
                exc.param = "lora_name"
            raise
        ctx.set_runtime_adapters(loaded)
        return loaded

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        loaded = await lora_update({"op": "load", "name": body.lora_name, "path": body.lora_path})
        return json_response({"success": True, "error_message": "", "loaded_adapters": loaded})

    async def lora_unload(name: str, not_found_status: int) -> dict[str, str]:
        try:
            return await lora_update({"op": "unload", "name": name})
        except APIError as exc:
            if exc.status_code != 400 or not exc.message.endswith("is not loaded"):
                raise
            # vLLM answers 404 "The lora adapter 'x' cannot be found."; SGLang a 400. Either way
            # the field at fault is the name the request sent.
            message = f"The lora adapter '{name}' cannot be found." if not_found_status == 404 else exc.message
            raise APIError(not_found_status, message, param="lora_name") from None

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        loaded = await lora_unload(body.lora_name, 400)
        return json_response({"success": True, "error_message": "", "loaded_adapters": loaded})

    @app.post("/v1/load_lora_adapter")
    async def v1_load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        await lora_update({"op": "load", "name": body.lora_name, "path": body.lora_path})
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def v1_unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        await lora_unload(body.lora_name, 404)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/abort_request", operation_id="abort_request_post")
    @app.put("/abort_request", operation_id="abort_request_put")
    async def abort_request(body: AbortRequest) -> Response:
        """SGLang's: the named request (or all of this frontend's) ends now with finish_reason
        "abort", keeping what it generated; an id with nothing in flight is not an error."""
        if not body.rid and not body.abort_all:
            raise bad_request("give the request's rid, or abort_all: true", param="rid")
        aborted = await ctx.client.abort_requests(body.rid or None, body.abort_all)
        return json_response({"aborted": aborted})

    @app.get("/flush_cache", operation_id="flush_cache_get")
    @app.post("/flush_cache", operation_id="flush_cache_post")
    async def flush_cache() -> Response:
        """SGLang's: forget the prefix cache (blocks running requests hold stay until they end)."""
        forgotten = await ctx.client.reset_prefix_cache()
        return Response(f"Cache flushed: {forgotten} cached KV blocks forgotten.\n", media_type="text/plain")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's (its dev-mode route): the same as /flush_cache."""
        await ctx.client.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/separate_reasoning")
    async def separate_reasoning(body: SeparateReasoningRequest) -> Response:
        name = body.reasoning_parser or settings.reasoning_parser
        if not name:
            raise bad_request("reasoning_parser is required (the server has no --reasoning-parser)",
                              param="reasoning_parser")
        try:
            fmt = get_reasoning_format(name)
        except ValueError as exc:
            raise bad_request(str(exc), param="reasoning_parser") from None
        reasoning, text = split_reasoning(fmt, body.text)
        return json_response({"text": text, "reasoning_text": reasoning or ""})

    return app


SETTINGS_ENV = "OPENAI_FRONTEND_SETTINGS"
# The uvicorn supervisor's pid, for its workers (_exit_with_supervisor).
SUPERVISOR_ENV = "OPENAI_FRONTEND_SUPERVISOR_PID"


def freeze_startup_heap() -> None:
    """Freeze the objects start-up made (imports, the app, the tokenizer: ~250k) so the garbage
    collector's full passes stop walking them: each took 100-160 ms on 2 cores, a stall of every
    stream on the event loop. Only for a process that serves until it exits (a frozen object is
    never collected). LLM_GC_FREEZE=0 turns it off. The engine's processes do the same
    (backend/gc_freeze.py); the frontend does not import the engine."""
    import gc
    import os

    if os.environ.get("LLM_GC_FREEZE", "1") != "0":
        gc.collect()
        gc.freeze()


def app_from_env() -> FastAPI:
    """App factory for multi-worker uvicorn: settings come as JSON in $OPENAI_FRONTEND_SETTINGS."""
    from openai_frontend import forced_exit

    app = create_app(Settings(**json.loads(os.environ[SETTINGS_ENV])))
    forced_exit.install()  # in this worker: its server is uvicorn's, made in this process
    _exit_with_supervisor()
    freeze_startup_heap()  # each worker serves until it exits
    return app


def _exit_with_supervisor(interval: float = 1.0) -> None:
    """A worker stops (gracefully, SIGTERM) once the uvicorn process that started it is gone.

    uvicorn's workers do not notice their supervisor's death: killed outright (SIGKILL, the OOM
    killer), it leaves them serving on the port it bound, so a restarted frontend cannot bind
    it and the orphans run with nobody to stop them. The supervisor's pid comes from the
    environment, not getppid() here: a worker still starting when its supervisor died would
    take its new parent (init) for the supervisor and never stop."""
    import os
    import signal
    import threading
    import time

    parent = int(os.environ.get(SUPERVISOR_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="frontend-supervisor-watch", daemon=True).start()

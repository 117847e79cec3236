"""POST /v1/responses: OpenAI's Responses API, served by the chat route.

A Responses request becomes a chat request (instructions as the system message, input items as
messages, function tools, `text.format` as `response_format`, `reasoning.effort` as the
template's `reasoning_effort`) and runs through `ChatHandler`, so tool calls, reasoning,
structured output and logprobs behave as they do there. Its answer comes back as output items:
a `reasoning` item (with --reasoning-parser), a `message` with one `output_text` part, then a
`function_call` item per call. Both modes run the chat route's stream through one translation
(`_Turn`): streaming sends its Responses events as they come, non-streaming returns the
response they end with, so both give the same items.

`store` (true unless false) keeps the response and its turn (`ResponseStore`) for
GET /v1/responses/{id} and for `previous_response_id`, whose conversation (the chain of its
turns) the new input continues (its instructions are not carried over, as OpenAI's are not).
`background` runs the turn in a task of its own (`background.py`), with GET, replay of its
stream and cancel from any frontend worker. `conversation` reads a conversation's items as the
history instead, and adds the turn to it once it has finished (`conversations.py`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional

from pydantic import ValidationError
from starlette.responses import Response

from openai_frontend.background import FINAL, BackgroundRuns
from openai_frontend.chat import ChatHandler
from openai_frontend.common import Context, ErrorEvent, dumps, error_event, json_response
from openai_frontend.conversations import Conversations
from openai_frontend.errors import APIError, bad_request, unsupported
from openai_frontend.protocol import (ChatCompletionRequest, ResponsesInputTokensRequest, ResponsesReasoning,
                                      ResponsesRequest, ResponsesText)
from openai_frontend.response_items import (OutputBuilder, input_items, input_messages, list_items, new_id,
                                            output_messages, snapshot)
from openai_frontend.response_store import ResponseStore
from openai_frontend.sampling import DEFAULT_VERBOSITY
from openai_frontend.streams import sse_response
from openai_frontend.truncation import truncated
from openai_frontend.validation_errors import validation_message

# Chat's names for what the request called otherwise: its errors are reported under the
# Responses names.
_PARAM_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "reasoning_effort": "reasoning.effort", "logprobs": "top_logprobs"}
_REFUSED = ("prompt", "context_management", "access_programs", "background_options",
            "image", "moderation", "prompt_cache_options")
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_REASONING_INCLUDE = "reasoning.encrypted_content"
_INCLUDES = (_LOGPROBS_INCLUDE, _REASONING_INCLUDE)


# -- request: Responses -> chat ------------------------------------------------------------------


_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")
# Function-tool fields of OpenAI's that change nothing when left at their default, and that this
# server does not implement otherwise (tool search, programmatic callers, async calls, a schema
# of what the tool returns).
_FUNCTION_DEFAULTS = {"defer_loading": False, "async": False, "allowed_callers": ["direct"], "output_schema": None}


_KIND_NAMES = {str: "a string", dict: "an object", bool: "a boolean"}


@dataclass
class ToolSet:
    """A request's tools in the chat shape, and what the answer needs to know of them."""

    chat: list[dict[str, Any]] = field(default_factory=list)
    namespaces: dict[str, str] = field(default_factory=dict)  # function name -> its namespace tool's name
    defaulted: list[int] = field(default_factory=list)  # chat tools whose `strict` was left out

    def without_default_strict(self) -> list[dict[str, Any]]:
        """The tools with every left-out `strict` false: OpenAI's fallback for a schema that
        strict mode cannot take."""
        return [{"type": "function", "function": {**t["function"], "strict": False}} if i in self.defaulted else t
                for i, t in enumerate(self.chat)]


def _function_tool(tool: dict[str, Any], where: str, tools: ToolSet) -> None:
    for key in sorted(set(tool) - {"type", *_FUNCTION_FIELDS}):
        if key not in _FUNCTION_DEFAULTS:
            raise bad_request(f"{where}: unknown field '{key}'", param=f"{where}.{key}")
        if tool[key] != _FUNCTION_DEFAULTS[key]:
            raise unsupported(f"{where}.{key}")
    for key, kinds in (("name", str), ("description", str), ("parameters", dict), ("strict", bool)):
        if not isinstance(tool.get(key), kinds) and (key == "name" or tool.get(key) is not None):
            raise bad_request(f"{where}.{key} must be {_KIND_NAMES[kinds]}", param=f"{where}.{key}")
    fn = {k: tool[k] for k in _FUNCTION_FIELDS if tool.get(k) is not None}
    if any(t["function"].get("name") == fn.get("name") for t in tools.chat):
        raise bad_request(f"{where}: a function named '{fn.get('name')}' is declared twice", param=f"{where}.name")
    if "strict" not in fn:
        tools.defaulted.append(len(tools.chat))
        fn["strict"] = True
    tools.chat.append({"type": "function", "function": fn})


def chat_tools(tools: Optional[list[dict[str, Any]]]) -> ToolSet:
    """Function tools, and the functions of namespace tools (Codex's), in the chat shape. Left
    out, `strict` is true, as in OpenAI's Responses API (a call's arguments are held to its
    schema, as a strict tool's on the chat route), with OpenAI's fallback to non-strict when the
    schema cannot be enforced (ResponsesHandler)."""
    out = ToolSet()
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind == "function":
            _function_tool(tool, f"tools[{i}]", out)
        elif kind == "namespace":
            if not isinstance(tool.get("name"), str) or not isinstance(tool.get("tools"), list):
                raise bad_request(f"tools[{i}]: a namespace needs a name and its tools", param=f"tools[{i}]")
            for j, inner in enumerate(tool["tools"]):
                where = f"tools[{i}].tools[{j}]"
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    raise unsupported(f"{where}.type", "a namespace's tools must be function tools here")
                _function_tool(inner, where, out)
                out.namespaces[inner.get("name")] = tool["name"]
        else:
            raise unsupported(f"tools[{i}].type", f"'{kind}' tools are not supported: this server calls "
                                                  "function tools, which the client runs")
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise unsupported("tool_choice", "a function ({\"type\": \"function\", \"name\": ...}), 'auto', 'none' or "
                                     "'required'; hosted and allowed-tools choices are not supported")


def _response_format(text: Optional[ResponsesText]) -> Optional[dict[str, Any]]:
    if text is None:
        return None
    if text.verbosity not in (None, DEFAULT_VERBOSITY):
        raise unsupported("text.verbosity", f"only '{DEFAULT_VERBOSITY}' (the model as trained); the length is "
                                            "set by max_output_tokens here")
    fmt = text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude_none=True, exclude={"type"})}


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]
                 ) -> tuple[dict[str, Any], list[dict[str, Any]], ToolSet]:
    """The chat request body for `req` after `history` (a stored conversation's messages), the
    turn's own input as messages (the instructions left out: they are not carried over), and
    its tools."""
    for name in _REFUSED:
        if getattr(req, name) is not None:
            raise unsupported(name)
    for k, value in enumerate(req.include or []):
        if value not in _INCLUDES:
            raise unsupported(f"include[{k}]", f"'{value}' (only {', '.join(repr(v) for v in _INCLUDES)})")
    reasoning = req.reasoning or ResponsesReasoning()
    for key in ("summary", "generate_summary"):
        if getattr(reasoning, key) is not None:
            raise unsupported(f"reasoning.{key}", "the reasoning comes back as it is, in the reasoning item's content")
    turn = input_messages(req.input)
    tools = chat_tools(req.tools)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + history + turn
    logprobs = _LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "tools": tools.chat or None, "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
        "reasoning_effort": reasoning.effort,
        "logprobs": logprobs, "top_logprobs": req.top_logprobs if logprobs else None,
        "user": req.user, "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention, "service_tier": req.service_tier,
    }
    return {k: v for k, v in body.items() if v is not None}, turn, tools


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request, or a 400 as the route's own validation words it, under the Responses names."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        errors = [{**e, "loc": (_PARAM_NAMES.get(e["loc"][0], e["loc"][0]), *e["loc"][1:])} if e.get("loc") else e
                  for e in exc.errors()]
        message, param = validation_message(errors)
        raise bad_request(message, param=param) from None


# -- the handler ------------------------------------------------------------------------------


def _about_a_schema(exc: APIError) -> bool:
    """Whether a refusal is about a schema the grammar cannot take (a strict tool's)."""
    text = exc.message.lower()
    return (exc.param or "").startswith("tools") or "schema" in text or "grammar" in text


class _Turn:
    """One response made from a chat stream: the Responses events, in order, then the response."""

    def __init__(self, handler: "ResponsesHandler", req: ResponsesRequest, model: str, logprobs: bool,
                 turn_input: list[dict[str, Any]], namespaces: dict[str, str]) -> None:
        self.handler = handler
        self.req = req
        self.model = model
        self.input = turn_input  # this turn's input as chat messages (stored with its answer)
        self.id = new_id("resp")
        self.input_items = input_items(req.input)  # with ids, kept from the first record on
        self.conversation = _conversation_id(req.conversation)
        self.created = time.time()
        self.builder = OutputBuilder(logprobs, namespaces, _REASONING_INCLUDE in (req.include or []))
        self.response: Optional[dict[str, Any]] = None
        self.error: Optional[APIError] = None

    def snapshot(self, status: str, usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return self.handler.response_object(self, status, usage)

    def record(self, response: dict[str, Any]) -> None:
        self.handler.record(self, response)

    async def events(self, chat_events: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
        builder = self.builder
        # A background response is queued until the engine's first token; a foreground one has
        # waited for that token before its answer began.
        queued = bool(self.req.background)
        started = self.snapshot("queued" if queued else "in_progress")
        yield {"type": "response.created", "response": started}
        yield {"type": "response.queued" if queued else "response.in_progress", "response": started}
        incomplete = False
        usage = None
        try:
            async for raw in chat_events:
                for line in raw.decode().splitlines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if queued and "error" not in chunk:
                        queued = False
                        yield {"type": "response.in_progress", "response": self.snapshot("in_progress")}
                    if "error" in chunk:
                        err = chunk["error"]
                        # The chat stream's error events are ErrorEvents: the error with its status
                        # (a 504's, say) and headers, for a non-streaming answer to raise.
                        self.error = raw.error if isinstance(raw, ErrorEvent) else APIError(500, err.get("message", ""))
                        yield {"type": "error", "code": err.get("code"), "message": err.get("message", ""),
                               "param": err.get("param")}
                        failed = self.snapshot("failed")
                        failed["error"] = {"code": err.get("code") or "server_error", "message": err.get("message", "")}
                        yield {"type": "response.failed", "response": failed}
                        return
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        lps = (choice.get("logprobs") or {}).get("content")
                        if delta.get("reasoning_content"):
                            for e in builder.reasoning(delta["reasoning_content"]):
                                yield e
                        if delta.get("content"):
                            for e in builder.text(delta["content"], lps):
                                yield e
                        elif lps and not delta.get("reasoning_content") and not delta.get("tool_calls"):
                            builder.hold_logprobs(lps)
                        for call in delta.get("tool_calls") or ():
                            for e in builder.tool_call(call):
                                yield e
                        if choice.get("finish_reason"):
                            incomplete = choice["finish_reason"] == "length"
        finally:
            await chat_events.aclose()  # type: ignore[attr-defined]
        for e in builder.finish(incomplete):
            yield e
        self.response = self.snapshot("incomplete" if incomplete else "completed", usage)
        self.record(self.response)
        if self.conversation is not None:
            self.handler.conversations.append(self.conversation, self.input_items + self.response["output"])
        yield {"type": "response.incomplete" if incomplete else "response.completed", "response": self.response}


class ResponsesHandler:
    def __init__(self, ctx: Context, chat: ChatHandler, store: ResponseStore, conversations: Conversations) -> None:
        self.ctx = ctx
        self.chat = chat
        self.store = store
        self.runs = BackgroundRuns(store)
        self.conversations = conversations

    async def __call__(self, req: ResponsesRequest, request_id: str) -> Response:
        if req.stream_options is not None and req.stream_options.include_obfuscation:
            raise unsupported("stream_options.include_obfuscation", "this server does not pad its stream events")
        if req.background and not self._stores(req):
            raise bad_request("A background response must be stored: it is read back with GET /v1/responses/{id}"
                              + (" (store is false)" if req.store is False
                                 else " (this server keeps no responses: --responses-store-size 0)"),
                              param="store" if req.store is False else "background")
        body, turn_input, tools = chat_request(req, self._history(req))
        chat_req = _validated(body)
        turn = _Turn(self, req, chat_req.model or self.ctx.model_name, bool(chat_req.logprobs), turn_input,
                     tools.namespaces)
        if req.background:
            # The POST does not wait for the engine: what fails from here on fails the response.
            turn.record(turn.snapshot("queued"))
            start = lambda: self._start(body, chat_req, tools, request_id, req)  # noqa: E731
            self.runs.start(turn, turn.events(_started_later(start)), streamed=bool(req.stream))
            if req.stream:
                return sse_response(_sse(self.runs.follow(turn.id, -1)), hooks=self.ctx.stream_hooks)
            return json_response(self.runs.view(self.store.get(turn.id) or {"response": turn.snapshot("queued")}))
        events = turn.events((await self._start(body, chat_req, tools, request_id, req)).body)
        if req.stream:
            return sse_response(_sse(events), hooks=self.ctx.stream_hooks)
        try:
            async for _ in events:
                pass
        finally:
            await events.aclose()
        if turn.error is not None:
            raise turn.error
        return json_response(turn.response)

    async def input_tokens(self, count_req: ResponsesInputTokensRequest) -> Response:
        """POST /v1/responses/input_tokens: the tokens the request's prompt would be (after
        truncation "auto"), as the preprocessing model renders it for generation."""
        if count_req.personality is not None:
            raise unsupported("personality", "this server has no personalities; instructions say how to answer")
        req = ResponsesRequest(**{name: getattr(count_req, name) for name in count_req.model_fields_set
                                  if name != "personality"})
        body, _, _ = chat_request(req, self._history(req))
        count = await self.chat.prompt_tokens(_validated(body))
        context = await self.ctx.max_model_len() if req.truncation == "auto" else None
        if context is not None and count >= context:
            messages = await self._fitted(body, context - 1)
            if messages is not None:
                count = await self._prompt_tokens(body, messages)
        return json_response({"object": "response.input_tokens", "input_tokens": count})

    def _history(self, req: ResponsesRequest) -> list[dict[str, Any]]:
        """The messages the request continues: its conversation's, or its previous response's chain."""
        conversation = _conversation_id(req.conversation)
        if conversation is not None and req.previous_response_id is not None:
            raise bad_request("conversation and previous_response_id cannot be used together: a response "
                              "continues one or the other", param="conversation")
        if conversation is not None:
            return self.conversations.history(conversation)
        if req.previous_response_id is None:
            return []
        previous_response_id = req.previous_response_id
        record = self.store.get(previous_response_id)
        if record is not None and self.runs.view(record)["status"] in ("queued", "in_progress"):
            raise bad_request(f"Previous response with id '{previous_response_id}' has not finished yet: a "
                              "conversation continues from a finished response", param="previous_response_id")
        stored = self.store.chain(previous_response_id) if record is not None else None
        if stored is None:
            raise bad_request(f"Previous response with id '{previous_response_id}' not found (or a turn "
                              "of its conversation is no longer stored)",
                              param="previous_response_id", code="previous_response_not_found")
        return stored

    async def _start(self, body: dict[str, Any], chat_req: ChatCompletionRequest, tools: ToolSet,
                     request_id: str, req: ResponsesRequest) -> Any:
        """The chat route's streamed answer (the chat route streams either way: one path from chat
        chunks to items makes both modes' items alike); with truncation "auto", from a history
        cut to fit when the whole one does not."""
        try:
            return await self._start_strict(body, chat_req, tools, request_id, req)
        except APIError as exc:
            if req.truncation != "auto" or exc.code != "context_length_exceeded":
                raise
            context = await self.ctx.max_model_len()
            if context is None:
                raise
            messages = await self._fitted(body, context - (req.max_output_tokens or 1))
            if messages is None:
                raise
        body["messages"] = messages
        return await self._start_strict(body, _validated(body), tools, request_id, req)

    def _prompt_tokens(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> Awaitable[int]:
        return self.chat.prompt_tokens(_validated({**body, "messages": messages}))

    async def _fitted(self, body: dict[str, Any], limit: int) -> Optional[list[dict[str, Any]]]:
        """truncation "auto": the body's messages cut to a prompt of at most `limit` tokens."""
        return await truncated(body["messages"], lambda messages: self._prompt_tokens(body, messages), limit)

    async def _start_strict(self, body: dict[str, Any], chat_req: ChatCompletionRequest, tools: ToolSet,
                            request_id: str, req: ResponsesRequest) -> Any:
        try:
            return await self._chat(chat_req, request_id, req)
        except APIError as exc:
            if not (exc.status_code == 400 and tools.defaulted and _about_a_schema(exc)):
                raise
        # OpenAI's rule for a tool that leaves `strict` out: strict where the schema allows it,
        # else not.
        body["tools"] = tools.without_default_strict()
        return await self._chat(_validated(body), request_id, req)

    # -- stored responses: GET, input items, cancel, DELETE -------------------------------------

    def stored(self, response_id: str) -> dict[str, Any]:
        record = self.store.get(response_id)
        if record is None:
            raise APIError(404, f"Response with id '{response_id}' not found", param="response_id",
                           code="response_not_found")
        return record

    def retrieve(self, response_id: str, query: Mapping[str, str]) -> Response:
        """The response as it stands, or (stream=true) a background one's events after
        `starting_after`, then each as it comes."""
        _known_query(query, ("stream", "starting_after", "include_obfuscation"))
        if query.get("include_obfuscation", "false") != "false":
            raise unsupported("include_obfuscation", "this server does not pad its stream events")
        stream = query.get("stream", "false")
        if stream not in ("true", "false"):
            raise bad_request("stream must be 'true' or 'false'", param="stream")
        record = self.stored(response_id)
        if stream == "false":
            if "starting_after" in query:
                raise bad_request("starting_after goes with stream=true", param="starting_after")
            return json_response(self.runs.view(record))
        after = _int_or_none(query.get("starting_after", "-1"))
        if after is None or after < -1:
            raise bad_request("starting_after must be an event's sequence number (an integer, 0 or more)",
                              param="starting_after")
        if self.store.events(response_id) is None:
            raise bad_request(f"Response with id '{response_id}' has no stream to replay: only one created with "
                              "background and stream true keeps its events", param="stream")
        return sse_response(_sse(self.runs.follow(response_id, after)), hooks=self.ctx.stream_hooks)

    def list_input_items(self, response_id: str, query: Mapping[str, str]) -> Response:
        _known_query(query, ("after", "limit", "order"))
        return json_response(list_items(self.stored(response_id).get("input_items", []), query))

    async def cancel(self, response_id: str) -> Response:
        """Stops a background response (OpenAI's rules: a foreground one cannot be, a finished one
        neither, a cancelled one is cancelled again as it was)."""
        response = self.runs.view(self.stored(response_id))
        status = response.get("status")
        if not response.get("background"):
            raise bad_request("Cannot cancel a synchronous response: only a background one can be cancelled",
                              param="response_id")
        if status == "cancelled":
            return json_response(response)
        if status in FINAL:
            raise bad_request(f"Cannot cancel a response that is already {status}", param="response_id")
        record = await self.runs.cancel(response_id)
        return json_response(self.runs.view(record if record is not None else self.stored(response_id)))

    async def delete(self, response_id: str) -> Response:
        record = self.store.get(response_id)
        if record is not None and self.runs.view(record)["status"] in ("queued", "in_progress"):
            await self.runs.cancel(response_id)  # a background turn still running stops first
        if not self.store.delete(response_id):
            self.stored(response_id)  # the 404
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def _chat(self, chat_req: ChatCompletionRequest, request_id: str, req: ResponsesRequest) -> Any:
        # Not streaming, the engine need not send each step's tokens (each response costs Triton's
        # path as much as a token), except with logprobs: which item a token's logprob goes with
        # follows the chunks it came in, and a streamed answer has them token by token.
        # A background response streams from the engine either way: it is in progress from its
        # first token.
        one_chunk = not req.stream and not chat_req.logprobs and not req.background
        try:
            return await self.chat(chat_req, request_id, engine_stream=False if one_chunk else None)
        except APIError as exc:
            if exc.param in _PARAM_NAMES:
                exc.param = _PARAM_NAMES[exc.param]
            raise

    def _reasoning_tokens(self, builder: OutputBuilder) -> int:
        text = builder.reasoning_text()
        tokenizer = self.ctx.files.tokenizer() if text else None
        return len(tokenizer.encode(text, add_special_tokens=False).ids) if tokenizer is not None else 0

    def response_object(self, turn: _Turn, status: str, chat_usage: Optional[dict[str, Any]]) -> dict[str, Any]:
        req = turn.req
        usage = None
        if chat_usage is not None:
            usage = {
                "input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(turn.builder)},
                "total_tokens": chat_usage["total_tokens"],
            }
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else {"type": "text"}
        return {
            "id": turn.id, "object": "response", "created_at": int(turn.created), "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": turn.model,
            "output": snapshot({"o": turn.builder.items})["o"] if status not in ("queued", "in_progress") else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "conversation": {"id": turn.conversation} if turn.conversation is not None else None,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": self._stores(req), "temperature": req.temperature, "text": {"format": fmt, "verbosity": DEFAULT_VERBOSITY},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0, "top_p": req.top_p,
            "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {}, "background": bool(req.background),
            "service_tier": req.service_tier or "default",
            "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        }

    def _stores(self, req: ResponsesRequest) -> bool:
        return req.store is not False and self.store.capacity > 0

    def record(self, turn: _Turn, response: dict[str, Any]) -> None:
        """Stores the turn as `response` says it stands (with `store`); `worker` names the
        process (and app) that runs it, for a background one's readers to tell it is gone."""
        if self._stores(turn.req):
            self.store.put(turn.id, {"response": response, "previous": turn.req.previous_response_id,
                                     "turn": turn.input + output_messages(turn.builder.items),
                                     "input_items": turn.input_items, "worker": self.runs.worker})


def _conversation_id(value: Any) -> Optional[str]:
    """`conversation`: its id, or an object with it."""
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str):
        raise bad_request("conversation must be a conversation's id or {\"id\": ...}", param="conversation")
    return value


def _known_query(query: Mapping[str, str], known: tuple[str, ...]) -> None:
    for key in query:
        if key not in known:
            raise unsupported(key) if key.startswith("include") else bad_request(
                f"Unknown query parameter '{key}'", param=key)


def _int_or_none(text: str) -> Optional[int]:
    try:
        return int(text)
    except ValueError:
        return None


async def _started_later(start: Callable[[], Awaitable[Response]]) -> AsyncIterator[bytes]:
    """The chat stream `start()` answers with, once it does (called only when this is iterated:
    a turn cancelled before it begins leaves nothing unawaited); a refusal to start is its one
    error event."""
    try:
        answer = await start()
    except APIError as exc:
        yield error_event(exc)
        return
    try:
        async for raw in answer.body:
            yield raw
    finally:
        await answer.body.aclose()


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Responses events as SSE, numbered in order (a background response's come numbered)."""
    try:
        seq = 0
        async for payload in events:
            payload.setdefault("sequence_number", seq)
            seq = payload["sequence_number"] + 1
            yield f"event: {payload['type']}\ndata: {dumps(payload)}\n\n".encode()
    finally:
        await events.aclose()  # type: ignore[attr-defined]

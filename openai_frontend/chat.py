"""POST /v1/chat/completions: OpenAI chat on the ensemble (chat template applied in Triton).

Streaming emits preformatted `chat.completion.chunk` events: per choice a role chunk,
reasoning deltas (`reasoning` and `reasoning_content`, with --reasoning-parser), content deltas, tool-call deltas
(id/type/name first, then argument fragments), the finish reason, an optional usage chunk, then
`data: [DONE]`. Non-streaming aggregates the same engine stream and runs the same incremental
reasoning and tool-call parsers over the whole text, so both give the same answer.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

from starlette.responses import Response

from openai_frontend.beam_search import BeamSpec, beam_spec
from openai_frontend.best_of import samples_per_prompt, with_sampled_logprobs
from openai_frontend.choices import returned_choices
from openai_frontend.common import Context, LastHiddenState, dumps, json_response, prediction_totals, usage
from openai_frontend.engine_types import EngineRequest, TokenLogprob
from openai_frontend.errors import bad_request, unsupported
from openai_frontend.logprobs import TokenNamer, chat_logprobs, prompt_logprobs
from openai_frontend.protocol import ChatCompletionRequest, ChatMessage
from openai_frontend.reasoning import (
    ConstraintError, ReasoningFormat, ReasoningStreamer, constrain_after_reasoning, for_prompt, get_reasoning_format,
    split_reasoning,
)
from openai_frontend.sampling import (
    CONSTRAINT_KEYS,
    adapter_for,
    build_sampling_params,
    check_unsupported,
    constraint_param,
)
from openai_frontend.streams import StartedStream, sse_events, sse_response, start_stream
from openai_frontend.tools import (
    ToolCallStreamer, ToolPlan, get_parser, parse_as_streamed, plan_tools,
)


def normalize_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template wants them.

    Text-part lists become one string (vLLM's "string" content format), an assistant's refusal
    parts counting as text; other parts are refused. Tool-call arguments stay as sent: the
    preprocessing model decodes them (backend/tokenizer.py), once.
    """
    out = []
    for i, msg in enumerate(messages):
        d = msg.model_dump(exclude_none=True)
        content = d.get("content")
        if content is None:
            d["content"] = ""  # templates expect a string
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type")
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise bad_request(f"a text content part needs a string 'text' (messages[{i}].content[{j}])",
                                          param="messages")
                    texts.append(part["text"])
                elif kind == "refusal" and d.get("role") == "assistant":
                    # An assistant's earlier refusal, as OpenAI returns it: text to the template,
                    # as vLLM reads it.
                    if not isinstance(part.get("refusal"), str):
                        raise bad_request(f"a refusal content part needs a string 'refusal' "
                                          f"(messages[{i}].content[{j}])", param="messages")
                    texts.append(part["refusal"])
                else:
                    raise unsupported("messages", f"content part type '{kind}' (only text is supported)")
            d["content"] = "\n".join(texts)
        out.append(d)
    return out


class _Choice:
    """Per-choice accumulation (non-streaming) or streaming state."""

    __slots__ = ("texts", "finish", "stop_reason", "completion_tokens", "logprobs", "tools", "got_logprobs",
                 "reasoning", "held_reasoning", "hidden", "prediction", "token_ids")

    def __init__(self, tools: Optional[ToolCallStreamer], reasoning: Optional[ReasoningFormat] = None,
                 hidden: bool = False) -> None:
        self.texts: list[str] = []
        self.finish: Optional[str] = None
        self.stop_reason: Any = None  # vLLM's: the matched stop string or stop token id
        self.completion_tokens = 0
        self.logprobs: list[TokenLogprob] = []
        self.got_logprobs = False
        self.tools = tools
        self.reasoning = ReasoningStreamer(reasoning) if reasoning is not None else None
        self.held_reasoning = ""  # stream_reasoning false: sent when the section ends
        self.hidden = LastHiddenState() if hidden else None  # return_hidden_states
        self.prediction: Optional[tuple[int, int]] = None  # (accepted, rejected) prediction tokens
        self.token_ids: list[int] = []  # return_token_ids (non-streaming)


def _reasoning_format(req: ChatCompletionRequest, thinking: Optional[ReasoningFormat],
                      plan: ToolPlan) -> Optional[ReasoningFormat]:
    """The format the answer is split by: the server's (as the prompt leaves it), unless the
    request keeps the reasoning in its content (separate_reasoning false). A forced tool choice
    splits it all the same: its calls follow the reasoning, and its content is null either way
    (the reasoning then is not sent)."""
    if thinking is None or not (req.separate_reasoning or plan.forced):
        return None
    return thinking


async def _thinking_format(ctx: Context, req: ChatCompletionRequest) -> Optional[ReasoningFormat]:
    """The server's reasoning format for this request: whether the output starts inside the
    reasoning section follows the generation prompt the request's template settings render
    (reasoning.for_prompt). A reply that continues the last message has no generation prompt."""
    parser = ctx.settings.reasoning_parser
    if not parser:
        return None
    fmt = get_reasoning_format(parser)
    if not req.add_generation_prompt or req.continue_final_message:
        return fmt
    kwargs = ({**(req.chat_template_kwargs or {}), "reasoning_effort": req.reasoning_effort}
              if req.reasoning_effort is not None else req.chat_template_kwargs)
    return for_prompt(fmt, await ctx.generation_prompt_tail(req.chat_template, kwargs))


def _thinking_budget(budget: int, thinking: Optional[ReasoningFormat], beams: bool) -> dict[str, Any]:
    """The engine's thinking_budget: the budget with the markers of the server's reasoning parser
    (as vLLM takes them from its reasoning config), the output starting inside the section when
    the generation prompt opened it."""
    if thinking is None:
        raise bad_request("thinking_token_budget needs a reasoning model served with --reasoning-parser",
                          param="thinking_token_budget")
    if beams:
        raise unsupported("thinking_token_budget", "not with use_beam_search")
    return {"budget": budget, "starts": list(thinking.starts), "end": thinking.ends[0],
            "inside": thinking.starts_in_reasoning}


def _include_reasoning(req: ChatCompletionRequest) -> bool:
    return req.include_reasoning and req.separate_reasoning


def _constrain_content_only(sp: dict[str, Any], fmt: Optional[ReasoningFormat],
                            req: ChatCompletionRequest) -> dict[str, Any]:
    """With a reasoning parser, the request's constraint applies after the reasoning section."""
    key = next((k for k in CONSTRAINT_KEYS if k in sp), None)
    if fmt is None or key is None:
        return sp
    try:
        wrapped = constrain_after_reasoning(fmt, key, sp[key], sp.get("whitespace_pattern"))
    except ConstraintError as exc:
        # Named as the request gave it; a constraint it did not give came from its tool_choice.
        raise bad_request(str(exc), param=constraint_param(req) or "tool_choice") from None
    # the whitespace pattern (only ever beside a json_schema) now lives in the tag's element
    out = {k: v for k, v in sp.items() if k not in (key, "whitespace_pattern")}
    out["structural_tag"] = wrapped
    return out


def _prompt_fields(req: ChatCompletionRequest, plan: ToolPlan, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The EngineRequest fields the prompt is rendered from."""
    return dict(
        messages=messages,
        tools=plan.template_tools,
        # vLLM's: OpenAI's reasoning_effort is a template variable (gpt-oss's template reads
        # it); preprocessing refuses it for a template that does not.
        chat_template_kwargs=({**(req.chat_template_kwargs or {}), "reasoning_effort": req.reasoning_effort}
                              if req.reasoning_effort is not None else req.chat_template_kwargs),
        add_generation_prompt=None if req.add_generation_prompt else False,
        continue_final_message=req.continue_final_message,
        documents=req.documents,
        chat_template=req.chat_template,
        add_special_tokens=True if req.add_special_tokens else None,
    )


class ChatHandler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def prompt_tokens(self, req: ChatCompletionRequest) -> int:
        """How many tokens the request's prompt is, rendered as generation renders it (the
        preprocessing model's tokenize: template, tools and all)."""
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.ctx.settings.tool_call_parser,
                          self.ctx.settings.exclude_tools_when_tool_choice_none)
        prompt = _prompt_fields(req, plan, normalize_messages(req.messages))
        return len(await self.ctx.client.tokenize(EngineRequest(sampling_params={}, **prompt)))

    async def __call__(self, req: ChatCompletionRequest, request_id: str, engine_stream: Optional[bool] = None) -> Response:
        """`engine_stream` False: the engine sends each sample's output in one response even when
        this answer streams (responses.py: a non-streaming Responses call runs this stream)."""
        ctx = self.ctx
        await ctx.refresh_adapters(req.model)
        model = ctx.check_model(req.model)
        check_unsupported(req, ctx.settings)
        samples = samples_per_prompt(req.best_of, req.n, req.stream, ctx.settings.max_n)
        if not req.messages:
            raise bad_request("messages must not be empty", param="messages")
        lora = adapter_for(req, ctx.adapter_names())
        beams = beam_spec(req, lora, **(await ctx.beam_facts() if req.use_beam_search else {}),
                          timeout=ctx.settings.stream_timeout)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.settings.tool_call_parser,
                          ctx.settings.exclude_tools_when_tool_choice_none)
        if beams is not None and plan.constraint is not None:
            if plan.forced:
                raise bad_request("tool_choice required or a named function is not supported with use_beam_search",
                                  param="tool_choice")
            raise bad_request("strict function calling is not supported with use_beam_search",
                              param="tools")
        sp = build_sampling_params(req)
        if lora:
            sp["lora_path"] = lora
        if samples > req.n:
            sp = with_sampled_logprobs(sp)
        if plan.constraint is not None:
            if not any(k in sp for k in CONSTRAINT_KEYS):
                sp[plan.constraint[0]] = plan.constraint[1]
            elif plan.forced:
                raise bad_request(
                    f"tool_choice {req.tool_choice if isinstance(req.tool_choice, str) else 'function'} "
                    "cannot be combined with another structured-output constraint",
                    param="tool_choice",
                )
            # else strict tools under auto beside the request's own constraint (response_format):
            # that leaves the output no room for a call, so there is no call to hold to a schema.
        # The server's parser, not the request's separate_reasoning, says the model thinks first:
        # that switch only decides how the answer is split (SGLang; QA: separate_reasoning false
        # held the reasoning itself to the JSON schema).
        thinking = await _thinking_format(ctx, req)
        sp = _constrain_content_only(sp, thinking, req)
        if req.thinking_token_budget is not None:
            sp["thinking_budget"] = _thinking_budget(req.thinking_token_budget, thinking, beams is not None)
        messages = normalize_messages(req.messages)
        requests = [
            EngineRequest(
                sampling_params=sp,
                **_prompt_fields(req, plan, messages),
                request_id=request_id,
                n=samples,
                stream=req.stream if engine_stream is None else engine_stream,
            )
        ]
        completion_id = f"chatcmpl-{request_id}"
        created = int(time.time())
        namer = TokenNamer(ctx.files, bool(req.return_tokens_as_token_ids)) if req.logprobs else None
        # vLLM's: the reply is the assistant's, or without a generation prompt the last message's
        # role's (the model goes on with that message). echo starts the reply with the last
        # message's content when its role is the reply's (with continue_final_message, the
        # continued message comes back whole).
        role = "assistant" if req.add_generation_prompt else messages[-1]["role"]
        echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == role else ""
        if req.stream:
            stream = await start_stream(ctx.client, requests)
            body = sse_events(stream, self._stream(stream, req, plan, model, completion_id, created, namer, echo, role,
                                                   thinking))
            return sse_response(body, hooks=ctx.stream_hooks)
        return await self._complete(requests, req, plan, model, completion_id, created, namer, echo, role, beams,
                                    thinking)

    # -- non-streaming ---------------------------------------------------------------------

    async def _complete(
        self, requests: list[EngineRequest], req: ChatCompletionRequest, plan: ToolPlan,
        model: str, completion_id: str, created: int, namer: Optional[TokenNamer], echo: str, role: str,
        beams: Optional[BeamSpec] = None, thinking: Optional[ReasoningFormat] = None,
    ) -> Response:
        choices = [_Choice(None, hidden=req.return_hidden_states) for _ in range(req.n)]
        for c in choices:
            c.texts.append(echo)
        prompt_tokens = 0
        cached: Optional[int] = None
        prompt_lps: Optional[list[TokenLogprob]] = None  # vLLM's prompt_logprobs (the samples share them)
        prompt_ids: Optional[list[int]] = None  # return_token_ids (the samples share the prompt)
        it = returned_choices(self.ctx.client, requests, req.n, beams)
        try:
            async for i, chunk in it:
                c = choices[i]
                if cached is None:
                    cached = chunk.cached_tokens
                if chunk.text:
                    c.texts.append(chunk.text)
                if req.return_token_ids:
                    c.token_ids.extend(chunk.token_ids)
                    prompt_ids = prompt_ids if prompt_ids is not None else chunk.prompt_token_ids
                if namer is not None:
                    lps = chunk.logprobs(req.top_logprobs or 0)
                    if lps is not None:
                        c.got_logprobs = True
                        c.logprobs.extend(lps)
                if req.prompt_logprobs is not None and prompt_lps is None:
                    prompt_lps = chunk.prompt_logprobs(req.prompt_logprobs)
                c.completion_tokens = chunk.completion_tokens
                c.prediction = chunk.prediction_tokens or c.prediction
                prompt_tokens = chunk.prompt_tokens or prompt_tokens
                if c.hidden is not None:
                    c.hidden.add(chunk)
                if chunk.finish_reason:
                    c.finish = chunk.finish_reason
                    c.stop_reason = chunk.openai_stop_reason
        finally:
            await it.aclose()
        out = []
        fmt = _reasoning_format(req, thinking, plan)
        for i, c in enumerate(choices):
            text = "".join(c.texts)
            message: dict[str, Any] = {"role": role, "content": text}
            if fmt is not None:
                reasoning, text = split_reasoning(fmt, text)
                # An output that is all reasoning (cut short by max_tokens, or EOS after </think>)
                # has no content: null, as vLLM's reasoning parsers give it.
                message["content"] = text if text or reasoning is None else None
                if _include_reasoning(req):
                    # an empty section (Qwen3's "<think>\n\n</think>" when it does not think) is
                    # null, as in SGLang, and as the stream, which sends no reasoning delta for it
                    # Both names: vLLM's since 0.11, and SGLang's (and vLLM's before).
                    message["reasoning"] = message["reasoning_content"] = reasoning or None
            finish = c.finish or "stop"
            if plan.parser_name:
                normal, calls = parse_as_streamed(get_parser(plan.parser_name), text, plan.tools, plan.forced,
                                                  plan.call_id)
                if not plan.parallel:
                    calls = calls[:1]
                # What the stream sent as content, calls or not: a call to a function that is
                # not in `tools` is dropped there (as SGLang's parsers drop it), so here too.
                # A forced tool_choice constrains the output to calls: no text of it is the
                # model's answer (OpenAI returns null there).
                # Beside calls, or after reasoning that left no content, no text is null too.
                empty = not normal and (calls or message["content"] is None)
                message["content"] = None if plan.forced or empty else normal
                if calls:
                    message["tool_calls"] = [
                        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                        for call in calls
                    ]
                    if finish == "stop":
                        finish = "tool_calls"
            logprobs = chat_logprobs(c.logprobs, namer) if namer is not None and c.got_logprobs else None
            out.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish,
                        "stop_reason": c.stop_reason})
            if c.hidden is not None:
                out[-1]["hidden_states"] = c.hidden.value()
            if req.return_token_ids:
                out[-1]["token_ids"] = c.token_ids
        body = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": out,
            "usage": usage(prompt_tokens, sum(c.completion_tokens for c in choices), cached,
                           prediction_totals([c.prediction for c in choices], req.prediction is not None)),
        }
        if req.prompt_logprobs is not None:
            name = namer or TokenNamer(self.ctx.files, bool(req.return_tokens_as_token_ids))
            body["prompt_logprobs"] = prompt_logprobs(prompt_lps, name) if prompt_lps is not None else None
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return json_response(body)

    # -- streaming -------------------------------------------------------------------------

    async def _stream(
        self, stream: StartedStream, req: ChatCompletionRequest, plan: ToolPlan,
        model: str, completion_id: str, created: int, namer: Optional[TokenNamer], echo: str, role: str,
        thinking: Optional[ReasoningFormat] = None,
    ) -> AsyncIterator[bytes]:
        n = req.n
        echoed = [not echo] * n
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)  # vLLM: both are needed
        head = f'data: {{"id":{dumps(completion_id)},"object":"chat.completion.chunk","created":{created},"model":{dumps(model)},"choices":[{{"index":'
        fmt = _reasoning_format(req, thinking, plan)
        choices = [
            _Choice(ToolCallStreamer(get_parser(plan.parser_name), plan.tools, plan.parallel, plan.forced, plan.call_id)
                    if plan.parser_name else None, fmt, req.return_hidden_states)
            for _ in range(n)
        ]
        # The first engine chunk is already here: the role chunks can report the prompt's size.
        prompt_tokens = stream.first[1].prompt_tokens if stream.first is not None else 0
        cached: Optional[int] = None

        def event(i: int, delta: str, finish: Optional[str] = None, logprobs: str = "null",
                  stop_reason: str = "null", token_ids: str = "", top: str = "") -> str:
            f = "null" if finish is None else f'"{finish}"'
            tail = token_ids + "}]" + top
            if continuous:
                tail += ',"usage":' + dumps(usage(prompt_tokens, choices[i].completion_tokens))
            return (f'{head}{i},"delta":{delta},"logprobs":{logprobs},"finish_reason":{f},'
                    f'"stop_reason":{stop_reason}{tail}}}\n\n')

        # vLLM's return_token_ids: the prompt's ids on each choice's first chunk (the first
        # engine chunk has them), then each chunk's own ids.
        ids_of = (lambda chunk: ',"token_ids":' + dumps(chunk.token_ids)) if req.return_token_ids else (lambda chunk: "")
        first_ids = stream.first[1].prompt_token_ids if req.return_token_ids and stream.first is not None else None
        top = ',"prompt_token_ids":' + dumps(first_ids) if first_ids is not None else ""
        # A forced tool_choice's content is null (as the non-streaming answer's), not even "".
        opening = '{"role":' + dumps(role) + ',"content":' + ("null" if plan.forced else '""') + "}"
        yield "".join(event(i, opening, top=top) for i in range(n)).encode()
        async for i, chunk in stream:
            c = choices[i]
            c.completion_tokens = chunk.completion_tokens
            if include_usage:
                c.prediction = chunk.prediction_tokens or c.prediction
            prompt_tokens = chunk.prompt_tokens or prompt_tokens
            if c.hidden is not None:
                c.hidden.add(chunk)
            if include_usage and cached is None:
                cached = chunk.cached_tokens
            text = chunk.text
            if not echoed[i]:
                echoed[i] = True
                text = echo + text
            parts: list[str] = []
            deltas: list[dict[str, Any]] = []
            thought = ""
            if c.reasoning is not None:
                thought, text = c.reasoning.feed(text) if text else ("", "")
                if chunk.finish_reason:
                    more_thought, more_text = c.reasoning.finish()
                    thought, text = thought + more_thought, text + more_text
                if not _include_reasoning(req):
                    thought = ""
                elif not req.stream_reasoning:
                    c.held_reasoning += thought
                    thought = ""
                    if c.held_reasoning and (not c.reasoning.in_reasoning or chunk.finish_reason):
                        thought, c.held_reasoning = c.held_reasoning, ""
            if c.tools is not None:
                normal, deltas = c.tools.feed(text) if text else ("", [])
                if chunk.finish_reason:
                    more_text, more = c.tools.finish()
                    normal += more_text
                    deltas += more
                text = normal
            logprobs = "null"
            if namer is not None:
                lps = chunk.logprobs(req.top_logprobs or 0)
                if lps:
                    logprobs = dumps(chat_logprobs(lps, namer))
            finish = chunk.finish_reason
            if finish == "stop" and c.tools is not None and c.tools.has_calls:
                finish = "tool_calls"
            # One event per kind of delta; the token logprobs ride on the first, the finish
            # reason on the last. Under a forced tool_choice not even an empty content delta
            # carries the logprobs (content is null there): the calls' delta does, or an empty one.
            forced = c.tools is not None and c.tools.forced
            items: list[str] = []
            if thought:
                thought_json = dumps(thought)  # under both names, as the whole message has it
                items.append(f'{{"reasoning":{thought_json},"reasoning_content":{thought_json}}}')
            if text or (logprobs != "null" and not thought and not forced):
                items.append('{"content":' + dumps(text) + "}")
            if deltas:
                items.append('{"tool_calls":' + dumps(deltas) + "}")
            token_ids = ids_of(chunk) if chunk.token_ids else ""
            if not items and (finish or logprobs != "null" or token_ids):
                items.append("{}")
            stop_reason = dumps(chunk.openai_stop_reason) if finish else "null"
            for k, item in enumerate(items):
                last = k == len(items) - 1
                parts.append(event(i, item, finish if last else None, logprobs if k == 0 else "null",
                                   stop_reason if last else "null", token_ids if k == 0 else ""))
            if finish and c.hidden is not None:  # as SGLang: an event of its own after the finish
                parts.append(event(i, '{"hidden_states":' + dumps(c.hidden.value()) + "}"))
            if parts:
                yield "".join(parts).encode()
        if include_usage:
            total = sum(c.completion_tokens for c in choices)
            predicted = prediction_totals([c.prediction for c in choices], req.prediction is not None)
            final = usage(prompt_tokens, total, cached, predicted)
            yield (
                f'data: {{"id":{dumps(completion_id)},"object":"chat.completion.chunk","created":{created},'
                f'"model":{dumps(model)},"choices":[],"usage":{dumps(final)}}}\n\n'
            ).encode()

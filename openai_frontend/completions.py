"""POST /v1/completions: OpenAI (legacy) completions on the ensemble.

A prompt is text or token ids, or a batch of either; each prompt is one engine stream carrying
its n choices, indexed prompt * n + i.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional, Union

from starlette.responses import Response

from openai_frontend.beam_search import BeamSpec, beam_spec
from openai_frontend.best_of import samples_per_prompt, with_sampled_logprobs
from openai_frontend.choices import returned_choices
from openai_frontend.common import Context, LastHiddenState, dumps, json_response, usage
from openai_frontend.engine_types import EngineChunk, EngineRequest, TokenLogprob
from openai_frontend.errors import bad_request
from openai_frontend.logprobs import CompletionLogprobs, TokenNamer, prompt_logprobs
from openai_frontend.protocol import CompletionRequest
from openai_frontend.sampling import adapter_for, build_sampling_params, check_unsupported
from openai_frontend.streams import StartedStream, sse_events, sse_response, start_stream

Prompt = Union[str, list[int]]


def split_prompts(prompt: Any) -> list[Prompt]:
    """The request's prompt as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt must be a non-empty string, list of strings, or list of token ids", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        for p in prompt:
            if isinstance(p, list) and (not p or not all(isinstance(t, int) for t in p)):
                raise bad_request("token-id prompts must be non-empty lists of integers", param="prompt")
            if p == "":
                raise bad_request("prompt must not be empty: there is nothing to continue", param="prompt")
        return list(prompt)
    raise bad_request("prompt must not mix strings and token ids", param="prompt")


def add_logprobs(lp: CompletionLogprobs, chunk: EngineChunk, echo: Optional[str], top: Optional[int]) -> Optional[dict]:
    """Adds the chunk's logprobs, in text order: with `echo` (the first chunk's echoed prompt),
    the prompt's before the generated tokens', each over its own text. Returns the chunk's own
    logprobs object, None when the engine sent none."""
    start = len(lp.tokens)
    if echo is not None:
        lp.add(chunk.prompt_logprobs(top) or [], echo, whole=True)
    items = chunk.logprobs(top)
    lp.add(items or [], chunk.text, whole=chunk.finish_reason is not None)
    return lp.since(start) if len(lp.tokens) > start or items is not None else None


def _cached(values: list[Optional[int]]) -> Optional[int]:
    """Cached prompt tokens over the prompts, None when the engine reports none."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


class CompletionHandler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def _echo_text(self, prompt: Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        text = self.ctx.files.decode(prompt)
        if text is None:
            raise bad_request("echo with token-id prompts needs the server's --tokenizer-path", param="echo")
        return text

    async def __call__(self, req: CompletionRequest, request_id: str) -> Response:
        ctx = self.ctx
        await ctx.refresh_adapters(req.model)
        model = ctx.check_model(req.model)
        check_unsupported(req, ctx.settings)
        samples = samples_per_prompt(req.best_of, req.n, req.stream, ctx.settings.max_n)
        lora = adapter_for(req, ctx.adapter_names())
        beams = beam_spec(req, lora, **(await ctx.beam_facts() if req.use_beam_search else {}),
                          timeout=ctx.settings.stream_timeout)
        prompts = split_prompts(req.prompt)
        if len(prompts) * samples > ctx.settings.max_n * 4:
            raise bad_request(f"too many samples: {len(prompts)} prompts x {samples}", param="prompt")
        sp = build_sampling_params(req)
        if lora:
            sp["lora_path"] = lora
        if samples > req.n:
            sp = with_sampled_logprobs(sp)
        requests = []
        batch = len(prompts) > 1
        for p, prompt in enumerate(prompts):
            rid = f"{request_id}-{p}" if batch else request_id
            common = dict(sampling_params=sp, request_id=rid, n=samples, stream=req.stream, batch_item=batch)
            if isinstance(prompt, str):
                requests.append(EngineRequest(text_input=prompt, add_special_tokens=None if req.add_special_tokens else False,
                                              **common))
            else:
                requests.append(EngineRequest(input_ids=list(prompt), **common))
        k = len(prompts) * req.n
        echoes = [self._echo_text(prompts[j // req.n]) for j in range(k)] if req.echo else None
        completion_id = f"cmpl-{request_id}"
        created = int(time.time())
        namer = TokenNamer(ctx.files, bool(req.return_tokens_as_token_ids))
        if req.stream:
            stream = await start_stream(ctx.client, requests)
            body = sse_events(stream, self._stream(stream, req, k, echoes, model, completion_id, created, namer))
            return sse_response(body, hooks=ctx.stream_hooks)
        return await self._complete(requests, req, echoes, model, completion_id, created, namer, beams)

    async def _complete(
        self, requests: list[EngineRequest], req: CompletionRequest, echoes: Optional[list[str]], model: str,
        completion_id: str, created: int, namer: TokenNamer, beams: Optional[BeamSpec] = None,
    ) -> Response:
        n = req.n
        k = len(requests) * n
        texts: list[list[str]] = [[echoes[j]] if echoes else [] for j in range(k)]
        finish: list[Optional[str]] = [None] * k
        stop_reasons: list[Any] = [None] * k
        completion_tokens = [0] * k
        prompt_tokens = [0] * k
        logprobs = [CompletionLogprobs(namer, req.skip_special_tokens) if req.logprobs is not None else None
                    for _ in range(k)]
        got_logprobs = [False] * k
        echoed = [False] * k
        prompt_lps: list[Optional[list[TokenLogprob]]] = [None] * k  # vLLM's prompt_logprobs
        cached: list[Optional[int]] = [None] * k
        hidden = [LastHiddenState() if req.return_hidden_states else None for _ in range(k)]
        token_ids: list[list[int]] = [[] for _ in range(k)]  # return_token_ids
        prompt_ids: list[Optional[list[int]]] = [None] * k
        it = returned_choices(self.ctx.client, requests, n, beams)
        try:
            async for j, chunk in it:
                if cached[j] is None:
                    cached[j] = chunk.cached_tokens
                echo = None
                if echoes and not echoed[j]:
                    echoed[j] = True
                    echo = echoes[j]
                if chunk.text:
                    texts[j].append(chunk.text)
                if req.return_token_ids:
                    token_ids[j].extend(chunk.token_ids)
                    prompt_ids[j] = prompt_ids[j] if prompt_ids[j] is not None else chunk.prompt_token_ids
                lp = logprobs[j]
                if lp is not None and add_logprobs(lp, chunk, echo, req.logprobs) is not None:
                    got_logprobs[j] = True
                if req.prompt_logprobs is not None and prompt_lps[j] is None:
                    prompt_lps[j] = chunk.prompt_logprobs(req.prompt_logprobs)
                completion_tokens[j] = chunk.completion_tokens
                prompt_tokens[j] = chunk.prompt_tokens or prompt_tokens[j]
                if hidden[j] is not None:
                    hidden[j].add(chunk)
                if chunk.finish_reason:
                    finish[j] = chunk.finish_reason
                    stop_reasons[j] = chunk.openai_stop_reason
        finally:
            await it.aclose()
        choices = [
            {
                "index": j,
                "text": "".join(texts[j]),
                "logprobs": logprobs[j].result() if logprobs[j] is not None and got_logprobs[j] else None,
                "finish_reason": finish[j] or "stop",
                "stop_reason": stop_reasons[j],
            }
            for j in range(k)
        ]
        for choice, h in zip(choices, hidden):
            if h is not None:
                choice["hidden_states"] = h.value()
        if req.prompt_logprobs is not None:
            for choice, items in zip(choices, prompt_lps):
                choice["prompt_logprobs"] = prompt_logprobs(items, namer) if items is not None else None
        if req.return_token_ids:  # vLLM's: both on each choice
            for choice, ids, prompt in zip(choices, token_ids, prompt_ids):
                choice["prompt_token_ids"], choice["token_ids"] = prompt, ids
        body = {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            # prompt tokens count once per prompt, not once per choice
            "usage": usage(sum(prompt_tokens[::n]), sum(completion_tokens), _cached(cached[::n])),
        }
        return json_response(body)

    async def _stream(
        self, stream: StartedStream, req: CompletionRequest, k: int, echoes: Optional[list[str]],
        model: str, completion_id: str, created: int, namer: TokenNamer,
    ) -> AsyncIterator[bytes]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)  # vLLM: both are needed
        head = f'data: {{"id":{dumps(completion_id)},"object":"text_completion","created":{created},"model":{dumps(model)},"choices":[{{"index":'
        completion_tokens = [0] * k
        prompt_tokens = [0] * k
        echoed = [not echoes] * k
        logprobs = [CompletionLogprobs(namer, req.skip_special_tokens) if req.logprobs is not None else None
                    for _ in range(k)]
        cached: list[Optional[int]] = [None] * k
        hidden = [LastHiddenState() if req.return_hidden_states else None for _ in range(k)]
        n = req.n
        async for j, chunk in stream:
            completion_tokens[j] = chunk.completion_tokens
            prompt_tokens[j] = chunk.prompt_tokens or prompt_tokens[j]
            if hidden[j] is not None:
                hidden[j].add(chunk)
            if include_usage and cached[j] is None:
                cached[j] = chunk.cached_tokens
            text, echo = chunk.text, None
            if not echoed[j]:
                echoed[j] = True
                echo = echoes[j]
                text = echo + text
            lp_json = "null"
            lp = logprobs[j]
            if lp is not None and (chunk_lp := add_logprobs(lp, chunk, echo, req.logprobs)) and chunk_lp["tokens"]:
                lp_json = dumps(chunk_lp)
            finish = chunk.finish_reason
            ids = ""
            if req.return_token_ids:  # vLLM's: the prompt's ids on the choice's first chunk, then each chunk's
                prompt = chunk.prompt_token_ids
                if prompt is not None:
                    ids = ',"prompt_token_ids":' + dumps(prompt)
                if chunk.token_ids:
                    ids += ',"token_ids":' + dumps(chunk.token_ids)
            if not text and not finish and lp_json == "null" and not ids:
                continue
            f = "null" if finish is None else f'"{finish}"'
            stop_reason = dumps(chunk.openai_stop_reason) if finish else "null"
            tail = ids + "}]"
            if continuous:
                tail += ',"usage":' + dumps(usage(prompt_tokens[j], completion_tokens[j]))
            yield (f'{head}{j},"text":{dumps(text)},"logprobs":{lp_json},"finish_reason":{f},'
                   f'"stop_reason":{stop_reason}{tail}}}\n\n').encode()
            if finish and hidden[j] is not None:  # as SGLang: an event of its own after the finish
                yield (f'{head}{j},"text":"","logprobs":null,"finish_reason":null,"stop_reason":null,'
                       f'"hidden_states":{dumps(hidden[j].value())}}}]}}\n\n').encode()
        if include_usage:
            u = usage(sum(prompt_tokens[::n]), sum(completion_tokens), _cached(cached[::n]))
            yield (
                f'data: {{"id":{dumps(completion_id)},"object":"text_completion","created":{created},'
                f'"model":{dumps(model)},"choices":[],"usage":{dumps(u)}}}\n\n'
            ).encode()

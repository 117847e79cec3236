"""vLLM's tokenizer API: POST /tokenize and /detokenize.

Tokens come from the server's own `preprocessing` model and text from its `postprocessing`
model, so /tokenize counts exactly what a generation request with the same prompt would send to
the engine (chat template, tools and a server-level --chat-template included), and /detokenize
decodes as the server's streams do. An empty prompt counts as vLLM's does (no tokens, or the
special tokens the tokenizer adds, like a Llama BOS). Only token strings (`return_token_strs`) need the
frontend's local tokenizer (`--tokenizer-path`).
"""

from __future__ import annotations

from typing import Any, Optional

from openai_frontend.chat import normalize_messages
from openai_frontend.common import Context
from openai_frontend.engine_types import EngineRequest
from openai_frontend.errors import APIError, bad_request, unsupported
from openai_frontend.protocol import DetokenizeRequest, TokenizeRequest
from openai_frontend.tools import tools_as_dicts


async def tokenize(ctx: Context, req: TokenizeRequest) -> dict:
    await ctx.refresh_adapters(req.model, verify=True)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("exactly one of prompt and messages is required", param="prompt")
    if req.mm_processor_kwargs is not None:
        raise unsupported("mm_processor_kwargs")
    tok = ctx.files.tokenizer() if req.return_token_strs else None
    if req.return_token_strs and tok is None:
        raise bad_request("return_token_strs needs the server's --tokenizer-path", param="return_token_strs")
    if req.prompt is not None:
        chat_only = [n for n in ("tools", "chat_template_kwargs", "chat_template") if getattr(req, n) is not None]
        if chat_only or req.continue_final_message:
            raise bad_request(f"{(chat_only or ['continue_final_message'])[0]} needs messages", param="prompt")
        if req.prompt == "":
            return await _result(ctx, await _empty_prompt(ctx, req.add_special_tokens), tok)
        request = EngineRequest(sampling_params={}, text_input=req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        if not req.messages:
            raise bad_request("messages must not be empty", param="messages")
        if req.continue_final_message and req.add_generation_prompt:  # as chat completions names it
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                              "(send add_generation_prompt: false)", param="continue_final_message")
        # How the messages may be rendered (continue_final_message, the template itself) is
        # preprocessing's to check, as for a generation.
        request = EngineRequest(
            sampling_params={},
            messages=normalize_messages(req.messages),
            tools=tools_as_dicts(req.tools) if req.tools else None,
            chat_template_kwargs=req.chat_template_kwargs,
            add_generation_prompt=None if req.add_generation_prompt else False,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            add_special_tokens=req.add_special_tokens,
        )
    return await _result(ctx, await ctx.client.tokenize(request), tok)


async def _result(ctx: Context, tokens: list[int], tok: Any) -> dict:
    return {"count": len(tokens), "max_model_len": await ctx.max_model_len(), "tokens": tokens,
            "token_strs": None if tok is None else [tok.id_to_token(t) for t in tokens]}


# Any short text will do: the special tokens are what encoding it with them adds around its
# encoding without them.
_PROBE = "a"


async def _empty_prompt(ctx: Context, add_special_tokens: Optional[bool]) -> list[int]:
    """The tokens of the prompt "": none, or the special tokens the tokenizer adds (a Llama
    BOS), as vLLM counts. Preprocessing takes an empty prompt for a missing one, so the special
    tokens are what a probe gets with them and not without."""
    if add_special_tokens is False:
        return []
    with_special = await ctx.client.tokenize(
        EngineRequest(sampling_params={}, text_input=_PROBE, add_special_tokens=add_special_tokens))
    plain = await ctx.client.tokenize(EngineRequest(sampling_params={}, text_input=_PROBE, add_special_tokens=False))
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start:start + len(plain)] == plain:
            return with_special[:start] + with_special[start + len(plain):]
    raise bad_request("prompt is empty, and the special tokens this tokenizer would add to it are not known; "
                      "send add_special_tokens: false to count none", param="prompt")


async def detokenize(ctx: Context, req: DetokenizeRequest) -> dict:
    await ctx.refresh_adapters(req.model, verify=True)
    ctx.check_model(req.model)
    try:
        return {"prompt": await ctx.client.detokenize(list(req.tokens)) if req.tokens else ""}
    except APIError as exc:
        if exc.param == "input_ids":  # the model's input name; this request calls them tokens
            exc.param = "tokens"
            exc.message = exc.message.replace("input_ids", "tokens", 1)
        raise

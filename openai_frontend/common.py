"""Small helpers shared by the handlers: compact JSON, responses, the handler context."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from starlette.responses import Response

from openai_frontend.engine_types import EngineClient, EngineRequest
from openai_frontend.errors import APIError, model_not_found
from openai_frontend.metrics import FrontendMetrics
from openai_frontend.settings import Settings
from openai_frontend.tokenizer import ModelFiles

log = logging.getLogger(__name__)

ENGINE_INFO_TTL_S = 30.0
# Enough for the longest reasoning marker (granite's "Here's my thought process:") and what follows it.
PROMPT_TAIL_TOKENS = 32
PROMPT_TAILS_KEPT = 256

_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
# Valid in JSON strings, but line breaks to str.splitlines(), which many SSE clients (httpx's
# iter_lines among them) use to split events: always escaped.
_LINE_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def dumps(value: Any) -> str:
    """Compact JSON, non-ASCII kept as is except the Unicode line separators."""
    out = _encode(value)
    if not out.isascii() and ("\u2028" in out or "\u2029" in out or "\x85" in out):
        out = out.translate(_LINE_BREAKS)
    return out


def json_response(body: Any, status_code: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(dumps(body), status_code=status_code, media_type="application/json", headers=headers)


class ErrorEvent(bytes):
    """An SSE error event that keeps the error it was made from: a consumer in this process (the
    Responses API's translation of a chat stream) gets its status and headers, which the event's
    body does not carry."""

    error: APIError


def error_event(exc: APIError) -> bytes:
    event = ErrorEvent(b"data: " + dumps(exc.body()).encode() + b"\n\n")
    event.error = exc
    return event


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int] = None,
          prediction: Optional[tuple[int, int]] = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:  # the engine reports prefix-cache hits
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if prediction is not None:  # Predicted Outputs: (accepted, rejected) prediction tokens
        out["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                            "rejected_prediction_tokens": prediction[1]}
    return out


def prediction_totals(per_sample: list[Optional[tuple[int, int]]], predicted: bool = False) -> Optional[tuple[int, int]]:
    """The request's (accepted, rejected) prediction tokens over its samples; None without a
    prediction. `predicted`: the request carried one, empty ones included (the engine drafts
    nothing from those and reports nothing; OpenAI still reports 0 and 0)."""
    known = [p for p in per_sample if p is not None]
    if not known:
        return (0, 0) if predicted else None
    return sum(p[0] for p in known), sum(p[1] for p in known)


class LastHiddenState:
    """SGLang's OpenAI-side `hidden_states` of a choice (return_hidden_states): the row of the last
    position the model ran, [] when only the prompt's rows came (the engine's layout is in
    backend/outputs.py). Keeps the latest entry only, not the prompt's block."""

    __slots__ = ("count", "last")

    def __init__(self) -> None:
        self.count = 0
        self.last: Any = None

    def add(self, chunk: Any) -> None:
        entries = chunk.hidden_states()
        if entries:
            self.count += len(entries)
            self.last = entries[-1]

    def value(self) -> Any:
        return self.last if self.count > 1 else []


@dataclass
class Context:
    """What every handler needs; one per app."""

    settings: Settings
    client: EngineClient
    files: ModelFiles
    metrics: FrontendMetrics = field(default_factory=FrontendMetrics)

    @property
    def stream_hooks(self) -> tuple:
        return self.metrics.stream_hooks

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    # The engine's facts (engine_info), asked again after ENGINE_INFO_TTL_S: a restarted
    # tritonserver may run with another max_model_len (QA: the first answer was kept for good).
    _engine_info: Optional[dict[str, Any]] = None
    _engine_info_at: float = 0.0

    _facts_call: Optional[asyncio.Task] = None  # the engine_info call in flight, shared

    async def _engine_facts(self) -> dict[str, Any]:
        """engine_info, as last answered within ENGINE_INFO_TTL_S; the last answer while the
        engine cannot be asked. Raises APIError before it has ever answered. One call at a time:
        a burst of requests waits for the same answer (or error) rather than sending one each."""
        if self._engine_info is None or time.monotonic() - self._engine_info_at > ENGINE_INFO_TTL_S:
            if self._facts_call is None:
                self._facts_call = asyncio.ensure_future(self._ask_engine())
                # Its error is read here even when every waiter left (no "never retrieved" warning).
                self._facts_call.add_done_callback(lambda t: t.cancelled() or t.exception())
            try:
                # Shielded: a waiter whose client left must not cancel the others' answer.
                await asyncio.shield(self._facts_call)
            except APIError:
                if self._engine_info is None:
                    raise
        return self._engine_info

    async def _ask_engine(self) -> None:
        try:
            self._engine_info = await self.client.engine_info()
            self._engine_info_at = time.monotonic()
        finally:
            self._facts_call = None

    async def max_model_len(self) -> Optional[int]:
        """The engine's context length (its max_model_len setting may be below the model's);
        until the engine answers, the model's config.json value, if known."""
        try:
            return int((await self._engine_facts())["config"]["max_model_len"])
        except (APIError, KeyError, TypeError, ValueError) as exc:
            log.debug("engine max_model_len unknown: %s", exc)
            return self.files.max_model_len

    async def default_max_tokens(self) -> Optional[int]:
        """The model's generation_config.json `max_new_tokens`, as the engine reports it: the
        `max_tokens` of an OpenAI request that sets none, as in vLLM; None when it has none (or
        the engine cannot be asked: the request then runs to the end of the context)."""
        try:
            value = (await self._engine_facts()).get("default_max_tokens")
        except APIError:
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    async def eos_token_ids(self) -> Optional[frozenset[int]]:
        """The ids that end a generation, as the engine found them (generation_config.json,
        config.json, the tokenizer's); None when its engine_info does not say."""
        ids = (await self._engine_facts()).get("eos_token_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return None
        return frozenset(ids)

    async def beam_facts(self) -> dict[str, Any]:
        """What a beam search is checked against (beam_search.beam_spec's keyword arguments)."""
        capacity = None
        try:
            config = (await self._engine_facts())["config"]
            capacity = int(config["max_num_seqs"]) + int(config["max_waiting_requests"])
        except (APIError, KeyError, TypeError, ValueError) as exc:
            log.debug("engine capacity unknown: %s", exc)
        return {"max_model_len": await self.max_model_len(), "eos": await self.eos_token_ids(),
                "default_max_tokens": await self.default_max_tokens(), "capacity": capacity}

    # The end of the generation prompt per (chat template, template kwargs): (answer, asked at).
    _prompt_tails: dict[bytes, tuple[asyncio.Future, float]] = field(default_factory=dict)

    async def generation_prompt_tail(self, chat_template: Optional[str],
                                     chat_template_kwargs: Optional[dict[str, Any]]) -> Optional[str]:
        """The last tokens' text of the prompt the server's chat template (or the request's own)
        renders for a one-message chat with its generation prompt, as the server's preprocessing
        renders and its postprocessing decodes it; None when that fails. The reasoning parser
        reads it (openai_frontend.reasoning.for_prompt). Asked once per template and kwargs
        within ENGINE_INFO_TTL_S (a restarted server may have another template), a burst sharing
        one answer."""
        # A digest, not the text: a client's kwargs (or template) may be megabytes. QA: each new
        # one held its text here until 256 others came.
        key = hashlib.sha256(dumps([chat_template, chat_template_kwargs]).encode()).digest()
        now = time.monotonic()
        entry = self._prompt_tails.get(key)
        if entry is None or now - entry[1] > ENGINE_INFO_TTL_S:
            self._prompt_tails.pop(key, None)
            # Oldest first (an entry asked again moves to the end): the expired, then the surplus.
            while self._prompt_tails and (len(self._prompt_tails) >= PROMPT_TAILS_KEPT
                                          or now - next(iter(self._prompt_tails.values()))[1] > ENGINE_INFO_TTL_S):
                self._prompt_tails.pop(next(iter(self._prompt_tails)))
            entry = (asyncio.ensure_future(self._ask_prompt_tail(chat_template, chat_template_kwargs)), now)
            self._prompt_tails[key] = entry
        # Shielded: a waiter whose client left must not cancel the others' answer.
        return await asyncio.shield(entry[0])

    async def _ask_prompt_tail(self, chat_template: Optional[str],
                               chat_template_kwargs: Optional[dict[str, Any]]) -> Optional[str]:
        # A user's message, else a system's and a user's (QA: some templates refuse a chat
        # without a system message, and the parser's rule then held for every request).
        for messages in ([{"role": "user", "content": "a"}],
                         [{"role": "system", "content": "a"}, {"role": "user", "content": "a"}]):
            probe = EngineRequest(sampling_params={}, messages=messages,
                                  chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
            try:
                tokens = await self.client.tokenize(probe)
                return await self.client.detokenize(tokens[-PROMPT_TAIL_TOKENS:]) if tokens else ""
            except Exception as exc:  # the request itself will say what is wrong with its template
                log.debug("generation prompt's tail unknown: %s", exc)
        return None

    # With runtime LoRA updating: the adapters the engine serves, as it last listed them (None
    # until it has); its list then replaces --lora-modules, which an unload may have shortened.
    runtime_adapters: Optional[frozenset] = None
    _listed_names: Optional[tuple[str, ...]] = None

    def adapter_names(self) -> tuple[str, ...]:
        """The adapter names a request's `model` may give: --lora-modules' order first."""
        return self.settings.lora_modules if self._listed_names is None else self._listed_names

    async def refresh_adapters(self, model: Optional[str] = None, verify: bool = False) -> None:
        """With runtime LoRA updating, learn the engine's adapters: for a listing (`model` None),
        for a `model` not known yet (another frontend worker may just have loaded it), and with
        `verify` for a known one too (another worker may have unloaded it). Generation leaves
        known names to the engine, whose refusal of an unloaded one is already a 404; the answers
        that only this list decides (/v1/models/{id}, /tokenize) verify. QA: a rate limit of one
        listing a second 404'd an adapter loaded by another worker a moment before, and a known
        name was never checked again."""
        if not self.settings.allow_runtime_lora_updating:
            return
        if model is not None and (not model or model in self.settings.model_aliases
                                  or (model in self.adapter_names() and not verify)):
            return
        self.set_runtime_adapters(await self.client.lora_update({"op": "list"}))

    def set_runtime_adapters(self, loaded: dict[str, str]) -> None:
        self.runtime_adapters = frozenset(loaded)
        static = self.settings.lora_modules
        # A name the base model answers to stays the base model's (the engine may have been
        # started with such an adapter; the frontend refuses to load one).
        listed = self.runtime_adapters.difference(self.settings.model_aliases)
        self._listed_names = tuple(n for n in static if n in listed) + tuple(sorted(listed.difference(static)))

    def check_model(self, model: Optional[str]) -> str:
        """The served name for a request's `model` (None/empty means the served model; a LoRA
        adapter's name is its own)."""
        if model and model in self.adapter_names():
            return model
        if model and model not in self.settings.model_aliases:
            raise model_not_found(model)
        return self.model_name

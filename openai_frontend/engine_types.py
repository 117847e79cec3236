"""What the handlers exchange with the engine client: one request in, a stream of chunks out.

Plain slotted dataclasses, no validation: a chunk is created per streamed response, so it must
be cheap. `TritonLLMClient` (triton_client.py) produces them from Triton responses; tests use a
fake client that yields them directly.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncContextManager, AsyncIterator, Optional, Protocol


@dataclass(slots=True)
class EngineRequest:
    """One generation: exactly one of `text_input`, `messages`, `input_ids`, `input_embeds` is set.

    `sampling_params` uses SGLang names (max_new_tokens, temperature, stop, json_schema, ...);
    it goes to the ensemble as the `sampling_parameters` JSON tensor. `n` samples of the prompt
    share one Triton stream (the engine interleaves them; each chunk says its `index`).
    `stream=False` asks the engine for one response per sample instead of one per step (what a
    non-streaming HTTP request needs: far fewer responses through Triton).
    """

    sampling_params: dict[str, Any]
    text_input: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = None
    continue_final_message: bool = False
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None  # the request's own (the server must trust request templates)
    add_special_tokens: Optional[bool] = None  # None: the default (true for text, false for messages)
    input_ids: Optional[list[int]] = None
    input_embeds: Optional[list[list[float]]] = None  # [num_tokens][hidden_size] (SGLang's input_embeds)
    request_id: str = ""
    # The client chose request_id (SGLang's rid): while a request runs under it, another one is
    # refused, as SGLang's tokenizer manager refuses it (an abort by rid must name one request).
    client_named: bool = False
    # Prompt i of a batch whose one id names it `<id>_<i>` (/generate) or `<id>-<i>`
    # (/v1/completions): an abort for `<id>` takes it. Another request a client named so is not.
    batch_item: bool = False
    n: int = 1
    stream: bool = True


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log probability, and the top alternatives at that position."""

    token_id: int
    logprob: Optional[float]  # None for a prompt's first token (nothing precedes it)
    text: Optional[str] = None  # the engine's token text when it sends one
    top: list["TokenLogprob"] = field(default_factory=list)
    rank: Optional[int] = None  # prompt tokens: 1 + how many tokens were more likely


@dataclass(slots=True)
class EngineChunk:
    """One streamed response of the ensemble.

    text: the text new in this response; token_ids: the token ids new in this response;
    finish_reason: None until the sample's last response, then "stop" / "length" / "abort";
    prompt_tokens / completion_tokens: counts so far (of this sample); meta_raw: the
    `meta_info` JSON string; index: which of the request's n samples (meta_info "index").
    """

    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    meta_raw: str = ""
    _meta: Optional[dict[str, Any]] = None
    index: int = 0

    @property
    def meta(self) -> dict[str, Any]:
        """meta_info parsed on demand (most chunks never need it)."""
        if self._meta is None:
            try:
                parsed = json.loads(self.meta_raw) if self.meta_raw else {}
            except ValueError:
                parsed = {}
            self._meta = parsed if isinstance(parsed, dict) else {}
        return self._meta

    @property
    def stop_reason(self) -> Any:
        """The matched stop string or token id (final chunk), when the engine reports one."""
        return self.meta.get("stop_reason")

    @property
    def openai_stop_reason(self) -> Any:
        """vLLM's `stop_reason`: the matched stop string or stop_token_ids entry; None for EOS."""
        return None if self.meta.get("matched_eos") else self.meta.get("stop_reason")

    def hidden_states(self) -> list:
        """The return_hidden_states entries new in this chunk (SGLang's layout: the prompt's rows
        as one entry, then one row per later position), or [] when the engine sent none."""
        if not self.meta_raw or "hidden_states" not in self.meta_raw:
            return []
        value = self.meta.get("hidden_states")
        return value if isinstance(value, list) else []

    @property
    def cached_tokens(self) -> Optional[int]:
        """Prompt tokens served from the prefix cache, when the engine reports it."""
        if not self.meta_raw or "cached_tokens" not in self.meta_raw:
            return None
        value = self.meta.get("cached_tokens")
        return value if isinstance(value, int) else None

    @property
    def prompt_token_ids(self) -> Optional[list[int]]:
        """The prompt's token ids, on a sample's first chunk when the request asked for them
        (sampling parameter return_prompt_token_ids)."""
        if not self.meta_raw or "prompt_token_ids" not in self.meta_raw:
            return None
        value = self.meta.get("prompt_token_ids")
        return value if isinstance(value, list) else None

    @property
    def prediction_tokens(self) -> Optional[tuple[int, int]]:
        """Predicted Outputs: (accepted, rejected) prediction tokens of this sample so far, when
        the request carried a prediction."""
        if not self.meta_raw or "accepted_prediction_tokens" not in self.meta_raw:
            return None
        accepted, rejected = self.meta.get("accepted_prediction_tokens"), self.meta.get("rejected_prediction_tokens")
        return (accepted, rejected) if isinstance(accepted, int) and isinstance(rejected, int) else None

    @property
    def spec_meta(self) -> Optional[dict[str, Any]]:
        """SGLang's spec_* meta_info of a speculating sample's final chunk (spec_verify_ct, ...)."""
        if not self.meta_raw or "spec_verify_ct" not in self.meta_raw:
            return None
        return {k: v for k, v in self.meta.items() if k.startswith("spec_")}

    def raw_logprobs(self) -> dict[str, list]:
        """The SGLang-format logprob lists of this chunk's meta_info, keyed as SGLang names them
        (output_token_logprobs, output_top_logprobs, output_token_ids_logprobs, input_...)."""
        if not self.meta_raw or "logprob" not in self.meta_raw:
            return {}
        return {k: v for k, v in self.meta.items() if k in LOGPROB_KEYS and isinstance(v, list)}

    def logprobs(self, top: Optional[int] = None) -> Optional[list[TokenLogprob]]:
        """The logprobs of this chunk's tokens, or None when the engine sent none; at most `top`
        alternatives each (the engine sends as many as the most any part of the request asked).

        The engine reports them in meta_info with SGLang's names: `output_token_logprobs` as
        [[logprob, token_id, text_or_null], ...] (one per new token) and `output_top_logprobs`
        as one list of such triples per new token.
        """
        return self._logprobs("output", top)

    def prompt_logprobs(self, top: Optional[int] = None) -> Optional[list[TokenLogprob]]:
        """The logprobs of prompt tokens (`input_token_logprobs`, `input_top_logprobs`, and our
        `input_token_ranks`: sent with a sample's first response when logprob_start_len >= 0),
        or None. The first prompt token's logprob is None."""
        return self._logprobs("input", top)

    def _logprobs(self, kind: str, top: Optional[int]) -> Optional[list[TokenLogprob]]:
        if not self.meta_raw or "logprob" not in self.meta_raw:
            return None
        meta = self.meta
        tokens = meta.get(f"{kind}_token_logprobs")
        if tokens is None:
            return None
        tops = meta.get(f"{kind}_top_logprobs") or []
        ranks = meta.get(f"{kind}_token_ranks") or []
        out = []
        for i, entry in enumerate(tokens):
            item = _triple(entry)
            if i < len(tops) and tops[i]:
                item.top = [_triple(t) for t in tops[i][:top]]
            if i < len(ranks):
                item.rank = ranks[i]
            out.append(item)
        return out


OUTPUT_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
INPUT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
LOGPROB_KEYS = frozenset(OUTPUT_LOGPROB_KEYS + INPUT_LOGPROB_KEYS)


def _triple(entry: Any) -> TokenLogprob:
    if isinstance(entry, dict):
        logprob, token_id, text = entry["logprob"], entry["token_id"], entry.get("text")
    else:
        logprob, token_id, text = entry[0], entry[1], entry[2] if len(entry) > 2 else None
    return TokenLogprob(int(token_id), None if logprob is None else float(logprob), text)


class EngineClient(Protocol):
    """What the handlers need from an engine client (TritonLLMClient or a test fake)."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]: ...

    async def tokenize(self, request: EngineRequest) -> list[int]: ...

    async def detokenize(
        self, token_ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True,
        validate: bool = True,
    ) -> str: ...

    async def is_ready(self) -> bool: ...

    # Optional (the test fakes leave them out; /health reads them with getattr): why a ready model
    # cannot serve the frontend, and why a model is not ready (TritonLLMClient).
    contract_error: Optional[str]

    async def not_ready_reason(self) -> Optional[str]: ...

    def hold(self, request: EngineRequest) -> AsyncContextManager[asyncio.Event]:
        """Hold a request made of many engine requests (beam search): its id claimed, and an event
        that /abort_request naming it sets (TritonLLMClient.hold)."""
        ...

    async def lora_update(self, command: dict[str, Any]) -> dict[str, str]: ...

    async def abort_requests(self, rid: Optional[str] = None, abort_all: bool = False) -> int: ...

    async def reset_prefix_cache(self) -> int: ...

    async def engine_info(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...

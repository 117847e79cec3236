"""POST /generate: SGLang's native API on the ensemble.

Request: `text`, `input_ids` or `input_embeds` (one prompt or a batch; embeddings are rows of
the model's hidden size, not prefix-cached, and allow no prompt logprobs), `sampling_params`
(SGLang names, passed to the engine as is, `n` included: one engine stream per prompt carries
its n samples), `rid`, `return_logprob`, `top_logprobs_num`, `token_ids_logprob`,
`logprob_start_len`, `return_text_in_logprobs`, `return_hidden_states`,
`custom_logit_processor` (only with --enable-custom-logit-processor).
Response: `{"text", "output_ids", "meta_info"}` (a list for a batch or n > 1, prompt-major).
meta_info: id, finish_reason ({"type": "stop", "matched": ...} / {"type": "length", "length": n} /
{"type": "abort", ...}), prompt_tokens, completion_tokens, cached_tokens, e2e_latency and, with
return_logprob, the engine's SGLang-format logprob lists; with return_hidden_states,
`hidden_states` (the prompt's final-norm rows as one entry, then one row per generated token
fed back, as SGLang); with sampling_params.prediction (OpenAI's Predicted Outputs, an extension
here), accepted_prediction_tokens and rejected_prediction_tokens (OpenAI's: the prediction's
tokens the output took, and the rest of it); on a speculating server (or with
a prediction), at a sample's end, SGLang's spec_verify_ct, spec_draft_token_num,
spec_accept_token_num, spec_accept_rate and spec_accept_length (output tokens per step).

Streaming, like SGLang: every event carries the cumulative `text` and `output_ids` and the
`meta_info` so far (plus `index` for a batch or n > 1), then `data: [DONE]`. The cumulative
parts are kept JSON-encoded and only appended to, so an event costs its own size, not a
re-encoding of everything before it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.responses import Response

from openai_frontend.common import Context, dumps, json_response
from openai_frontend.engine_types import INPUT_LOGPROB_KEYS, OUTPUT_LOGPROB_KEYS, EngineChunk, EngineRequest
from openai_frontend.errors import bad_request, unsupported
from openai_frontend.protocol import GenerateRequest
from openai_frontend.sampling import check_custom_logit_processor, check_stop
from openai_frontend.streams import StartedStream, iterate_choices, sse_events, sse_response, start_stream

_LOGPROB_KEYS = ("return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob")


def _check_unsupported(req: GenerateRequest, ctx: Context) -> None:
    for name in ("image_data", "audio_data", "video_data"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    if req.return_routed_experts:
        raise unsupported("return_routed_experts", "no MoE models")
    if req.routed_experts_start_len:
        raise unsupported("routed_experts_start_len", "no MoE models")
    if req.priority is not None:
        raise unsupported("priority", "give sampling_params.priority, vLLM's order: lower runs first "
                          "(on a server with scheduling_policy priority)")
    processor = req.custom_logit_processor
    check_custom_logit_processor(any(processor) if isinstance(processor, list) else processor, ctx.settings)


def _pick(value: Any, i: int, batch: int, name: str) -> Any:
    """Per-prompt value of a field that is either one value or a list of `batch` values."""
    if isinstance(value, list):
        if len(value) != batch:
            raise bad_request(f"{name} has {len(value)} entries for {batch} prompts", param=name)
        return value[i]
    return value


def finish_reason_obj(chunk: EngineChunk) -> Optional[dict[str, Any]]:
    reason = chunk.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": chunk.completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": chunk.stop_reason}
    if reason == "abort":
        return {"type": "abort", "message": chunk.meta.get("message", "aborted")}
    return {"type": reason}


class _Out:
    """Accumulated output of one sample (JSON-encoded pieces kept for cheap cumulative events)."""

    __slots__ = ("rid", "text_json", "texts", "ids", "ids_json", "finish", "prompt_tokens", "completion_tokens",
                 "cached_tokens", "logprob", "lp_keys", "lps", "lps_json", "input_lps", "start", "hidden",
                 "hidden_json", "prediction", "spec")

    def __init__(self, rid: str, lp_keys: tuple[str, ...], start: float, hidden: bool = False) -> None:
        self.rid = rid
        self.text_json = ""
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.ids_json = ""
        self.finish: Optional[dict[str, Any]] = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        # With return_logprob, the output lists SGLang always sends (the top ones only with
        # top_logprobs_num): present even while empty.
        self.logprob = bool(lp_keys)
        self.lp_keys = lp_keys
        # output_* lists (extended per chunk) and their JSON (without brackets); input_* (once)
        self.lps: dict[str, list] = {}
        self.lps_json: dict[str, str] = {}
        self.input_lps: dict[str, Any] = {k.replace("output", "input", 1): [] for k in lp_keys}
        self.start = start
        # return_hidden_states: the entries so far (None: not asked for) and, streaming, their JSON.
        self.hidden: Optional[list] = [] if hidden else None
        self.hidden_json = ""
        self.prediction: Optional[tuple[int, int]] = None  # sampling_params.prediction: (accepted, rejected)
        self.spec: Optional[dict[str, Any]] = None  # a speculating sample's spec_* meta_info, at its end

    def add(self, chunk: EngineChunk, encode: bool) -> None:
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        text = chunk.text
        if text:
            self.texts.append(text)
            if encode:
                self.text_json += dumps(text)[1:-1]
        ids = chunk.token_ids
        if ids:
            self.ids.extend(ids)
            if encode:
                new = ",".join(map(str, ids))
                self.ids_json = f"{self.ids_json},{new}" if self.ids_json else new
        cached = chunk.cached_tokens
        if cached is not None:
            self.cached_tokens = cached
        self.prediction = chunk.prediction_tokens or self.prediction
        self.spec = chunk.spec_meta or self.spec
        if chunk.finish_reason:
            self.finish = finish_reason_obj(chunk)
        if self.hidden is not None:
            entries = chunk.hidden_states()
            if entries:
                self.hidden.extend(entries)
                if encode:
                    new = dumps(entries)[1:-1]
                    self.hidden_json = f"{self.hidden_json},{new}" if self.hidden_json else new
        if self.logprob:
            for key, value in chunk.raw_logprobs().items():
                if key in INPUT_LOGPROB_KEYS:
                    self.input_lps[key] = value
                    continue
                self.lps.setdefault(key, []).extend(value)
                if encode and value:
                    new = dumps(value)[1:-1]
                    old = self.lps_json.get(key)
                    self.lps_json[key] = f"{old},{new}" if old else new

    def _base(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.prediction is not None:
            meta["accepted_prediction_tokens"], meta["rejected_prediction_tokens"] = self.prediction
        if self.spec is not None:
            meta.update(self.spec)
        if self.finish is not None:
            meta["e2e_latency"] = time.perf_counter() - self.start
        return meta

    def meta(self) -> dict[str, Any]:
        meta = self._base()
        if self.hidden is not None:
            meta["hidden_states"] = self.hidden
        if self.logprob:
            for key in self.lp_keys:
                meta[key] = []
            meta.update(self.lps)
            meta.update(self.input_lps)
        return meta

    def meta_json(self) -> str:
        """meta() as JSON, with the growing logprob lists spliced in from their encoded form."""
        hidden = f',"hidden_states":[{self.hidden_json}]' if self.hidden is not None else ""
        if not self.logprob:
            return dumps(self._base())[:-1] + hidden + "}"
        base = self._base()
        base.update(self.input_lps)
        parts = [dumps(base)[:-1], hidden]
        keys = list(self.lp_keys) + [k for k in self.lps_json if k not in self.lp_keys]
        for key in keys:
            parts.append(f',"{key}":[{self.lps_json.get(key, "")}]')
        parts.append("}")
        return "".join(parts)

    def result(self) -> dict[str, Any]:
        return {"text": "".join(self.texts), "output_ids": self.ids, "meta_info": self.meta()}


class GenerateHandler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def _requests(self, req: GenerateRequest, request_id: str
                  ) -> tuple[list[EngineRequest], list[str], list[tuple[str, ...]], list[bool], bool]:
        settings = self.ctx.settings
        _check_unsupported(req, self.ctx)
        given = [name for name in ("text", "input_ids", "input_embeds") if getattr(req, name) is not None]
        if len(given) != 1:
            raise bad_request("exactly one of text, input_ids and input_embeds is required", param="text")
        embedded = req.input_embeds is not None
        if req.text is not None:
            batch = isinstance(req.text, list)
            prompts: list[Any] = req.text if batch else [req.text]
        else:
            given_prompt = (req.input_embeds if embedded else req.input_ids) or []
            # input_ids [[ids]] and input_embeds [[[floats]]] are batches: one list level deeper.
            first = given_prompt[0] if given_prompt else None
            if embedded:
                first = first[0] if first else None
            batch = isinstance(first, list)
            prompts = given_prompt if batch else [given_prompt]
        # An empty text too: preprocessing would take it for a missing prompt.
        if not prompts or any(not p for p in prompts if isinstance(p, (list, str))):
            raise bad_request("empty prompt", param=given[0])
        if embedded and any(len({len(row) for row in p}) != 1 or not p[0] for p in prompts):
            raise bad_request("input_embeds: every row needs the same number (the model's hidden size) of values",
                              param="input_embeds")
        b = len(prompts)
        max_samples = settings.max_n * 4
        if b > max_samples:
            raise bad_request(f"too many prompts in one request: {b}, at most {max_samples}", param=given[0])
        if isinstance(req.sampling_params, list) and len(req.sampling_params) != b:
            raise bad_request(f"sampling_params has {len(req.sampling_params)} entries for {b} prompts", param="sampling_params")
        if isinstance(req.rid, list) and len(set(req.rid)) != len(req.rid):
            # Each prompt's rid names it in the response and to /abort_request: two alike could
            # not be told apart (SGLang refuses them too).
            dup = next(r for i, r in enumerate(req.rid) if r in req.rid[:i])
            raise bad_request(f"rid must name each prompt once; '{dup}' is given twice", param="rid")
        requests: list[EngineRequest] = []
        rids: list[str] = []
        lp_keys: list[tuple[str, ...]] = []
        hidden: list[bool] = []
        multi = batch
        total = 0
        for p, prompt in enumerate(prompts):
            sp = dict(_pick(req.sampling_params, p, b, "sampling_params") or {})
            n = sp.pop("n", 1)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > settings.max_n:
                raise bad_request(f"sampling_params.n must be an integer in [1, {settings.max_n}]", param="n")
            total += n
            if total > max_samples:
                raise bad_request(f"too many samples in one request: the prompts times their n come to more than "
                                  f"{max_samples}", param="n")
            multi = multi or n > 1
            if "stream" in sp:  # the engine would take it for the request's own
                raise bad_request("stream is a /generate argument, not a sampling parameter", param="stream")
            check_stop(sp.get("stop"), sp.get("stop_token_ids"), settings)
            check_custom_logit_processor(sp.get("custom_logit_processor"), settings)
            for key in _LOGPROB_KEYS:
                value = getattr(req, key)
                if key == "token_ids_logprob" and not value:
                    value = None  # SGLang's: an empty list asks for none
                elif key == "token_ids_logprob" and not isinstance(value[0], list):
                    pass  # one list of ids for every prompt
                else:
                    value = _pick(value, p, b, key)
                if value is not None:
                    sp[key] = value
            if req.return_text_in_logprobs:
                sp["return_text_in_logprobs"] = True
            lora = _pick(req.lora_path, p, b, "lora_path")
            if lora is not None:  # SGLang's: the name of a LoRA adapter the engine serves
                sp["lora_path"] = lora
            # SGLang takes it at the top level and, in newer versions, among the sampling params.
            inner = sp.get("return_hidden_states", False)
            if not isinstance(inner, bool):
                raise bad_request("sampling_params.return_hidden_states must be true or false",
                                  param="return_hidden_states")
            wants_hidden = bool(_pick(req.return_hidden_states, p, b, "return_hidden_states")) or inner
            if wants_hidden:
                sp["return_hidden_states"] = True
            processor = _pick(req.custom_logit_processor, p, b, "custom_logit_processor")
            if processor:
                sp["custom_logit_processor"] = processor
            # SGLang's: one string rid for a batch names its prompts <rid>_<i>.
            # request_id: the X-Request-Id header, else a string rid, else a generated one.
            rid = _pick(req.rid, p, b, "rid") if isinstance(req.rid, list) else request_id
            batch_item = batch and not isinstance(req.rid, list)  # a batch of one too, as SGLang
            if batch_item:
                rid = f"{rid}_{p}"
            common = dict(sampling_params=sp, request_id=rid, n=n, stream=req.stream, client_named=req.rid is not None,
                          batch_item=batch_item)
            if isinstance(prompt, str):
                requests.append(EngineRequest(text_input=prompt, **common))
            elif embedded:
                requests.append(EngineRequest(input_embeds=prompt, **common))
            else:
                requests.append(EngineRequest(input_ids=list(prompt), **common))
            keys: tuple[str, ...] = ()
            if sp.get("return_logprob"):
                keys = OUTPUT_LOGPROB_KEYS[:2] if sp.get("top_logprobs_num") else OUTPUT_LOGPROB_KEYS[:1]
            for i in range(n):
                rids.append(rid if n == 1 else f"{rid}_{i}")
                lp_keys.append(keys)
                hidden.append(wants_hidden)
        return requests, rids, lp_keys, hidden, multi

    async def __call__(self, req: GenerateRequest, request_id: Optional[str] = None) -> Response:
        requests, rids, lp_keys, hidden, multi = self._requests(req, request_id or uuid.uuid4().hex)
        start = time.perf_counter()
        outs = [_Out(rid, keys, start, wants) for rid, keys, wants in zip(rids, lp_keys, hidden)]
        if req.stream:
            stream = await start_stream(self.ctx.client, requests)
            return sse_response(sse_events(stream, self._stream(stream, outs, multi)), hooks=self.ctx.stream_hooks)
        it = iterate_choices(self.ctx.client, requests)
        try:
            async for j, chunk in it:
                outs[j].add(chunk, False)
        finally:
            await it.aclose()
        results = [o.result() for o in outs]
        return json_response(results if multi else results[0])

    async def _stream(self, stream: StartedStream, outs: list[_Out], multi: bool) -> AsyncIterator[bytes]:
        async for j, chunk in stream:
            o = outs[j]
            o.add(chunk, True)
            if not chunk.text and not chunk.finish_reason and not chunk.token_ids:
                continue
            index = f',"index":{j}' if multi else ""
            yield (
                f'data: {{"text":"{o.text_json}","output_ids":[{o.ids_json}],'
                f'"meta_info":{o.meta_json()}{index}}}\n\n'
            ).encode()

"""POST /generate: SGLang's native API on the ensemble.

Request: `text` or `input_ids` (one prompt or a batch), `sampling_params` (SGLang names, passed
to the engine as is; `n` is expanded here into n streams), `rid`, `return_logprob`,
`top_logprobs_num`, ... Response: `{"text", "output_ids", "meta_info"}` (a list for a batch or
n > 1). Streaming, like SGLang: every event carries the cumulative `text` and `output_ids` and the
`meta_info` so far (plus `index` for a batch), then `data: [DONE]`.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.responses import Response

from openai_frontend.common import Context, dumps, error_event, json_response
from openai_frontend.engine_types import EngineChunk, EngineRequest
from openai_frontend.errors import APIError, bad_request, unsupported
from openai_frontend.protocol import GenerateRequest
from openai_frontend.streams import DONE_EVENT, StartedStream, iterate_choices, sse_response, start_stream

_LOGPROB_KEYS = ("return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob")

log = logging.getLogger(__name__)


def _check_unsupported(req: GenerateRequest) -> None:
    for name in ("input_embeds", "image_data", "audio_data", "video_data", "lora_path", "custom_logit_processor"):
        if getattr(req, name) is not None:
            raise unsupported(name)
    hidden = req.return_hidden_states
    if any(hidden) if isinstance(hidden, list) else hidden:
        raise unsupported("return_hidden_states")
    if req.return_routed_experts:
        raise unsupported("return_routed_experts", "no MoE models")
    if req.routed_experts_start_len:
        raise unsupported("routed_experts_start_len", "no MoE models")


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
    """Accumulated output of one stream (text kept JSON-escaped for cheap cumulative events)."""

    __slots__ = ("rid", "text_json", "texts", "ids", "ids_json", "finish", "prompt_tokens", "completion_tokens",
                 "token_lps", "top_lps", "logprob", "start")

    def __init__(self, rid: str, logprob: bool, start: float) -> None:
        self.rid = rid
        self.text_json = ""
        self.texts: list[str] = []
        self.ids: list[int] = []
        self.ids_json = ""
        self.finish: Optional[dict[str, Any]] = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.token_lps: list[list[Any]] = []
        self.top_lps: list[list[list[Any]]] = []
        self.logprob = logprob
        self.start = start

    def add(self, chunk: EngineChunk) -> None:
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        if chunk.text:
            self.texts.append(chunk.text)
        if chunk.token_ids:
            self.ids.extend(chunk.token_ids)
        if chunk.finish_reason:
            self.finish = finish_reason_obj(chunk)
        if self.logprob:
            items = chunk.logprobs()
            if items:
                for lp in items:
                    self.token_lps.append([lp.logprob, lp.token_id, lp.text])
                    self.top_lps.append([[t.logprob, t.token_id, t.text] for t in lp.top])

    def meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": 0,
        }
        if self.finish is not None:
            meta["e2e_latency"] = time.perf_counter() - self.start
        if self.logprob:
            meta["output_token_logprobs"] = self.token_lps
            meta["output_top_logprobs"] = self.top_lps
        return meta

    def result(self) -> dict[str, Any]:
        return {"text": "".join(self.texts), "output_ids": self.ids, "meta_info": self.meta()}


class GenerateHandler:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def _requests(self, req: GenerateRequest, request_id: str) -> tuple[list[EngineRequest], list[str], list[bool], bool]:
        _check_unsupported(req)
        if (req.text is None) == (req.input_ids is None):
            raise bad_request("exactly one of text and input_ids is required", param="text")
        if req.text is not None:
            batch = isinstance(req.text, list)
            prompts: list[Any] = req.text if batch else [req.text]
        else:
            ids = req.input_ids or []
            batch = bool(ids) and isinstance(ids[0], list)
            prompts = ids if batch else [ids]
        if not prompts or any(not p for p in prompts if isinstance(p, list)):
            raise bad_request("empty prompt", param="input_ids" if req.text is None else "text")
        b = len(prompts)
        if isinstance(req.sampling_params, list) and len(req.sampling_params) != b:
            raise bad_request(f"sampling_params has {len(req.sampling_params)} entries for {b} prompts", param="sampling_params")
        requests: list[EngineRequest] = []
        rids: list[str] = []
        want_logprob: list[bool] = []
        multi = batch
        for p, prompt in enumerate(prompts):
            sp = dict(_pick(req.sampling_params, p, b, "sampling_params") or {})
            n = sp.pop("n", 1)
            if not isinstance(n, int) or n < 1 or n > self.ctx.settings.max_n:
                raise bad_request(f"sampling_params.n must be an integer in [1, {self.ctx.settings.max_n}]", param="n")
            multi = multi or n > 1
            for key in _LOGPROB_KEYS:
                value = getattr(req, key)
                if key == "token_ids_logprob" and value and not isinstance(value[0], list):
                    pass  # one list of ids for every prompt
                else:
                    value = _pick(value, p, b, key)
                if value is not None:
                    sp[key] = value
            if req.return_text_in_logprobs:
                sp["return_text_in_logprobs"] = True
            rid = _pick(req.rid, p, b, "rid") or (request_id if b == 1 else f"{request_id}-{p}")
            seed = sp.get("seed")
            for i in range(n):
                params = sp if n == 1 or seed is None else {**sp, "seed": seed + i}
                full_rid = rid if n == 1 else f"{rid}-{i}"
                if isinstance(prompt, str):
                    requests.append(EngineRequest(sampling_params=params, text_input=prompt, request_id=full_rid))
                else:
                    requests.append(EngineRequest(sampling_params=params, input_ids=list(prompt), request_id=full_rid))
                rids.append(full_rid)
                want_logprob.append(bool(sp.get("return_logprob")))
        return requests, rids, want_logprob, multi

    async def __call__(self, req: GenerateRequest, request_id: Optional[str] = None) -> Response:
        requests, rids, want_logprob, multi = self._requests(req, request_id or uuid.uuid4().hex)
        start = time.perf_counter()
        outs = [_Out(rid, lp, start) for rid, lp in zip(rids, want_logprob)]
        if req.stream:
            stream = await start_stream(self.ctx.client, requests)
            return sse_response(self._stream(stream, outs, multi))
        it = iterate_choices(self.ctx.client, requests)
        try:
            async for j, chunk in it:
                outs[j].add(chunk)
        finally:
            await it.aclose()
        results = [o.result() for o in outs]
        return json_response(results if multi else results[0])

    async def _stream(self, stream: StartedStream, outs: list[_Out], multi: bool) -> AsyncIterator[bytes]:
        try:
            async for j, chunk in stream:
                o = outs[j]
                o.add(chunk)
                if chunk.text:
                    o.text_json += dumps(chunk.text)[1:-1]
                if chunk.token_ids:
                    new = ",".join(map(str, chunk.token_ids))
                    o.ids_json = f"{o.ids_json},{new}" if o.ids_json else new
                if not chunk.text and not chunk.finish_reason and not chunk.token_ids:
                    continue
                index = f',"index":{j}' if multi else ""
                yield (
                    f'data: {{"text":"{o.text_json}","output_ids":[{o.ids_json}],'
                    f'"meta_info":{dumps(o.meta())}{index}}}\n\n'
                ).encode()
        except APIError as exc:
            yield error_event(exc)
        except Exception as exc:  # the response has started: report in the stream
            log.exception("error while streaming")
            yield error_event(APIError(500, f"Internal server error: {exc}"))
        finally:
            await stream.aclose()
        yield DONE_EVENT

"""vLLM's beam search (`use_beam_search`, `length_penalty`; the beam width is `n`), run by the
frontend over the engine.

As in vLLM v1, the search lives outside the engine. Each step asks the engine for one token of
every live beam together with its 2 x width most likely next tokens (`max_new_tokens` 1,
`top_logprobs_num`), keeps the `width` best extensions by cumulative logprob, and sets aside the
extensions that end with an end-of-sequence token (or a `stop_token_ids` entry) as finished.
After `max_tokens` steps the finished and live beams are ranked by vLLM's score,
cumulative logprob / length ** length_penalty, the length counting the prompt and not the final
end-of-sequence token, and the best `width` are returned, each as one choice.

The beams of a step are extensions of one prompt, so the engine's prefix cache serves all but
the last partial block of each step's prefill. Logprobs are the model's own: the step requests
turn the model's default penalties off, and with `temperature` > 0 they are of the scaled
distribution, as vLLM's v0 engine computed them.

A search is one request to its client: its steps carry its id, it holds a client-named id for
its whole run (a second request under it is refused), /abort_request by that id (or abort_all)
ends it with finish_reason "abort" and the beams it had, and `--stream-timeout` bounds the whole
search (504), not each step. Under --workers, an abort received by another worker ends the steps
it finds in flight, which ends the search too; a second request under its id sent to another
worker is not refused (the engine refuses duplicates by single requests, and the steps are many).

Nothing is known before the last step, so beam search does not stream. Logprobs come from
the steps' alternatives (each beam's tokens and up to the steps' top-k, `echo` prepends the
prompt text). Parameters that would change the search (stop strings, penalties, top-k/p,
constraints, ...) and prompt logprobs are refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Optional, Sequence, TypeVar, Union

from openai_frontend.engine_types import EngineChunk, EngineClient, EngineRequest, TokenLogprob
from openai_frontend.errors import bad_request, context_exceeded, timed_out
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest
from openai_frontend.sampling import constraint_from_request
from openai_frontend.streams import Item

MAX_BEAM_WIDTH = 10  # 2 x width alternatives per step, and the engine reports at most 20

AnyRequest = Union[ChatCompletionRequest, CompletionRequest]

# What a parameter may be and leave the search as it is (None: not given).
_NEUTRAL: dict[str, tuple] = {
    "stop": (None, [], ""),
    "stop_regex": (None, []),
    "prompt_logprobs": (None,),
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "custom_logit_processor": (None, ""),
    "logits_processors": (None, []),
}


@dataclass(frozen=True)
class BeamSpec:
    width: int
    max_tokens: Optional[int]  # None: up to the model's context
    length_penalty: float
    eos: frozenset[int]
    ignore_eos: bool
    max_model_len: Optional[int]
    step_params: dict[str, Any]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    top_logprobs: Optional[int] = None  # None: the client asked for no logprobs
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids: they end a beam even with ignore_eos
    keep_stop: bool = False  # include_stop_str_in_output: the stop token's text stays
    timeout: Optional[float] = None  # seconds for the whole search (--stream-timeout); None: no limit
    prompt_token_ids: bool = False  # return_token_ids: each beam's meta_info carries the prompt's ids


def beam_spec(req: AnyRequest, lora: Optional[str] = None, max_model_len: Optional[int] = None,
              eos: Optional[frozenset[int]] = None, default_max_tokens: Optional[int] = None,
              timeout: Optional[float] = None, capacity: Optional[int] = None) -> Optional[BeamSpec]:
    """The request's beam search, checked, or None when it asks for none. `eos`: the engine's
    end-of-sequence ids (Context.eos_token_ids); `default_max_tokens`: the model's, for a request
    that sets none (Context.default_max_tokens); `capacity`: the sequences the engine takes at
    once, running and waiting (Context.beam_facts)."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise bad_request("length_penalty is only used with use_beam_search", param="length_penalty")
        return None
    width = req.n
    if width > MAX_BEAM_WIDTH:
        raise bad_request(f"with use_beam_search, n (the beam width) must be at most {MAX_BEAM_WIDTH}", param="n")
    if req.stream:
        raise bad_request("use_beam_search cannot be streamed: the beams are only known after the last step",
                          param="use_beam_search")
    if capacity is not None and width > capacity:
        # Each step sends the live beams together: more than the engine runs and queues would be
        # a 503 on an idle server too, retried in vain (QA).
        raise bad_request(f"with use_beam_search, n (the beam width) must be at most {capacity} on this server: "
                          "each step runs the beams at once (its max_num_seqs + max_waiting_requests)", param="n")
    if req.best_of is not None and req.best_of != width:
        raise bad_request("with use_beam_search, best_of must equal n (the beam width)", param="best_of")
    for name, neutral in _NEUTRAL.items():
        if getattr(req, name, None) not in neutral:
            raise bad_request(f"'{name}' is not supported with use_beam_search", param=name)
    if constraint_from_request(req) is not None:
        raise bad_request("structured output is not supported with use_beam_search", param="use_beam_search")
    if eos is None:
        raise bad_request("use_beam_search needs the engine's end-of-sequence ids, which its engine_info does not "
                          "report", param="use_beam_search")
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    else:
        max_tokens = req.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise bad_request("with use_beam_search, max_tokens must be at least 1", param="max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(req, ChatCompletionRequest):
        top_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        top_logprobs = req.logprobs
    if top_logprobs is not None and req.echo:
        raise bad_request("echo with logprobs is not supported with use_beam_search (it scores the prompt)",
                          param="echo")
    step: dict[str, Any] = {
        "max_new_tokens": 1, "return_logprob": True, "top_logprobs_num": max(2 * width, top_logprobs or 0),
        "ignore_eos": True,
        "temperature": req.temperature or 0.0,
        # the model's generation_config defaults would otherwise bend the beams' scores
        "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    }
    if req.priority:
        step["priority"] = req.priority
    if lora:
        step["lora_path"] = lora
    if req.cache_salt is not None:  # every step reads and extends the beams' cached blocks
        step["cache_salt"] = req.cache_salt
    if top_logprobs is not None and not req.return_tokens_as_token_ids:
        step["return_text_in_logprobs"] = True
    return BeamSpec(
        width=width, max_tokens=max_tokens, length_penalty=req.length_penalty,
        eos=eos, ignore_eos=bool(req.ignore_eos), stop_ids=frozenset(req.stop_token_ids or ()),
        keep_stop=bool(req.include_stop_str_in_output),
        max_model_len=max_model_len, step_params=step,
        skip_special_tokens=req.skip_special_tokens, spaces_between_special_tokens=req.spaces_between_special_tokens,
        top_logprobs=top_logprobs, timeout=timeout, prompt_token_ids=bool(req.return_token_ids),
    )


T = TypeVar("T")


async def _all(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Run together; the first failure cancels the rest and is raised as itself (not as the
    ExceptionGroup a TaskGroup raises), so API errors keep their status."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(a) for a in aws]
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
    return [t.result() for t in tasks]


@dataclass
class _Beam:
    """A beam as its last token and a link to the beam it extends: a step makes 2 x width
    children per live beam, and copying their token lists would cost their length each."""

    parent: Optional["_Beam"] = None
    token: int = -1
    cum_logprob: float = 0.0
    length: int = 0
    finish: str = "length"
    logprob: Optional[TokenLogprob] = None  # the token's own, with the step's alternatives

    def path(self) -> list["_Beam"]:
        out, beam = [], self
        while beam.parent is not None:
            out.append(beam)
            beam = beam.parent
        return out[::-1]

    def tokens(self) -> list[int]:
        return [b.token for b in self.path()]


def _score(beam: _Beam, prompt_len: int, length_penalty: float) -> tuple[int, float]:
    """A sort key ordered as vLLM's score, cum_logprob / length ** length_penalty, computed in
    logs: the power itself overflows a float for a large |length_penalty| (QA: 500s at 400)."""
    log_length = math.log(max(prompt_len + beam.length - (beam.finish == "stop"), 1))
    cum = beam.cum_logprob
    if cum < 0:  # the usual case: the larger log(-score), the worse
        return 0, length_penalty * log_length - math.log(-cum)
    if cum == 0:
        return 1, 0.0
    return 2, math.log(cum) - length_penalty * log_length


def _meta(path: list[_Beam], top: Optional[int], cached_tokens: Optional[int],
          prompt_ids: Optional[list[int]] = None) -> str:
    """The beam's meta_info in the engine's form, which the handlers already read: the prompt's
    prefix-cache hits (of the search's first step, the prompt alone) and, if asked, logprobs and
    the prompt's ids."""
    def entry(lp: TokenLogprob) -> list:
        return [lp.logprob, lp.token_id, lp.text]

    meta: dict[str, Any] = {} if cached_tokens is None else {"cached_tokens": cached_tokens}
    if top is not None:
        meta["output_token_logprobs"] = [entry(b.logprob) for b in path]
        meta["output_top_logprobs"] = [[entry(t) for t in b.logprob.top[:top]] for b in path]
    if prompt_ids is not None:
        meta["prompt_token_ids"] = prompt_ids
    return json.dumps(meta, ensure_ascii=False) if meta else ""


async def _alternatives(client: EngineClient, prompt: EngineRequest, ids: list[int], spec: BeamSpec,
                        aborted: asyncio.Event) -> tuple[list[TokenLogprob], Optional[int]]:
    """The most likely next tokens after `ids` (2 x width, or the client's top_logprobs if more),
    and how many of `ids` the prefix cache served. A step aborted in the engine (an abort another
    frontend worker sent by the search's id) aborts the search."""
    step = EngineRequest(sampling_params=spec.step_params, input_ids=ids, stream=False,
                         request_id=prompt.request_id, batch_item=prompt.batch_item)
    stream = client.generate(step)
    top: list[TokenLogprob] = []
    cached: Optional[int] = None
    try:
        async for chunk in stream:
            lps = chunk.logprobs(spec.step_params["top_logprobs_num"])
            if lps:
                top = lps[0].top
            cached = chunk.cached_tokens if chunk.cached_tokens is not None else cached
            if chunk.finish_reason == "abort":
                aborted.set()
    finally:
        await stream.aclose()
    return top, cached


async def _search(client: EngineClient, prompt: EngineRequest, spec: BeamSpec) -> list[EngineChunk]:
    # Held while the engine works for it: an abort after the last step would count a search
    # that it did not stop (review).
    async with client.hold(prompt) as aborted:
        ids, best, cached = await _search_held(client, prompt, spec, aborted)
    paths = [b.path() for b in best]
    texts = await _all([
        client.detokenize([b.token for b in (path[:-1] if path and path[-1].finish == "stop" and not spec.keep_stop
                                             else path)],
                          skip_special_tokens=spec.skip_special_tokens,
                          spaces_between_special_tokens=spec.spaces_between_special_tokens, validate=False)
        for path in paths
    ])
    return [
        EngineChunk(text, [b.token for b in path], beam.finish, len(ids), beam.length,
                    _meta(path, spec.top_logprobs, cached, ids if spec.prompt_token_ids else None))
        for beam, path, text in zip(best, paths, texts)
    ]


async def _search_held(client: EngineClient, prompt: EngineRequest, spec: BeamSpec,
                       aborted: asyncio.Event) -> tuple[list[int], list[_Beam], Optional[int]]:
    """The prompt's ids, its best beams (best first) and the prefix-cache hits of its first step."""
    ids = list(prompt.input_ids) if prompt.input_ids is not None else await client.tokenize(prompt)
    steps = spec.max_tokens
    if spec.max_model_len is not None:
        room = spec.max_model_len - len(ids)
        if room < 1:
            raise context_exceeded(spec.max_model_len, len(ids), detail="at least one token must be left to generate",
                                   param="messages" if prompt.messages is not None else "prompt")
        steps = room if steps is None else min(steps, room)
    if steps is None:
        raise bad_request("use_beam_search needs max_tokens when the model's context length is unknown",
                          param="max_tokens")
    live, finished = [_Beam()], []
    cached: Optional[int] = None
    for step in range(steps):
        if aborted.is_set():
            break
        found = await _all([_alternatives(client, prompt, ids + beam.tokens(), spec, aborted) for beam in live])
        if aborted.is_set():
            break  # this step's alternatives are partial: the beams stay as they were
        tops = [top for top, _ in found]
        if step == 0:
            cached = found[0][1]
        grown = []
        for beam, top in zip(live, tops):
            for alt in top[: 2 * spec.width]:
                if alt.logprob is None:
                    continue
                child = _Beam(beam, alt.token_id, beam.cum_logprob + alt.logprob, beam.length + 1,
                              logprob=TokenLogprob(alt.token_id, alt.logprob, alt.text, top))
                if alt.token_id in spec.stop_ids or (alt.token_id in spec.eos and not spec.ignore_eos):
                    child.finish = "stop"
                    finished.append(child)
                else:
                    grown.append(child)
        grown.sort(key=lambda b: _score(b, len(ids), spec.length_penalty), reverse=True)
        live = grown[: spec.width]
        if not live:
            break
    if aborted.is_set():
        # Ended by /abort_request: the live beams end "abort" with what they have, as a single
        # request keeps what it generated; before the first step that is the empty beam, per choice.
        live = [_Beam(beam.parent, beam.token, beam.cum_logprob, beam.length, "abort", beam.logprob) for beam in live]
        live += [_Beam(finish="abort")] * (spec.width - len(live) - len(finished))
    best = sorted(finished + live, key=lambda b: _score(b, len(ids), spec.length_penalty), reverse=True)[: spec.width]
    return ids, best, cached


async def beam_search_choices(client: EngineClient, prompts: Sequence[EngineRequest], spec: BeamSpec) -> AsyncIterator[Item]:
    """Each prompt's best beams, as choices prompt * width + rank (best first), one chunk each."""
    try:
        async with asyncio.timeout(spec.timeout):
            results = await _all([_search(client, p, spec) for p in prompts])
    except TimeoutError:
        # Its steps were cancelled on the way out, so aborted in the engine as a timed-out stream is.
        raise timed_out(f"Triton request timed out: the beam search ran past the stream timeout "
                        f"({spec.timeout:g} s)") from None
    for p, chunks in enumerate(results):
        for rank, chunk in enumerate(chunks):
            yield p * spec.width + rank, chunk

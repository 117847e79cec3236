"""The API contract, parameter by parameter: every request parameter the seeds name works or is
refused by name; none is silently ignored.

The seeds (../shared/seeds/, described in ../shared/README.md) are the spec of the user-facing
APIs. For each parameter they name, sent with a valid, non-default value, exactly one holds:

* REFUSED: HTTP 400 whose OpenAI error body names the parameter, and nothing reaches the engine.
* ENGINE: the value is in the EngineRequest sent to Triton (in `sampling_params` under its SGLang
  name, or in another field), and the engine's own parser (`parse_sampling_params`) accepts the
  `sampling_parameters` that goes on the wire.
* FRONTEND: the frontend acts on it itself (rendering, best_of, beam search, ids, tool-call
  parsing); the case's check looks at the effect.
* NO_EFFECT: accepted, with the reason it changes nothing written in ACCEPTED_WITHOUT_EFFECT.

"Never silently ignored" is checked directly too: every accepted request is sent again without
the parameter, and the two exchanges (what reached the engine, and the response) must differ,
or, for NO_EFFECT, must not. Every sampling_parameters payload that reaches the fake engine is
run through the engine's parser, the baselines included.

The engine is `FakeLLMClient` (no Triton, no model); the app runs under uvicorn on loopback.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import httpx
import pytest
from tritonclient.utils import deserialize_bytes_tensor

from backend.sampling_params import SamplingParams, parse_sampling_params
from openai_frontend.engine_types import EngineChunk, EngineRequest
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, ParseFunctionCallRequest
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import FakeLLMClient, serve_in_thread, text_chunks
from openai_frontend.triton_client import build_inputs

# ---------------------------------------------------------------------------------------------
# The contract: request parameter names, as the seeds give them
# ---------------------------------------------------------------------------------------------

# /generate top-level fields: 000 and 001 (the `/generate` table), 002 (GenerateReqInput).
# None of them is marked internal or engine-only there, so none is skipped.
GENERATE_FIELDS = [
    "text", "input_ids", "input_embeds", "image_data", "audio_data", "sampling_params", "rid",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
    "return_text_in_logprobs", "stream", "lora_path", "custom_logit_processor",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
]

# /generate `sampling_params` keys: 000 and 001 (core, penalizers, constrained decoding, other
# options), 002 (the older SamplingParams list, a subset).
GENERATE_SAMPLING_PARAMS = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "json_schema", "regex", "ebnf", "structural_tag", "n", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params",
]

# /v1/chat/completions, OpenAI's own request fields (003 builds on them: "compatible with
# OpenAI's Chat Completions API"). verbosity, prompt_cache_key and safety_identifier are OpenAI's
# newest, typed parameters of the current SDK.
OPENAI_CHAT_FIELDS = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
    "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
    "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
    "verbosity", "web_search_options",
]

# /v1/chat/completions, vLLM's extras: 003, "Chat API", sampling and extra parameters (none is
# marked internal there).
VLLM_CHAT_EXTRAS = [
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "echo",
    "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids",
]

# /v1/chat/completions, SGLang's extras: 000's OpenAI example passes them in extra_body.
SGLANG_CHAT_EXTRAS = ["custom_logit_processor", "custom_params"]

# /v1/completions, OpenAI's own request fields (003: "compatible with OpenAI's Completions API").
OPENAI_COMPLETION_FIELDS = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
    "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user",
]

# /v1/completions, vLLM's extras: 003, "Completions API", sampling and extra parameters (none is
# marked internal there).
VLLM_COMPLETION_EXTRAS = [
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
    "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "priority",
    "logits_processors", "return_tokens_as_token_ids",
]

# /parse_function_call: 004 (SGLang's native function-call parsing).
PARSE_FUNCTION_CALL_FIELDS = ["text", "tool_call_parser", "tools"]

# protocol.py accepts these though no seed names them (SGLang's OpenAI extras, vLLM's names on the
# other endpoint, the reasoning switches, vLLM's newer cache_salt, structured_outputs, return_token_ids, bad_words
# and thinking_token_budget). They are held to the same rule, so that every field
# the frontend accepts is covered (test_every_accepted_field_is_covered).
BEYOND_SEEDS = {
    "generate": ["video_data", "priority"],
    "chat": ["prompt_cache_retention", "allowed_token_ids", "stop_regex", "regex", "ebnf", "json_schema", "no_stop_trim", "rid", "lora_path",
             "return_hidden_states", "separate_reasoning", "stream_reasoning", "include_reasoning", "cache_salt",
             "structured_outputs", "return_token_ids", "bad_words", "thinking_token_budget"],
    "completions": ["request_id", "stop_regex", "regex", "ebnf", "json_schema", "structural_tag", "no_stop_trim", "rid",
                    "lora_path", "custom_logit_processor", "custom_params", "return_hidden_states", "cache_salt",
                    "structured_outputs", "return_token_ids", "bad_words"],
    "parse_function_call": [],
}

CONTRACT: dict[str, list[str]] = {
    "generate": GENERATE_FIELDS,
    "generate.sampling_params": GENERATE_SAMPLING_PARAMS,
    "chat": OPENAI_CHAT_FIELDS + VLLM_CHAT_EXTRAS + SGLANG_CHAT_EXTRAS,
    "completions": OPENAI_COMPLETION_FIELDS + VLLM_COMPLETION_EXTRAS,
    "parse_function_call": PARSE_FUNCTION_CALL_FIELDS,
}

# Accepted, and by design no effect. The test proves the "no effect" (same exchange as without).
ACCEPTED_WITHOUT_EFFECT: dict[str, dict[str, str]] = {
    "chat": {
        "user": "OpenAI's end-user id for the provider's abuse monitoring; never changes the output "
                "(vLLM accepts and ignores it too)",
        "metadata": "tags for OpenAI's stored completions; nothing is stored here (store: true is refused)",
        "safety_identifier": "OpenAI's successor of `user` (an end-user id for abuse monitoring); never "
                             "changes the output",
        "prompt_cache_key": "a hint OpenAI routes requests by for cache hits; the prefix cache here is "
                            "automatic and shared, so the hint changes nothing",
        "prompt_cache_retention": "'in_memory' is what the prefix cache here is (other values are refused)",
    },
    "completions": {
        "user": "OpenAI's end-user id for the provider's abuse monitoring; never changes the output "
                "(vLLM accepts and ignores it too)",
    },
}

# ---------------------------------------------------------------------------------------------
# The fake engine and the servers
# ---------------------------------------------------------------------------------------------

MODEL = "contract-model"
ADAPTER = "sql-lora"  # a LoRA adapter the server lists: `model` may name it (vLLM)
PROMPT = "Once upon"
MESSAGES = [{"role": "user", "content": "Say hello"}]
PREFILL = MESSAGES + [{"role": "assistant", "content": "Sure: "}]
PIECES = ["Hel", "lo", ",", " wor", "ld", "!"]
OUTPUT = "".join(PIECES)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
STRUCTURAL_TAG = json.dumps({"type": "structural_tag", "triggers": ["<a>"],
                             "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}]})
CUSTOM_LOGIT_PROCESSOR = json.dumps({"callable": "DeterministicLogitProcessor"})
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
REASONING = ["<think>", "Let me ", "think.", "</think>", "Hello", "!"]

EOS = ord("Z")  # the fake tokenizer's tokens are bytes: "Z" ends a sequence (generation_config.json)


def _logprob_meta(i: int, piece: str) -> str:
    """Engine logprobs in SGLang's meta_info form; the first chunk also scores the prompt."""
    meta: dict[str, Any] = {
        "output_token_logprobs": [[-0.5, 100 + i, piece]],
        "output_top_logprobs": [[[-0.5, 100 + i, piece], [-1.5, 7, "alt"], [-2.5, 8, "other"]]],
    }
    if i == 0:
        meta["input_token_logprobs"] = [[None, 1, "<s>"], [-2.0, 2, "x"]]
        meta["input_top_logprobs"] = [None, [[-2.0, 2, "x"]]]
    return json.dumps(meta)


def _beam_step(ids: list[int]) -> list[EngineChunk]:
    """One beam search step. Ending now ("Z") scores -1.0 and "A" then "B" -1.02, so which one wins
    depends on length_penalty (vLLM's score: cumulative logprob / length ** length_penalty)."""
    alts = [("B", -0.51), ("Z", -3.0)] if ids[-1] == ord("A") else [("Z", -1.0), ("A", -0.51)]
    top = [[lp, ord(t), t] for t, lp in alts]
    meta = json.dumps({"output_token_logprobs": [top[0]], "output_top_logprobs": [top]})
    return [EngineChunk(alts[0][0], [ord(alts[0][0])], "length", len(ids), 1, meta)]


def _script(pieces: list[str]) -> Callable[[EngineRequest], list[EngineChunk]]:
    def script(req: EngineRequest) -> list[EngineChunk]:
        sp = req.sampling_params
        if sp.get("max_new_tokens") == 1 and "top_logprobs_num" in sp and req.input_ids is not None:
            return _beam_step(req.input_ids)
        out = [WEATHER_CALL, "\n", TIME_CALL] if req.tools else pieces
        return text_chunks(out, meta=[_logprob_meta(i, p) for i, p in enumerate(out)])

    return script


@dataclass
class Server:
    url: str
    fake: FakeLLMClient
    http: httpx.Client


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    # The engine's engine_info gives beam search its end-of-sequence id; the model files have no
    # tokenizer.json, so token texts come from the engine's logprobs.
    files = tmp_path_factory.mktemp("model")
    (files / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    main = Settings(model_name=MODEL, tool_call_parser="qwen25", lora_modules=(ADAPTER,),
                    tokenizer_path=str(files), enable_custom_logit_processor=True)
    # A reasoning parser changes every chat response (and wraps constraints), so it gets its own app.
    reasoning = Settings(model_name=MODEL, reasoning_parser="qwen3")
    fakes = {"main": FakeLLMClient(_script(PIECES), eos_token_ids=[EOS]), "reasoning": FakeLLMClient(_script(REASONING))}
    with serve_in_thread(create_app(main, client=fakes["main"])) as main_url, \
            serve_in_thread(create_app(reasoning, client=fakes["reasoning"])) as reasoning_url, \
            httpx.Client(timeout=10) as http:
        yield {"main": Server(main_url, fakes["main"], http),
               "reasoning": Server(reasoning_url, fakes["reasoning"], http)}


# ---------------------------------------------------------------------------------------------
# One exchange: the response, and what reached the engine
# ---------------------------------------------------------------------------------------------


def wire_sampling_params(req: EngineRequest) -> dict[str, Any]:
    """The `sampling_parameters` tensor the Triton client builds for `req` (n included), decoded."""
    tensor = next(t for t in build_inputs(req) if t.name() == "sampling_parameters")
    return json.loads(deserialize_bytes_tensor(tensor._get_content())[0])


@dataclass
class Exchange:
    status: int
    body: Any  # the JSON body, or a stream's events
    requests: list[EngineRequest]
    wire: list[dict[str, Any]] = field(default_factory=list)
    parsed: list[SamplingParams] = field(default_factory=list)

    @property
    def request(self) -> EngineRequest:
        """The handler's request (beam search steps and tokenize calls come after it)."""
        return self.requests[0]

    @property
    def sp(self) -> SamplingParams:
        """The first request's sampling parameters as the engine parsed them."""
        return self.parsed[0]

    @property
    def choices(self) -> list[dict[str, Any]]:
        return self.body["choices"]

    def texts(self) -> list[str]:
        if isinstance(self.body, list):  # a stream: the deltas joined per choice
            out: dict[int, str] = {}
            for event in self.body:
                for c in event.get("choices", ()):
                    piece = c["delta"].get("content") if "delta" in c else c.get("text")
                    out[c["index"]] = out.get(c["index"], "") + (piece or "")
            return [out[i] for i in sorted(out)]
        return [c["message"]["content"] if "message" in c else c["text"] for c in self.choices]


def send(server: Server, path: str, body: dict[str, Any]) -> Exchange:
    server.fake.requests.clear()
    r = server.http.post(server.url + path, json=body)
    if body.get("stream") and r.status_code == 200:
        payload: Any = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    else:
        payload = r.json()
    ex = Exchange(r.status_code, payload, list(server.fake.requests))
    for req in ex.requests:
        wire = wire_sampling_params(req)
        ex.wire.append(wire)
        ex.parsed.append(parse_sampling_params(wire))  # the engine refuses what it cannot honour
    return ex


_VOLATILE_KEYS = {"created", "e2e_latency"}
_GENERATED_IDS = [(re.compile(r"\b[0-9a-f]{32}\b"), "<request-id>"), (re.compile(r"call_[0-9a-f]{24}"), "call_<id>")]


def observable(ex: Exchange) -> str:
    """Everything a parameter may change, less what differs between any two requests."""
    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: scrub(v) for k, v in value.items() if k not in _VOLATILE_KEYS}
        if isinstance(value, list):
            return [scrub(v) for v in value]
        return value

    seen = {"status": ex.status, "body": scrub(ex.body), "wire": ex.wire,
            "requests": [dataclasses.asdict(r) for r in ex.requests]}
    text = json.dumps(seen, sort_keys=True, default=str)
    for pattern, replacement in _GENERATED_IDS:
        text = pattern.sub(replacement, text)
    return text


# ---------------------------------------------------------------------------------------------
# Cases: one per parameter and endpoint
# ---------------------------------------------------------------------------------------------

REFUSED, ENGINE, FRONTEND, NO_EFFECT = "refused", "engine", "frontend", "accepted without effect"
DROP = object()  # in a case body: leave this key of the endpoint's base body out
Check = Callable[[Exchange], bool]


@dataclass(frozen=True)
class Case:
    outcome: str
    body: dict[str, Any]  # merged over the endpoint's base body
    check: Optional[Check] = None
    baseline: Optional[dict[str, Any]] = None  # default: `body` without the parameter
    app: str = "main"


def refused(**body: Any) -> Case:
    return Case(REFUSED, body)


def engine(check: Check, **body: Any) -> Case:
    return Case(ENGINE, body, check)


def frontend(check: Check, app: str = "main", **body: Any) -> Case:
    return Case(FRONTEND, body, check, app=app)


def no_effect(**body: Any) -> Case:
    return Case(NO_EFFECT, body)


def sp_has(**expected: Any) -> Check:
    """The engine parsed these SamplingParams values out of the wire."""
    return lambda ex: all(getattr(ex.sp, k) == v for k, v in expected.items())


def request_has(**expected: Any) -> Check:
    """The EngineRequest carries these field values."""
    return lambda ex: all(getattr(ex.request, k) == v for k, v in expected.items())


def both(*checks: Check) -> Check:
    return lambda ex: all(c(ex) for c in checks)


def _tool_calls(ex: Exchange) -> list[dict[str, Any]]:
    return ex.choices[0]["message"].get("tool_calls") or []


def _reasoning_events(ex: Exchange) -> int:
    return sum(1 for e in ex.body for c in e.get("choices", ()) if c["delta"].get("reasoning_content"))


def _beam_steps(ex: Exchange) -> list[dict[str, Any]]:
    return [w for r, w in zip(ex.requests, ex.wire) if r.input_ids is not None and w.get("max_new_tokens") == 1]


def _shared_cases(chat: bool) -> dict[str, Case]:
    """Parameters chat and completions share (OpenAI's, vLLM's, SGLang's extras)."""
    def token_names(ex: Exchange) -> list[str]:
        lp = ex.choices[0]["logprobs"]
        return [t["token"] for t in lp["content"]] if chat else lp["tokens"]

    def prompt_logprobs(ex: Exchange) -> Any:
        return ex.body["prompt_logprobs"] if chat else ex.choices[0]["prompt_logprobs"]

    logprobs = {"logprobs": True} if chat else {"logprobs": 1}
    return {
        # A LoRA adapter's name as the model (vLLM) selects that adapter.
        "model": engine(both(sp_has(lora_path=ADAPTER), lambda ex: ex.body["model"] == ADAPTER), model=ADAPTER),
        "frequency_penalty": engine(sp_has(frequency_penalty=0.5), frequency_penalty=0.5),
        "presence_penalty": engine(sp_has(presence_penalty=0.5), presence_penalty=0.5),
        "logit_bias": engine(sp_has(logit_bias={5: 10.0}), logit_bias={"5": 10}),
        "max_tokens": engine(sp_has(max_new_tokens=12), max_tokens=12),
        "n": engine(both(request_has(n=2), sp_has(n=2), lambda ex: len(ex.choices) == 2), n=2),
        "seed": engine(sp_has(seed=42), seed=42),
        "stop": engine(sp_has(stop=["END"]), stop=["END"]),
        "stream": engine(both(request_has(stream=True), lambda ex: ex.texts() == [OUTPUT]), stream=True),
        "stream_options": frontend(lambda ex: ex.body[-1]["choices"] == [] and ex.body[-1]["usage"]["completion_tokens"]
                                   == len(PIECES), stream=True, stream_options={"include_usage": True}),
        "temperature": engine(sp_has(temperature=0.5), temperature=0.5),
        "top_p": engine(sp_has(top_p=0.9), top_p=0.9),
        "user": no_effect(user="user-1234"),
        "response_format": engine(
            lambda ex: json.loads(ex.sp.json_schema) == SCHEMA,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}),
        # best_of samples go to the engine as n, with their logprobs to rank them; n come back.
        "best_of": frontend(lambda ex: ex.request.n == 2 and ex.sp.return_logprob and len(ex.choices) == 1, best_of=2),
        "use_beam_search": frontend(lambda ex: ex.texts() == ["AB"] and len(_beam_steps(ex)) == 2,
                                    use_beam_search=True, max_tokens=2),
        "top_k": engine(sp_has(top_k=20), top_k=20),
        "min_p": engine(sp_has(min_p=0.1), min_p=0.1),
        "repetition_penalty": engine(sp_has(repetition_penalty=1.1), repetition_penalty=1.1),
        # 0: beams ranked by their plain sum, so ending at once (-1.0) beats "AB" (-1.02).
        "length_penalty": frontend(lambda ex: ex.texts() == [""] and ex.choices[0]["finish_reason"] == "stop",
                                   use_beam_search=True, max_tokens=2, length_penalty=0.0),
        "stop_token_ids": engine(sp_has(stop_token_ids=[13]), stop_token_ids=[13]),
        "include_stop_str_in_output": engine(sp_has(include_stop_str_in_output=True), include_stop_str_in_output=True),
        "ignore_eos": engine(sp_has(ignore_eos=True), ignore_eos=True),
        "min_tokens": engine(sp_has(min_tokens=2), min_tokens=2),
        "skip_special_tokens": engine(sp_has(skip_special_tokens=False), skip_special_tokens=False),
        "spaces_between_special_tokens": engine(sp_has(spaces_between_special_tokens=False),
                                                spaces_between_special_tokens=False),
        "truncate_prompt_tokens": engine(sp_has(truncate_prompt_tokens=4), truncate_prompt_tokens=4),
        "allowed_token_ids": engine(sp_has(allowed_token_ids=[5, 6]), allowed_token_ids=[5, 6]),
        "prompt_logprobs": engine(both(sp_has(return_logprob=True, logprob_start_len=0, top_logprobs_num=1),
                                       lambda ex: prompt_logprobs(ex)[1]["2"]["logprob"] == -2.0), prompt_logprobs=1),
        "guided_json": engine(lambda ex: json.loads(ex.sp.json_schema) == SCHEMA, guided_json=SCHEMA),
        "guided_regex": engine(sp_has(regex="(yes|no)"), guided_regex="(yes|no)"),
        "guided_choice": engine(sp_has(ebnf='root ::= "yes" | "no"'), guided_choice=["yes", "no"]),
        "guided_grammar": engine(sp_has(ebnf='root ::= "a" | "b"'), guided_grammar='root ::= "a" | "b"'),
        "structural_tag": engine(sp_has(structural_tag=STRUCTURAL_TAG), structural_tag=STRUCTURAL_TAG),
        # The engine's grammar backend is xgrammar; vLLM's other backends are refused by name.
        "guided_decoding_backend": refused(guided_decoding_backend="outlines"),
        "guided_whitespace_pattern": engine(sp_has(whitespace_pattern="[ ]?"), guided_json=SCHEMA,
                                            guided_whitespace_pattern="[ ]?"),
        "priority": engine(sp_has(priority=1), priority=1),
        "logits_processors": engine(sp_has(logits_processors=["my_module.MyLogitsProcessor"]),
                                    logits_processors=["my_module.MyLogitsProcessor"]),
        "return_tokens_as_token_ids": frontend(
            lambda ex: token_names(ex)[0] == "token_id:100" and not ex.sp.return_text_in_logprobs,
            return_tokens_as_token_ids=True, **logprobs),
        "request_id": frontend(lambda ex: ex.request.request_id == "req-42" and ex.body["id"].endswith("-req-42"),
                               request_id="req-42"),
        "rid": frontend(lambda ex: ex.request.request_id == "rid-42" and ex.body["id"].endswith("-rid-42"),
                        rid="rid-42"),
        "stop_regex": engine(sp_has(stop_regex=["E[A-Z]D"]), stop_regex="E[A-Z]D"),
        "regex": engine(sp_has(regex="(yes|no)"), regex="(yes|no)"),
        "ebnf": engine(sp_has(ebnf='root ::= "a"'), ebnf='root ::= "a"'),
        "json_schema": engine(lambda ex: json.loads(ex.sp.json_schema) == SCHEMA, json_schema=json.dumps(SCHEMA)),
        "no_stop_trim": engine(sp_has(no_stop_trim=True), no_stop_trim=True),
        "lora_path": engine(sp_has(lora_path=ADAPTER), lora_path=ADAPTER),
        "custom_logit_processor": engine(sp_has(custom_logit_processor=CUSTOM_LOGIT_PROCESSOR),
                                         custom_logit_processor=CUSTOM_LOGIT_PROCESSOR),
        "custom_params": engine(sp_has(custom_params={"token_id": 5}), custom_logit_processor=CUSTOM_LOGIT_PROCESSOR,
                                custom_params={"token_id": 5}),
        "return_hidden_states": engine(both(sp_has(return_hidden_states=True),
                                            lambda ex: ex.choices[0]["hidden_states"] == []),
                                       return_hidden_states=True),
        "cache_salt": engine(sp_has(cache_salt="tenant-a"), cache_salt="tenant-a"),
        "structured_outputs": engine(sp_has(regex="(yes|no)"), structured_outputs={"regex": "(yes|no)"}),
        "bad_words": engine(sp_has(bad_words=["spam"]), bad_words=["spam"]),
        "return_token_ids": engine(both(sp_has(return_prompt_token_ids=True),
                                        lambda ex: isinstance(ex.choices[0]["token_ids"], list)),
                                   return_token_ids=True),
    }


CHAT_CASES: dict[str, Case] = {
    **_shared_cases(chat=True),
    "messages": engine(request_has(messages=PREFILL), messages=PREFILL),
    "logprobs": engine(both(sp_has(return_logprob=True),
                            lambda ex: [t["token"] for t in ex.choices[0]["logprobs"]["content"]] == PIECES),
                       logprobs=True),
    "top_logprobs": engine(both(sp_has(top_logprobs_num=2),
                                lambda ex: len(ex.choices[0]["logprobs"]["content"][0]["top_logprobs"]) == 2),
                           logprobs=True, top_logprobs=2),
    "max_completion_tokens": engine(sp_has(max_new_tokens=12), max_completion_tokens=12),
    # The qwen25 parser turns the fake's two <tool_call> blocks into tool_calls.
    "tools": engine(both(request_has(tools=[WEATHER, TIME]),
                         lambda ex: [c["function"]["name"] for c in _tool_calls(ex)] == ["get_weather", "get_time"]),
                    tools=[WEATHER, TIME]),
    # A named function is forced by a structural tag in the model's own call format.
    "tool_choice": engine(lambda ex: json.loads(ex.sp.structural_tag)["format"]["begin"].endswith(
                              '{"name": "get_weather", "arguments": '),
                          tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "parallel_tool_calls": frontend(lambda ex: [c["function"]["name"] for c in _tool_calls(ex)] == ["get_weather"],
                                    tools=[WEATHER, TIME], parallel_tool_calls=False),
    "metadata": no_effect(metadata={"project": "contract"}),
    "store": refused(store=True),  # store: false is accepted: it is what happens
    "service_tier": refused(service_tier="flex"),  # "auto" and "default" are accepted: the one tier there is
    "audio": refused(audio={"voice": "alloy", "format": "wav"}, modalities=["text", "audio"]),
    "modalities": refused(modalities=["text", "audio"]),  # ["text"] is accepted: it is what happens
    # Predicted Outputs: the text travels to the engine, which drafts from it.
    "prediction": engine(sp_has(prediction="Hello"), prediction={"type": "content", "content": [{"type": "text", "text": "Hel"},
                                                                                        {"type": "text", "text": "lo"}]}),
    "reasoning_effort": engine(request_has(chat_template_kwargs={"reasoning_effort": "low"}), reasoning_effort="low"),
    "web_search_options": refused(web_search_options={"search_context_size": "low"}),
    "functions": refused(functions=[WEATHER["function"]]),
    "function_call": refused(function_call="auto"),
    "verbosity": refused(verbosity="low"),
    "prompt_cache_key": no_effect(prompt_cache_key="contract"),
    "safety_identifier": no_effect(safety_identifier="user-hash"),
    "prompt_cache_retention": no_effect(prompt_cache_retention="in_memory"),
    # vLLM: the reply starts with the last message when it is the assistant's.
    "echo": frontend(lambda ex: ex.texts() == ["Sure: " + OUTPUT], messages=PREFILL, echo=True),
    "add_generation_prompt": engine(request_has(add_generation_prompt=False), add_generation_prompt=False),
    "continue_final_message": engine(request_has(continue_final_message=True), messages=PREFILL,
                                     add_generation_prompt=False, continue_final_message=True),
    "add_special_tokens": engine(request_has(add_special_tokens=True), add_special_tokens=True),
    "documents": engine(request_has(documents=[{"title": "t", "text": "x"}]), documents=[{"title": "t", "text": "x"}]),
    # Preprocessing renders it only where the operator trusts request templates, else refuses it.
    "chat_template": engine(request_has(chat_template="{{ messages[0].content }}"),
                            chat_template="{{ messages[0].content }}"),
    "chat_template_kwargs": engine(request_has(chat_template_kwargs={"enable_thinking": False}),
                                   chat_template_kwargs={"enable_thinking": False}),
    "mm_processor_kwargs": refused(mm_processor_kwargs={"num_crops": 4}),
    "separate_reasoning": frontend(lambda ex: ex.texts() == ["".join(REASONING)]
                                   and "reasoning_content" not in ex.choices[0]["message"],
                                   app="reasoning", separate_reasoning=False),
    "stream_reasoning": frontend(lambda ex: _reasoning_events(ex) == 1, app="reasoning", stream=True,
                                 stream_reasoning=False),
    "include_reasoning": frontend(lambda ex: ex.texts() == ["Hello!"]
                                  and "reasoning_content" not in ex.choices[0]["message"],
                                  app="reasoning", include_reasoning=False),
    # vLLM's newer reasoning cap: the engine forces the parser's closing marker after 8 tokens.
    "thinking_token_budget": Case(ENGINE, {"thinking_token_budget": 8},
                                  lambda ex: ex.sp.thinking_budget.budget == 8 and ex.sp.thinking_budget.end == "</think>",
                                  app="reasoning"),
}

COMPLETION_CASES: dict[str, Case] = {
    **_shared_cases(chat=False),
    "prompt": engine(request_has(text_input="Paris is"), prompt="Paris is"),
    "echo": frontend(lambda ex: ex.texts() == [PROMPT + OUTPUT], echo=True),
    "logprobs": engine(both(sp_has(return_logprob=True, top_logprobs_num=2),
                            lambda ex: ex.choices[0]["logprobs"]["tokens"] == PIECES
                            and len(ex.choices[0]["logprobs"]["top_logprobs"][0]) == 2), logprobs=2),
    "suffix": refused(suffix=" The end."),
    "add_special_tokens": engine(request_has(add_special_tokens=False), add_special_tokens=False),
}


def _sampling(key: str, value: Any, check: Optional[Check] = None, **top: Any) -> Case:
    """A /generate sampling_params key: `top` are top-level fields it needs."""
    return Case(ENGINE, {**top, "sampling_params": {key: value}}, check or sp_has(**{key: value}), baseline=top)


GENERATE_CASES: dict[str, Case] = {
    "text": engine(request_has(text_input="Paris is"), text="Paris is"),
    "input_ids": Case(ENGINE, {"text": DROP, "input_ids": [1, 2, 3]}, request_has(input_ids=[1, 2, 3])),
    "input_embeds": Case(ENGINE, {"text": DROP, "input_embeds": [[0.5, 0.25], [0.125, 1.0]]},
                         request_has(input_embeds=[[0.5, 0.25], [0.125, 1.0]])),
    "image_data": refused(image_data="example_image.png"),
    "audio_data": refused(audio_data="example_audio.wav"),
    "video_data": refused(video_data="example_video.mp4"),
    "sampling_params": engine(sp_has(temperature=0.5, max_new_tokens=8),
                              sampling_params={"temperature": 0.5, "max_new_tokens": 8}),
    "rid": frontend(lambda ex: ex.request.request_id == "rid-42" and ex.body["meta_info"]["id"] == "rid-42",
                    rid="rid-42"),
    "return_logprob": engine(both(sp_has(return_logprob=True),
                                  lambda ex: [t[2] for t in ex.body["meta_info"]["output_token_logprobs"]] == PIECES),
                             return_logprob=True),
    "logprob_start_len": engine(both(sp_has(logprob_start_len=0),
                                     lambda ex: ex.body["meta_info"]["input_token_logprobs"][1][0] == -2.0),
                                return_logprob=True, logprob_start_len=0),
    "top_logprobs_num": engine(both(sp_has(top_logprobs_num=2),
                                    lambda ex: "output_top_logprobs" in ex.body["meta_info"]),
                               return_logprob=True, top_logprobs_num=2),
    "token_ids_logprob": engine(sp_has(token_ids_logprob=[5, 7]), return_logprob=True, token_ids_logprob=[5, 7]),
    "return_text_in_logprobs": engine(sp_has(return_text_in_logprobs=True), return_logprob=True,
                                      return_text_in_logprobs=True),
    "stream": engine(both(request_has(stream=True), lambda ex: ex.body[-1]["text"] == OUTPUT), stream=True),
    "lora_path": engine(sp_has(lora_path=ADAPTER), lora_path=ADAPTER),
    "custom_logit_processor": engine(sp_has(custom_logit_processor=CUSTOM_LOGIT_PROCESSOR),
                                     custom_logit_processor=CUSTOM_LOGIT_PROCESSOR),
    "return_hidden_states": engine(both(sp_has(return_hidden_states=True),
                                        lambda ex: ex.body["meta_info"]["hidden_states"] == []),
                                   return_hidden_states=True),
    "return_routed_experts": refused(return_routed_experts=True),
    "routed_experts_start_len": refused(routed_experts_start_len=4),
    # Newer SGLang's top-level priority (not in the seeds): refused, pointing at sampling_params.
    "priority": refused(priority=1),
}

GENERATE_SAMPLING_CASES: dict[str, Case] = {
    "max_new_tokens": _sampling("max_new_tokens", 12),
    "stop": _sampling("stop", ["END"]),
    "stop_token_ids": _sampling("stop_token_ids", [13]),
    "stop_regex": _sampling("stop_regex", [r"\d{3}"]),
    "temperature": _sampling("temperature", 0.5),
    "top_p": _sampling("top_p", 0.9),
    "top_k": _sampling("top_k", 20),
    "min_p": _sampling("min_p", 0.1),
    "frequency_penalty": _sampling("frequency_penalty", 0.5),
    "presence_penalty": _sampling("presence_penalty", 0.5),
    "repetition_penalty": _sampling("repetition_penalty", 1.1),
    "min_new_tokens": _sampling("min_new_tokens", 2),
    "json_schema": _sampling("json_schema", json.dumps(SCHEMA)),
    "regex": _sampling("regex", "(France|England)"),
    "ebnf": _sampling("ebnf", 'root ::= "Hello" | "Hi" | "Hey"'),
    "structural_tag": _sampling("structural_tag", STRUCTURAL_TAG),
    # n leaves sampling_params for EngineRequest.n, and the Triton client puts it back on the wire.
    "n": _sampling("n", 2, both(request_has(n=2), sp_has(n=2),
                                lambda ex: [o["text"] for o in ex.body] == [OUTPUT] * 2)),
    "ignore_eos": _sampling("ignore_eos", True),
    "skip_special_tokens": _sampling("skip_special_tokens", False),
    "spaces_between_special_tokens": _sampling("spaces_between_special_tokens", False),
    "no_stop_trim": _sampling("no_stop_trim", True),
    "custom_params": _sampling("custom_params", {"token_id": 5}, custom_logit_processor=CUSTOM_LOGIT_PROCESSOR),
}

PYTHONIC_CALL = "[get_weather(city='Paris')]"

PARSE_FUNCTION_CALL_CASES: dict[str, Case] = {
    "text": frontend(lambda ex: ex.body == {"normal_text": "It is sunny.", "calls": []},
                     text="It is sunny.", tools=[WEATHER]),
    "tool_call_parser": frontend(lambda ex: [c["name"] for c in ex.body["calls"]] == ["get_weather"],
                                 text=PYTHONIC_CALL, tool_call_parser="pythonic", tools=[WEATHER]),
    # Calls to functions not in `tools` are dropped, as SGLang does.
    "tools": frontend(lambda ex: [(c["name"], json.loads(c["parameters"])) for c in ex.body["calls"]]
                      == [("get_weather", {"city": "Paris"})], tools=[WEATHER]),
}

CASES: dict[str, dict[str, Case]] = {
    "generate": GENERATE_CASES,
    "generate.sampling_params": GENERATE_SAMPLING_CASES,
    "chat": CHAT_CASES,
    "completions": COMPLETION_CASES,
    "parse_function_call": PARSE_FUNCTION_CALL_CASES,
}

PATHS = {"generate": "/generate", "generate.sampling_params": "/generate", "chat": "/v1/chat/completions",
         "completions": "/v1/completions", "parse_function_call": "/parse_function_call"}

BASE_BODIES: dict[str, dict[str, Any]] = {
    "generate": {"text": PROMPT},
    "generate.sampling_params": {"text": PROMPT},
    "chat": {"model": MODEL, "messages": MESSAGES},
    "completions": {"model": MODEL, "prompt": PROMPT},
    "parse_function_call": {"text": WEATHER_CALL},
}


def request_body(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    merged = {**BASE_BODIES[endpoint], **body}
    return {k: v for k, v in merged.items() if v is not DROP}


def baseline_body(name: str, case: Case) -> dict[str, Any]:
    if case.baseline is not None:
        return case.baseline
    return {k: v for k, v in case.body.items() if k != name and v is not DROP}


def _contract_params() -> list[Any]:
    params = []
    for endpoint, names in CONTRACT.items():
        for name in names + BEYOND_SEEDS.get(endpoint, []):
            params.append(pytest.param(endpoint, name, id=f"{endpoint}:{name}"))
    return params


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint, name", _contract_params())
def test_parameter_works_or_is_refused_by_name(servers: dict[str, Server], endpoint: str, name: str) -> None:
    case = CASES[endpoint].get(name)
    assert case is not None, f"{endpoint}: no case for '{name}', which the contract names"
    server = servers[case.app]
    path = PATHS[endpoint]
    ex = send(server, path, request_body(endpoint, case.body))

    if case.outcome == REFUSED:
        assert ex.status == 400, f"'{name}' was accepted ({ex.status}); the case says it is refused"
        error = ex.body["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == name or name in error["message"], f"the error does not name '{name}': {error}"
        assert not ex.requests, "a refused request must not reach the engine"
        return

    assert ex.status == 200, f"'{name}' was refused: {ex.body}"
    assert endpoint == "parse_function_call" or ex.requests, "nothing reached the engine"
    base = send(server, path, request_body(endpoint, baseline_body(name, case)))
    assert base.status == 200, f"the baseline without '{name}' failed: {base.body}"

    if case.outcome == NO_EFFECT:
        assert name in ACCEPTED_WITHOUT_EFFECT.get(endpoint, {}), f"'{name}' has no effect and no stated reason"
        assert observable(ex) == observable(base), f"'{name}' has an effect now: move it out of ACCEPTED_WITHOUT_EFFECT"
        return
    assert observable(ex) != observable(base), f"'{name}' changed nothing: it is silently ignored"
    assert case.check is not None and case.check(ex), (
        f"'{name}' did not have its effect; wire: {ex.wire}, response: {json.dumps(ex.body)[:2000]}"
    )


def test_every_accepted_field_is_covered() -> None:
    """A field added to protocol.py must get a case here: the rule holds for every accepted name."""
    for endpoint, model in [("generate", GenerateRequest), ("chat", ChatCompletionRequest),
                            ("completions", CompletionRequest), ("parse_function_call", ParseFunctionCallRequest)]:
        covered = set(CONTRACT[endpoint]) | set(BEYOND_SEEDS[endpoint])
        assert set(model.model_fields) <= covered, f"{endpoint}: not covered: {set(model.model_fields) - covered}"
        assert set(CASES[endpoint]) == covered, f"{endpoint}: cases without a contract entry or the reverse"
    assert set(GENERATE_SAMPLING_CASES) == set(GENERATE_SAMPLING_PARAMS)
    # What the engine is sent for /generate, it must know: no seed key falls through to its
    # "unknown sampling parameter" error.
    assert set(GENERATE_SAMPLING_PARAMS) <= set(SamplingParams.model_fields)


def test_no_effect_entries_have_reasons_and_cases() -> None:
    for endpoint, reasons in ACCEPTED_WITHOUT_EFFECT.items():
        for name, reason in reasons.items():
            assert reason.strip(), f"{endpoint}:{name} needs a reason"
            assert CASES[endpoint][name].outcome == NO_EFFECT, f"{endpoint}:{name} is listed but its case is not"
    for endpoint, cases in CASES.items():
        for name, case in cases.items():
            if case.outcome == NO_EFFECT:
                assert name in ACCEPTED_WITHOUT_EFFECT.get(endpoint, {}), f"{endpoint}:{name} has no stated reason"


def test_seed_names_are_in_the_seeds() -> None:
    """The lists above are the seeds' names, not invented ones (OpenAI's own fields excepted: the
    seeds refer to OpenAI's API for them)."""
    seeds = Path(__file__).resolve().parents[2] / "shared" / "seeds"
    if not seeds.is_dir():
        pytest.skip(f"no seeds at {seeds}")
    text = "".join(p.read_text() for p in sorted(seeds.glob("*.txt"))).replace("\\_", "_")
    openai_only = set(OPENAI_CHAT_FIELDS) | set(OPENAI_COMPLETION_FIELDS)
    named = [n for endpoint, names in CONTRACT.items() for n in names if n not in openai_only]
    assert [n for n in named if not re.search(rf"\b{re.escape(n)}\b", text)] == []


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_no_stop_trim_is_include_stop_str_in_output_under_beam_search(servers: dict[str, Server],
                                                                      endpoint: str) -> None:
    """Beam search reads vLLM's name for the flag; SGLang's must not be silently dropped there."""
    body = {"use_beam_search": True, "max_tokens": 2, "length_penalty": 0.0}  # the beam that ends at once wins
    texts = {flag: send(servers["main"], PATHS[endpoint], request_body(endpoint, {**body, flag: True})).texts()
             for flag in ("no_stop_trim", "include_stop_str_in_output")}
    assert texts["no_stop_trim"] == texts["include_stop_str_in_output"] == ["Z"]  # the end token's text kept

"""The OpenAI/SGLang frontend against a scripted engine client, through the official openai SDK.

The app runs under uvicorn on a loopback port (real HTTP, real disconnects); the engine is
`FakeLLMClient`, which yields scripted `EngineChunk`s and records requests and how streams ended.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from openai_frontend.engine_types import EngineChunk
from openai_frontend.errors import APIError
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import FakeLLMClient, infer_response, serve_in_thread, text_chunks

REPO_ROOT = Path(__file__).resolve().parents[1]
# The OpenAI endpoints ask for vLLM's repetition penalty, which counts prompt tokens too.
VLLM_REPETITION = {"repetition_penalty_counts_prompt": True}
MODEL = "demo-model"
MESSAGES = [{"role": "user", "content": "Say hello"}]
PIECES = ["Hel", "lo", ",", " wor", "ld", "!"]


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient()


@pytest.fixture(scope="module")
def base_url(fake):
    with serve_in_thread(create_app(Settings(model_name=MODEL), client=fake)) as url:
        yield url


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.script = lambda req: text_chunks(PIECES)
    fake.delay = 0.0
    fake.requests.clear()
    fake.finished.clear()
    fake.closed_early.clear()
    yield


@pytest.fixture()
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


# ---------------------------------------------------------------------------------------------
# models, health, request ids
# ---------------------------------------------------------------------------------------------


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # The Triton model's name is one a request may give too (Context.check_model): the same card.
    assert client.models.retrieve("ensemble").id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other")
    assert err.value.body["code"] == "model_not_found"


def test_health(base_url, fake):
    assert httpx.get(base_url + "/health").status_code == 200
    assert httpx.get(base_url + "/ping").status_code == 200 and httpx.post(base_url + "/ping").status_code == 200
    fake.ready = False
    try:
        r = httpx.get(base_url + "/health")
        assert r.status_code == 503
        assert r.json()["error"]["type"]
        assert httpx.get(base_url + "/ping").status_code == 503
    finally:
        fake.ready = True


class _TwoServers(FakeLLMClient):
    """Two tritonservers, as TritonLLMClient shows them: `down` holds those that do not generate."""

    server_urls = ["a:8001", "b:8001"]

    def __init__(self) -> None:
        super().__init__(script=lambda req: text_chunks(["x"]))
        self.down: dict[int, APIError] = {}
        self.at: list[int] = []

    def generate_at(self, index: int, request):
        self.at.append(index)
        return self._fail(self.down[index]) if index in self.down else self.generate(request)

    async def _fail(self, error: APIError):
        raise error
        yield  # pragma: no cover - an async generator that raises at once


def test_health_generate_probes_every_server_and_fails_only_when_none_generates():
    fake = _TwoServers()
    with serve_in_thread(create_app(Settings(model_name=MODEL, health_generate_timeout=5), client=fake)) as url:
        r = httpx.get(url + "/health_generate")
        assert r.status_code == 200 and r.json() == {"servers": {"a:8001": "ok", "b:8001": "ok"}}
        assert sorted(fake.at) == [0, 1] and len({q.request_id for q in fake.requests}) == 2
        fake.down[1] = APIError(503, "Triton is not reachable")
        r = httpx.get(url + "/health_generate")  # the frontend still serves, through a
        assert r.status_code == 200 and r.json()["servers"] == {"a:8001": "ok", "b:8001": "Triton is not reachable"}
        fake.down[0] = APIError(500, "stub crashed")
        r = httpx.get(url + "/health_generate")
        assert r.status_code == 503
        assert r.json()["error"]["message"] == ("no server generated a token: a:8001: stub crashed; "
                                                "b:8001: Triton is not reachable")


def test_request_id_echoed_and_used(base_url, client):
    r = httpx.post(
        base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES},
        headers={"X-Request-Id": "abc-123"},
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "chatcmpl-abc-123"
    assert httpx.get(base_url + "/v1/models").headers["x-request-id"]  # generated when absent
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, extra_headers={"x-request-id": "sdk-1"}
    )
    assert raw.headers["x-request-id"] == "sdk-1"


def test_request_id_header_wins_over_body_as_in_vllm(base_url):
    body = {"model": MODEL, "messages": MESSAGES, "request_id": "from-body"}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "from-header"})
    assert r.status_code == 200
    assert r.json()["id"] == "chatcmpl-from-header" and r.headers["x-request-id"] == "from-header"
    # Without the header the body's id is used, and echoed.
    r = httpx.post(base_url + "/v1/chat/completions", json=body)
    assert r.json()["id"] == "chatcmpl-from-body" and r.headers["x-request-id"] == "from-body"
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "rid": "sg-1"})
    assert r.json()["id"] == "cmpl-sg-1" and r.headers["x-request-id"] == "sg-1"
    # An id that cannot be a header value is still used, but not echoed.
    r = httpx.post(base_url + "/v1/chat/completions", json={**body, "request_id": "naïve\nid"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-naïve\nid"
    assert r.headers["x-request-id"] not in ("", "naïve\nid")


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------


def test_chat_non_streaming(client, fake):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.5, top_p=0.9, seed=3,
        stop=["END"], extra_body={"top_k": 20, "min_p": 0.1, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].message.content == "".join(PIECES)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == len(PIECES)
    assert r.usage.total_tokens == 7 + len(PIECES)
    req = fake.requests[0]
    assert req.messages == MESSAGES and req.text_input is None
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert req.sampling_params == {
        "max_new_tokens": 12, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "seed": 3, "stop": ["END"],
        **VLLM_REPETITION,
    }


def test_logit_bias_and_allowed_token_ids_reach_the_engine(client, fake):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias={"17": -100, "42": 2.5},
                                   extra_body={"allowed_token_ids": [17, 42, 99]})
    client.completions.create(model=MODEL, prompt="x", logit_bias={"5": 100})
    assert fake.requests[0].sampling_params == {"max_new_tokens": None, "max_new_tokens_from_model": True,  # chat:
                                                # the model's default, or up to the end of the context
                                                "logit_bias": {"17": -100, "42": 2.5}, "allowed_token_ids": [17, 42, 99],
                                                **VLLM_REPETITION}
    assert fake.requests[1].sampling_params == {"max_new_tokens": 16, "logit_bias": {"5": 100},  # 16: legacy default
                                                **VLLM_REPETITION}


def test_chat_content_parts_and_tool_messages(client, fake):
    client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        ],
    )
    msgs = fake.requests[0].messages
    assert msgs[0]["content"] == "a\nb"
    # As sent: the preprocessing model decodes it for the template, once (tests/test_tokenizer.py).
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    assert msgs[2] == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    # OpenAI requires the id that ties a result to its call.
    for bad in ({"role": "tool", "content": "42"}, {"role": "tool", "tool_call_id": 7, "content": "42"}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[*MESSAGES, bad])
        assert "'tool' message needs 'tool_call_id'" in _error(err)["message"], _error(err)
        assert _error(err)["param"] == "messages.1", _error(err)
    # and the calls it answers: a list of OpenAI's call objects, id, name and arguments included
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for bad in ({"id": "call_1", "type": "function"}, {**call, "id": ""}, {**call, "function": {"name": "f"}},
                {**call, "function": {"arguments": "{}"}}, {**call, "type": "code"}, "x", None):
        for calls in ([bad], bad) if bad is not None else ([bad],):  # tool_calls null: none made
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=MODEL, messages=[*MESSAGES, {"role": "assistant", "tool_calls": calls}])
            assert "tool_calls must be a list of" in _error(err)["message"] and _error(err)["param"] == "messages.1", \
                (calls, _error(err))
    assert len(fake.requests) == 1


def test_chat_streaming_with_usage(client, fake):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(PIECES)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(PIECES)
    assert chunks[-1].usage.prompt_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_continue_final_message_and_echo(client, fake):
    prefill = MESSAGES + [{"role": "assistant", "content": "Sure: "}]
    r = client.chat.completions.create(model=MODEL, messages=prefill,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    req = fake.requests[0]
    assert req.continue_final_message is True and req.add_generation_prompt is False
    assert r.choices[0].message.content == "".join(PIECES)  # the continuation only, as vLLM
    echo = dict(model=MODEL, messages=prefill, n=2,
                extra_body={"continue_final_message": True, "add_generation_prompt": False, "echo": True})
    r = client.chat.completions.create(**echo)
    assert [c.message.content for c in r.choices] == ["Sure: " + "".join(PIECES)] * 2
    chunks = list(client.chat.completions.create(stream=True, **echo))
    for i in range(2):
        assert "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == i) == "Sure: " + "".join(PIECES)
    # echo repeats only a message of the reply's role: the assistant's after a generation prompt
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"echo": True})
    assert r.choices[0].message.content == "".join(PIECES) and r.choices[0].message.role == "assistant"
    # without one, the reply goes on with the last message, in its role (vLLM's; QA: not echoed)
    assert MESSAGES[-1]["role"] == "user"
    raw = dict(model=MODEL, messages=MESSAGES, extra_body={"echo": True, "add_generation_prompt": False})
    r = client.chat.completions.create(**raw)
    assert (r.choices[0].message.role, r.choices[0].message.content) == ("user", MESSAGES[-1]["content"] + "".join(PIECES))
    chunks = list(client.chat.completions.create(stream=True, **raw))
    assert chunks[0].choices[0].delta.role == "user"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == MESSAGES[-1]["content"] + "".join(PIECES)

    for extra, message in [
        ({"continue_final_message": True}, "add_generation_prompt"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "final assistant message"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra)
        body = _error(err)
        assert body["param"] == "continue_final_message" and message in body["message"], body


def test_chat_streaming_raw_sse_format(base_url):
    with httpx.stream("POST", base_url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def _sample_counter():
    """A script whose successive samples say choice-0, choice-1, ... (one counter per request)."""
    seen: dict[int, int] = {}

    def script(req):
        k = seen.get(id(req), 0)
        seen[id(req)] = k + 1
        return text_chunks(["choice", f"-{k}"])

    return script


def test_chat_n2(client, fake):
    fake.script = _sample_counter()
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=10)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.message.content for c in r.choices] == ["choice-0", "choice-1"]
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 7
    # n samples share one engine request (one Triton stream); the engine varies the seed
    assert len(fake.requests) == 1 and fake.requests[0].n == 2 and fake.requests[0].sampling_params["seed"] == 10
    assert fake.requests[0].stream is False  # non-streaming: one response per sample from Triton

    fake.requests.clear()
    fake.delay = 0.001
    fake.script = _sample_counter()
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=10, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {0: "choice-0", 1: "choice-1"}
    assert finish == {0: "stop", 1: "stop"}
    assert fake.requests[0].stream is True


def test_chat_length_finish(client, fake):
    fake.script = lambda req: text_chunks(["a", "b"], finish="length")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_chat_logprobs_mapped_when_engine_sends_them(client, fake):
    metas = [
        json.dumps({"output_token_logprobs": [[-0.5, 100, "Hel"]], "output_top_logprobs": [[[-0.5, 100, "Hel"], [-1.5, 7, "He"]]]}),
        json.dumps({"output_token_logprobs": [[-0.25, 101, None]], "output_top_logprobs": [[[-0.25, 101, None]]]}),
    ]
    fake.script = lambda req: text_chunks(["Hel", "lo"], meta=metas)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2)
    assert fake.requests[0].sampling_params["return_logprob"] is True
    assert fake.requests[0].sampling_params["top_logprobs_num"] == 2
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hel", "token_id:101"]  # no tokenizer: ids as text
    assert content[0].logprob == -0.5 and [t.token for t in content[0].top_logprobs] == ["Hel", "He"]
    # streaming carries them per chunk
    got = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            got += [t.logprob for t in chunk.choices[0].logprobs.content]
    assert got == [-0.5, -0.25]
    # requested but not sent by the engine: null
    fake.script = lambda req: text_chunks(["x"])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True)
    assert r.choices[0].logprobs is None


# ---------------------------------------------------------------------------------------------
# completions
# ---------------------------------------------------------------------------------------------


def test_completions(client, fake):
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6)
    assert r.choices[0].text == "".join(PIECES)
    assert r.object == "text_completion"
    assert fake.requests[0].text_input == "Once upon"
    assert fake.requests[0].sampling_params == {"max_new_tokens": 6, **VLLM_REPETITION}
    fake.requests.clear()
    r = client.completions.create(model=MODEL, prompt="P")
    assert fake.requests[0].sampling_params == {"max_new_tokens": 16, **VLLM_REPETITION}  # OpenAI's default for completions
    for empty in ("", ["a", ""], [], [[]]):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=empty)
        assert err.value.body["param"] == "prompt" and "empty" in err.value.body["message"]


def test_completions_batch_tokens_echo_and_stream(client, fake):
    r = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == ["a" + "".join(PIECES)] * 2 + ["b" + "".join(PIECES)] * 2
    assert r.usage.prompt_tokens == 14  # once per prompt, not per choice
    fake.requests.clear()
    client.completions.create(model=MODEL, prompt=[1, 2, 3])
    assert fake.requests[0].input_ids == [1, 2, 3] and fake.requests[0].text_input is None

    text = ""
    usage = None
    for chunk in client.completions.create(model=MODEL, prompt="x", stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert text == "".join(PIECES)
    assert usage.completion_tokens == len(PIECES) and usage.prompt_tokens == 7


def test_streamed_batch_with_a_refused_prompt_is_a_400_before_any_chunk(client, fake):
    # The short prompt's chunks come first; the long one's refusal must still be the answer.
    fake.delay = 0.01  # each stream sleeps before each item: the short prompt's first chunk leads
    fake.script = lambda req: ([APIError(400, "the prompt is too long: 9999 tokens, the context is 1024")]
                               if req.text_input == "long" else text_chunks(PIECES))
    with pytest.raises(openai.BadRequestError) as err:
        list(client.completions.create(model=MODEL, prompt=["short", "long"], stream=True))
    assert "too long" in _error(err)["message"]
    fake.script = lambda req: text_chunks(PIECES)
    got = {}
    for chunk in client.completions.create(model=MODEL, prompt=["a", "b", "c"], stream=True):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + c.text
    assert got == {0: "".join(PIECES), 1: "".join(PIECES), 2: "".join(PIECES)}


def _scored_samples(fake, means):
    """Each sample the fake generates gets the next mean logprob per token from `means`."""
    it = iter(means)

    def script(req):
        lp = next(it)
        meta = json.dumps({"output_token_logprobs": [[lp, 100, None]]})
        return text_chunks([f"s{lp}", "!"], meta=[meta, meta])

    fake.script = script


def test_best_of_returns_the_n_best_samples(client, fake):
    _scored_samples(fake, [-2.0, -0.5, -3.0, -1.0])
    r = client.completions.create(model=MODEL, prompt="x", n=2, best_of=4, max_tokens=2)
    assert [(c.index, c.text) for c in r.choices] == [(0, "s-0.5!"), (1, "s-1.0!")]
    assert r.choices[0].logprobs is None  # ranked by logprobs the client did not ask for
    assert r.usage.completion_tokens == 4  # the returned samples' tokens
    sent = fake.requests[-1]
    assert sent.n == 4 and sent.sampling_params["return_logprob"] is True

    # per prompt of a batch, prompt-major; chat takes vLLM's best_of extra
    _scored_samples(fake, [-1.0, -0.1, -0.2, -0.3, -9.0, -0.4])
    r = client.completions.create(model=MODEL, prompt=["a", "b"], best_of=3, max_tokens=2, logprobs=0)
    assert [(c.index, c.text) for c in r.choices] == [(0, "s-0.1!"), (1, "s-0.3!")]
    assert r.choices[0].logprobs.token_logprobs == [-0.1, -0.1]
    _scored_samples(fake, [-3.0, -2.0])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"best_of": 2})
    assert [(c.index, c.message.content) for c in r.choices] == [(0, "s-2.0!")]
    assert fake.requests[-1].n == 2


def test_best_of_errors(client):
    for kwargs, words in [
        (dict(n=3, best_of=2), "best_of must be >= n"),
        (dict(best_of=1000), "best_of must be at most"),
        (dict(best_of=2, stream=True), "cannot be streamed"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", **kwargs)
        assert err.value.body["param"] == "best_of" and words in err.value.body["message"]


# A scripted language model for beam search: next-token logprobs by the tokens generated so far
# (after the one-token prompt "x"). Greedy takes A then C (-2.0); the best pair is B E (-1.0).
EOS = 90  # "Z"
_NEXT = {
    "": [("A", -0.5), ("B", -0.9)],
    "A": [("C", -1.5), ("D", -1.6)],
    "B": [("E", -0.1), ("F", -2.5)],
    "AC": [("Z", -0.05), ("G", -3.0)], "AD": [("G", -0.3), ("Z", -0.4)],
    "BE": [("Z", -2.0), ("H", -0.2)], "BF": [("H", -0.1), ("Z", -0.1)],
}


def _beam_lm(req):
    if req.sampling_params.get("max_new_tokens") != 1:
        return text_chunks(PIECES)
    generated = "".join(chr(t) for t in req.input_ids[1:])
    alts = _NEXT.get(generated, [("Q", -5.0)])
    text = req.sampling_params.get("return_text_in_logprobs")
    top = [[lp, ord(tok), tok if text else None] for tok, lp in alts]
    meta = json.dumps({"output_token_logprobs": [top[0]], "output_top_logprobs": [top]})
    return [EngineChunk(alts[0][0], [ord(alts[0][0])], "length", len(req.input_ids), 1, meta)]


@pytest.fixture(scope="module")
def beam_client(tmp_path_factory):
    files = tmp_path_factory.mktemp("model")
    (files / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    bfake = FakeLLMClient(_beam_lm, eos_token_ids=[EOS])  # the engine's, from its engine_info
    with serve_in_thread(create_app(Settings(model_name=MODEL, tokenizer_path=str(files)), client=bfake)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), bfake


def test_a_beam_width_past_what_the_engine_takes_at_once_is_a_400(tmp_path):
    # QA: on a server running 4 sequences and queueing 2, n=8 beams (sent together each step)
    # got 503 "overloaded" on an idle server, every time, and the SDK retried it.
    class Small(FakeLLMClient):
        async def engine_info(self):
            info = await super().engine_info()
            info["config"].update(max_num_seqs=4, max_waiting_requests=2)
            return info

    fake = Small(_beam_lm, eos_token_ids=[EOS])
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    with serve_in_thread(create_app(Settings(model_name=MODEL, tokenizer_path=str(tmp_path)), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert len(client.completions.create(model=MODEL, prompt="x", n=6, max_tokens=1,
                                             extra_body={"use_beam_search": True}).choices) == 6
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", n=7, max_tokens=1, extra_body={"use_beam_search": True})
        assert _error(err)["param"] == "n" and "at most 6" in _error(err)["message"]


def test_beam_search_keeps_the_best_beams_not_the_greedy_path(beam_client):
    client, bfake = beam_client
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=2, extra_body={"use_beam_search": True})
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, "BE", "length"), (1, "AC", "length")]
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == 1
    steps = [q for q in bfake.requests if q.input_ids is not None]
    assert all(q.sampling_params["top_logprobs_num"] == 4 and q.sampling_params["repetition_penalty"] == 1.0
               and "cache_salt" not in q.sampling_params for q in steps)
    bfake.requests.clear()  # every step runs under the request's cache salt
    client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=2,
                              extra_body={"use_beam_search": True, "cache_salt": "tenant-a"})
    steps = [q for q in bfake.requests if q.input_ids is not None]
    assert steps and all(q.sampling_params["cache_salt"] == "tenant-a" for q in steps)

    # A third step: B E H (-1.2 over 4 tokens) is best; A C Z ends (-2.05 over 3: the EOS does
    # not count in its length) and beats B E Z and A C G. Beams that end are not extended.
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=3, extra_body={"use_beam_search": True})
    assert [(c.text, c.finish_reason) for c in r.choices] == [("BEH", "length"), ("AC", "stop")]
    assert r.usage.completion_tokens == 6  # the EOS counts as a generated token, not as text
    # length_penalty 0 ranks by the plain sum; ignore_eos keeps A C Z growing
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=3,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.0, "ignore_eos": True})
    assert [c.text for c in r.choices] == ["BEH", "ACZ"]
    # stop_token_ids end a beam even with ignore_eos; include_stop_str_in_output keeps the token's text
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=3,
                                  extra_body={"use_beam_search": True, "ignore_eos": True, "stop_token_ids": [EOS]})
    assert [(c.text, c.finish_reason) for c in r.choices] == [("BEH", "length"), ("AC", "stop")]
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=3,
                                  extra_body={"use_beam_search": True, "include_stop_str_in_output": True})
    assert [(c.text, c.finish_reason) for c in r.choices] == [("BEH", "length"), ("ACZ", "stop")]

    # logprobs: each beam's own tokens, with the step's alternatives; echo prepends the prompt
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=2, logprobs=2,
                                  extra_body={"use_beam_search": True})
    assert r.choices[0].logprobs.tokens == ["B", "E"] and r.choices[0].logprobs.token_logprobs == [-0.9, -0.1]
    assert r.choices[0].logprobs.top_logprobs[1] == {"E": -0.1, "F": -2.5}
    assert r.choices[1].logprobs.token_logprobs == [-0.5, -1.5]
    r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=2, echo=True,
                                  extra_body={"use_beam_search": True})
    assert [c.text for c in r.choices] == ["xBE", "xAC"]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       logprobs=True, top_logprobs=1, extra_body={"use_beam_search": True})
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in r.choices[0].logprobs.content] == [
        ("Q", -5.0, ["Q"])]

    # chat: the prompt is the rendered messages; one choice per beam
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=1, max_tokens=2,
                                       extra_body={"use_beam_search": True})
    assert [c.message.content for c in r.choices] == ["Q" * 2]  # the fake tokenizes the messages' JSON


@pytest.mark.parametrize("after_steps", [0, 1])
def test_an_aborted_beam_search_ends_every_choice_abort_with_the_beams_it_had(after_steps):
    """/abort_request ends a search as one request: each of its `n` choices ends "abort" with its
    beam so far (QA: an abort between steps went unseen, and one that emptied a step ended the
    search with no choices, which the handlers filled as empty "stop" ones)."""
    import asyncio

    from openai_frontend.beam_search import beam_search_choices, beam_spec
    from openai_frontend.engine_types import EngineRequest
    from openai_frontend.protocol import CompletionRequest

    started = []  # the steps' first beams, as the fake engine starts them (each then takes 0.2 s)

    def lm(req):
        started.append(req)
        return _beam_lm(req)

    fake = FakeLLMClient(lm, delay=0.2, eos_token_ids=[EOS])
    spec = beam_spec(CompletionRequest(model=MODEL, prompt="x", n=2, max_tokens=3, use_beam_search=True),
                     eos=frozenset({EOS}))

    async def run():
        async def collect():
            return [item async for item in beam_search_choices(fake, [EngineRequest({}, input_ids=[ord("x")],
                                                                                     request_id="r")], spec)]
        task = asyncio.create_task(collect())
        while len(started) < 1 + after_steps:  # step 0 has one beam; step 1 starts after it
            await asyncio.sleep(0.01)
        assert await fake.abort_requests("r") == 1  # during step `after_steps`
        return await task

    chunks = asyncio.run(run())
    beams = [(i, c.finish_reason, c.token_ids, c.prompt_tokens) for i, c in chunks]
    if after_steps == 0:
        assert beams == [(0, "abort", [], 1), (1, "abort", [], 1)]
    else:  # one step kept: its two best extensions, best first
        assert beams == [(0, "abort", [ord("A")], 1), (1, "abort", [ord("B")], 1)]
    assert all(r.request_id == "r" for r in fake.requests)  # the steps carry the search's id


def test_beam_search_scores_extreme_length_penalties_without_overflow(beam_client):
    """QA: length ** length_penalty overflowed a float at 400 (a 500). The key is computed in
    logs; it orders beams exactly as the quotient does wherever the quotient is finite."""
    import itertools
    import random

    from openai_frontend.beam_search import _Beam, _score

    rng = random.Random(0)
    beams = [_Beam(parent=None, token=1, cum_logprob=c, length=rng.randint(1, 9), finish=f)
             for c, f in itertools.product([-7.5, -1.0, -0.01, 0.0, 1e-7], [None, "stop"])]
    for penalty in (-3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 7.0):
        direct = sorted(beams, key=lambda b: b.cum_logprob / max(5 + b.length - (b.finish == "stop"), 1) ** penalty)
        ours = sorted(beams, key=lambda b: _score(b, 5, penalty))
        assert [b.cum_logprob / max(5 + b.length - (b.finish == "stop"), 1) ** penalty for b in ours] == \
            [b.cum_logprob / max(5 + b.length - (b.finish == "stop"), 1) ** penalty for b in direct]
    for penalty in (400.0, -400.0, 1e300):
        sorted(beams, key=lambda b: _score(b, 5, penalty))  # no OverflowError, no ZeroDivisionError
    client, _ = beam_client
    for penalty in (400.0, -400.0):
        r = client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=3,
                                      extra_body={"use_beam_search": True, "length_penalty": penalty})
        assert len(r.choices) == 2


def test_beam_search_refuses_what_would_change_it(beam_client, client):
    bclient, _ = beam_client
    for kwargs, param in [
        (dict(stream=True), "use_beam_search"),
        (dict(n=11), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=["x"]), "stop"),
        (dict(logprobs=1, echo=True), "echo"),
        (dict(top_p=0.5), "top_p"),
        (dict(frequency_penalty=0.5), "frequency_penalty"),
        (dict(extra_body={"guided_regex": "a+"}), "use_beam_search"),
        (dict(n=2, best_of=3), "best_of"),
    ]:
        body = kwargs.pop("extra_body", {})
        with pytest.raises(openai.BadRequestError) as err:
            bclient.completions.create(model=MODEL, prompt="x", max_tokens=kwargs.pop("max_tokens", 2), **kwargs,
                                       extra_body={"use_beam_search": True, **body})
        assert err.value.body["param"] == param, (kwargs, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:  # an engine that does not report its EOS ids
        client.completions.create(model=MODEL, prompt="x", extra_body={"use_beam_search": True})
    assert "end-of-sequence ids" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", extra_body={"length_penalty": 0.5})
    assert err.value.body["param"] == "length_penalty"


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def _error(excinfo) -> dict:
    body = excinfo.value.body
    assert set(body) == {"message", "type", "param", "code"}
    return body


def test_error_unknown_parameter_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"frobnicate": 1})
    body = _error(err)
    assert body["param"] == "frobnicate" and "frobnicate" in body["message"]


def test_error_for_a_value_no_union_branch_takes(client):
    # pydantic reports every branch of prompt's union; the message must be about the real fault.
    for prompt, message, param in (
        ([5, -1], "Invalid value for 'prompt.1': Input should be greater than or equal to 0", "prompt.1"),
        ([[1, -2]], "Invalid value for 'prompt.0.1': Input should be greater than or equal to 0", "prompt.0.1"),
        (5, "Invalid value for 'prompt': expected one of: str, list[str], list[int], list[list[int]]", "prompt"),
        (["a", [1, 2]], "Invalid value for 'prompt': expected one of: str, list[str], list[int], list[list[int]]",
         "prompt"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        body = _error(err)
        assert (body["message"], body["param"]) == (message, param), prompt


def test_error_for_a_malformed_object_tool_choice_names_what_is_wrong(client, fake):
    # QA: {"type": "function"} got the string branch's "Input should be 'none', 'auto' or
    # 'required'". An object is judged by the object branch: what it lacks, or, for an object of
    # another kind, every accepted form.
    forms = ("Invalid value for 'tool_choice': expected one of: \"none\", \"auto\", \"required\", "
             '{"type": "function", "function": {"name": ...}}')
    for choice, message, param in (
        ({"type": "function"}, "Missing required parameter: 'tool_choice.function'", "tool_choice.function"),
        ({"type": "function", "function": {}}, "Missing required parameter: 'tool_choice.function.name'",
         "tool_choice.function.name"),
        ({"type": "function", "function": {"name": "get_weather"}, "x": 1},
         "Unrecognized request argument supplied: tool_choice.x", "tool_choice.x"),
        ({"type": "tool", "name": "get_weather"}, forms, "tool_choice"),
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, forms, "tool_choice"),
        ("sometimes", "Invalid value for 'tool_choice': Input should be 'none', 'auto' or 'required'", "tool_choice"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=choice)
        body = _error(err)
        assert (body["message"], body["param"]) == (message, param), choice
    assert not fake.requests


def test_error_unsupported_parameter_named(client, fake):
    for kwargs, name in [
        ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        body = _error(err)
        assert body["param"] == name and name in body["message"], body
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", suffix="tail")
    assert _error(err)["param"] == "suffix"
    assert fake.requests == []


def test_vllm_structured_outputs_map_onto_the_guided_constraints(client, fake):
    """vLLM 0.11's structured_outputs object: each constraint reaches the engine as its guided_*
    twin does, and its whitespace options as guided_whitespace_pattern does."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for so, want in [
        ({"json": schema}, {"json_schema": json.dumps(schema)}),
        ({"json": json.dumps(schema), "disable_any_whitespace": True},
         {"json_schema": json.dumps(schema), "whitespace_pattern": ""}),
        ({"json_object": True, "whitespace_pattern": "[ ]?"}, {"json_schema": '{"type": "object"}',
                                                               "whitespace_pattern": "[ ]?"}),
        ({"regex": "(yes|no)", "disable_fallback": True}, {"regex": "(yes|no)"}),
        ({"choice": ["yes", "no"]}, {"guided_choice": ["yes", "no"]}),
        ({"grammar": 'root ::= "a"'}, {"ebnf": 'root ::= "a"'}),
        ({"structural_tag": {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}},
          "disable_additional_properties": True},
         {"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "x"}})}),
        ({"json_object": False}, {}),
    ]:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"structured_outputs": so})
        sp = fake.requests[-1].sampling_params
        keys = ("json_schema", "regex", "guided_choice", "ebnf", "structural_tag", "whitespace_pattern")
        assert {k: sp[k] for k in keys if k in sp} == want, so
    client.completions.create(model=MODEL, prompt="x", extra_body={"structured_outputs": {"regex": "a+"}})
    assert fake.requests[-1].sampling_params["regex"] == "a+"
    count = len(fake.requests)
    for body, param, message in [
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice", "only one"),
        ({"structured_outputs": {"json": schema}, "guided_regex": "a"}, "structured_outputs.json", "only one"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "must not be empty"),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace", "needs a JSON constraint"),
        ({"structured_outputs": {"json": schema, "disable_any_whitespace": True, "whitespace_pattern": " "}},
         "structured_outputs.disable_any_whitespace", "both set the JSON whitespace"),
        ({"structured_outputs": {"json_": schema}}, "structured_outputs.json_", "Unrecognized request argument"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=body)
        assert _error(err)["param"] == param and message in _error(err)["message"], (body, _error(err))
    assert len(fake.requests) == count


def test_add_special_tokens_goes_to_preprocessing_only_when_not_the_default(client, fake):
    client.completions.create(model=MODEL, prompt="x")
    assert fake.requests[-1].add_special_tokens is None
    client.completions.create(model=MODEL, prompt="x", extra_body={"add_special_tokens": False})
    assert fake.requests[-1].add_special_tokens is False
    client.completions.create(model=MODEL, prompt=[1, 2], extra_body={"add_special_tokens": False})
    assert fake.requests[-1].input_ids == [1, 2]  # ids are sent as given
    client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert fake.requests[-1].add_special_tokens is None
    client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"add_special_tokens": True})
    assert fake.requests[-1].add_special_tokens is True


def test_documents_and_request_chat_template_go_to_preprocessing(client, fake):
    # Both are the server's to judge (its template must use documents; it must trust request
    # templates): the frontend passes them on.
    docs = [{"title": "t", "text": "x"}]
    client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={
        "documents": docs, "chat_template": "{{ messages[0].content }}"})
    assert fake.requests[-1].documents == docs and fake.requests[-1].chat_template == "{{ messages[0].content }}"


def test_error_validation_is_400_not_422(base_url):
    r = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "temperature": "hot"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "temperature"
    r = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(base_url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400
    # `curl -d '{...}'` without a JSON content type: say what is wrong, for every endpoint
    for path in ("/v1/chat/completions", "/generate"):
        r = httpx.post(base_url + path, content=json.dumps({"model": MODEL, "messages": MESSAGES, "text": "x"}),
                       headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400
        assert "Content-Type: application/json" in r.json()["error"]["message"]
        # none declared at all (QA: pydantic's "a valid dictionary" instead)
        r = httpx.post(base_url + path, content=json.dumps({"model": MODEL, "messages": MESSAGES, "text": "x"}))
        assert "content-type" not in r.request.headers
        assert r.status_code == 400 and "declared no Content-Type" in r.json()["error"]["message"], r.text


def test_lone_surrogates_are_400_on_every_endpoint(base_url, fake):
    # JSON's "\\ud800" escape alone decodes to text with no UTF-8 form: refused up front, never
    # a 500 from the tokenizer, the gRPC message or the abort of a request id.
    lone = "\\ud800"
    bodies = {
        "/v1/chat/completions": '{"model": "%s", "messages": [{"role": "user", "content": "a%sb"}]}' % (MODEL, lone),
        "/v1/completions": '{"model": "%s", "prompt": "x", "stop": ["%s"]}' % (MODEL, lone),
        "/generate": '{"text": "ab", "rid": "%s"}' % lone,
        "/tokenize": '{"model": "%s", "prompt": "%s"}' % (MODEL, lone),
    }
    for path, body in bodies.items():
        r = httpx.post(base_url + path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "surrogate" in err["message"], err
        assert err["param"] == {"/v1/chat/completions": "messages[0].content", "/v1/completions": "stop[0]",
                                "/generate": "rid", "/tokenize": "prompt"}[path], err
    assert "messages[0].content" in httpx.post(base_url + "/v1/chat/completions", content=bodies[
        "/v1/chat/completions"].encode(), headers={"content-type": "application/json"}).json()["error"]["message"]
    # A proper pair is one character and goes through.
    ok = '{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}' % MODEL
    r = httpx.post(base_url + "/v1/chat/completions", content=ok.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200 and fake.requests[-1].messages[0]["content"] == "\U0001f600"
    assert len(fake.requests) == 1


def test_empty_body_says_so(base_url):
    r = httpx.post(base_url + "/v1/chat/completions", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "None" not in r.json()["error"]["message"] and "body" in r.json()["error"]["message"]


def test_small_validation_gaps_are_400(base_url):
    def post(path, body):
        return httpx.post(base_url + path, content=json.dumps(body), headers={"content-type": "application/json"})

    r = post("/v1/completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "length_penalty": float("nan")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
    r = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert r.status_code == 400 and "content[0]" in r.json()["error"]["message"]
    # QA: no coercion across JSON types (pydantic's lax mode took "8" as 8, true as 1, "yes" as true)
    for path, body, param in (("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
                              ("/v1/completions", {"prompt": "x", "n": True}, "n"),
                              ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": 1}, "logprobs"),
                              ("/v1/chat/completions", {"messages": MESSAGES, "ignore_eos": "yes"}, "ignore_eos"),
                              ("/generate", {"input_ids": [True, 2]}, "input_ids")):
        r = post(path, body if path == "/generate" else {"model": MODEL, **body})
        assert r.status_code == 400 and (r.json()["error"]["param"] or "").startswith(param), (path, r.text)
    r = post("/parse_function_call", {"text": "x", "tool_call_parser": "nope", "tools": []})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_call_parser" and err["message"].count("nope") == 1, err


def test_error_unknown_model_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    assert _error(err)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="x")


def test_error_from_engine_is_400_even_when_streaming(client, fake):
    fake.script = lambda req: APIError(400, "unsupported parameter 'frequency_penalty': not supported yet")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, frequency_penalty=0.5)
    assert "frequency_penalty" in _error(err)["message"]
    assert fake.requests[0].sampling_params["frequency_penalty"] == 0.5
    with pytest.raises(openai.BadRequestError):
        list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))


def test_error_mid_stream_is_an_sse_error_event(client, fake):
    fake.script = lambda req: [*text_chunks(["a", "b"])[:1], APIError(500, "engine crashed")]
    with pytest.raises(openai.APIError) as err:
        for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
            pass
    assert "engine crashed" in str(err.value)


def test_error_triton_unreachable_is_503():
    from openai_frontend.testing import free_port

    app = create_app(Settings(triton_url=f"127.0.0.1:{free_port()}", model_name=MODEL))
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            c.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert err.value.status_code == 503
        assert "unavailable" in _error(err)["message"].lower()
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model=MODEL, prompt="x", stream=True)
        assert err.value.status_code == 503
        assert httpx.get(url + "/health").status_code == 503


def test_an_unhandled_error_answers_500_and_keeps_the_connection(base_url, fake):
    """QA: after a 500 from an unexpected exception, Starlette re-raised it and uvicorn dropped
    the connection: a pooled client's next request on it failed with ECONNRESET."""
    import socket
    from urllib.parse import urlparse

    def boom(req):
        raise RuntimeError("unexpected")

    fake.script = boom
    url = urlparse(base_url)
    body = json.dumps({"model": MODEL, "prompt": "x"}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        reader = sock.makefile("rb")

        def exchange(request: bytes) -> tuple[int, bytes]:
            sock.sendall(request)
            status = int(reader.readline().split()[1])
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            return status, reader.read(length)

        status, answer = exchange(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert status == 500 and b"unexpected" in answer
        status, answer = exchange(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection
        assert status == 200 and MODEL.encode() in answer


def test_server_side_errors_are_logged_once_with_the_request_id(base_url, fake, caplog):
    caplog.set_level("INFO", logger="openai_frontend")
    fake.script = lambda req: APIError(500, "internal error: engine step failed: boom")
    for stream, rid in ((False, "qa-req-1"), (True, "qa-req-2")):
        r = httpx.post(base_url + "/v1/completions", headers={"x-request-id": rid},
                       json={"model": MODEL, "prompt": "x", "stream": stream})
        assert r.status_code == 500 or "boom" in r.text
        lines = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
        assert len(lines) == 1 and "boom" in lines[0] and "500" in lines[0], lines
    # Mid-stream, after the 200 went out: logged where the error event is written.
    fake.script = lambda req: [*text_chunks(["a"])[:1], APIError(500, "internal error: engine step failed: bang")]
    r = httpx.post(base_url + "/v1/completions", headers={"x-request-id": "qa-req-5"},
                   json={"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == 200 and "bang" in r.text
    lines = [rec.getMessage() for rec in caplog.records if "qa-req-5" in rec.getMessage()]
    assert len(lines) == 1 and "bang" in lines[0], lines
    fake.script = lambda req: APIError(400, "bad top_p")  # the client's side: not the server's log's business
    httpx.post(base_url + "/v1/completions", headers={"x-request-id": "qa-req-3"}, json={"model": MODEL, "prompt": "x"})
    assert not [rec for rec in caplog.records if "qa-req-3" in rec.getMessage()]
    from openai_frontend.testing import free_port

    app = create_app(Settings(triton_url=f"127.0.0.1:{free_port()}", model_name=MODEL))
    with serve_in_thread(app) as url:  # Triton unreachable: the 503s say so in the log too
        r = httpx.post(url + "/v1/completions", headers={"x-request-id": "qa-req-4"}, json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503
    lines = [rec.getMessage() for rec in caplog.records if "qa-req-4" in rec.getMessage()]
    assert len(lines) == 1 and "503" in lines[0], lines


def test_api_key_401():
    fake = FakeLLMClient()
    with serve_in_thread(create_app(Settings(model_name=MODEL, api_key="s3cret"), client=fake)) as url:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert _error(err)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.post(url + "/generate", json={"text": "x"}).status_code == 401
        # Which of OpenAI's answers: no key at all, not Bearer auth, or a wrong key.
        missing = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["message"].startswith("You didn't provide an API key"), missing.json()
        basic = httpx.get(url + "/v1/models", headers={"authorization": "Basic czNjcmV0"})
        assert "must use Bearer auth" in basic.json()["error"]["message"], basic.json()
        empty = httpx.get(url + "/v1/models", headers={"authorization": "Bearer"})
        assert "must use Bearer auth" in empty.json()["error"]["message"], empty.json()
        # The scheme in any case, the key between any spaces (RFC 7235), is still the right key.
        for header in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
            assert httpx.get(url + "/v1/models", headers={"authorization": header}).status_code == 200, header
        wrong = httpx.get(url + "/v1/models", headers={"authorization": "bearer nope"})
        assert wrong.json()["error"] == {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}
        assert httpx.get(url + "/health").status_code == 200  # health stays open
        assert httpx.get(url + "/ping").status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message.content
        assert fake.requests and len(fake.requests) == 1


# ---------------------------------------------------------------------------------------------
# SGLang /generate
# ---------------------------------------------------------------------------------------------


def test_generate_streaming_as_sglang_example_reads_it(base_url, fake):
    # The client loop of the SGLang docs' streaming example, verbatim in substance.
    response = httpx.stream(
        "POST", base_url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 32},
              "stream": True},
    )
    printed = ""
    metas = []
    with response as r:
        prev = 0
        for chunk in r.iter_lines():
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    break
                data = json.loads(chunk[5:].strip("\n"))
                output = data["text"].strip()
                printed += output[prev:]
                prev = len(output)
                metas.append(data["meta_info"])
                assert data["output_ids"] == [100 + i for i in range(len(data["output_ids"]))]  # cumulative
        else:
            raise AssertionError("no data: [DONE]")
    assert printed == "".join(PIECES)
    assert len(metas) == len(PIECES)
    assert all(m["finish_reason"] is None for m in metas[:-1])
    assert metas[-1]["finish_reason"] == {"type": "stop", "matched": None}
    assert metas[-1]["completion_tokens"] == len(PIECES) and metas[-1]["prompt_tokens"] == 7
    req = fake.requests[0]
    assert req.text_input == "The capital of France is"
    assert req.sampling_params == {"temperature": 0, "max_new_tokens": 32}


def test_generate_non_streaming_and_batch(base_url, fake):
    fake.script = lambda req: text_chunks(["A", "B"], finish="stop", stop_reason="</s>")
    r = httpx.post(base_url + "/generate", json={"input_ids": [1, 2, 3], "rid": "r1", "stream": None}).json()
    assert r["text"] == "AB" and r["output_ids"] == [100, 101]  # null stream: SGLang's default, false
    assert r["meta_info"]["id"] == "r1"
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</s>"}
    assert fake.requests[0].input_ids == [1, 2, 3]
    fake.script = _sample_counter()
    batch = httpx.post(base_url + "/generate", json={"text": ["x", "y"], "sampling_params": {"n": 2, "seed": 5}}).json()
    assert isinstance(batch, list) and len(batch) == 4
    # one engine stream per prompt, carrying its n samples; results prompt-major
    assert [(q.text_input, q.n, q.sampling_params.get("seed")) for q in fake.requests[1:]] == [("x", 2, 5), ("y", 2, 5)]
    assert all("n" not in q.sampling_params for q in fake.requests)
    assert [b["text"] for b in batch] == ["choice-0", "choice-1", "choice-0", "choice-1"]
    assert len({b["meta_info"]["id"] for b in batch}) == 4
    bad = httpx.post(base_url + "/generate", json={"text": "x", "image_data": "a.png"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "image_data"
    assert httpx.post(base_url + "/generate", json={"text": "x", "bogus": 1}).status_code == 400
    # A batch of one is a batch: its prompt is <rid>_0, as SGLang names it (QA: it was <rid>).
    fake.script = lambda req: text_chunks(["A"])
    one = httpx.post(base_url + "/generate", json={"text": ["x"], "rid": "one"}).json()
    assert [b["meta_info"]["id"] for b in one] == ["one_0"] and fake.requests[-1].request_id == "one_0"
    # The engine's name for a prompt (input_ids) becomes the field this request gave (QA).
    fake.script = lambda req: APIError(400, "the prompt has 5002 tokens, but the context is 4096 tokens",
                                       param="input_ids")
    for body, param in (({"text": "x"}, "text"), ({"input_ids": [1]}, "input_ids"),
                        ({"input_embeds": [[0.5, 0.5]]}, "input_embeds")):
        for stream in (False, True):
            r = httpx.post(base_url + "/generate", json={**body, "stream": stream})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, stream, r.text)


# ---------------------------------------------------------------------------------------------
# client disconnect
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "n": 2}),
    ("/generate", {"text": "x", "stream": True}),
])
def test_client_disconnect_cancels_upstream(base_url, fake, path, body):
    fake.script = lambda req: [EngineChunk("t", [1], None, 3, i + 1) for i in range(10_000)]
    fake.delay = 0.01
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", base_url + path, json=body) as r:
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 3:
                    break
    # leaving the block closed the connection
    assert fake.closed_early.wait(5), "upstream stream was not closed after the client left"
    deadline = time.monotonic() + 5
    while len(fake.finished) < len(fake.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.finished and all(f == "closed" for f in fake.finished)


# ---------------------------------------------------------------------------------------------
# tool calls: the built-in JSON-array format (tool_choice required / named, no parser needed)
# ---------------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _reassemble(stream) -> tuple[str, dict[int, dict], list]:
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            indices = [d.index for d in c.delta.tool_calls or []]
            assert len(indices) == len(set(indices)), "two entries for one call in a chunk (OpenAI sends one)"
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None, "id sent twice"
                    call["id"] = d.id
                    assert d.type == "function"
                if d.function and d.function.name:
                    assert call["name"] is None, "name sent twice"
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    assert call["name"] is not None, "arguments before the name"
                    call["arguments"] += d.function.arguments
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return content, calls, finishes


def test_tool_choice_required_json_array(client, fake):
    output = '[{"name": "get_weather", "parameters": {"city": "Paris \\"}{\\" ]", "unit": "c"}}, ' \
             '{"name": "get_time", "parameters": {"tz": "UTC"}}]'
    fake.script = lambda req: text_chunks(_pieces(output))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required")
    req = fake.requests[0]
    assert req.tools == [WEATHER, TIME]
    schema = json.loads(req.sampling_params["json_schema"])
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_weather", {"city": 'Paris "}{" ]', "unit": "c"}), ("get_time", {"tz": "UTC"})]
    assert all(t.id.startswith("call_") for t in msg.tool_calls)

    content, calls, finishes = _reassemble(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", stream=True)
    )
    assert content == "" and finishes == ["tool_calls"]
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == [
        (t.function.name, t.function.arguments) for t in msg.tool_calls]


def test_tool_choice_named_json_array(client, fake):
    fake.script = lambda req: text_chunks(_pieces('[{"name": "get_time", "parameters": {}}]', 5))
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    schema = json.loads(fake.requests[0].sampling_params["json_schema"])
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["get_time"]
    assert r.choices[0].message.tool_calls[0].function.name == "get_time"
    assert r.choices[0].message.tool_calls[0].function.arguments == "{}"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    assert _error(err)["param"] == "tool_choice"


def test_tool_choice_conflicts_and_none(client, fake):
    with pytest.raises(openai.BadRequestError) as err:  # auto needs a parser; this server has none
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    assert "--tool-call-parser" in _error(err)["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"})
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == "".join(PIECES) and not r.choices[0].message.tool_calls
    # The model sees the tools and calls none (OpenAI's none; vLLM's default): the prompt, and
    # its cached prefix, stay the tool turns' (QA: they were left out, as SGLang does).
    assert fake.requests[-1].tools == [WEATHER]
    assert not any(k in fake.requests[-1].sampling_params for k in ("json_schema", "structural_tag"))
    with serve_in_thread(create_app(Settings(model_name=MODEL, exclude_tools_when_tool_choice_none=True),
                                    client=fake)) as url:
        openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="none")
    assert fake.requests[-1].tools is None  # vLLM's --exclude-tools-when-tool-choice-none


def test_structured_output_params(client, fake):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                   response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(fake.requests[-1].sampling_params["json_schema"]) == schema
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
    assert json.loads(fake.requests[-1].sampling_params["json_schema"]) == {"type": "object"}
    client.completions.create(model=MODEL, prompt="x", extra_body={"guided_choice": ["yes", "no."]})
    assert fake.requests[-1].sampling_params["guided_choice"] == ["yes", "no."]  # the engine builds the grammar
    client.completions.create(model=MODEL, prompt="x", extra_body={"guided_grammar": 'root ::= "a"'})
    assert fake.requests[-1].sampling_params["ebnf"] == 'root ::= "a"'
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_regex": "a", "guided_json": schema})


def test_response_format_fields_are_checked_not_dropped(client, fake):
    """SDK QA: fields a response_format type does not take passed silently, a json_schema without
    its required name too, and {"type": "text", "json_schema": ...} answered free text."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"type": "json_schema", "json_schema": {"schema": schema}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "bogus": 1}},
         "response_format.json_schema.bogus"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": "yes"}},
         "response_format.json_schema.strict"),
        ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
        ({"type": "json_object", "foo": 1}, "response_format.foo"),
        ({"type": "text", "json_schema": {"name": "x", "schema": schema}}, "response_format.json_schema"),
    ]
    for rf, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=rf)
        assert _error(err)["param"] == param, rf
    ok = {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": schema, "strict": True}}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=ok)
    assert json.loads(fake.requests[-1].sampling_params["json_schema"]) == schema
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "text"})
    assert not any(k in fake.requests[-1].sampling_params for k in ("json_schema", "regex", "structural_tag"))


def test_json_array_scanner_partial_inputs():
    from openai_frontend.tools import JsonArrayToolParser

    text = '[ {"parameters": {"q": "a}b", "n": [1, {"x": 2}]}, "name": "search"} ,{"name":"f","parameters":{}} ]'
    full = JsonArrayToolParser().detect_and_parse(text, [])
    assert [(c.name, c.parameters) for c in full.calls] == [
        ("search", '{"q": "a}b", "n": [1, {"x": 2}]}'), ("f", "{}")]
    for size in (1, 2, 7):
        p = JsonArrayToolParser()
        names, args = [], {}
        for piece in _pieces(text, size):
            for item in p.parse_streaming_increment(piece, []).calls:
                if item.name:
                    names.append(item.name)
                else:
                    args[item.tool_index] = args.get(item.tool_index, "") + item.parameters
        assert names == ["search", "f"]
        assert [args.get(0, ""), args.get(1, "")] == [c.parameters for c in full.calls]
    plain = JsonArrayToolParser()
    assert plain.parse_streaming_increment("Hi", []).normal_text == "Hi"
    assert plain.parse_streaming_increment(" there", []).normal_text == " there"


# ---------------------------------------------------------------------------------------------
# triton_client pieces that need no server
# ---------------------------------------------------------------------------------------------


def test_decode_response_fast_path():
    from openai_frontend.triton_client import _is_final, decode_response

    resp = infer_response({
        "text_output": "héllo 世界", "output_ids": [5, 6, 70000], "finish_reason": "stop",
        "meta_info": '{"stop_reason": "</s>"}', "prompt_tokens": [12], "completion_tokens": [3],
    }, final=True)
    chunk = decode_response(resp)
    assert chunk.text == "héllo 世界" and chunk.token_ids == [5, 6, 70000]
    assert chunk.finish_reason == "stop" and chunk.stop_reason == "</s>"
    assert (chunk.prompt_tokens, chunk.completion_tokens) == (12, 3)
    assert _is_final(resp)
    mid = decode_response(infer_response({"text_output": "", "output_ids": [], "finish_reason": ""}))
    assert mid.text == "" and mid.token_ids == [] and mid.finish_reason is None
    assert not _is_final(infer_response({"text_output": "x"}))


class _FailingStream:
    """A fake ensemble stream: `responses` (ModelInferResponse) then an error with `message`."""

    def __init__(self, responses: list, message: str) -> None:
        self.items = [(type("Result", (), {"get_response": lambda _, r=r: r})(), None) for r in responses]
        self.message = message

    def stream_infer(self, requests, stream_timeout=None):
        return self

    async def get_model_metadata(self, model_name, as_json=False, client_timeout=None):  # the ensemble's
        from openai_frontend.triton_client import ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS

        return {"inputs": [{"name": n} for n in ENSEMBLE_INPUTS], "outputs": [{"name": n} for n in ENSEMBLE_OUTPUTS]}

    def __aiter__(self):
        return self

    async def __anext__(self):
        from tritonclient.utils import InferenceServerException

        if self.items:
            return self.items.pop(0)
        if self.message is not None:
            message, self.message = self.message, None
            return None, InferenceServerException(message)
        raise StopAsyncIteration

    def cancel(self) -> None:
        pass


@pytest.mark.parametrize("answered, message, aborted", [
    # A postprocessing step failing mid-stream ended the client's stream while llm generated on to
    # max_tokens (Triton 2.51 does not stop an ensemble's other steps): aborted like a disconnect.
    (True, "postprocessing internal error: RuntimeError: boom", True),
    (False, "postprocessing internal error: RuntimeError: boom", True),  # its first response failed
    (True, "in ensemble 'ensemble', invalid argument", True),
    # Refused before it ran: nothing to abort (an abort there would only add work to an overload).
    (False, "invalid sampling parameter top_p: must be in (0, 1]", False),
    (False, "llm engine overloaded: 64 requests waiting", False),
    # Its stub is gone: nothing to abort on.
    (True, "Failed to process the request(s) for model 'llm_0_0', message: Stub process 'llm_0_0' is not healthy.",
     False),
    # Another step's stub is gone: llm runs on (review).
    (True, "Failed to process the request(s) for model 'postprocessing_0_0', message: Stub process "
           "'postprocessing_0_0' is not healthy.", True),
])
def test_a_stream_that_fails_after_llm_started_is_aborted(answered, message, aborted):
    import asyncio

    from openai_frontend.engine_types import EngineRequest
    from openai_frontend.errors import APIError
    from openai_frontend.triton_client import TritonLLMClient

    client = TritonLLMClient("localhost:1", abort_model="llm")
    first = infer_response({"text_output": "a", "output_ids": [5], "finish_reason": ""})
    client._servers[0].client = _FailingStream([first] if answered else [], message)
    sent = []

    async def abort(request_id: str, server) -> None:
        sent.append(request_id)

    client._abort = abort

    async def run():
        chunks = []
        with pytest.raises(APIError):
            async for chunk in client.generate(EngineRequest({"max_new_tokens": 50}, text_input="hi")):
                chunks.append(chunk)
        return chunks

    assert len(asyncio.run(run())) == int(answered)
    assert len(sent) == int(aborted), (message, sent)


def test_a_burst_asks_the_engine_for_its_facts_once(monkeypatch):
    """Review: each request of a burst sent its own engine_info when the answer was stale (at
    start, and every ENGINE_INFO_TTL_S); one call is in flight, and waiters share its answer or
    its error."""
    import asyncio
    from types import SimpleNamespace

    from openai_frontend import common

    class Engine:
        calls = 0
        fail = False

        async def engine_info(self):
            self.calls += 1
            await asyncio.sleep(0.05)
            if self.fail:
                raise APIError(503, "Triton server unavailable")
            return {"config": {"max_model_len": 256}, "eos_token_ids": [7]}

    async def burst(ctx):
        return await asyncio.gather(*(ctx.max_model_len() for _ in range(20)), return_exceptions=True)

    engine = Engine()
    ctx = common.Context(Settings(model_name=MODEL), engine, SimpleNamespace(max_model_len=4096))
    assert asyncio.run(burst(ctx)) == [256] * 20 and engine.calls == 1
    engine.fail = True
    fresh = common.Context(Settings(model_name=MODEL), engine, SimpleNamespace(max_model_len=4096))
    assert asyncio.run(burst(fresh)) == [4096] * 20 and engine.calls == 2  # never answered: config.json's


def test_the_openai_endpoints_ask_for_the_models_default_max_tokens(tmp_path):
    """QA: a model whose generation_config.json sets max_new_tokens 7 ran a chat without
    max_tokens to the end of its 32k context. vLLM takes it as the default max_tokens, capped by
    the context's room (vllm-project/vllm#34063); SGLang ignores it, and /generate does too. The
    engine applies it (it knows the file and the prompt's length): requests ask for it."""
    from backend.sampling_params import load_default_max_tokens

    for cfg, want in (({"max_new_tokens": 7}, 7), ({"max_new_tokens": 0}, None), ({"max_new_tokens": True}, None),
                      ({"temperature": 0.6}, None)):
        (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
        assert load_default_max_tokens(tmp_path) == want, cfg
    assert load_default_max_tokens(tmp_path / "nowhere") is None

    fake = FakeLLMClient()
    with serve_in_thread(create_app(Settings(model_name=MODEL), client=fake)) as url:
        chat = {"model": MODEL, "messages": MESSAGES}
        for body, want in (({**chat}, None), ({**chat, "max_tokens": 50}, 50), ({**chat, "max_completion_tokens": 3}, 3),
                           ({"model": MODEL, "prompt": "x"}, 16),  # a completion's own default, as in vLLM
                           ({"model": MODEL, "prompt": "x", "max_tokens": None}, None)):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            assert httpx.post(url + path, json=body).status_code == 200
            sp = fake.requests[-1].sampling_params
            assert sp["max_new_tokens"] == want and sp.get("max_new_tokens_from_model", False) == (want is None), body
        assert httpx.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": None}}).status_code == 200
        assert "max_new_tokens_from_model" not in fake.requests[-1].sampling_params  # SGLang's rule


def test_error_mapping():
    from openai_frontend.triton_errors import map_stream_error

    e = map_stream_error("in ensemble 'ensemble', unsupported parameter 'n': n > 1 is not supported yet")
    assert e.status_code == 400 and e.message == "unsupported parameter 'n': n > 1 is not supported yet"
    assert e.param == "n"
    assert map_stream_error("invalid sampling parameter top_p: must be in (0, 1]").param == "top_p"
    assert map_stream_error("LoRA adapter 'x' is not loaded; loaded adapters: none").param == "lora_path"
    # QA: these named no parameter.
    assert map_stream_error("logprob_start_len 3 must be less than the prompt length 3").param == "logprob_start_len"
    assert map_stream_error("the prompt has 800 tokens, but the context is 768 tokens").param == "input_ids"
    # Past the context: OpenAI's code and vLLM's words, which clients match (LiteLLM's
    # ContextWindowExceededError: "maximum context length"), the engine's sentence after.
    e = map_stream_error("the prompt has 800 tokens, but the context is 768 tokens (at least one must be left to generate)")
    assert e.code == "context_length_exceeded" and e.message == (
        "This model's maximum context length is 768 tokens. However, your request has 800 input tokens. Please "
        "reduce the length of the input. (the prompt has 800 tokens, but the context is 768 tokens (at least one "
        "must be left to generate))")
    e = map_stream_error("max_new_tokens must be at most 6: the context is 4096 tokens and the prompt has 4090; got 50")
    assert (e.code, e.param) == ("context_length_exceeded", "max_new_tokens") and e.message.startswith(
        "This model's maximum context length is 4096 tokens. However, you requested 4140 tokens (4090 in the "
        "input, 50 in the completion).")
    for message, param in (("stop_token_ids token ids must be < the vocabulary size 4096", "stop_token_ids"),
                           ("logit_bias token ids must be < the vocabulary size 4096", "logit_bias"),
                           ("invalid json_schema: 'type' must be a string", "json_schema"),
                           ("invalid regex: unbalanced parenthesis", "regex"),
                           ("invalid whitespace_pattern: nothing to repeat", "whitespace_pattern"),
                           ("chat_template_kwargs may not set messages", "chat_template_kwargs"),
                           ("input_ids out of range [0, 4096): [99999]", "input_ids"),
                           ("prompt token id 99999 is out of range [0, 4096)", "input_ids"),
                           # QA: these named none
                           ("custom_logit_processor failed: ValueError('it left no token that can be drawn')",
                            "custom_logit_processor"),
                           ("prompt logprobs (logprob_start_len >= 0) need the prompt's token ids; with input_embeds "
                            "only the output's logprobs are available (logprob_start_len -1)", "logprob_start_len"),
                           ("min_tokens must be at most 6: the context is 4096 tokens and the prompt has 4090; got 50",
                            "min_tokens"),
                           # QA: preprocessing's message checks named none
                           ("messages[1].refusal must be a string", "messages"),
                           ("messages[1].tool_calls[0].function.arguments is not valid JSON", "messages")):
        assert map_stream_error(message).param == param, message
    # The engine's own messages: a check across fields names the parameter it refuses (QA: two
    # grammars named none).
    from backend.sampling_params import SamplingParamsError, parse_sampling_params

    for raw, param in (({"json_schema": "{}", "regex": "a"}, "regex"), ({"ebnf": "x", "structural_tag": "{}"},
                                                                         "structural_tag"),
                       ({"temperature": -1}, "temperature"),
                       ({"top_k": "x"}, "top_k"), ({"seed": 1, "sampling_seed": 2}, "sampling_seed"),
                       ({"stop": ["a"] * 40, "stop_regex": ["b"] * 25}, "stop")):
        with pytest.raises(SamplingParamsError) as err:
            parse_sampling_params(raw)
        assert map_stream_error(str(err.value)).param == param, str(err.value)
    assert map_stream_error("Request for unknown model: 'ensemble' is not found").status_code == 503
    assert map_stream_error("internal error: boom").status_code == 500
    # the engine's own message for a step that raised (tests/test_engine.py)
    assert map_stream_error("internal error: engine step failed: shape '[-1, 32, 16]' is invalid").status_code == 500
    # A request running when the engine process died, and one cut by shutdown: the server's
    assert map_stream_error("internal error: the engine process has stopped").status_code == 500
    assert map_stream_error("the server is shutting down").status_code == 503
    # QA: Triton's own refusal while it stops was a 400, which tells a client not to retry.
    stopping = map_stream_error("in ensemble 'ensemble', [request id: a@f.1] Server is stopping, scheduler for model "
                                "has stopped accepting new inference requests")
    assert stopping.status_code == 503 and stopping.headers["Retry-After"]
    # preprocessing's message for an empty prompt names the ensemble's tensors: not passed on
    from tritonclient.utils import InferenceServerException

    from openai_frontend.triton_errors import map_infer_error

    for err in (map_stream_error("in ensemble 'ensemble', exactly one of text_input, messages, input_ids, input_embeds is required"),
                map_infer_error(InferenceServerException(
                    "exactly one of text_input, messages, input_ids, input_embeds is required", status="StatusCode.INVALID_ARGUMENT")),
                map_stream_error("in ensemble 'ensemble', the prompt is empty (text_input given empty)")):
        assert (err.status_code, err.message) == (400, "the prompt is empty")


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("code,details,status", [
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", 503),
    (grpc.StatusCode.UNKNOWN, "Stream removed", 503),  # a SIGKILLed server (grpc/grpc#34076)
    (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", 503),
    (grpc.StatusCode.INTERNAL, "Internal error from Core", 503),  # grpc.aio: the write failed
    (grpc.StatusCode.UNKNOWN, "failed to connect to all addresses", 503),
    (grpc.StatusCode.NOT_FOUND, "Request for unknown model", 503),
    (grpc.StatusCode.INVALID_ARGUMENT, "unsupported parameter 'n'", 400),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 504),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "Exceeds maximum queue size", 429),
    (grpc.StatusCode.INTERNAL, "model raised: boom", 500),
    (grpc.StatusCode.UNKNOWN, "something else", 500),
])
def test_rpc_errors_map_lost_connections_to_503(code, details, status):
    """A server that dies mid-call is an outage (503, Retry-After), whatever code grpc picks; a
    stream (grpc's error) and a unary call (tritonclient's exception) map it alike."""
    from tritonclient.utils import InferenceServerException

    from openai_frontend.triton_errors import map_infer_error, map_rpc_error

    for err in (map_rpc_error(_RpcError(code, details)),
                map_infer_error(InferenceServerException(details, status=str(code)))):
        assert err.status_code == status, (code, details, err.message)
        if status in (503, 429):
            assert err.headers and "Retry-After" in err.headers
        # The server's own time limit: a retry would run as long (the SDK retries 5xx unless told).
        assert (err.headers or {}).get("x-should-retry") == ("false" if status == 504 else None)



def test_build_inputs():
    import numpy as np

    from openai_frontend.engine_types import EngineRequest
    from openai_frontend.triton_client import build_inputs

    def tensors(req):
        return {t.name(): t for t in build_inputs(req)}

    t = tensors(EngineRequest({"max_new_tokens": 3}, text_input="hi"))
    assert set(t) == {"text_input", "stream", "sampling_parameters"}
    assert t["stream"].datatype() == "BOOL" and t["text_input"].datatype() == "BYTES"
    t = tensors(EngineRequest({}, input_ids=[1, 2, 3]))
    assert t["input_ids"].datatype() == "INT32" and t["input_ids"].shape() == [3]
    t = tensors(EngineRequest({}, messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}],
                              add_generation_prompt=False))
    assert {"messages", "tools", "add_generation_prompt"} <= set(t) and "chat_template_kwargs" not in t
    with pytest.raises(APIError):
        build_inputs(EngineRequest({}))
    assert np  # keep the import used


def test_the_contract_check_covers_every_tensor_the_frontend_sends_and_the_ensemble_declares_them():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from openai_frontend.engine_types import EngineRequest
    from openai_frontend.triton_client import (
        ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS, build_inputs, contract_problem, model_tensors,
    )

    sent = set()
    for req in (EngineRequest({}, text_input="hi", add_special_tokens=False, n=2),
                EngineRequest({}, input_ids=[1]), EngineRequest({}, input_embeds=[[0.5, 0.5]]),
                EngineRequest({}, messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}],
                              chat_template_kwargs={"a": 1}, add_generation_prompt=False, continue_final_message=True,
                              documents=[{"text": "d"}], chat_template="{{ 1 }}", add_special_tokens=True)):
        sent |= {t.name() for t in build_inputs(req)}
    assert sent == set(ENSEMBLE_INPUTS)
    config = text_format.Parse((REPO_ROOT / "model_repository" / "ensemble" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    metadata = {"inputs": [{"name": t.name} for t in config.input], "outputs": [{"name": t.name} for t in config.output]}
    assert contract_problem("ensemble", model_tensors(metadata)) is None
    llm = text_format.Parse((REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text(),
                            model_config_pb2.ModelConfig())
    problem = contract_problem("llm", model_tensors({"inputs": [{"name": t.name} for t in llm.input],
                                                     "outputs": [{"name": t.name} for t in llm.output]}))
    assert problem.startswith("Triton model 'llm' is not one this frontend can call: it has no output text_output "
                              "and no input text_input, messages, tools, "), problem
    assert contract_problem("m", model_tensors({"inputs": metadata["inputs"], "outputs": []})).startswith(
        f"Triton model 'm' is not one this frontend can call: it has no output {', '.join(ENSEMBLE_OUTPUTS)}. ")

    # As a library the client calls any model (tests and benches stream from llm): a request is
    # checked for its own inputs; the frontend's client for the whole contract.
    import asyncio

    from openai_frontend.triton_client import TritonLLMClient

    class Metadata:
        async def get_model_metadata(self, model_name, as_json=False, client_timeout=None):
            return {"inputs": [{"name": t.name} for t in llm.input], "outputs": [{"name": t.name} for t in llm.output]}

    async def problem(request, **kwargs):
        client = TritonLLMClient("localhost:1", "llm", **kwargs)
        client._servers[0].client = Metadata()
        return await client._request_problem(client._servers[0], build_inputs(request)), client.contract_error

    ids = EngineRequest({}, input_ids=[1, 2])
    assert asyncio.run(problem(ids)) == (None, None)
    chat = asyncio.run(problem(EngineRequest({}, messages=[{"role": "user", "content": "x"}])))
    assert chat == ("Triton model 'llm' cannot take this request: it has no input messages", None)
    as_frontend = asyncio.run(problem(ids, serves_frontend=True))
    assert as_frontend[0] == as_frontend[1] and as_frontend[0].startswith("Triton model 'llm' is not one this frontend")

    # The verdict is read again once the model was seen not ready (a reload under the same name).
    class Reloading:
        ready, metadata = True, Metadata()

        async def is_model_ready(self, model_name, client_timeout=None):
            return self.ready

        async def get_model_metadata(self, model_name, as_json=False, client_timeout=None):
            return metadata if self.metadata is None else await self.metadata.get_model_metadata(model_name)

    async def health_over_a_reload():
        client = TritonLLMClient("localhost:1", "ensemble", serves_frontend=True)
        client._servers[0].client = server = Reloading()
        seen = [await client.is_ready(), client.contract_error is not None]
        server.ready, server.metadata = False, None
        seen.append(await client.is_ready())
        server.ready = True
        return seen + [await client.is_ready(), client.contract_error]

    assert asyncio.run(health_over_a_reload()) == [False, True, False, True, None]


def test_not_ready_reason_reads_the_models_state_from_the_repository_index():
    import asyncio

    from tritonclient.utils import InferenceServerException

    from openai_frontend.triton_client import TritonLLMClient

    class Index:
        def __init__(self, models):
            self.models = models

        async def get_model_repository_index(self, as_json=False, client_timeout=None):
            if self.models is None:
                raise InferenceServerException("unavailable")
            return {"models": self.models}

    async def reason(models):
        client = TritonLLMClient("localhost:1")
        client._servers[0].client = Index(models)
        return await client.not_ready_reason()

    failed = [{"name": "ensemble", "version": "1", "state": "UNAVAILABLE", "reason": "llm failed to load"},
              {"name": "llm", "version": "1", "state": "UNAVAILABLE", "reason": "bad config"}]
    assert asyncio.run(reason(failed)) == "UNAVAILABLE: llm failed to load"
    assert asyncio.run(reason([{"name": "ensemble", "state": "LOADING"}])) == "LOADING"
    assert asyncio.run(reason([{"name": "llm", "state": "READY"}])) == "Triton has no model of that name (it has: llm)"
    assert asyncio.run(reason([])) == "Triton has no model of that name (it has: none)"
    assert asyncio.run(reason(None)) == "Triton does not answer: unavailable"


def test_nameless_functions_and_messages_without_content_are_refused(client, fake):
    nameless = {"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}
    for kwargs in ({"tools": [nameless], "tool_choice": "required"},
                   {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ""}}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        assert "name" in _error(err)["message"]
    for role in ("user", "system", "developer", "tool"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[*MESSAGES, {"role": role}])
        assert f"a '{role}' message needs 'content'" in _error(err)["message"]
    assert not fake.requests
    # An assistant message may leave it out (its tool calls, or nothing yet, say what it did).
    client.chat.completions.create(model=MODEL, messages=[*MESSAGES, {"role": "assistant"}, *MESSAGES])
    assert len(fake.requests) == 1


def test_tools_must_take_an_object_and_the_function_role_is_refused(client, fake):
    # QA: a forced call under a string or array schema came back as text (the parsers read only an
    # object as arguments), and a 'function' message was accepted and left out of the prompt.
    for schema in ({"type": "string", "maxLength": 5}, {"type": "array", "items": {"type": "integer"}}):
        tool = {"type": "function", "function": {"name": "a", "parameters": schema}}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="required")
        assert "type 'object'" in _error(err)["message"] and _error(err)["param"].startswith("tools"), _error(err)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[*MESSAGES, {"role": "function", "name": "a", "content": "1"}])
    assert "'function' role" in _error(err)["message"]
    assert not fake.requests
    # No type (or an object's) is a schema of an object.
    for schema in ({}, {"properties": {"x": {"type": "integer"}}}, {"type": "object"}):
        tool = {"type": "function", "function": {"name": "a", "parameters": schema}}
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="required")
    assert len(fake.requests) == 3


def test_a_bad_schema_in_forced_tools_is_named_as_the_tools(client, fake):
    # QA: the engine's grammar error named json_schema / structural_tag, which this client never sent.
    script, fake.script = fake.script, lambda req: APIError(400, "invalid structural_tag: dangling $ref",
                                                            param="structural_tag")
    try:
        tool = {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="required")
        assert _error(err)["param"] == "tools"
        assert _error(err)["message"] == "invalid tools (a function's parameters): dangling $ref"
        # The same error from a response_format keeps that name.
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[tool], tool_choice="none",
                                           response_format={"type": "json_object"})
        assert _error(err)["param"] == "response_format"
    finally:
        fake.script = script


def test_a_bad_whitespace_pattern_is_named_by_the_parameter_that_carried_it(client, fake):
    # QA: one inside the client's own structural tag was named guided_whitespace_pattern.
    script, fake.script = fake.script, lambda req: APIError(400, "invalid whitespace_pattern: expected a string",
                                                            param="whitespace_pattern")
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {}, "whitespace_pattern": 5}}
    try:
        for extra, param in (({"structural_tag": json.dumps(tag)}, "structural_tag"),
                             ({"response_format": tag}, "response_format"),
                             ({"guided_json": {}, "guided_whitespace_pattern": "("}, "guided_whitespace_pattern"),
                             ({"structured_outputs": {"json": {}, "whitespace_pattern": "("}},
                              "structured_outputs.whitespace_pattern")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra)
            assert _error(err)["param"] == param, extra
    finally:
        fake.script = script


def test_stream_options_require_stream(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stream_options={"include_usage": True})
    assert _error(err)["param"] == "stream_options"


# ---------------------------------------------------------------------------------------------
# tool calls with a model format parser (--tool-call-parser qwen25)
# ---------------------------------------------------------------------------------------------

QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
QWEN_OUTPUT = "Let me check that for you.\n" + QWEN_CALL + "\n" + \
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen(fake):
    pytest.importorskip("openai_frontend.tool_parsers")
    qfake = FakeLLMClient()
    with serve_in_thread(create_app(Settings(model_name=MODEL, tool_call_parser="qwen25"), client=qfake)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), qfake, url


@pytest.mark.parametrize("size", [1, 4, 13, 1000])
def test_tool_call_streaming_equals_non_streaming(qwen, size):
    client, qfake, _ = qwen
    qfake.script = lambda req: text_chunks(_pieces(QWEN_OUTPUT, size))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check that for you."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})]
    assert qfake.requests[-1].tools == [WEATHER, TIME]
    assert not any(k in qfake.requests[-1].sampling_params for k in ("json_schema", "structural_tag"))  # auto

    content, calls, finishes = _reassemble(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], stream=True))
    assert content == msg.content
    assert finishes == ["tool_calls"]
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == [
        (t.function.name, t.function.arguments) for t in msg.tool_calls]
    assert all(calls[k]["id"].startswith("call_") for k in calls)


def test_mistral_tool_call_ids_are_the_nine_characters_its_templates_take_back():
    # QA: call_<24 hex> ids came back in the agent's next turn and Mistral's chat template
    # refused them ("Tool call IDs should be alphanumeric strings with length 9!"): a 400.
    import re

    pytest.importorskip("openai_frontend.tool_parsers")
    mfake = FakeLLMClient(lambda req: text_chunks(_pieces(
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "get_time", "arguments": {"tz": "UTC"}}]', 5)))
    with serve_in_thread(create_app(Settings(model_name=MODEL, tool_call_parser="mistral"), client=mfake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for choice in ("auto", "required"):
            r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice)
            ids = [t.id for t in r.choices[0].message.tool_calls]
            _, calls, _ = _reassemble(client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, stream=True))
            ids += [calls[k]["id"] for k in sorted(calls)]
            assert len(ids) == 4 and len(set(ids)) == 4
            assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids), ids


BROKEN_OUTPUT = ("Checking.\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par"is"}}\n</tool_call>'
                 + " Sorry.\n" + '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_call_broken_after_its_name_is_the_same_call_streaming_or_not(qwen, size):
    # A stream has sent get_weather's name and '{"city": "Par"' before the JSON breaks; it cannot
    # take them back. The non-streaming answer must be that same call, not the markup as text.
    client, qfake, _ = qwen
    qfake.script = lambda req: text_chunks(_pieces(BROKEN_OUTPUT, size))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME])
    msg = r.choices[0].message
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [
        ("get_weather", '{"city": "Par"'), ("get_time", '{"tz": "UTC"}')]
    assert msg.content == "Checking.\nSorry." and r.choices[0].finish_reason == "tool_calls"
    content, calls, finishes = _reassemble(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], stream=True))
    assert (content, finishes) == (msg.content, ["tool_calls"])
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == [
        (t.function.name, t.function.arguments) for t in msg.tool_calls]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_call_to_an_undefined_function_is_dropped_alike_streaming_or_not(qwen, size):
    client, qfake, _ = qwen
    out = 'Hi <tool_call>\n{"name": "sub", "arguments": {"a": 1}}\n</tool_call>'
    qfake.script = lambda req: text_chunks(_pieces(out, size))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    msg = r.choices[0].message
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"
    content, calls, finishes = _reassemble(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True))
    assert (content, calls, finishes) == (msg.content, {}, ["stop"])
    assert msg.content == "Hi"


def test_tool_call_plain_text_and_parallel_false(qwen):
    client, qfake, _ = qwen
    qfake.script = lambda req: text_chunks(_pieces("No tools needed <tool_ here.", 3))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    assert r.choices[0].message.content == "No tools needed <tool_ here." and r.choices[0].finish_reason == "stop"
    content, calls, finishes = _reassemble(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True))
    assert content == "No tools needed <tool_ here." and calls == {} and finishes == ["stop"]

    qfake.script = lambda req: text_chunks(_pieces(QWEN_OUTPUT, 5))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [t.function.name for t in r.choices[0].message.tool_calls] == ["get_weather"]
    _, calls, _ = _reassemble(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], parallel_tool_calls=False, stream=True))
    assert [c["name"] for c in calls.values()] == ["get_weather"]


def test_forced_tool_choice_content_is_null_and_never_streamed(qwen):
    # QA: tool_choice required and max_tokens cut the output inside a second call's trigger;
    # "<tool_" came back as content. The constraint allows nothing but calls: content is null, and
    # no content delta is streamed (not even an empty one carrying logprobs).
    client, qfake, _ = qwen
    pieces = _pieces(QWEN_CALL + "\n<tool_", 6)
    metas = [json.dumps({"output_token_logprobs": [[-0.5, 100 + i, None]]}) for i in range(len(pieces))]
    qfake.script = lambda req: text_chunks(pieces, finish="length", meta=metas)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, logprobs=True)
        r = client.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        assert msg.content is None and r.choices[0].finish_reason == "length", choice
        assert [t.function.name for t in msg.tool_calls] == ["get_weather"]
        assert len(r.choices[0].logprobs.content) == len(pieces)
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.choices[0].delta.content is None for c in chunks), choice
        assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == len(pieces)
        content, calls, finishes = _reassemble(chunks)
        assert (content, finishes) == ("", ["length"])
        assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == [
            (t.function.name, t.function.arguments) for t in msg.tool_calls]
    # Under auto the same tail may be text (a trailing "<"): it stays content in both modes.
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME])
    content, _, _ = _reassemble(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                                               stream=True))
    assert r.choices[0].message.content == content == "<tool_"


def test_tool_choice_required_uses_structural_tag_in_model_format(qwen):
    client, qfake, _ = qwen
    qfake.script = lambda req: text_chunks(_pieces(QWEN_CALL, 6))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required")
    tag = json.loads(qfake.requests[-1].sampling_params["structural_tag"])
    fmt = tag["format"]
    # one or more calls separated by newlines and nothing else (no text around them)
    assert tag["type"] == "structural_tag" and fmt["type"] == "tags_with_separator"
    assert fmt["separator"] == "\n" and fmt["at_least_one"] is True and fmt["stop_after_first"] is False
    assert [t["begin"] for t in fmt["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ', '<tool_call>\n{"name": "get_time", "arguments": ']
    assert fmt["tags"][0]["content"] == {"type": "json_schema", "json_schema": WEATHER["function"]["parameters"]}
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"

    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME],
                                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tag = json.loads(qfake.requests[-1].sampling_params["structural_tag"])
    assert tag["format"]["type"] == "tag" and tag["format"]["end"] == "}\n</tool_call>"


def test_tool_constraints_compile_and_accept_the_parsed_format():
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from openai_frontend.protocol import ChatTool, NamedToolChoice
    from openai_frontend.tools import get_parser, parse_complete, plan_tools

    tools = [ChatTool.model_validate(WEATHER), ChatTool.model_validate(TIME)]
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    samples = {
        "qwen25": QWEN_CALL,
        "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
        "json_array": '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]',
    }
    for parser_name, choice in [("qwen25", "required"), ("qwen25", named), ("llama3", named), (None, "required"),
                                (None, named), ("pythonic", "required")]:
        plan = plan_tools(tools, choice, None, parser_name)
        key, value = plan.constraint
        grammar = (xgr.Grammar.from_structural_tag(value) if key == "structural_tag"
                   else xgr.Grammar.from_json_schema(value))
        sample = samples[plan.parser_name]
        assert accepts(grammar, sample), (parser_name, choice)
        assert not accepts(grammar, "Hello"), (parser_name, choice)
        _, calls = parse_complete(get_parser(plan.parser_name), sample, plan.tools)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"})]

    # required, in each JSON-arguments format: several calls separated by newlines parse back;
    # text after the calls, or a second call when parallel_tool_calls is false, is refused
    second = {"qwen25": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
              "llama3": '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}',
              "mistral": '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "UTC"}}]'}
    first = {"qwen25": QWEN_CALL, "llama3": samples["llama3"],
             "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]'}
    for parser_name in ("qwen25", "llama3", "mistral"):
        both = first[parser_name] + "\n" + second[parser_name]
        for parallel in (True, False):
            plan = plan_tools(tools, "required", parallel, parser_name)
            grammar = xgr.Grammar.from_structural_tag(plan.constraint[1])
            assert accepts(grammar, first[parser_name]), parser_name
            assert accepts(grammar, both) is parallel, (parser_name, parallel)
            assert not accepts(grammar, first[parser_name] + " and some text"), parser_name
        _, calls = parse_complete(get_parser(parser_name), both, plan.tools)
        assert [c.name for c in calls] == ["get_weather", "get_time"], parser_name


RECURSIVE = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["v", "child"], "additionalProperties": False}
PROPERTY_REF = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5},
                                                "b": {"$ref": "#/properties/a"}},
                "required": ["a", "b"], "additionalProperties": False}
DEFINITIONS_REF = {"type": "object", "definitions": {"d": {"type": "string", "enum": ["p", "q"]}},
                   "properties": {"a": {"$ref": "#/definitions/d"}, "e": {"enum": [{"$ref": "#"}]}},
                   "required": ["a"], "additionalProperties": False}


def test_local_refs_in_forced_tools_keep_their_target_in_the_json_array_schema(demo_model_path):
    # QA: wrapped in the JSON-array schema (no model-format parser), a tool's "$ref": "#" meant
    # the wrapping array (a silently wrong constraint), and "#/properties/a" or "#/definitions/d"
    # were refused by the compiler. Compiled here as the engine compiles them.
    pytest.importorskip("xgrammar")
    from backend.grammar import GrammarCompiler, GrammarError
    from backend.tokenizer import load_tokenizer
    from openai_frontend.protocol import ChatTool
    from openai_frontend.tools import plan_tools

    def tool(name: str, parameters: dict) -> ChatTool:
        return ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})

    tokenizer = load_tokenizer(demo_model_path)
    compiler = GrammarCompiler(tokenizer, 4096)

    def feeds(compiled, text: str) -> bool:
        state = compiler.matcher(compiled)
        return all(state.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))

    try:
        tools = [tool("rec", RECURSIVE), tool("prop", PROPERTY_REF), tool("defs", DEFINITIONS_REF)]
        for parser in (None, "pythonic"):
            kind, spec = plan_tools(tools, "required", None, parser).constraint
            assert kind == "json_schema"
            compiled = compiler.compile(kind, spec)
            good = ('[{"name": "rec", "parameters": {"v": 1, "child": {"v": 2, "child": null}}}, '
                    '{"name": "prop", "parameters": {"a": 1, "b": 5}}, '
                    '{"name": "defs", "parameters": {"a": "q", "e": {"$ref":"#"}}}]')
            assert feeds(compiled, good), parser
            for bad in ('[{"name": "rec", "parameters": {"v": 1, "child": [{"name"',  # the wrapper's shape
                        '[{"name": "rec", "parameters": {"v": 1, "child": {"v": 12',
                        '[{"name": "prop", "parameters": {"a": 1, "b": 6',
                        '[{"name": "prop", "parameters": {"a": 1, "b": "',
                        '[{"name": "defs", "parameters": {"a": "r',
                        '[{"name": "defs", "parameters": {"a": "p", "e": {"$ref":"#/$'):  # enum data kept
                assert not feeds(compiled, bad), (parser, bad)
        # A reference to another document is still the compiler's error.
        kind, spec = plan_tools([tool("ext", {"type": "object", "properties": {"a": {"$ref": "other.json#/a"}}})],
                                "required", None, None).constraint
        assert '"$ref": "other.json#/a"' in spec
        with pytest.raises(GrammarError):
            compiler.compile(kind, spec)
    finally:
        compiler.shutdown()


def test_parse_function_call_endpoint(qwen):
    _, _, url = qwen
    r = httpx.post(url + "/parse_function_call", json={"text": QWEN_OUTPUT, "tool_call_parser": "qwen25", "tools": [WEATHER, TIME]})
    assert r.status_code == 200
    body = r.json()
    assert body["normal_text"] == "Let me check that for you."
    assert [(c["name"], json.loads(c["parameters"])) for c in body["calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "Europe/Paris"})]
    assert httpx.post(url + "/parse_function_call", json={"text": "x", "tool_call_parser": "nope"}).status_code == 400


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}),
    ("/generate", {"text": "x"}),
    ("/generate", {"text": "x", "stream": True}),  # gone before the first chunk
])
def test_client_disconnect_before_response_cancels_upstream(base_url, fake, path, body):
    fake.script = lambda req: [EngineChunk("t", [1], None, 3, i + 1) for i in range(10_000)]
    fake.delay = 2.0 if body.get("stream") else 0.01
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base_url + path, json=body, timeout=0.3)
    assert fake.closed_early.wait(5), "upstream stream was not closed after the client left"


def test_cli_starts_and_serves(tmp_path):
    import subprocess
    import sys

    from openai_frontend.testing import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "openai_frontend", "--triton-url", f"127.0.0.1:{free_port()}", "--model-name", "cli-model",
         "--port", str(port), "--host", "127.0.0.1", "--api-key", "k", "--tool-call-parser", "qwen25", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer k"})
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode()
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert r.json()["data"][0]["id"] == "cli-model"
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503  # no Triton there
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([sys.executable, "-m", "openai_frontend", "--tool-call-parser", "nope"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert bad.returncode != 0 and "nope" in bad.stderr


# ---------------------------------------------------------------------------------------------
# issue 7 (frontend parts): metrics, overload, limits, custom logit processors; OpenAPI
# ---------------------------------------------------------------------------------------------


def _metric(text: str, sample: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_requests_by_endpoint_and_status_and_streams(base_url, fake):
    before = httpx.get(base_url + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    ok = 'frontend_requests_total{endpoint="/v1/chat/completions",status="200"}'
    bad = 'frontend_requests_total{endpoint="/v1/chat/completions",status="400"}'
    n_ok, n_bad = _metric(before.text, ok), _metric(before.text, bad)
    for _ in range(2):
        httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "n": 0})
    fake.script = lambda req: [EngineChunk("t", [1], None, 3, i + 1) for i in range(200)]
    fake.delay = 0.01
    with httpx.stream("POST", base_url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, "stream": True}) as r:
        lines = r.iter_lines()
        next(lines)
        during = httpx.get(base_url + "/metrics").text
        assert _metric(during, "frontend_streams_in_flight") == 1
        assert _metric(during, 'frontend_requests_in_flight{endpoint="/v1/chat/completions"}') == 1
    deadline = time.monotonic() + 5
    while _metric(httpx.get(base_url + "/metrics").text, "frontend_streams_in_flight") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = httpx.get(base_url + "/metrics").text
    assert _metric(after, ok) == n_ok + 3 and _metric(after, bad) == n_bad + 1
    assert _metric(after, 'frontend_requests_in_flight{endpoint="/v1/chat/completions"}') == 0
    assert 'frontend_request_duration_seconds_bucket{endpoint="/v1/chat/completions",le="+Inf"}' in after
    httpx.get(base_url + "/no/such/route")
    assert 'endpoint="other",status="404"' in httpx.get(base_url + "/metrics").text  # bounded labels


def test_shared_metrics_sum_every_workers_counts(tmp_path):
    """--workers N: a scrape answered by any worker shows the sum of all workers' counts; a
    worker that exited keeps its counters in the sum but not its gauges."""
    import os

    from openai_frontend.metrics import FrontendMetrics, SharedMetrics

    def worker(requests: int, streams_open: int) -> FrontendMetrics:
        m = FrontendMetrics()
        for _ in range(requests):
            m.request_started("/v1/completions")
            m.request_finished("/v1/completions", 200, 0.02)
        m.request_started("/generate")  # still in flight
        for _ in range(streams_open):
            m.stream_started()
        return m

    exited = SharedMetrics(worker(3, 2), str(tmp_path))
    exited.publish(out_of_order=1, servers={"a:8001": {"requests": 4, "in_flight": 2, "up": 0, "prompt_chunks": 10,
                                                        "prompt_chunks_matched": 6},
                                            "b:8001": {"requests": 1, "in_flight": 1, "up": 1}})
    os.replace(exited.path, tmp_path / "999999999.json")  # a pid no process has
    me = SharedMetrics(worker(2, 1), str(tmp_path))
    text = me.render(out_of_order=0, servers={"a:8001": {"requests": 3, "in_flight": 1, "up": 1, "prompt_chunks": 5,
                                                          "prompt_chunks_matched": 4},
                                              "b:8001": {"requests": 2, "in_flight": 0, "up": 0}})
    # Per tritonserver (several): requests summed over every worker; in flight and up from the live
    # ones (up while every live worker routes to it).
    assert _metric(text, 'frontend_triton_server_requests_total{server="a:8001"}') == 7
    assert _metric(text, 'frontend_triton_server_requests_in_flight{server="a:8001"}') == 1
    assert _metric(text, 'frontend_triton_server_up{server="a:8001"}') == 1
    assert _metric(text, 'frontend_triton_server_up{server="b:8001"}') == 0
    assert _metric(text, 'frontend_triton_server_prompt_chunks_total{server="a:8001"}') == 15
    assert _metric(text, 'frontend_triton_server_prompt_chunks_matched_total{server="a:8001"}') == 10
    assert _metric(text, 'frontend_triton_server_prompt_chunks_total{server="b:8001"}') == 0
    assert _metric(text, 'frontend_requests_total{endpoint="/v1/completions",status="200"}') == 5
    assert _metric(text, 'frontend_request_duration_seconds_count{endpoint="/v1/completions"}') == 5
    assert _metric(text, 'frontend_request_duration_seconds_bucket{endpoint="/v1/completions",le="0.025"}') == 5
    assert _metric(text, "frontend_streams_total") == 3
    assert _metric(text, "frontend_triton_out_of_order_responses_total") == 1
    # gauges: this worker's only
    assert _metric(text, "frontend_streams_in_flight") == 1
    assert _metric(text, 'frontend_requests_in_flight{endpoint="/generate"}') == 1
    # a scrape publishes the answering worker's latest counts first
    me.metrics.request_started("/v1/completions")
    me.metrics.request_finished("/v1/completions", 400, 0.5)
    assert _metric(me.render(0), 'frontend_requests_total{endpoint="/v1/completions",status="400"}') == 1


def test_every_route_has_its_own_metrics_label_and_other_paths_share_one(base_url):
    from starlette.routing import Route

    from openai_frontend.metrics import endpoint_label

    app = create_app(Settings(model_name=MODEL, allow_runtime_lora_updating=True), client=FakeLLMClient())
    paths = {r.path for r in app.routes if isinstance(r, Route)}
    assert {"/abort_request", "/flush_cache", "/separate_reasoning", "/v1/load_lora_adapter"} <= paths
    for path in paths:
        want = "/v1/models/{model}" if path == "/v1/models/{model_id:path}" else path
        assert endpoint_label(path) == want
    assert endpoint_label("/v1/models/org/name") == "/v1/models/{model}"
    for path in ("/nope", "/v1/chat/completions/x", "/abort_request/1", "/docs"):
        assert endpoint_label(path) == "other"

    def count(text: str, path: str, status: int) -> float:
        return _metric(text, f'frontend_requests_total{{endpoint="{path}",status="{status}"}}')

    before = httpx.get(base_url + "/metrics").text
    httpx.post(base_url + "/abort_request", json={"rid": "r1"})
    httpx.post(base_url + "/flush_cache")
    httpx.post(base_url + "/separate_reasoning", json={"text": "a", "reasoning_parser": "qwen3"})
    httpx.get(base_url + "/no/such/route")
    after = httpx.get(base_url + "/metrics").text
    for path, status in (("/abort_request", 200), ("/flush_cache", 200), ("/separate_reasoning", 200),
                         ("other", 404)):
        assert count(after, path, status) == count(before, path, status) + 1, path


def test_overload_and_unavailable_are_503_with_retry_after(client, base_url, fake):
    from openai_frontend.triton_errors import map_stream_error

    err = map_stream_error("in ensemble 'ensemble', engine overloaded: 1024 requests are waiting")
    assert err.status_code == 503 and err.code == "overloaded" and err.headers["Retry-After"]
    assert err.message == "The server is overloaded, retry later: engine overloaded: 1024 requests are waiting"
    # The engine's own refusal says it already: not twice.
    own = map_stream_error("in ensemble 'ensemble', the server is overloaded: 3 sequences are already waiting; retry later")
    assert own.message == "The server is overloaded: 3 sequences are already waiting; retry later"
    # Review: refusals that repeat the client's own words were read as an outage, a 503 the SDK
    # retries though the request can never succeed.
    from backend.sampling_params import SamplingParamsError, parse_sampling_params

    with pytest.raises(SamplingParamsError) as unknown:
        parse_sampling_params({"overloaded": 1})
    for message, param in ((str(unknown.value), "overloaded"),
                           ("LoRA adapter 'overloaded-test' is not loaded", "lora_path"),
                           ("LoRA adapter 'ft-model-not found' is not loaded", "lora_path"),
                           ("logits processor 'x.overloaded' does not match the server's logits_processor_pattern",
                            "logits_processors")):
        mapped = map_stream_error(f"in ensemble 'ensemble', {message}")
        assert (mapped.status_code, mapped.param, mapped.message) == (400, param, message)
    fake.script = lambda req: err
    for stream in (False, True):
        r = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": stream})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {"message": err.message, "type": "service_unavailable_error", "param": None,
                                     "code": "overloaded"}
    r = httpx.post(base_url + "/generate", json={"text": "x"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_request_body_size_limit_is_413():
    fake = FakeLLMClient()
    with serve_in_thread(create_app(Settings(model_name=MODEL, max_body_bytes=1000), client=fake)) as url:
        big = {"model": MODEL, "prompt": "x" * 2000}
        r = httpx.post(url + "/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["param"] == "body"

        def chunks():  # no content-length: counted while reading
            yield b'{"model": "demo-model", "prompt": "'
            for _ in range(10):
                yield b"x" * 200
            yield b'"}'

        r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "too large" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "body"
        assert httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200
        assert not fake.requests[:-1]


def test_stop_strings_limit(client, base_url):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=[f"s{i}" for i in range(65)])
    assert _error(err)["param"] == "stop"
    r = httpx.post(base_url + "/generate", json={"text": "x", "sampling_params": {"stop": ["a"] * 65}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=[f"s{i}" for i in range(64)])


def test_custom_logit_processor_only_when_enabled(client, base_url, fake):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"custom_logit_processor": "{}"})
    assert _error(err)["param"] == "custom_logit_processor"
    r = httpx.post(base_url + "/generate", json={"text": "x", "custom_logit_processor": "{}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "custom_logit_processor"
    r = httpx.post(base_url + "/generate", json={"text": "x", "sampling_params": {"custom_logit_processor": "{}"}})
    assert r.status_code == 400
    assert not fake.requests

    enabled = FakeLLMClient()
    with serve_in_thread(create_app(Settings(model_name=MODEL, enable_custom_logit_processor=True),
                                    client=enabled)) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        c.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={
            "custom_logit_processor": '{"callable": "x"}', "custom_params": {"k": 1}})
        sp = enabled.requests[-1].sampling_params
        assert sp["custom_logit_processor"] == '{"callable": "x"}' and sp["custom_params"] == {"k": 1}
        httpx.post(url + "/generate", json={"text": "x", "custom_logit_processor": "P",
                                            "sampling_params": {"custom_params": {"a": 2}}})
        sp = enabled.requests[-1].sampling_params
        assert sp["custom_logit_processor"] == "P" and sp["custom_params"] == {"a": 2}


def test_unicode_line_separators_do_not_split_sse_events(client, base_url, fake):
    pieces = ["a\u2028b", "c\u2029d", "e\x85f", "中文🙂"]
    fake.script = lambda req: text_chunks(pieces)
    # httpx's iter_lines splits on every str.splitlines() break: each event must stay one line
    for path, body in [("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True}),
                       ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}),
                       ("/generate", {"text": "x", "stream": True})]:
        with httpx.stream("POST", base_url + path, json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events
    assert events[-1]["text"] == "".join(pieces)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True) if c.choices)
    assert text == "".join(pieces)


def test_predicted_outputs_reach_the_engine_and_their_counts_the_usage(client, base_url, fake):
    def metas(accepted: int, rejected: int) -> list[str]:
        return [json.dumps({"index": 0, "accepted_prediction_tokens": a, "rejected_prediction_tokens": r})
                for a, r in ((0, 0), (accepted, rejected))]

    fake.script = lambda req: text_chunks(["Hel", "lo"], meta=metas(1, 3))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       prediction={"type": "content", "content": "Hello there"})
    assert fake.requests[-1].sampling_params["prediction"] == "Hello there"
    details = r.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (1, 3)
    # n samples: the request's counts are their sums; streaming reports them in its usage chunk.
    usage = [c.usage for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": "Hello"}]}) if c.usage]
    assert fake.requests[-1].sampling_params["prediction"] == "Hello"
    assert (usage[0].completion_tokens_details.accepted_prediction_tokens,
            usage[0].completion_tokens_details.rejected_prediction_tokens) == (2, 6)
    # Without a prediction the engine reports none, and usage has no details.
    fake.script = lambda req: text_chunks(["Hel", "lo"])
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES).usage.completion_tokens_details is None
    # An empty prediction drafts nothing (it is not sent), yet OpenAI's usage reports it: 0 and 0.
    for empty in ("", []):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, prediction={"type": "content", "content": empty})
        assert "prediction" not in fake.requests[-1].sampling_params
        details = r.usage.completion_tokens_details
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    # /generate (SGLang's API, prediction as an extension of its sampling_params) reports them in meta_info.
    spec = {"spec_verify_ct": 1, "spec_draft_token_num": 1, "spec_accept_token_num": 1, "spec_accept_rate": 1.0,
            "spec_accept_length": 2.0}
    last = json.dumps({**json.loads(metas(1, 0)[1]), **spec})
    fake.script = lambda req: text_chunks(["Hel", "lo"], meta=[metas(1, 0)[0], last])
    meta = httpx.post(base_url + "/generate", json={"text": "x", "sampling_params": {"prediction": "Hello"}}).json()["meta_info"]
    assert (meta["accepted_prediction_tokens"], meta["rejected_prediction_tokens"]) == (1, 0)
    assert {k: meta[k] for k in spec} == spec  # SGLang's speculative meta_info, at the sample's end


def test_server_info_reports_sglangs_average_accept_length(base_url, fake):
    for path in ("/get_server_info", "/server_info"):
        assert httpx.get(base_url + path).json()["internal_states"] == [{}]  # nothing verified yet
    fake.stats = {"spec_drafts_total": 10, "spec_accepted_tokens_total": 25}
    info = httpx.get(base_url + "/server_info").json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == 3.5  # 25 kept over 10 steps, + 1 each
    assert info["engine"]["stats"]["spec_drafts_total"] == 10


@pytest.mark.parametrize("prediction", [
    "Hello", {"type": "text", "content": "Hello"}, {"type": "content"}, {"type": "content", "content": 5},
    {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    {"type": "content", "content": "x", "extra": 1},
])
def test_a_malformed_prediction_is_refused_by_name(client, prediction):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, prediction=prediction)
    assert err.value.body["param"] == "prediction"


def test_a_prediction_is_refused_where_it_cannot_apply(client):
    prediction = {"type": "content", "content": "Hello"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, prediction=prediction,
                                       extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "prediction" and "use_beam_search" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # OpenAI's completions API has none
        client.completions.create(model=MODEL, prompt="x", extra_body={"prediction": prediction})
    assert err.value.body["param"] == "prediction"


def test_cached_tokens_and_engine_logprobs_pass_through(client, base_url, fake):
    metas = [json.dumps({"index": 0, "cached_tokens": 16, "output_token_logprobs": [[-0.5, 100, "Hel"]],
                         "output_top_logprobs": [[[-0.5, 100, "Hel"], [-1.5, 7, "Hi"]]],
                         "input_token_logprobs": [[None, 1, "<s>"], [-2.0, 2, "x"]]}),
             json.dumps({"index": 0, "cached_tokens": 16, "output_token_logprobs": [[-0.25, 101, "lo"]],
                         "output_top_logprobs": [[[-0.25, 101, "lo"], [-3.0, 8, "p"]]]})]
    fake.script = lambda req: text_chunks(["Hel", "lo"], meta=metas)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 16
    assert [(t.token, t.logprob) for t in r.choices[0].logprobs.content] == [("Hel", -0.5), ("lo", -0.25)]
    sp = fake.requests[-1].sampling_params
    assert sp["return_logprob"] and sp["top_logprobs_num"] == 2 and sp["return_text_in_logprobs"]
    usage = [c.usage for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                             stream_options={"include_usage": True}) if c.usage]
    assert usage[0].prompt_tokens_details.cached_tokens == 16

    body = {"text": "x", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    whole = httpx.post(base_url + "/generate", json=body).json()
    meta = whole["meta_info"]
    assert meta["cached_tokens"] == 16
    assert meta["output_token_logprobs"] == [[-0.5, 100, "Hel"], [-0.25, 101, "lo"]]
    assert meta["output_top_logprobs"][1] == [[-0.25, 101, "lo"], [-3.0, 8, "p"]]
    assert meta["input_token_logprobs"] == [[None, 1, "<s>"], [-2.0, 2, "x"]]
    assert fake.requests[-1].sampling_params["logprob_start_len"] == 0
    with httpx.stream("POST", base_url + "/generate", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = events[-1]["meta_info"]
    for m in (last, meta):
        m.pop("e2e_latency"), m.pop("id")
    assert last == meta  # cumulative streaming meta_info == non-streaming
    assert events[0]["meta_info"]["output_token_logprobs"] == [[-0.5, 100, "Hel"]]


def test_openapi_document_is_served_and_valid(base_url):
    import jsonschema
    from schemathesis.specs.openapi.definitions import OPENAPI_31

    doc = httpx.get(base_url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    jsonschema.validators.validator_for(OPENAPI_31)(OPENAPI_31).validate(doc)
    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/models", "/health", "/metrics"):
        assert path in doc["paths"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["$ref"].endswith("ChatCompletionRequest")


# ---------------------------------------------------------------------------------------------
# /tokenize, /detokenize (the real models answer in tests/test_frontend_triton.py)
# ---------------------------------------------------------------------------------------------


def test_tokenize_sends_the_prompt_as_a_generation_would(base_url, fake):
    r = httpx.post(base_url + "/tokenize", json={"prompt": "hé"}).json()
    assert r == {"count": 3, "max_model_len": None, "tokens": list("hé".encode()), "token_strs": None}
    assert fake.requests[-1].text_input == "hé"

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"}]
    httpx.post(base_url + "/tokenize", json={"messages": messages, "tools": tools, "add_generation_prompt": False,
                                             "continue_final_message": True, "chat_template_kwargs": {"k": 1}})
    sent = fake.requests[-1]
    assert sent.messages[0]["content"] == "a\nb"  # content parts joined as for chat completions
    assert sent.tools == tools and sent.chat_template_kwargs == {"k": 1}
    assert sent.add_generation_prompt is False and sent.continue_final_message is True

    assert httpx.post(base_url + "/detokenize", json={"tokens": list("hé".encode())}).json() == {"prompt": "hé"}
    httpx.post(base_url + "/tokenize", json={"prompt": "x", "add_special_tokens": False})
    assert fake.requests[-1].add_special_tokens is False
    for body in ({"prompt": "a", "tools": tools}, {"prompt": "a", "continue_final_message": True},
                 {"messages": [], "prompt": None}, {"prompt": "a", "mm_processor_kwargs": {}},
                 {"prompt": "a", "unknown": 1}):
        resp = httpx.post(base_url + "/tokenize", json=body)
        assert resp.status_code == 400 and resp.json()["error"]["message"], (body, resp.text)
    assert httpx.post(base_url + "/detokenize", json={"tokens": [2**31]}).status_code == 400
    resp = httpx.post(base_url + "/tokenize", json={"messages": messages, "continue_final_message": True})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "continue_final_message"


def test_tokenize_an_empty_prompt_counts_what_the_tokenizer_adds(base_url, fake, monkeypatch):
    """vLLM's count for "": none, or the special tokens (a Llama BOS). Preprocessing takes ""
    for a missing prompt, so "" is never sent to it."""
    sent = len(fake.requests)
    r = httpx.post(base_url + "/tokenize", json={"model": MODEL, "prompt": "", "add_special_tokens": False})
    assert r.status_code == 200 and r.json() == {"count": 0, "max_model_len": None, "tokens": [], "token_strs": None}
    assert len(fake.requests) == sent  # nothing to ask Triton
    r = httpx.post(base_url + "/tokenize", json={"prompt": ""})  # the fake adds no special tokens
    assert r.status_code == 200 and r.json()["count"] == 0 and r.json()["tokens"] == []

    async def with_bos(request):  # a Llama-style tokenizer: BOS (1) unless told not to
        fake.requests.append(request)
        assert request.text_input, "preprocessing refuses an empty text_input"
        return ([1] if request.add_special_tokens is not False else []) + list(request.text_input.encode())

    monkeypatch.setattr(fake, "tokenize", with_bos)
    for body, tokens in (({"prompt": ""}, [1]), ({"prompt": "", "add_special_tokens": True}, [1]),
                         ({"prompt": "", "add_special_tokens": False}, []), ({"prompt": "hi"}, [1, 104, 105])):
        r = httpx.post(base_url + "/tokenize", json=body)
        assert r.status_code == 200 and (r.json()["count"], r.json()["tokens"]) == (len(tokens), tokens), (body, r.text)


def test_an_empty_prompt_is_a_400_naming_the_requests_field(base_url, fake):
    """Never preprocessing's words for it, which name the ensemble's tensors."""
    for body in ({"text": ""}, {"text": ["a", ""]}, {"input_ids": []}):
        r = httpx.post(base_url + "/generate", json={**body, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == next(iter(body)) and "text_input" not in r.text
    # what preprocessing or the engine say anyway reaches the client in the OpenAI request's terms
    fake.script = lambda req: APIError(400, "the prompt is empty")
    for path, body, param in (("/v1/completions", {"prompt": " "}, "prompt"),
                              ("/v1/chat/completions", {"messages": MESSAGES}, "messages")):
        r = httpx.post(base_url + path, json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "the prompt is empty", "type": "invalid_request_error", "param": param, "code": None}


def test_sampling_edge_values_are_sent_or_refused(base_url, fake):
    post = lambda path, body: httpx.post(base_url + path, json={"model": MODEL, **body})
    # Wrong types for stop / stop_token_ids are 400s naming them, not 500s.
    for sp, param in (({"stop": 5}, "stop"), ({"stop": True}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids")):
        r = httpx.post(base_url + "/generate", json={"text": "hi", "sampling_params": sp})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(base_url + "/generate", json={"text": "hi", "sampling_params": {"stream": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    n = len(fake.requests)
    # An explicit repetition_penalty 1.0 is sent (it must win over the model's default), and so is
    # stop "" (the engine refuses it as it refuses [""]).
    assert post("/v1/chat/completions", {"messages": MESSAGES, "repetition_penalty": 1.0, "stop": ""}).status_code == 200
    sp = fake.requests[n].sampling_params
    assert sp["repetition_penalty"] == 1.0 and sp["stop"] == [""] and sp["max_new_tokens"] is None
    r = post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = post("/v1/completions", {"prompt": "x", "max_tokens": None})
    assert r.status_code == 200 and fake.requests[-1].sampling_params["max_new_tokens"] is None
    # As vLLM and OpenAI: no tokens asked for is a 400, but for a completion echoing (scoring) its prompt.
    for path, body, param in (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0},
                               "max_completion_tokens"),
                              ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0, "echo": True},
                               "max_tokens"),
                              ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens")):
        r = post(path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert "must be at least 1" in r.json()["error"]["message"]
    r = post("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and fake.requests[-1].sampling_params["max_new_tokens"] == 0
    # OpenAI's nullable fields: null is the default.
    r = post("/v1/chat/completions", {"messages": MESSAGES, "n": None, "stream": None, "logprobs": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    assert post("/v1/completions", {"prompt": "x", "echo": None, "n": None}).status_code == 200


def test_a_generate_batch_over_the_sample_limit_says_the_limit_and_names_its_field(base_url, fake):
    n = len(fake.requests)
    r = httpx.post(base_url + "/generate", json={"text": ["hi"] * 5000, "sampling_params": {"max_new_tokens": 1}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "text" and err["message"].endswith("5000, at most 256"), err
    r = httpx.post(base_url + "/generate", json={"input_ids": [[1, 2]] * 100, "sampling_params": {"n": 3}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "n" and "more than 256" in err["message"], err
    assert len(fake.requests) == n


def test_stop_reason_and_continuous_usage_as_vllm(base_url, client, fake):
    import json as _json

    def sse(path: str, body: dict) -> list[dict]:
        r = httpx.post(base_url + path, json={"model": MODEL, "stream": True, **body})
        return [_json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]

    # A matched stop string (or stop token id) is the choice's stop_reason, streamed or not.
    fake.script = lambda req: text_chunks(["a", "b"], stop_reason="END")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert r.choices[0].model_extra["stop_reason"] == "END"
    r = client.completions.create(model=MODEL, prompt="x")
    assert r.choices[0].model_extra["stop_reason"] == "END"
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        events = sse(path, body)
        assert [e["choices"][0]["stop_reason"] for e in events] == [None] * (len(events) - 1) + ["END"]
    # The model's EOS is no stop_reason (vLLM reports null), though /generate's matched keeps it.
    fake.script = lambda req: text_chunks(["a", "b"], meta=["", '{"stop_reason": 4093, "matched_eos": true}'])
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].model_extra["stop_reason"] is None
    # continuous_usage_stats needs include_usage; the role chunk already has the prompt's size.
    fake.script = lambda req: text_chunks(["a", "b"], prompt_tokens=7)
    events = sse("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in e for e in events)
    events = sse("/v1/chat/completions", {"messages": MESSAGES,
                                          "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(e["usage"]["prompt_tokens"] == 7 for e in events)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[0]["usage"]["completion_tokens"] == 0


def test_generate_ids_and_logprob_keys_as_sglang(base_url, fake):
    fake.script = lambda req: text_chunks(["a", "b"])
    r = httpx.post(base_url + "/generate", json={"text": ["x", "y"], "rid": "X", "sampling_params": {"n": 2}})
    assert [o["meta_info"]["id"] for o in r.json()] == ["X_0_0", "X_0_1", "X_1_0", "X_1_1"]
    r = httpx.post(base_url + "/generate", json={"text": "x", "rid": "Y", "sampling_params": {"n": 2}})
    assert [o["meta_info"]["id"] for o in r.json()] == ["Y_0", "Y_1"]
    # One rid names the request, as SGLang's does: before an X-Request-Id header (QA: the header
    # won, so an abort or a duplicate check by the rid missed the request); the one used is echoed
    # when the client gave no header.
    r = httpx.post(base_url + "/generate", json={"text": "x", "rid": "g77"})
    assert r.json()["meta_info"]["id"] == "g77" and r.headers["x-request-id"] == "g77"
    # A rid the client chose is its request's alone while it runs (the client refuses a second,
    # tests/test_frontend_triton.py); a generated id needs no such check.
    assert fake.requests[-1].client_named
    httpx.post(base_url + "/generate", json={"text": "x"})
    assert not fake.requests[-1].client_named
    r = httpx.post(base_url + "/generate", json={"text": "x", "rid": "g78"}, headers={"X-Request-Id": "hdr1"})
    assert r.json()["meta_info"]["id"] == "g78" and r.headers["x-request-id"] == "hdr1"
    assert fake.requests[-1].request_id == "g78" and fake.requests[-1].client_named
    r = httpx.post(base_url + "/generate", json={"text": "x"}, headers={"X-Request-Id": "hdr2"})
    assert r.json()["meta_info"]["id"] == "hdr2"
    # SGLang's top-level priority (higher first there) points at the sampling parameter.
    r = httpx.post(base_url + "/generate", json={"text": "x", "priority": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority" and "sampling_params.priority" in r.text
    # An empty token_ids_logprob asks for none, as SGLang reads it (QA: "0 entries for 1 prompts").
    r = httpx.post(base_url + "/generate", json={"text": "x", "return_logprob": True, "token_ids_logprob": []})
    assert r.status_code == 200 and "token_ids_logprob" not in fake.requests[-1].sampling_params, r.text
    r = httpx.post(base_url + "/generate", json={"text": ["x", "y", "z"], "rid": ["a", "b", "a"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid" and "'a' is given twice" in r.text
    # return_logprob: the token lists always (input ones too), the top ones only with top_logprobs_num.
    meta = httpx.post(base_url + "/generate", json={"text": "x", "return_logprob": True}).json()["meta_info"]
    assert meta["output_token_logprobs"] == [] and meta["input_token_logprobs"] == []
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta
    meta = httpx.post(base_url + "/generate", json={"text": "x", "return_logprob": True,
                                                    "top_logprobs_num": 2}).json()["meta_info"]
    assert meta["output_top_logprobs"] == [] and meta["input_top_logprobs"] == []
    events = [line for line in httpx.post(base_url + "/generate", json={
        "text": "x", "return_logprob": True, "stream": True}).text.splitlines() if line.startswith("data: {")]
    import json as _json
    assert all("input_token_logprobs" in _json.loads(e[6:])["meta_info"] for e in events)


def test_frontend_bench_clients_count_every_token():
    """openai_frontend.bench's three load generators against its scripted-engine frontend (in
    its own process): each request's completion tokens counted once, streamed or not."""
    import asyncio

    from openai_frontend import bench

    with bench._fake_server(0.0, 8) as url:
        for load in (bench.run_raw_load, bench.run_load, bench.run_sdk_load):
            for endpoint in ("chat", "completions"):
                for stream in (False, True):
                    r = asyncio.run(load(url, endpoint=endpoint, stream=stream, concurrency=3, requests=7,
                                         max_tokens=5))
                    assert (r["requests"], r["tokens"]) == (7, 35), (load.__name__, endpoint, stream, r)


def test_generate_return_hidden_states_as_sglang(base_url, fake):
    # The engine sends each response's new entries (the prompt's rows as one, then a row per
    # fed-back token); /generate reports them all, cumulative in every streamed event.
    rows = [[[0.5, 1.0], [1.5, 2.0]], [2.5, 3.0], [3.5, 4.0]]

    def script(req):
        chunks = text_chunks(["a", "b", "c"])
        for chunk, entry in zip(chunks, rows):
            chunk.meta_raw = json.dumps({"index": 0, "hidden_states": [entry]})
        return chunks

    fake.script = script
    r = httpx.post(base_url + "/generate", json={"text": "x", "return_hidden_states": True}).json()
    assert r["meta_info"]["hidden_states"] == rows
    assert fake.requests[-1].sampling_params["return_hidden_states"] is True
    events = [json.loads(line[6:]) for line in httpx.post(base_url + "/generate", json={
        "text": "x", "return_hidden_states": True, "return_logprob": True, "stream": True}).text.splitlines()
        if line.startswith("data: {")]
    assert [e["meta_info"]["hidden_states"] for e in events] == [rows[:1], rows[:2], rows]
    # Off (the default, or false for this prompt of a batch): no key, nothing asked of the engine.
    batch = httpx.post(base_url + "/generate", json={"text": ["x", "y"], "return_hidden_states": [False, True]}).json()
    assert "hidden_states" not in batch[0]["meta_info"] and batch[1]["meta_info"]["hidden_states"] == rows
    assert [q.sampling_params.get("return_hidden_states") for q in fake.requests[-2:]] == [None, True]
    # Newer SGLang takes it among the sampling params too.
    inside = httpx.post(base_url + "/generate", json={"text": "x", "sampling_params": {"return_hidden_states": True}})
    assert inside.json()["meta_info"]["hidden_states"] == rows
    odd = httpx.post(base_url + "/generate", json={"text": "x", "sampling_params": {"return_hidden_states": "yes"}})
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "return_hidden_states"
    bad = httpx.post(base_url + "/generate", json={"text": ["x", "y"], "return_hidden_states": [True]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "return_hidden_states"


def test_detokenize_names_its_own_field_in_an_error():
    # The preprocessing model calls them input_ids; this request calls them tokens (QA).
    import asyncio
    from types import SimpleNamespace

    from openai_frontend.errors import APIError
    from openai_frontend.protocol import DetokenizeRequest
    from openai_frontend.tokenization import detokenize

    async def refuse(tokens):
        raise APIError(400, "input_ids out of range [0, 4096): [99999]", param="input_ids")

    async def no_adapters(model, verify=False):
        pass

    ctx = SimpleNamespace(check_model=lambda model: None, refresh_adapters=no_adapters,
                          client=SimpleNamespace(detokenize=refuse))
    with pytest.raises(APIError) as err:
        asyncio.run(detokenize(ctx, DetokenizeRequest(tokens=[99999])))
    assert (err.value.param, err.value.message) == ("tokens", "tokens out of range [0, 4096): [99999]")


@pytest.mark.parametrize("frontend_id", ["a.b", "x@y", "", "sp ace"])
def test_cli_refuses_a_frontend_id_that_would_not_parse_out_of_a_triton_id(frontend_id):
    # Triton request ids are <client id>@<frontend id>.<suffix>, parsed from the right.
    from openai_frontend.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--model-name", MODEL, "--frontend-id", frontend_id])
    assert "--frontend-id" in str(exc.value)


def test_cli_workers_auto_is_one_per_four_usable_cpus_up_to_four(monkeypatch):
    from openai_frontend.__main__ import parse_args

    from backend import host_limits

    monkeypatch.setattr(host_limits, "cpu_quota", lambda dirs=None: None)
    for cpus, workers in ((2, 1), (7, 1), (8, 2), (16, 4), (64, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert parse_args(["--model-name", MODEL]).workers == workers
    # a container limited to 2.5 CPUs on a 64-core host: its event loops would take the engine's time
    monkeypatch.setattr(host_limits, "cpu_quota", lambda dirs=None: 2.5)
    assert parse_args(["--model-name", MODEL]).workers == 1
    monkeypatch.setattr(host_limits, "cpu_quota", lambda dirs=None: 12.0)
    assert parse_args(["--model-name", MODEL]).workers == 3
    assert parse_args(["--model-name", MODEL, "--workers", "3"]).workers == 3
    for bad in ("0", "many"):
        with pytest.raises(SystemExit):
            parse_args(["--model-name", MODEL, "--workers", bad])


def test_the_engines_facts_are_asked_again_after_a_while(monkeypatch):
    """QA: after a tritonserver restart with another max_model_len, the frontend kept the first
    answer for good (and, with the server down, said config.json's)."""
    import asyncio
    from types import SimpleNamespace

    from openai_frontend import common

    class Engine:
        info: object = {"config": {"max_model_len": 256}, "eos_token_ids": [7]}

        async def engine_info(self):
            if isinstance(self.info, Exception):
                raise self.info
            return self.info

    engine = Engine()
    ctx = common.Context(Settings(model_name=MODEL), engine, SimpleNamespace(max_model_len=4096))

    async def facts():
        return await ctx.max_model_len(), await ctx.eos_token_ids()

    assert asyncio.run(facts()) == (256, frozenset({7}))
    engine.info = {"config": {"max_model_len": 2048}, "eos_token_ids": [8]}
    assert asyncio.run(facts()) == (256, frozenset({7}))  # within the TTL: the answer had
    monkeypatch.setattr(common, "ENGINE_INFO_TTL_S", 0.0)
    assert asyncio.run(facts()) == (2048, frozenset({8}))
    engine.info = APIError(503, "Triton server unavailable")
    assert asyncio.run(facts()) == (2048, frozenset({8}))  # down: the last answer, not config.json's
    fresh = common.Context(Settings(model_name=MODEL), engine, SimpleNamespace(max_model_len=4096))
    assert asyncio.run(fresh.max_model_len()) == 4096  # never answered: config.json's


class _OneAnswerCall:
    """A fake one-response gRPC call: its answer, then (after `end_after` s, or never) its end."""

    def __init__(self, meta: dict, end_after: float | None) -> None:
        import numpy as np

        self.answer = np.array([json.dumps(meta).encode()], dtype=np.object_)
        self.end_after = end_after
        self.sent = False
        self.ended = False
        self.cancelled = None  # an asyncio.Event once read: set by cancel(), as gRPC ends the call

    def stream_infer(self, requests):
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        import asyncio

        if not self.sent:
            self.sent = True
            answer = self.answer
            return type("Result", (), {"as_numpy": lambda _, name: answer})(), None
        if self.end_after is None:
            self.cancelled = asyncio.Event()
            await self.cancelled.wait()
            raise asyncio.CancelledError()  # grpc.aio's end of a read on a cancelled call
        await asyncio.sleep(self.end_after)
        self.ended = True
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled.set()


@pytest.mark.parametrize("end_after", [0.05, None])
def test_a_one_response_llm_call_is_read_until_the_server_ends_it(monkeypatch, end_after):
    # Triton 2.51 kept `llm` loaded at shutdown when the frontend closed its channel between an
    # abort's answer and the end of that call (README): the call is read to its end, within
    # CALL_END_WAIT_S when the server never ends it.
    import asyncio

    from openai_frontend import triton_client
    from openai_frontend.triton_client import TritonLLMClient

    monkeypatch.setattr(triton_client, "CALL_END_WAIT_S", 0.3)
    client = TritonLLMClient("localhost:1", abort_model="llm")
    call = client._servers[0].client = _OneAnswerCall({"aborted": 1}, end_after)
    t0 = time.monotonic()
    answer = asyncio.run(client._llm_request([], "abort", 5, "abort.x"))
    assert answer == {"aborted": 1}
    assert call.ended == (end_after is not None)
    assert (call.cancelled is not None and call.cancelled.is_set()) == (end_after is None)  # cut at the wait
    assert time.monotonic() - t0 < 1.0


def test_requests_cut_by_a_forced_stop_get_an_openai_style_503():
    """QA: when uvicorn stops for good (a second Ctrl-C, the graceful timeout run out) it cancels
    what still runs: a request not yet answered got uvicorn's plain-text 500, a stream was cut
    without a word. Now a 503 in OpenAI's shape, and an error event then [DONE]."""
    import threading

    import uvicorn

    from openai_frontend.testing import free_port

    fake = FakeLLMClient(lambda req: text_chunks([f"w{i} " for i in range(300)]), delay=0.05)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(Settings(model_name=MODEL), client=fake), host="127.0.0.1",
                                           port=port, log_level="warning", timeout_graceful_shutdown=0.5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES}
    got: dict[str, object] = {}
    streaming = threading.Event()

    def plain() -> None:
        r = httpx.post(url, json=body, timeout=30)
        got["plain"] = (r.status_code, r.headers.get("content-type"), r.json())

    def stream() -> None:
        lines = []
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    streaming.set()
        got["stream"] = lines

    clients = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for c in clients:
        c.start()
    assert streaming.wait(10)
    time.sleep(0.2)
    server.should_exit = True
    for c in clients:
        c.join(30)
    thread.join(30)
    status, content_type, error = got["plain"]
    assert (status, content_type) == (503, "application/json"), got["plain"]
    assert error["error"]["type"] == "service_unavailable_error" and "shutting down" in error["error"]["message"]
    lines = got["stream"]
    assert lines[-1] == "[DONE]" and "shutting down" in json.loads(lines[-2])["error"]["message"], lines[-3:]
    assert fake.finished.count("closed") == 2  # both engine streams were closed


def test_strict_tools_under_auto_hold_calls_to_their_schema(qwen):
    """QA: `strict: true` (what the SDK's pydantic_function_tool sends) was accepted and ignored
    under tool_choice auto: a call could break its schema and `.parse()` failed in the client.
    Text stays free; a call, once begun, must be a declared function with valid arguments, as
    SGLang constrains auto when a tool is strict."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    client, qfake, _ = qwen
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    qfake.script = lambda req: text_chunks(_pieces("Let me check.\n" + QWEN_CALL, 6))
    for parallel in (None, False):
        kw = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[strict_weather, TIME], **kw)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        tag = json.loads(qfake.requests[-1].sampling_params["structural_tag"])
        assert tag["format"]["type"] == "triggered_tags" and tag["format"]["triggers"] == ["<tool_call>"]
        grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
        second = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
        assert accepts(grammar, "Let me check.\n" + QWEN_CALL)
        assert accepts(grammar, "Just text, no call.")
        assert accepts(grammar, QWEN_CALL + "\n" + second) is (parallel is None)
        bad_args = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 5, "unit": "kelvin"}}\n</tool_call>'
        assert not accepts(grammar, bad_args)
        assert not accepts(grammar, '<tool_call>\n{"name": "get_nothing", "arguments": {}}\n</tool_call>')
    # Without a strict tool, auto stays unconstrained.
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME])
    assert "structural_tag" not in qfake.requests[-1].sampling_params
    # Beside a response_format the output has no room for a call: nothing to hold, nothing refused.
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[strict_weather],
                                   response_format={"type": "json_object"})
    sp = qfake.requests[-1].sampling_params
    assert "structural_tag" not in sp and "json_schema" in sp


def test_strict_llama3_calls_are_held_to_their_schema_also_as_a_bare_object():
    """Llama 3 may write a call as a bare JSON object at the start of its output, with no
    <|python_tag|> to trigger a constraint (SGLang leaves it free): under strict auto it is held
    to its schema too, as are the calls after its ';', while text stays free."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from openai_frontend.protocol import ChatTool
    from openai_frontend.tools import get_parser, parse_as_streamed, plan_tools

    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    tools = [ChatTool.model_validate(strict_weather), ChatTool.model_validate(TIME)]
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}'
    other = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    bad = '{"name": "get_weather", "parameters": {"city": 5}}'
    for parallel in (True, False):
        plan = plan_tools(tools, "auto", parallel, "llama3")
        grammar = xgr.Grammar.from_structural_tag(plan.constraint[1])
        for text, ok in [(call, True), ("\n " + call, True), (bad, False), ("\u3000" + call, True),
                         ("\u00a0" + bad, False), ("\x1c\u2028" + bad, False),  # whitespace the parser skips ('{"name": "nope", "parameters": {}}', False),
                         (call + "; " + other, parallel), (call + ";" + bad, False),
                         ("<|python_tag|>" + call, True), ("<|python_tag|>" + call + "; " + bad, False),
                         ("Let me check. <|python_tag|>" + call, True), ("Let me check. <|python_tag|>" + bad, False),
                         ("Plain text {with braces}.", True), ("<b>bold</b>", True), ("", True),
                         ('{"a": 1} is JSON', False)]:
            assert accepts(grammar, text) is ok, (parallel, text)
            if ok and text.lstrip().startswith(("{", "<|")):  # what the grammar lets through, the parser reads as calls
                _, calls = parse_as_streamed(get_parser("llama3"), text, plan.tools, False, lambda: "id")
                assert calls and all(c.name in ("get_weather", "get_time") for c in calls), text


def test_strict_tools_under_auto_are_refused_where_the_format_cannot_hold_them():
    from openai_frontend.errors import APIError
    from openai_frontend.protocol import ChatTool
    from openai_frontend.tools import plan_tools

    tools = [ChatTool.model_validate(TIME),
             ChatTool.model_validate({**WEATHER, "function": {**WEATHER["function"], "strict": True}})]
    with pytest.raises(APIError) as err:
        plan_tools(tools, "auto", None, "pythonic")
    assert err.value.status_code == 400 and err.value.param == "tools[1].function.strict"
    assert "pythonic" in str(err.value) and "strict false" in str(err.value)
    assert plan_tools(tools, "required", None, "pythonic").constraint is not None


def test_the_current_sdks_newer_fields_work_or_are_refused_by_name(client, fake):
    """SDK QA: safety_identifier / prompt_cache_key are metadata and hints (accepted, like user);
    what this server cannot do is refused by name: obfuscation padding, other cache retentions,
    a verbosity other than the default "medium"."""
    client.chat.completions.create(model=MODEL, messages=MESSAGES, safety_identifier="u-1", prompt_cache_key="k",
                                   prompt_cache_retention="in_memory", verbosity="medium")
    for stream in (client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                  stream_options={"include_obfuscation": False}),
                   client.completions.create(model=MODEL, prompt="x", stream=True,
                                             stream_options={"include_obfuscation": False, "include_usage": True})):
        assert list(stream)
    for kw, param in (({"stream": True, "stream_options": {"include_obfuscation": True}},
                       "stream_options.include_obfuscation"),
                      ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
                      ({"verbosity": "low"}, "verbosity"), ({"verbosity": "high"}, "verbosity")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
        assert _error(err)["param"] == param, kw


def test_an_assistant_refusal_part_in_history_is_text(client, fake):
    """SDK QA: an assistant message with a `refusal` content part (as OpenAI returns refusals)
    was a 400; vLLM reads it as text. Elsewhere it is still refused."""
    history = [{"role": "user", "content": "do the bad thing"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
               {"role": "user", "content": "ok, say hello"}]
    client.chat.completions.create(model=MODEL, messages=history)
    assert fake.requests[-1].messages[1]["content"] == "I can't help with that."
    for bad in ([{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}],
                [{"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}]):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=bad)


def _utf8_script(req):
    """Demo-tokenizer ids as the engine streams them: the detokenizer holds a character's first
    byte piece back (text ""), and a response can carry several tokens (stream_interval), a
    special token among them."""
    def chunk(text, ids, lps, finish=None, prompt=None):
        meta = {"output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids)]}
        if prompt:
            meta.update(input_token_logprobs=[[None, prompt[0], None]] + [[-1.0, i, None] for i in prompt[1:]])
        return EngineChunk(text, ids, finish, 4, 0, json.dumps(meta))
    echo = req.sampling_params.get("logprob_start_len", -1) == 0
    special = "" if req.sampling_params.get("skip_special_tokens", True) else "<|im_start|>"
    return [chunk("", [127], [-0.1], prompt=[127, 102, 289, 74] if echo else None), chunk("é", [102], [-0.2]),
            chunk(" ok", [289, 74], [-0.3, -0.4]),
            chunk(special + "日本語", [4092, 1906, 1129, 252], [-0.5, -0.6, -0.7, -0.8], finish="length")]


def test_completion_text_offsets_index_the_text_through_utf8_pieces_and_skipped_tokens(demo_model_path):
    # QA: offsets advanced by each token's name, "�" for every byte piece of a character and the
    # skipped special token's whole name, so they pointed past their tokens in the text.
    with serve_in_thread(create_app(Settings(model_name=MODEL, tokenizer_path=demo_model_path),
                                    client=FakeLLMClient(_utf8_script))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for echo, prefix, want in [(False, "", [0, 0, 1, 3, 4, 4, 6, 6]),
                                   (True, "é ok", [0, 0, 1, 3] + [4 + o for o in [0, 0, 1, 3, 4, 4, 6, 6]])]:
            r = client.completions.create(model=MODEL, prompt="é ok", max_tokens=8, logprobs=1, echo=echo)
            assert r.choices[0].text == prefix + "é ok日本語"
            assert r.choices[0].logprobs.text_offset == want
            streamed = [c.choices[0] for c in client.completions.create(
                model=MODEL, prompt="é ok", max_tokens=8, logprobs=1, echo=echo, stream=True)]
            assert "".join(c.text for c in streamed) == r.choices[0].text
            assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == want
            assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == r.choices[0].logprobs.tokens
            text = r.choices[0].text
            for token, offset in zip(r.choices[0].logprobs.tokens, want):
                assert token in ("�", "<|im_start|>") or text[offset:offset + len(token)] == token
        # Kept in the text, the special token advances by its name.
        r = client.completions.create(model=MODEL, prompt="x", max_tokens=8, logprobs=0,
                                      extra_body={"skip_special_tokens": False})
        assert r.choices[0].text == "é ok<|im_start|>日本語"
        assert r.choices[0].logprobs.text_offset[4:] == [4, 16, 18, 18]


def test_completion_text_offsets_streamed_equal_one_chunk_when_the_detokenizer_held_text_back():
    # QA: a token whose bytes were two lone UTF-8 continuation bytes ("\ufffd\ufffd" at once)
    # came in a chunk with no text (the detokenizer held it back); the next chunk's text started
    # with it, and its first token's streamed offset pointed there: 14 where non-streaming said 16.
    from openai_frontend.engine_types import TokenLogprob
    from openai_frontend.logprobs import CompletionLogprobs

    class Namer:
        raw_of = {1: b"\x81\x82", 2: b" being", 3: b"\xe3\x81", 4: b"\x86"}

        def __call__(self, lp):
            return lp.text

        def raw(self, lp):
            return self.raw_of[lp.token_id]

        def special(self, lp):
            return False

    def offsets(chunks):
        lp = CompletionLogprobs(Namer())
        for k, (ids, text) in enumerate(chunks):
            lp.add([TokenLogprob(i, -1.0, text=Namer.raw_of[i].decode("utf-8", "replace")) for i in ids], text,
                   whole=k == len(chunks) - 1)
        return lp.text_offset

    text = "\ufffd\ufffd beingう"
    whole = offsets([([1, 2, 3, 4], text)])
    assert whole == [0, 2, 8, 8]
    assert offsets([([1], ""), ([2, 3], "\ufffd\ufffd being"), ([4], "う")]) == whole
    assert offsets([([1], ""), ([2], ""), ([3], ""), ([4], text)]) == whole
    # The last chunk's text may have lost a stop string: its tokens' offsets stay within it.
    assert offsets([([1, 2], "\ufffd\ufffd")]) == offsets([([1], ""), ([2], "\ufffd\ufffd")]) == [0, 2]
    # An echoed prompt's text is as given: what its tokens decode beyond it is not carried on.
    lp = CompletionLogprobs(Namer())
    lp.add([TokenLogprob(2, None, text=" being")], "being", whole=True)
    lp.add([TokenLogprob(4, -1.0, text="x")], "x")
    assert lp.text_offset == [0, 5]


def test_message_name_and_metadata_are_typed_as_openai_types_them(client, base_url):
    # QA: any type was accepted for a message's `name` and for `metadata` (OpenAI: strings, at
    # most 16 pairs, keys of 64 and values of 512 characters).
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi", "name": "bob"}],
                                        metadata={"team": "a"}, max_tokens=2)
    assert ok.choices[0].message.content
    for body, param in (({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages.0.name"),
                        ({"messages": MESSAGES, "metadata": {"a": 1}}, "metadata.a"),
                        ({"messages": MESSAGES, "metadata": {str(i): "x" for i in range(17)}}, "metadata"),
                        ({"messages": MESSAGES, "metadata": {"k": "v" * 513}}, "metadata")):
        r = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_workers_sharing_an_engine_agree_on_runtime_adapters_at_once():
    # Two frontend workers (apps) on one engine (QA, --frontend-workers 3): an adapter loaded
    # through one was a 404 on another that had listed less than a second before; one unloaded
    # through one stayed in another's /v1/models/{id} and /tokenize; the same refused load named
    # lora_name or lora_path depending on the worker.
    engine = FakeLLMClient()
    settings = dict(model_name=MODEL, allow_runtime_lora_updating=True)
    with serve_in_thread(create_app(Settings(**settings), client=engine)) as a, \
            serve_in_thread(create_app(Settings(**settings), client=engine)) as b:
        assert httpx.get(b + "/v1/models").status_code == 200  # b has just listed (none)
        assert httpx.post(a + "/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": "/x"}).status_code == 200
        chat = httpx.post(b + "/v1/chat/completions", json={"model": "ad", "messages": MESSAGES, "max_tokens": 2})
        assert chat.status_code == 200 and engine.requests[-1].sampling_params["lora_path"] == "ad", chat.text
        for url in (a, b):
            again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": "/x"})
            assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name", again.text
        assert httpx.post(a + "/v1/unload_lora_adapter", json={"lora_name": "ad"}).status_code == 200
        assert httpx.get(b + "/v1/models/ad").status_code == 404
        tok = httpx.post(b + "/tokenize", json={"model": "ad", "prompt": "hi"})
        assert tok.status_code == 404 and tok.json()["error"]["code"] == "model_not_found", tok.text
        assert [m["id"] for m in httpx.get(b + "/v1/models").json()["data"]] == [MODEL]


def test_metrics_dirs_of_frontends_that_are_gone_are_swept(tmp_path):
    # QA: a multi-worker frontend killed (SIGKILL) left its metrics directory in /tmp for good.
    import subprocess
    import sys

    from openai_frontend.__main__ import METRICS_DIR_PREFIX, sweep_metrics_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{METRICS_DIR_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{METRICS_DIR_PREFIX}{os.getpid()}-def"
    old_style = tmp_path / f"{METRICS_DIR_PREFIX}x1y2z3"  # named before pids were: left alone
    for d in (dead, live, old_style):
        d.mkdir()
        (d / "1.json").write_text("{}")
    sweep_metrics_dirs(str(tmp_path))
    assert not dead.exists() and live.exists() and old_style.exists()


def test_several_workers_over_several_servers_share_one_router_memory(tmp_path):
    from openai_frontend.__main__ import parse_args, settings_from_args, share_router_memory
    from openai_frontend.router import Router
    from openai_frontend.router_memory import chunk_hashes

    def shared(*argv: str):
        settings = settings_from_args(parse_args(["--workers", "2", *argv]))
        settings.metrics_dir = str(tmp_path / argv[-1].replace(",", "_"))
        os.mkdir(settings.metrics_dir)
        share_router_memory(settings)
        return settings

    settings = shared("--triton-url", "a:8001,b:8001")
    assert settings.router_memory_path.startswith(settings.metrics_dir)  # removed with it at exit
    # Two workers' routers (as each worker's client makes them) see one table.
    one, two = (Router(2, settings.router_config(), names=settings.triton_urls, memory_path=settings.router_memory_path)
                for _ in range(2))
    prompt = "A prompt long enough for a few chunks, sent through the first worker. " * 4
    one.memory.remember(1, one.memory.lookup(chunk_hashes(prompt)))
    assert two.memory.matched(two.memory.lookup(chunk_hashes(prompt)), [0, 1]) == [0, len(chunk_hashes(prompt))]
    # One server, or a policy that remembers nothing: no file.
    assert shared("--triton-url", "a:8001").router_memory_path is None
    assert shared("--router-policy", "round_robin", "--triton-url", "c:8001,d:8001").router_memory_path is None


def test_triton_url_takes_grpc_endpoints_not_an_http_url(capsys):
    from openai_frontend.__main__ import main, parse_args, settings_from_args

    for good in ("localhost:8001", "10.0.0.5:9001", "[::1]:8001", "dns:///triton:8001"):
        assert parse_args(["--triton-url", good]).triton_url == [good]
    assert settings_from_args(parse_args([])).triton_urls == ["localhost:8001"]
    # Several servers (data parallelism): repeated or comma-separated.
    several = settings_from_args(parse_args(["--triton-url", "a:8001,b:8001", "--triton-url", "c:8001"]))
    assert several.triton_urls == ["a:8001", "b:8001", "c:8001"]
    assert several.router_config().policy == "cache_aware"
    # cache_aware's placement of new prompts: the same in every process when there are several.
    placements = {w: settings_from_args(parse_args(["--workers", w])).router_config().placement for w in ("1", "3")}
    assert placements == {"1": "least_seen", "3": "hash"}
    with pytest.raises(SystemExit, match="a server is named twice"):
        main(["--triton-url", "a:8001,a:8001"])
    with pytest.raises(SystemExit, match="cache_threshold must be within"):
        main(["--router-cache-threshold", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--router-policy", "least_busy"])
    assert "invalid choice: 'least_busy'" in capsys.readouterr().err
    for url in ("http://localhost:8001", "https://triton:8001", "grpc://triton:8001"):
        with pytest.raises(SystemExit):
            parse_args(["--triton-url", url])
        assert f"Triton's gRPC endpoint as host:port (8001 by default), not a URL: '{url}'" in capsys.readouterr().err


def test_qwen3_coder_calls_are_the_same_streamed_and_not_and_strict_tools_are_refused():
    """The qwen3_coder parser through the frontend (its parsing alone: test_tool_parser_qwen3_coder.py)."""
    from tests.test_tool_parser_qwen3_coder import TOOLS, call

    fake = FakeLLMClient()
    output = "Let me look.\n" + call("get_weather", ("city", "Paris"), ("days", "3")) + call("get_time")
    pieces = [output[i:i + 7] for i in range(0, len(output), 7)]
    fake.script = lambda req: text_chunks(pieces)
    messages = [{"role": "user", "content": "weather?"}]
    with serve_in_thread(create_app(Settings(model_name=MODEL, tool_call_parser="qwen3_coder"), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert calls == [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]
        assert r.choices[0].message.content == "Let me look." and r.choices[0].finish_reason == "tool_calls"
        streamed: dict[int, list[str]] = {}
        text = ""
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True):
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for tc in delta.tool_calls or ():
                entry = streamed.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
        assert text == "Let me look." and [tuple(v) for _, v in sorted(streamed.items())] == calls
        # Strict tools under auto need JSON arguments to constrain: refused by name.
        strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=messages, tools=strict)
        assert err.value.body["param"] == "tools[0].function.strict"

"""The frontend on the real tritonserver (model_repository/: preprocessing -> llm -> postprocessing,
the demo model), over the real tritonclient gRPC stream: the Triton side of the frontend.

TritonLLMClient's tensors and final flag, n samples in one stream, error mapping; SGLang /generate
called with `requests` exactly as the seed examples do; detokenization of CJK / emoji / spaces end
to end; bad inputs; auth, request ids, body and stop limits; /metrics; a client disconnect frees
the engine's KV blocks; graceful shutdown drains a stream; Triton unreachable, restarted and
overloaded -> 503 + Retry-After, and the frontend recovers by itself. (The OpenAI SDK's view is in
test_openai_sdk.py.) One tritonserver for the module; the last test restarts it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import requests

from client.local_server import REPO_ROOT, free_port, triton_home
from openai_frontend.engine_types import EngineRequest
from openai_frontend.errors import APIError
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import scrape_metric, serve_in_thread, start_triton, wait_kv_blocks_free
from openai_frontend.triton_client import TritonLLMClient, _is_final, build_inputs

MODEL = "demo"
GREEDY = {"temperature": 0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Say hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def triton(demo_model_path, tmp_path_factory):
    if not (triton_home() / "backends" / "python" / "triton_python_backend_stub").exists():
        pytest.skip("tritonserver's Python backend stub is not installed (scripts/setup.sh)")
    log = tmp_path_factory.mktemp("triton") / "server.log"
    box = {"server": start_triton(demo_model_path, log), "log": log, "model": demo_model_path}
    yield box
    box["server"].stop(timeout=10)


@pytest.fixture(scope="module")
def base_url(triton):
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, abort_model="llm",
                        tool_call_parser="qwen25", max_body_bytes=64 * 1024)
    with serve_in_thread(create_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def tok(demo_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_path)


def _metrics_url(triton) -> str:
    return triton["server"].metrics_url


def _run(coro):
    return asyncio.run(coro)


async def _collect(url: str, request: EngineRequest, model: str = "ensemble"):
    client = TritonLLMClient(url, model)
    try:
        return [c async for c in client.generate(request)]
    finally:
        await client.close()


# ---------------------------------------------------------------------------------------------
# TritonLLMClient on the ensemble
# ---------------------------------------------------------------------------------------------


def test_client_sends_chat_inputs_and_streams_to_the_final_flag(triton, tok):
    url = triton["server"].grpc_url
    kwargs = {"enable_thinking": False}
    req = EngineRequest(sampling_params={**GREEDY, "max_new_tokens": 6}, messages=MESSAGES, tools=[WEATHER],
                        chat_template_kwargs=kwargs, request_id="inputs-1")
    chunks = _run(_collect(url, req))
    # one response per token unless the llm model's senders fell behind (then merged, in order)
    assert 1 < len(chunks) <= 6 and [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    counts = [c.completion_tokens for c in chunks]
    assert counts == sorted(set(counts)) and counts[-1] == 6
    assert [len(c.token_ids) for c in chunks] == [b - a for a, b in zip([0] + counts, counts)]
    # messages, tools and chat_template_kwargs reached the chat template in preprocessing
    prompt = tok.apply_chat_template(MESSAGES, tools=[WEATHER], add_generation_prompt=True, tokenize=False, **kwargs)
    assert chunks[0].prompt_tokens == len(tok(prompt).input_ids)
    ids = [t for c in chunks for t in c.token_ids]
    assert "".join(c.text for c in chunks) == tok.decode(ids, skip_special_tokens=True)

    # stream=False: one response with everything, identical result (greedy)
    whole = _run(_collect(url, EngineRequest(sampling_params={**GREEDY, "max_new_tokens": 6}, messages=MESSAGES,
                                             tools=[WEATHER], chat_template_kwargs=kwargs, stream=False)))
    assert len(whole) == 1 and whole[0].token_ids == ids and whole[0].finish_reason == "length"

    # add_generation_prompt=False and pre-tokenized prompts
    no_gen = _run(_collect(url, EngineRequest(sampling_params={"max_new_tokens": 1}, messages=MESSAGES,
                                              add_generation_prompt=False)))
    ref = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert no_gen[0].prompt_tokens == len(tok(ref).input_ids)
    by_ids = _run(_collect(url, EngineRequest(sampling_params={**GREEDY, "max_new_tokens": 3}, input_ids=[5, 6, 7, 8])))
    assert by_ids[0].prompt_tokens == 4 and sum(len(c.token_ids) for c in by_ids) == 3


def test_client_n_samples_share_one_stream(triton):
    url = triton["server"].grpc_url
    for stream in (True, False):
        chunks = _run(_collect(url, EngineRequest(sampling_params={"max_new_tokens": 4, "ignore_eos": True, "seed": 3},
                                                  text_input="Once upon a time", n=3, stream=stream)))
        finished = [c.index for c in chunks if c.finish_reason]
        assert sorted(finished) == [0, 1, 2], finished
        for i in range(3):
            assert sum(len(c.token_ids) for c in chunks if c.index == i) == 4
        if not stream:
            assert len(chunks) == 3  # one response per sample


def test_client_error_mapping(triton):
    url = triton["server"].grpc_url
    with pytest.raises(APIError) as err:
        _run(_collect(url, EngineRequest(sampling_params={"top_p": 0}, text_input="a")))
    assert err.value.status_code == 400 and err.value.param == "top_p"
    with pytest.raises(APIError) as err:
        _run(_collect(url, EngineRequest(sampling_params={"bogus_param": 1}, text_input="a")))
    assert err.value.status_code == 400 and "bogus_param" in err.value.message
    with pytest.raises(APIError) as err:
        _run(_collect(url, EngineRequest(sampling_params={}, input_ids=[5] * 1100)))
    assert err.value.status_code == 400 and "context" in err.value.message
    with pytest.raises(APIError) as err:
        _run(_collect(url, EngineRequest(sampling_params={}, text_input="a"), model="no_such_model"))
    assert err.value.status_code == 503

    async def ready(name):
        client = TritonLLMClient(url, name)
        try:
            return await client.is_ready()
        finally:
            await client.close()

    assert _run(ready("ensemble")) is True
    assert _run(ready("no_such_model")) is False


# ---------------------------------------------------------------------------------------------
# SGLang /generate, as the seed documents call it
# ---------------------------------------------------------------------------------------------


def test_generate_normal_and_streaming_as_the_seed_examples(base_url, tok):
    response = requests.post(
        base_url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 32}},
    )
    assert response.status_code == 200, response.text
    whole = response.json()
    assert set(whole) == {"text", "output_ids", "meta_info"}
    meta = whole["meta_info"]
    assert meta["completion_tokens"] == len(whole["output_ids"]) > 0
    assert meta["prompt_tokens"] == len(tok("The capital of France is").input_ids)
    assert meta["finish_reason"]["type"] in ("length", "stop") and "e2e_latency" in meta and "cached_tokens" in meta
    assert whole["text"] == tok.decode(whole["output_ids"], skip_special_tokens=True)

    # the seed's streaming loop, verbatim except that it collects instead of printing
    response = requests.post(
        base_url + "/generate",
        json={
            "text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 32},
            "stream": True,
        },
        stream=True,
    )
    printed = []
    prev = 0
    saw_done = False
    last = None
    for chunk in response.iter_lines(decode_unicode=False):
        chunk = chunk.decode("utf-8")
        if chunk and chunk.startswith("data:"):
            if chunk == "data: [DONE]":
                saw_done = True
                break
            data = json.loads(chunk[5:].strip("\n"))
            output = data["text"].strip()
            printed.append(output[prev:])
            prev = len(output)
            last = data
    assert saw_done and response.headers["content-type"].startswith("text/event-stream")
    assert "".join(printed) == whole["text"].strip()
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]  # cumulative
    assert last["meta_info"]["finish_reason"] == meta["finish_reason"]


def test_generate_batch_n_input_ids_and_logprobs(base_url):
    batch = requests.post(base_url + "/generate", json={
        "text": ["Hello", "The sky is"],
        "sampling_params": [{"max_new_tokens": 4, **GREEDY}, {"max_new_tokens": 6, **GREEDY}],
    }).json()
    assert [b["meta_info"]["completion_tokens"] for b in batch] == [4, 6]
    single = requests.post(base_url + "/generate", json={"text": "The sky is",
                                                          "sampling_params": {"max_new_tokens": 6, **GREEDY}}).json()
    assert batch[1]["text"] == single["text"]

    multi = requests.post(base_url + "/generate", json={
        "input_ids": [11, 12, 13], "sampling_params": {"n": 3, "max_new_tokens": 5, "ignore_eos": True, "seed": 1},
    }).json()
    assert len(multi) == 3 and all(m["meta_info"]["completion_tokens"] == 5 for m in multi)
    assert len({m["meta_info"]["id"] for m in multi}) == 3

    lp = requests.post(base_url + "/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, **GREEDY},
        "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True,
    }).json()
    out = lp["meta_info"]["output_token_logprobs"]
    tops = lp["meta_info"]["output_top_logprobs"]
    assert [e[1] for e in out] == lp["output_ids"] and len(tops) == 4
    for (logprob, token_id, _), top in zip(out, tops):
        assert len(top) == 2 and top[0][1] == token_id and abs(top[0][0] - logprob) < 1e-4  # greedy
        assert logprob <= 0

    # SGLang's scoring request: max_new_tokens 0, logprobs from the prompt's first token.
    scored = requests.post(base_url + "/generate", json={
        "text": "The sky is blue", "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0,
    }).json()
    inp = scored["meta_info"]["input_token_logprobs"]
    assert scored["output_ids"] == [] and scored["meta_info"]["finish_reason"]["type"] == "length"
    assert len(inp) == scored["meta_info"]["prompt_tokens"] and inp[0][0] is None
    assert all(e[0] <= 0 for e in inp[1:])

    # streaming a batch with n: events carry "index", each cumulative for its own sample
    events = []
    with requests.post(base_url + "/generate", stream=True, json={
        "text": ["a b", "c d"], "sampling_params": {"n": 2, "max_new_tokens": 3, "ignore_eos": True}, "stream": True,
    }) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(len(e["output_ids"]) == 3 for e in finals.values())


def _strict_json(text: str):
    """JSON as strict parsers read it: -Infinity / NaN (which Python writes) are errors."""
    def refuse(name):
        raise AssertionError(f"{name} in a JSON response")
    return json.loads(text, parse_constant=refuse)


def _close(a, b) -> bool:
    """Equal, floats within 1e-5 (logprobs), at any depth."""
    if a == b:
        return True
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= 1e-5
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def _generate_events(base_url: str, body: dict) -> dict[int, dict]:
    """The last streamed event of each sample (SGLang's events are cumulative)."""
    last: dict[int, dict] = {}
    with requests.post(base_url + "/generate", stream=True, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                event = _strict_json(line[6:].decode())
                last[event.get("index", 0)] = event
    return last


def test_generate_return_hidden_states_match_hf(base_url, demo_model_path):
    # SGLang's layout through the ensemble: the prompt's final-norm rows as one entry, then a row
    # per generated token fed back; together HF's last hidden states of prompt + output[:-1].
    # Streamed events carry them cumulatively, the last one all of them.
    import torch
    from transformers import AutoModelForCausalLM

    ids = [11, 12, 13, 14, 15, 16, 17]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, **GREEDY}, "return_hidden_states": True}
    out = requests.post(base_url + "/generate", json=body).json()
    hidden = out["meta_info"]["hidden_states"]
    assert len(hidden) == 5 and len(hidden[0]) == len(ids)
    model = AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = model(torch.tensor([ids + out["output_ids"][:-1]]), output_hidden_states=True).hidden_states[-1][0]
    assert torch.allclose(torch.tensor(hidden[0] + hidden[1:]), want, atol=1e-3, rtol=0)
    events = [json.loads(line[5:]) for line in requests.post(base_url + "/generate", json={**body, "stream": True})
              .iter_lines(decode_unicode=True) if line.startswith("data: {")]
    assert events[-1]["meta_info"]["hidden_states"] == hidden
    lengths = [len(e["meta_info"]["hidden_states"]) for e in events]  # a token each, or more when merged
    assert lengths == sorted(set(lengths)) and lengths[-1] == 5 and len(lengths) > 1
    plain = requests.post(base_url + "/generate", json={**body, "return_hidden_states": False}).json()
    assert "hidden_states" not in plain["meta_info"] and plain["output_ids"] == out["output_ids"]


def test_generate_input_embeds_equal_the_same_prompt_as_ids(triton, base_url, demo_model_path):
    # SGLang's input_embeds through the ensemble (preprocessing checks them and hands llm an
    # empty prompt_ids; llm reads the embeddings): the model's own embedding rows of a prompt
    # generate what its ids do, single, batched and streamed; tritonclient straight to the
    # ensemble and to llm too. The demo model's default repetition penalty counts prompt tokens,
    # which an embedded prompt has none of: off for the comparison.
    from safetensors.numpy import load_file

    table = load_file(str(demo_model_path / "model.safetensors"))["model.embed_tokens.weight"]
    prompts = [[11, 12, 13, 14, 15, 16, 17], [300, 301, 302]]
    sp = {"max_new_tokens": 6, "repetition_penalty": 1.0, **GREEDY}
    embeds = [table[p].tolist() for p in prompts]
    by_ids = requests.post(base_url + "/generate", json={"input_ids": prompts, "sampling_params": sp}).json()
    batch = requests.post(base_url + "/generate", json={"input_embeds": embeds, "sampling_params": sp}).json()
    single = requests.post(base_url + "/generate", json={"input_embeds": embeds[0], "sampling_params": sp}).json()
    for got, want in ((batch[0], by_ids[0]), (batch[1], by_ids[1]), (single, by_ids[0])):
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        assert got["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
        assert got["meta_info"]["cached_tokens"] == 0
    streamed = _generate_events(base_url, {"input_embeds": embeds[1], "sampling_params": sp})[0]
    assert streamed["output_ids"] == by_ids[1]["output_ids"] and streamed["text"] == by_ids[1]["text"]

    url = triton["server"].grpc_url
    request = EngineRequest(sampling_params=sp, input_embeds=embeds[0])
    for model in ("ensemble", "llm"):
        chunks = _run(_collect(url, request, model=model))
        assert [t for c in chunks for t in c.token_ids] == by_ids[0]["output_ids"]

    post = lambda body: httpx.post(base_url + "/generate", json=body, timeout=60)  # noqa: E731
    err = _error(post({"input_embeds": [[0.1] * 64] * 3}), 400)
    assert "hidden size" in err["message"] and "[num_tokens, 128]" in err["message"]
    assert _error(post({"input_embeds": [[0.1] * 128, [0.1] * 127]}), 400)["param"] == "input_embeds"
    assert "exactly one of" in _error(post({"text": "x", "input_embeds": [[0.1] * 128]}), 400)["message"]
    err = _error(post({"input_embeds": [[0.1] * 128], "return_logprob": True, "logprob_start_len": 0}), 400)
    assert "prompt logprobs" in err["message"]
    assert _error(post({"input_embeds": [[0.1, "x"]]}), 400)["param"].startswith("input_embeds")


def test_random_generate_requests_stream_exactly_what_they_return(base_url):
    """SGLang /generate with random sampling parameters (seeds, n, stops, stop ids, min tokens,
    penalties, constraints, logprobs): the last streamed event of every sample equals the
    non-streamed answer (text, ids, finish reason, token counts, logprobs)."""
    import random

    rng = random.Random(7)
    volatile = {"id", "e2e_latency"}
    for case in range(14):
        sp: dict = {"max_new_tokens": rng.randint(1, 40), "n": rng.choice([1, 1, 2])}
        sp.update({"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.9, "seed": rng.randrange(999)})
        choice = rng.choice(["plain", "stop", "stop_ids", "min", "penalties", "regex", "json"])
        if choice == "stop":
            sp["stop"] = [rng.choice(["e", " t", "."])]
        elif choice == "stop_ids":
            sp["stop_token_ids"] = [rng.randrange(10, 4000) for _ in range(50)]
        elif choice == "min":
            sp.update(min_new_tokens=5, max_new_tokens=rng.randint(5, 40))
        elif choice == "penalties":
            sp.update(frequency_penalty=0.4, presence_penalty=0.2, repetition_penalty=1.1)
        elif choice == "regex":
            sp.update(regex=r"(yes|no), because [a-z ]{3,20}\.", max_new_tokens=rng.choice([4, 40]))
        elif choice == "json":
            sp.update(json_schema=json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                              "required": ["ok"], "additionalProperties": False}))
        body: dict = {"text": rng.choice(["The sky is", "日本語と 🙂", "Once"]), "sampling_params": sp}
        if rng.random() < 0.5:
            body.update(return_logprob=True, top_logprobs_num=rng.randint(0, 2), logprob_start_len=rng.choice([-1, 0]))
        plain = requests.post(base_url + "/generate", json=body)
        assert plain.status_code == 200, plain.text
        answers = _strict_json(plain.text)
        answers = answers if isinstance(answers, list) else [answers]
        streamed = _generate_events(base_url, body)
        assert sorted(streamed) == list(range(len(answers))), (case, body)
        for i, want in enumerate(answers):
            got = streamed[i]
            assert (got["text"], got["output_ids"]) == (want["text"], want["output_ids"]), (case, i, body)
            meta_got = {k: v for k, v in got["meta_info"].items() if k not in volatile}
            meta_want = {k: v for k, v in want["meta_info"].items() if k not in volatile}
            assert meta_got.keys() == meta_want.keys(), (case, i, body)
            for key in meta_want:
                assert _close(meta_got[key], meta_want[key]), (case, i, key, body)


def test_repetition_penalty_is_sglangs_on_generate_and_vllms_on_openai(base_url):
    """SGLang's repetition_penalty scales tokens generated so far, so it changes nothing at the
    first output position; vLLM's scales the prompt's tokens too (QA s19_sampling: /generate
    penalized the prompt). A logit_bias makes the prompt's last token the favourite, without
    saturating it."""
    prompt = [911, 1204, 377, 2049, 58, 1433]
    bias = {str(prompt[-1]): 9.0}

    def generate(rep: float) -> tuple:
        r = requests.post(base_url + "/generate", json={
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "logit_bias": bias, "repetition_penalty": rep}})
        assert r.status_code == 200, r.text
        first = r.json()["meta_info"]["output_token_logprobs"][0]
        return first[1], round(first[0], 5)

    def completion(rep: float) -> tuple:
        r = requests.post(base_url + "/v1/completions", json={
            "model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 0,
            "logit_bias": bias, "repetition_penalty": rep, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        return int(lp["tokens"][0].removeprefix("token_id:")), round(lp["token_logprobs"][0], 5)

    plain = generate(1.0)
    assert plain[0] == prompt[-1]
    assert generate(1.8) == plain  # nothing generated yet: nothing to penalize
    assert completion(1.0) == plain
    assert completion(1.8) != plain  # the prompt's tokens count


def test_tokenize_and_detokenize_as_the_server_does(triton, base_url, tok):
    # vLLM's tokenizer API, answered by the server's own preprocessing / postprocessing models.
    text = "Hello, 世界 🙂 spaces  kept"
    r = requests.post(base_url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == tok(text).input_ids and r["count"] == len(r["tokens"]) and r["token_strs"] is None
    assert r["max_model_len"] == 1024  # the engine's (LLM_MAX_MODEL_LEN), not the model's 4096
    back = requests.post(base_url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    assert requests.post(base_url + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    # vLLM's add_special_tokens reaches preprocessing (the demo's Qwen tokenizer adds no BOS either way).
    bare = requests.post(base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok(text, add_special_tokens=False).input_ids

    # Messages: exactly the prompt a chat completion with them is charged for.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = requests.post(base_url + "/tokenize", json={"messages": messages, "tools": tools}).json()
    want = tok(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)).input_ids
    assert chat["tokens"] == want
    completion = requests.post(base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "tools": tools, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == chat["count"]
    special = requests.post(base_url + "/detokenize", json={"tokens": chat["tokens"][:3]}).json()["prompt"]
    assert special.startswith("<|im_start|>")  # special tokens are kept, as vLLM's detokenize does
    cont = requests.post(base_url + "/tokenize", json={
        "messages": [*messages, {"role": "assistant", "content": "It is"}],
        "add_generation_prompt": False, "continue_final_message": True}).json()
    assert tok.decode(cont["tokens"]).endswith("<|im_start|>assistant\nIt is")

    # Errors are 400s that say what is wrong.
    for body, needle in [
        ({"prompt": "a", "messages": messages}, "exactly one of prompt and messages"),
        ({}, "exactly one of prompt and messages"),
        ({"prompt": "a", "return_token_strs": True}, "--tokenizer-path"),
        ({"messages": messages, "chat_template": "{{ x }}"}, "LLM_TRUST_REQUEST_CHAT_TEMPLATE"),
        ({"prompt": "a", "chat_template": "{{ x }}"}, "chat_template needs messages"),
        ({"messages": messages, "continue_final_message": True}, "cannot both be true"),
        ({"messages": messages, "add_generation_prompt": False, "continue_final_message": True},
         "needs a final assistant message"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs"),
    ]:
        resp = requests.post(base_url + "/tokenize", json=body)
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"], (body, resp.text)
    for tokens, needle in [([5, 4096], "out of range"), ([-1], "tokens")]:
        resp = requests.post(base_url + "/detokenize", json={"tokens": tokens})
        assert resp.status_code == 400 and needle in resp.text, (tokens, resp.text)
    assert requests.post(base_url + "/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404

    # With the model's files, token strings and the context length too.
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, tokenizer_path=str(triton["model"]))
    with serve_in_thread(create_app(settings)) as url:
        r = requests.post(url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
        assert r["max_model_len"] == 1024
        card = requests.get(url + "/v1/models").json()["data"][0]
        assert card["max_model_len"] == 1024


def test_streamed_text_survives_cjk_emoji_and_spaces(base_url, tok):
    prompt = "Streaming text: spaces,  double  spaces, 中文字符 and emoji 🙂🎉 should survive. 日本語も"
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 40, **GREEDY}}
    whole = requests.post(base_url + "/generate", json=body).json()
    events = []
    with requests.post(base_url + "/generate", json={**body, "stream": True}, stream=True) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, never rewritten
    assert texts[-1] == whole["text"] == tok.decode(whole["output_ids"], skip_special_tokens=True)

    # the same through the OpenAI chat stream (deltas) and with a sampled (non-greedy) run
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "seed": 7,
            "temperature": 1.0}
    full = httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60).json()
    deltas = []
    with httpx.stream("POST", base_url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    deltas.append(c["delta"].get("content") or "")
    assert "".join(deltas) == full["choices"][0]["message"]["content"]


def test_generate_structured_outputs(base_url):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
              "required": ["name", "population"], "additionalProperties": False}
    r = requests.post(base_url + "/generate", json={
        "text": "Here is the information of the capital of France in the JSON format.\n",
        "sampling_params": {"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(schema)},
    })
    assert r.status_code == 200, r.text
    import jsonschema

    jsonschema.validate(json.loads(r.json()["text"]), schema)
    r = requests.post(base_url + "/generate", json={
        "text": "Paris is the capital of",
        "sampling_params": {"temperature": 0, "max_new_tokens": 16, "regex": "(France|England)"},
    })
    assert r.status_code == 200 and r.json()["text"] in ("France", "England"), r.text


# ---------------------------------------------------------------------------------------------
# Bad inputs, auth, ids, limits
# ---------------------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_bad_inputs_get_openai_errors_and_the_server_keeps_serving(base_url):
    post = lambda path, body: httpx.post(base_url + path, json=body, timeout=60)  # noqa: E731
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    assert _error(post("/v1/chat/completions", {**chat, "temperature": "hot"}), 400)["param"] == "temperature"
    assert _error(post("/v1/chat/completions", {**chat, "messages": []}), 400)["param"] == "messages"
    assert _error(post("/v1/chat/completions", {**chat, "model": "gpt-9"}), 404)["code"] == "model_not_found"
    assert _error(post("/v1/chat/completions", {**chat, "top_p": 0}), 400)["param"] == "top_p"  # the engine's check
    assert _error(post("/v1/chat/completions", {**chat, "top_p": 0, "stream": True}), 400)["param"] == "top_p"
    assert _error(post("/v1/chat/completions", {**chat, "n": 1000}), 400)["param"] == "n"
    assert _error(post("/v1/chat/completions", {**chat, "stop": [f"s{i}" for i in range(65)]}), 400)["param"] == "stop"
    assert _error(post("/v1/chat/completions", {**chat, "frobnicate": 1}), 400)["param"] == "frobnicate"
    err = _error(post("/v1/chat/completions", {**chat, "tools": [WEATHER],
                                               "tool_choice": {"type": "function", "function": {"name": "nope"}}}), 400)
    assert err["param"] == "tool_choice"
    err = _error(post("/v1/chat/completions", {**chat, "custom_logit_processor": "{}"}), 400)
    assert err["param"] == "custom_logit_processor" and "--enable-custom-logit-processor" in err["message"]
    err = _error(post("/generate", {"text": "x", "custom_logit_processor": "{}"}), 400)
    assert err["param"] == "custom_logit_processor"
    assert _error(post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}), 400)["param"] == "max_tokens"
    assert _error(post("/v1/completions", {"model": MODEL, "prompt": [5] * 1100}), 400)
    assert _error(post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "many"}}), 400)
    _error(post("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}), 400)
    big = "x" * (70 * 1024)
    assert _error(post("/v1/completions", {"model": MODEL, "prompt": big}), 413)
    r = httpx.post(base_url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    _error(r, 400)
    # still serving
    ok = post("/v1/chat/completions", chat)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None


def test_request_id_echoed_and_api_key(triton, base_url):
    r = httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"X-Request-Id": "my-req-42"})
    assert r.headers["x-request-id"] == "my-req-42" and r.json()["id"] == "cmpl-my-req-42"
    assert httpx.get(base_url + "/v1/models").headers["x-request-id"]  # generated when absent

    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, api_key="sekret")
    with serve_in_thread(create_app(settings)) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        missing = _error(httpx.post(url + "/v1/completions", json=body), 401)  # OpenAI's: no code for this one
        assert missing["message"].startswith("You didn't provide an API key") and missing["code"] is None, missing
        wrong = _error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert wrong["code"] == "invalid_api_key", wrong
        assert _error(httpx.get(url + "/v1/models"), 401)
        ok = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}, timeout=60)
        assert ok.status_code == 200
        assert httpx.get(url + "/health").status_code == 200  # health and metrics stay open
        assert httpx.get(url + "/metrics").status_code == 200


def test_a_frontend_pointed_at_a_model_it_cannot_call_or_that_is_not_there_says_so(triton):
    # QA: --triton-model llm (the engine, not the ensemble) answered chat with Triton's
    # "unexpected inference input 'messages'" and /generate's ids with empty text, /health 200.
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, triton_model="llm")
    with serve_in_thread(create_app(settings)) as url:
        health = _error(httpx.get(url + "/health"), 500)
        assert health["message"].startswith(
            "Triton model 'llm' is not one this frontend can call: it has no output text_output and no input "
            "text_input, messages, "), health
        assert "--triton-model names it" in health["message"]
        chat = _error(httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}), 500)
        ids = _error(httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}), 500)
        assert chat["message"] == ids["message"] == health["message"]
    # A name Triton does not have: /health says so, with the names it has.
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, triton_model="ensembel")
    with serve_in_thread(create_app(settings)) as url:
        health = _error(httpx.get(url + "/health"), 503)
        assert health["message"] == (
            f"Triton model 'ensembel' at {triton['server'].grpc_url} is not ready: Triton has no model of that name "
            "(it has: ensemble, llm, postprocessing, preprocessing)"), health


def test_models_health_and_parse_function_call(base_url):
    models = httpx.get(base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(base_url + f"/v1/models/{MODEL}").json()["id"] == MODEL
    _error(httpx.get(base_url + "/v1/models/other"), 404)
    assert httpx.get(base_url + "/health").status_code == 200
    r = httpx.post(base_url + "/parse_function_call", json={
        "text": 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "tool_call_parser": "qwen25", "tools": [WEATHER],
    }).json()
    assert r["normal_text"] == "Sure." and r["calls"][0]["name"] == "get_weather"
    assert json.loads(r["calls"][0]["parameters"]) == {"city": "Paris"}


# ---------------------------------------------------------------------------------------------
# Disconnects free the engine's KV blocks; metrics
# ---------------------------------------------------------------------------------------------


def _aborted(triton) -> float:
    return scrape_metric(_metrics_url(triton), "llm_request_finished_total", 'finish_reason="abort"') or 0.0


def _wait_aborted(triton, at_least: float, timeout: float = 5.0) -> None:
    # Metrics are published by the engine thread while clients see their streams end on the
    # response threads, so the counter may trail the last response by a step: poll for it.
    deadline = time.monotonic() + timeout
    while (seen := _aborted(triton)) < at_least:
        assert time.monotonic() < deadline, f"{seen:.0f} aborted requests counted, expected >= {at_least:.0f}"
        time.sleep(0.05)


@pytest.fixture
def cancelled_grpc_reads(monkeypatch):
    """Counts gRPC stream reads (grpc.aio's own, wrapped) whose awaiting task was cancelled while
    they were in flight. grpc.aio leaks each one (its batch, and the message with the transport
    buffer it pins: grpc/grpc#43360): the frontend grew ~1.4 KB per client disconnect."""
    from grpc.aio import _call

    original = _call._StreamResponseMixin._read
    count = [0]

    async def _read(self):
        try:
            return await original(self)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                count[0] += 1
            raise

    monkeypatch.setattr(_call._StreamResponseMixin, "_read", _read)

    unary = _call.UnaryUnaryCall._invoke

    async def _invoke(self):  # grpc.aio's own catches the cancellation (returns EOF): look after it
        result = await unary(self)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            count[0] += 1
        return result

    monkeypatch.setattr(_call.UnaryUnaryCall, "_invoke", _invoke)
    return count


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True, "n": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": "a long story " * 30, "stream": True}),
    ("/generate", {"text": "tell me", "stream": True}),
])
def test_client_disconnect_mid_stream_frees_kv_blocks(triton, base_url, path, body, cancelled_grpc_reads):
    body = {**body, **({"sampling_params": {"max_new_tokens": 900, "ignore_eos": True}} if path == "/generate"
                       else {"max_tokens": 900, "ignore_eos": True})}
    aborted = _aborted(triton)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", base_url + path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (a dropped iterator closes the connection: keep it)
            seen, used, last_scrape = 0, 0.0, 0.0
            for line in lines:
                seen += line.startswith("data: {")
                if time.monotonic() - last_scrape > 0.05:  # the engine publishes every 0.2 s while busy
                    last_scrape = time.monotonic()
                    used = scrape_metric(_metrics_url(triton), "llm_kv_blocks_used")
                if seen >= 4 and used > 0:
                    break
            assert used > 0
    # leaving the block closes the connection mid-stream
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)
    # freed because the engine aborted the request (900 tokens take far longer)
    _wait_aborted(triton, aborted + 1)
    assert cancelled_grpc_reads[0] == 0


def test_client_disconnect_before_the_response_frees_kv_blocks(triton, base_url, cancelled_grpc_reads):
    """A non-streaming client hangs up while its request runs: the engine aborts it. The
    connection is a raw socket closed once the engine holds the request's blocks, so the hang-up
    lands mid-generation however fast generation is (a client timeout used to race it)."""
    aborted = _aborted(triton)
    body = json.dumps({"model": MODEL, "prompt": "wait for it", "max_tokens": 1000, "ignore_eos": True}).encode()
    url = httpx.URL(base_url)
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 10
        while scrape_metric(_metrics_url(triton), "llm_kv_blocks_used") == 0:
            assert time.monotonic() < deadline, f"the request never reached the engine: {sock.recv(4096)!r}"
            time.sleep(0.02)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)  # nothing answered yet: 1000 tokens take a second or more
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)
    _wait_aborted(triton, aborted + 1)
    assert cancelled_grpc_reads[0] == 0


def test_a_request_past_the_stream_timeout_is_aborted_in_the_engine(triton):
    """--stream-timeout: the client gets its 504 (streaming: an error event), and the engine
    stops the request (QA: it generated on to its length for nobody)."""
    # On an idle machine the demo model writes 1000 tokens in under a second (the test's timeout
    # was 1 s): four samples of 1000 take seconds, ten times this timeout and more.
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, abort_model="llm", stream_timeout=0.3)
    with serve_in_thread(create_app(settings)) as url:
        for stream in (False, True):
            aborted = _aborted(triton)
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "go on", "max_tokens": 1000, "n": 4, "ignore_eos": True, "stream": stream})
            if stream:
                assert r.status_code == 200 and "timed out" in r.text
            else:
                assert r.status_code == 504 and "timed out" in r.json()["error"]["message"], r.text
                assert r.headers["x-should-retry"] == "false"  # the OpenAI SDK would run it 3 times
            _wait_aborted(triton, aborted + 1)  # 4 x 1000 tokens take seconds more (and would end as "length")
            wait_kv_blocks_free(_metrics_url(triton), timeout=10)
            assert time.monotonic() - t0 < 8


def _stream_until_aborted(url: str, body: dict, started: threading.Event, out: list) -> None:
    with httpx.Client(timeout=60) as http, http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    started.set()
        out.append(events)


def test_abort_request_ends_streams_with_finish_reason_abort(triton, base_url):
    """SGLang's /abort_request: by rid (a /generate stream, and one prompt of a batch), and
    abort_all (OpenAI streams); each keeps what it generated and frees its blocks. A second
    request under a rid in flight is refused, as SGLang refuses it; once it ended the rid is free."""
    aborted = _aborted(triton)
    long = {"max_new_tokens": None, "ignore_eos": True}  # up to the end of the context
    bodies = {
        "single": {"text": "tell me", "stream": True, "rid": "abort-me", "sampling_params": long},
        "batch": {"text": ["one", "two"], "stream": True, "rid": "abort-batch", "sampling_params": long},
        # n > 1: SGLang names the samples <rid>_<i>, and refuses a request under one of them.
        "samples": {"text": "tell me", "stream": True, "rid": "abort-n", "sampling_params": {**long, "n": 2}},
    }
    agains = {"single": "abort-me", "batch": "abort-batch_1", "samples": "abort-n_1"}
    for name, body in bodies.items():
        started, out = threading.Event(), []
        t = threading.Thread(target=_stream_until_aborted, args=(base_url + "/generate", body, started, out))
        t.start()
        assert started.wait(30)
        again = {"text": "again", "rid": agains[name], "sampling_params": {"max_new_tokens": 2}}
        dup = httpx.post(base_url + "/generate", json=again)
        assert dup.status_code == 400, dup.text
        assert dup.json()["error"]["message"] == f"Duplicate request ID detected: {again['rid']}"
        assert dup.json()["error"]["param"] == "rid"
        if name == "batch":  # the other way round: samples named as the batch's running prompts
            dup = httpx.post(base_url + "/generate", json={**again, "rid": "abort-batch", "sampling_params": {"n": 2}})
            assert dup.status_code == 400 and dup.json()["error"]["message"].endswith("abort-batch_0"), dup.text
        r = httpx.post(base_url + "/abort_request", json={"rid": body["rid"]})
        assert r.status_code == 200 and r.json() == {"aborted": 2 if name == "batch" else 1}, r.text
        t.join(30)
        assert not t.is_alive() and out, name
        r = httpx.post(base_url + "/generate", json=again)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2, r.text
        finals = [e["meta_info"] for e in out[0] if e["meta_info"].get("finish_reason")]
        assert finals and all(m["finish_reason"]["type"] == "abort" for m in finals), finals
        assert all(0 < m["completion_tokens"] < 1000 for m in finals)
    # A request its client named like a batch item is not one (QA: aborting "job" took "job_1").
    threads = {}
    for rid in ("job", "job_1"):
        started, out = threading.Event(), []
        body = {"text": "tell me", "stream": True, "rid": rid, "sampling_params": long}
        threads[rid] = (threading.Thread(target=_stream_until_aborted, args=(base_url + "/generate", body, started, out)),
                        started, out)
        threads[rid][0].start()
        assert started.wait(30)
    for rid in ("job", "job_1"):
        r = httpx.post(base_url + "/abort_request", json={"rid": rid})
        assert r.status_code == 200 and r.json() == {"aborted": 1}, (rid, r.text)
        threads[rid][0].join(30)
        assert not threads[rid][0].is_alive() and threads[rid][2], rid
    # abort_all, over OpenAI chat streams
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "ignore_eos": True}
    threads, outs = [], []
    for _ in range(3):
        started, out = threading.Event(), []
        threads.append((threading.Thread(target=_stream_until_aborted,
                                         args=(base_url + "/v1/chat/completions", body, started, out)), started))
        outs.append(out)
        threads[-1][0].start()
    assert all(started.wait(30) for _, started in threads)
    r = httpx.put(base_url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.json()["aborted"] >= 3
    for t, _ in threads:
        t.join(30)
    for out in outs:
        reasons = [c["choices"][0]["finish_reason"] for c in out[0] if c.get("choices") and c["choices"][0]["finish_reason"]]
        assert reasons == ["abort"], reasons
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)
    _wait_aborted(triton, aborted + 6)
    # an id with nothing in flight is no error; neither rid nor abort_all is one
    assert httpx.post(base_url + "/abort_request", json={"rid": "nobody"}).json() == {"aborted": 0}
    r = httpx.post(base_url + "/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    assert httpx.post(base_url + "/abort_request", json={"rid": "x", "bogus": 1}).status_code == 400


def test_abort_request_by_a_sample_id_ends_that_sample_only(triton, base_url):
    """QA: with n > 1 the samples report ids <rid>_<i> (and a request under one is refused), but an
    abort by one matched nothing and the sample ran to its end. As SGLang's parallel samples each
    have a rid of their own, it now ends that sample alone; <rid> ends the rest."""
    aborted = _aborted(triton)
    body = {"text": "tell me", "stream": True, "rid": "pair", "sampling_params": {"max_new_tokens": None,
                                                                                   "ignore_eos": True, "n": 2}}
    events: list = []

    def read() -> None:
        with httpx.Client(timeout=60) as http, http.stream("POST", base_url + "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            events.extend(json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))

    def finals() -> dict:
        return {e["index"]: e["meta_info"] for e in list(events) if e["meta_info"].get("finish_reason")}

    t = threading.Thread(target=read)
    t.start()
    deadline = time.monotonic() + 30
    while len({e["index"] for e in list(events)}) < 2:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.02)
    r = httpx.post(base_url + "/abort_request", json={"rid": "pair_1"})
    assert r.status_code == 200 and r.json() == {"aborted": 1}, r.text
    while 1 not in finals():
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.02)
    assert finals()[1]["finish_reason"]["type"] == "abort" and finals()[1]["id"] == "pair_1"
    # The sibling runs on; the same sample again, or one the request does not have, is nothing.
    tokens_then = sum(1 for e in list(events) if e["index"] == 0)
    while sum(1 for e in list(events) if e["index"] == 0) < tokens_then + 3:
        assert time.monotonic() < deadline and 0 not in finals()
        time.sleep(0.02)
    for rid in ("pair_1", "pair_2"):
        assert httpx.post(base_url + "/abort_request", json={"rid": rid}).json() == {"aborted": 0}, rid
    assert httpx.post(base_url + "/abort_request", json={"rid": "pair"}).json() == {"aborted": 1}
    t.join(30)
    assert not t.is_alive()
    done = finals()
    assert done[0]["finish_reason"]["type"] == "abort" and done[0]["completion_tokens"] > done[1]["completion_tokens"]
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)
    _wait_aborted(triton, aborted + 1)


def test_health_generate_goes_through_the_engine(triton, base_url):
    steps = scrape_metric(_metrics_url(triton), "llm_engine_steps_total") or 0.0
    r = httpx.get(base_url + "/health_generate", timeout=30)
    assert r.status_code == 200
    time.sleep(1.2)  # the engine publishes at once when idle, at most every 1 s while busy
    assert (scrape_metric(_metrics_url(triton), "llm_engine_steps_total") or 0.0) > steps
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)


def test_flush_cache_makes_the_next_prompt_cold(triton, base_url):
    """SGLang's /flush_cache and vLLM's /reset_prefix_cache reach the engine's prefix cache."""
    body = {"text": "a shared system prompt " * 20, "sampling_params": {"max_new_tokens": 1}}

    def cached() -> int:
        r = httpx.post(base_url + "/generate", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    cached()
    assert cached() > 0  # the second time, the prompt's full blocks come from the cache
    r = httpx.post(base_url + "/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed: ")
    assert int(r.text.split()[2]) > 0, r.text
    assert cached() == 0
    assert httpx.post(base_url + "/reset_prefix_cache").status_code == 200
    assert cached() == 0
    r = httpx.get(base_url + "/flush_cache")  # SGLang accepts GET too; the last prompt is cached again
    assert r.status_code == 200 and int(r.text.split()[2]) > 0, r.text
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)


def test_get_server_info_reports_the_effective_engine_config(triton, base_url):
    info = httpx.get(base_url + "/get_server_info").json()
    engine, frontend = info["engine"], info["frontend"]
    cfg = engine["config"]
    assert cfg["device"] == "cpu" and cfg["dtype"] == "float32"
    assert cfg["num_kv_blocks"] > 0 and cfg["max_model_len"] > 0 and cfg["block_size"] == 16  # "auto" resolved
    assert cfg["model_path"] == str(triton["model"]) and engine["vocab_size"] == 4096
    # generation_config.json's EOS id and the tokenizer's own (beam search ends beams on them)
    assert engine["eos_token_ids"] == [4091, 4093]
    assert engine["stats"]["num_kv_blocks"] == cfg["num_kv_blocks"] and engine["stats"]["num_steps"] >= 0
    # Requests the llm model took and has not sent the final response of (this one excluded).
    assert engine["stats"]["open_requests"] >= 0
    # Every "auto" setting as resolved on this CPU host, the llm model's own included.
    assert (cfg["max_prefill_tokens_while_decoding"], cfg["prefill_context_unit"], cfg["prefill_tokens_per_decode"],
            cfg["flat_prefill_tokens"], cfg["cuda_graphs"], cfg["max_responses_per_step"],
            cfg["stream_interval"], cfg["prefill_cap_queue_ratio"]) == (96, 640, 6, 0, False, 16, 1, 1.0)
    assert cfg["torch_threads"] >= 1 and cfg["response_senders"] >= 1
    # Left unset on purpose only: the pool was sized in blocks, and no logits processors are allowed.
    assert {k for k, v in cfg.items() if v is None} <= {"kv_cache_memory_mb", "logits_processor_pattern", "speculative_config"}, cfg
    assert frontend["served_model_name"] == MODEL and frontend["tool_call_parser"] == "qwen25"
    assert "api_key" not in frontend
    assert info["internal_states"] == [{}]  # SGLang's; no speculative decoding on this server


def test_an_abort_that_overtakes_its_request_still_aborts_it(triton):
    """The frontend's abort can reach the llm model before the request it names (still in
    preprocessing): the model remembers it and ends the request as soon as it arrives."""
    url = triton["server"].grpc_url
    client = TritonLLMClient(url, "llm", abort_model="llm")

    async def scenario():
        try:
            await client._abort("early-1")  # nothing runs under this id yet
            req = EngineRequest(sampling_params={"max_new_tokens": None, "ignore_eos": True}, input_ids=[5, 6, 7])
            payload = {"model_name": "llm", "inputs": build_inputs(req), "request_id": "early-1",
                       "parameters": {"triton_enable_empty_final_response": True}}
            return await _llm_stream(client, payload)
        finally:
            await client.close()

    reasons = _run(scenario())
    assert reasons and reasons[-1] == "abort", reasons
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)


async def _llm_stream(client: TritonLLMClient, payload: dict) -> list[str]:
    """The finish_reason of each response of one llm stream, to the final one."""
    done = asyncio.Event()

    async def one():
        yield payload
        await done.wait()

    reasons = []
    try:
        async for result, error in client._get().stream_infer(one()):
            assert error is None, error
            if result.get_response().outputs:
                reasons.append(result.as_numpy("finish_reason").reshape(-1)[0].decode())
            if _is_final(result.get_response()):
                break
    finally:
        done.set()
    return reasons


def test_beam_search_needs_no_model_files_in_the_frontend(base_url):
    # The EOS ids come from the engine (engine_info): base_url's frontend has no --tokenizer-path.
    body = {"model": MODEL, "prompt": "beams", "max_tokens": 3, "n": 2, "use_beam_search": True}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


def test_client_disconnect_stops_a_beam_search(triton):
    # Beam search is many short engine requests, one per beam and step: a client that leaves
    # must stop the search (no more steps) and leave no KV block held.
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, tokenizer_path=str(triton["model"]))
    with serve_in_thread(create_app(settings)) as url:
        body = {"model": MODEL, "prompt": "wait for it", "max_tokens": 3000, "n": 4, "use_beam_search": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=1.5)
        wait_kv_blocks_free(_metrics_url(triton), timeout=10)
        time.sleep(0.5)
        steps = scrape_metric(_metrics_url(triton), "llm_engine_steps_total")
        time.sleep(1.5)  # the engine publishes every 1 s while busy, and at once when idle
        assert scrape_metric(_metrics_url(triton), "llm_engine_steps_total") == steps


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_abort_request_ends_a_beam_search_with_what_it_had(triton, route):
    """QA: /abort_request by rid answered {"aborted": 0} and the search ran on to max_tokens (its
    steps were sent under no id), and abort_all could end it with empty "stop" choices; a /generate
    request naming its rid was not refused. It is one request to its client, as in SGLang."""
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, abort_model="llm")
    prompt = {"prompt": "wait for it"} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "wait for it"}]}
    body = {"model": MODEL, **prompt, "max_tokens": 3000, "n": 3, "use_beam_search": True}
    with serve_in_thread(create_app(settings)) as url:
        for how in ({"rid": "beams-1"}, {"abort_all": True}):
            result: dict = {}
            search = threading.Thread(target=lambda: result.update(r=httpx.post(
                url + route, json={**body, "rid": "beams-1"}, timeout=120)))
            search.start()
            time.sleep(1.0)  # some steps in
            dup = httpx.post(url + "/generate", json={"text": "x", "rid": "beams-1"}, timeout=30)
            assert dup.status_code == 400 and "Duplicate request ID" in dup.text, dup.text
            t0 = time.monotonic()
            aborted = httpx.post(url + "/abort_request", json=how, timeout=30)
            assert aborted.status_code == 200 and aborted.json()["aborted"] >= 1, aborted.text
            search.join(30)
            assert not search.is_alive() and time.monotonic() - t0 < 5
            r = result["r"]
            assert r.status_code == 200, r.text
            choices, usage = r.json()["choices"], r.json()["usage"]
            assert len(choices) == 3 and {c["finish_reason"] for c in choices} == {"abort"}, choices
            assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] < 3 * 3000, usage
            wait_kv_blocks_free(_metrics_url(triton), timeout=10)


def test_the_stream_timeout_bounds_a_whole_beam_search(triton):
    """QA: --stream-timeout was per engine stream, and a beam search is hundreds of short ones:
    a search of 7.5 s answered 200 past a 2 s timeout."""
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, abort_model="llm", stream_timeout=1.5)
    body = {"model": MODEL, "prompt": "wait for it", "max_tokens": 3000, "n": 3, "use_beam_search": True}
    with serve_in_thread(create_app(settings)) as url:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and "beam search" in r.json()["error"]["message"], r.text
        assert r.headers["x-should-retry"] == "false"
        assert time.monotonic() - t0 < 5
        wait_kv_blocks_free(_metrics_url(triton), timeout=10)


def _requests_ended(server, model: str) -> int:
    """Requests `model` has ended, succeeded or failed (Triton's statistics)."""
    stats = httpx.get(f"http://{server.http_url}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]["inference_stats"]
    return int(stats["success"]["count"]) + int(stats["fail"]["count"])


def test_a_disconnect_during_a_beam_searchs_tokenize_leaves_the_grpc_call_alone(triton, cancelled_grpc_reads):
    """Beam search tokenizes the prompt with a unary call to preprocessing; a client leaving
    meanwhile cancelled the task awaiting it (review s20), which grpc.aio leaks."""
    settings = Settings(triton_url=triton["server"].grpc_url, model_name=MODEL, abort_model="llm")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 400_000}],
                       "use_beam_search": True, "n": 2, "max_tokens": 5}).encode()
    ended = _requests_ended(triton["server"], "preprocessing")
    with serve_in_thread(create_app(settings)) as url:
        url = httpx.URL(url)
        with socket.create_connection((url.host, url.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.3)  # tokenizing 400,000 words takes preprocessing a second or more
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)  # not answered yet: the tokenize was still in flight
        # The shielded call finishes on its own. Until it has, closing the frontend would cancel
        # it (a slower host under the suite's other lane took over 3.3 s to tokenize).
        deadline = time.monotonic() + 60
        while _requests_ended(triton["server"], "preprocessing") == ended:
            assert time.monotonic() < deadline, "preprocessing never ended the tokenize call"
            time.sleep(0.1)
        time.sleep(0.5)  # its answer's way back to the frontend
    assert cancelled_grpc_reads[0] == 0
    wait_kv_blocks_free(_metrics_url(triton), timeout=10)


def test_frontend_metrics(base_url):
    before = httpx.get(base_url + "/metrics").text

    def count(text: str, endpoint: str, status: int) -> int:
        for line in text.splitlines():
            if line.startswith(f'frontend_requests_total{{endpoint="{endpoint}",status="{status}"}}'):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    for _ in range(3):
        assert httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                          timeout=60).status_code == 200
    httpx.post(base_url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    with httpx.stream("POST", base_url + "/generate", json={
            "text": "x", "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}) as r:
        lines = r.iter_lines()  # (a dropped iterator closes the connection: keep it)
        next(lines)
        during = httpx.get(base_url + "/metrics").text
        assert "frontend_streams_in_flight 1" in during, during
        assert 'frontend_requests_in_flight{endpoint="/generate"} 1' in during
    # The disconnect is seen and counted asynchronously: on a loaded host that takes a while.
    deadline = time.monotonic() + 15
    while True:
        after = httpx.get(base_url + "/metrics").text
        if "frontend_streams_in_flight 0" in after or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert count(after, "/v1/completions", 200) - count(before, "/v1/completions", 200) == 3
    assert count(after, "/v1/completions", 404) - count(before, "/v1/completions", 404) == 1
    assert count(after, "/generate", 200) - count(before, "/generate", 200) == 1
    assert "frontend_streams_in_flight 0" in after
    assert "# TYPE frontend_request_duration_seconds histogram" in after


# ---------------------------------------------------------------------------------------------
# Process-level behaviour: graceful shutdown; Triton unreachable, restarted, overloaded
# ---------------------------------------------------------------------------------------------


def _start_frontend_process(grpc_url: str, port: int, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "openai_frontend", "--triton-url", grpc_url, "--model-name", MODEL,
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the frontend exited"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the frontend did not start")


def test_abort_request_reaches_the_streams_of_other_frontend_processes(triton, base_url):
    """SGLang's /abort_request with --workers 2, aborted from a replica given the same
    --frontend-id: whichever process holds a stream, the engine aborts it by the rid (or all of
    that frontend's), and a frontend with another id keeps its streams. The replica refuses a
    rid the workers have in flight."""
    url = triton["server"].grpc_url
    ports = free_port(), free_port()
    workers = _start_frontend_process(url, ports[0], "--workers", "2", "--frontend-id", "shared-fe")
    replica = _start_frontend_process(url, ports[1], "--frontend-id", "shared-fe")
    try:
        aborted = _aborted(triton)
        long = {"max_new_tokens": None, "ignore_eos": True}
        base = f"http://127.0.0.1:{ports[0]}"
        # A rid names one request in flight (a second is refused); a batch's rid names its prompts.
        streams = [(base + "/generate", {"text": "tell me", "stream": True, "rid": "one-rid", "sampling_params": long})]
        streams.append((base + "/generate", {"text": ["one", "two"], "stream": True, "rid": "a-batch",
                                             "sampling_params": long}))
        streams.append((base + "/v1/completions", {"model": MODEL, "prompt": "no rid", "stream": True,
                                                   "max_tokens": 1000, "ignore_eos": True}))
        other = {"model": MODEL, "prompt": "another frontend", "stream": True, "max_tokens": 300, "ignore_eos": True}
        streams.append((base_url + "/v1/completions", other))
        threads, outs = [], []
        for target, body in streams:
            started, out = threading.Event(), []
            threads.append(threading.Thread(target=_stream_until_aborted, args=(target, body, started, out)))
            threads[-1].start()
            outs.append(out)
            assert started.wait(30)
        # A rid in flight is refused by the replica too: the llm model holds the running names of
        # every process sharing the frontend id.
        for rid in ("one-rid", "a-batch_1"):
            dup = httpx.post(f"http://127.0.0.1:{ports[1]}/generate",
                             json={"text": "again", "rid": rid, "sampling_params": {"max_new_tokens": 2}})
            assert dup.status_code == 400, dup.text
            assert dup.json()["error"]["message"] == f"Duplicate request ID detected: {rid}"
            assert dup.json()["error"]["param"] == "rid"
        abort = f"http://127.0.0.1:{ports[1]}/abort_request"
        assert httpx.post(abort, json={"rid": "one-rid"}).json() == {"aborted": 1}
        assert httpx.post(abort, json={"rid": "a-batch"}).json() == {"aborted": 2}
        assert httpx.post(abort, json={"abort_all": True}).json() == {"aborted": 1}  # the one without a rid
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        for out in outs[:2]:
            finals = [e["meta_info"]["finish_reason"]["type"] for e in out[0] if e["meta_info"].get("finish_reason")]
            assert finals and set(finals) == {"abort"}, finals
        reasons = [[c["choices"][0]["finish_reason"] for c in out[0] if c["choices"][0]["finish_reason"]] for out in outs[2:]]
        assert reasons == [["abort"], ["length"]]
        _wait_aborted(triton, aborted + 4)
        wait_kv_blocks_free(_metrics_url(triton), timeout=10)
        # Whichever worker answers a scrape, /metrics counts both workers' requests.
        want = {'frontend_requests_total{endpoint="/generate",status="200"} 2', "frontend_streams_total 3",
                "frontend_streams_in_flight 0"}
        deadline = time.monotonic() + 10
        while not want <= set((text := httpx.get(base + "/metrics").text).splitlines()):
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        for _ in range(6):
            text = httpx.get(base + "/metrics").text
            assert want <= set(text.splitlines()), text
    finally:
        for proc in (workers, replica):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_graceful_shutdown_drains_in_flight_streams(triton):
    port = free_port()
    proc = _start_frontend_process(triton["server"].grpc_url, port, "--graceful-shutdown-timeout", "60")
    try:
        body = {"model": MODEL, "prompt": "once", "max_tokens": 40, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        got = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    got.append(json.loads(line[6:]))
                    break
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections while draining
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            done = False
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    got.append(json.loads(line[6:]))
        chunks = [g for g in got if g["choices"]]
        assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"
        # All of it, not cut short (a busy server may merge tokens into fewer chunks).
        assert got[-1]["usage"]["completion_tokens"] == 40 and "".join(c["choices"][0]["text"] for c in chunks)
        # uvicorn re-raises the signal once it has shut down cleanly
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_triton_unreachable_is_503():
    settings = Settings(triton_url=f"localhost:{free_port()}", model_name=MODEL)
    with serve_in_thread(create_app(settings)) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=30)
        assert _error(r, 503)["type"] == "service_unavailable_error" and r.headers["retry-after"]
        r = httpx.post(url + "/generate", json={"text": "x", "stream": True}, timeout=30)
        assert r.status_code == 503  # before the stream starts: a real status code
        health = _error(httpx.get(url + "/health", timeout=30), 503)
        assert health["message"].startswith(f"Triton model 'ensemble' at {settings.triton_url} is not ready: "
                                            "Triton does not answer: "), health
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = httpx.post(url + path, json=body, timeout=30)
            assert _error(r, 503)["type"] == "service_unavailable_error" and r.headers["retry-after"], path


@pytest.mark.parametrize("when", ["serving", "starting"])
def test_frontend_workers_stop_when_their_supervisor_is_killed(when):
    """--workers 2, the uvicorn supervisor SIGKILLed (the OOM killer, kill -9), once its workers
    serve or while they still start: they stop too and the port is free again for a restarted
    frontend, instead of orphans serving on it."""
    port = free_port()
    if when == "serving":
        proc = _start_frontend_process(f"localhost:{free_port()}", port, "--workers", "2")
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "openai_frontend", "--triton-url", f"localhost:{free_port()}", "--model-name", MODEL,
             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--workers", "2"],
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    children: set[int] = set()
    for _ in range(300):
        children = {int(p) for p in (Path("/proc") / str(proc.pid) / "task" / str(proc.pid) / "children").read_text().split()}
        if len(children) >= 2:
            break
        time.sleep(0.05)
    assert len(children) >= 2, children
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(Path(f"/proc/{c}").exists() and "Z" not in _proc_state(c) for c in children):
        time.sleep(0.2)
    assert not [c for c in children if Path(f"/proc/{c}").exists() and "Z" not in _proc_state(c)], "orphaned workers"
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nobody holds the port any more


def _proc_state(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_triton_restart_then_overload(triton, base_url, demo_model_path):
    """Last in the module: restarts tritonserver on the same ports (with a tiny waiting queue)."""
    srv = triton["server"]
    ports = dict(http_port=srv.http_port, grpc_port=srv.grpc_port, metrics_port=srv.metrics_port)
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    assert httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    srv.stop(timeout=5)
    r = httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=30)
    assert _error(r, 503) and r.headers["retry-after"]
    assert httpx.get(base_url + "/health", timeout=30).status_code == 503

    env = {"LLM_MAX_NUM_SEQS": "2", "LLM_MAX_WAITING_REQUESTS": "2"}
    triton["server"] = srv = start_triton(demo_model_path, triton["log"], env=env, **ports)
    deadline = time.monotonic() + 30  # the same frontend, not restarted, recovers by itself
    while httpx.get(base_url + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the frontend did not reconnect to the restarted tritonserver"
        time.sleep(0.5)
    assert httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200

    # 2 running + 2 waiting fit; the rest are refused as overloaded: 503 + Retry-After. Each runs
    # long enough (about a second) that all 10 are in flight together however slowly the
    # threads start on a busy host (with 60 tokens, one CI run saw the first ones end first).
    results: list[tuple[int, dict, dict]] = []
    lock = threading.Lock()

    def one() -> None:
        r = httpx.post(base_url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "go", "max_tokens": 400, "ignore_eos": True, "stream": True})
        with lock:
            results.append((r.status_code, dict(r.headers), r.json() if r.status_code != 200 else {}))

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(s for s, _, _ in results)
    assert statuses.count(200) >= 4 and statuses.count(503) >= 1, statuses
    for status, headers, body in results:
        if status == 503:
            assert headers["retry-after"] == "1" and body["error"]["code"] == "overloaded"
    wait_kv_blocks_free(srv.metrics_url)
    assert httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200

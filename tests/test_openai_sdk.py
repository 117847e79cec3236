"""The official `openai` SDK, unmodified, against the frontend on the real tritonserver (the
repository's model_repository/ with the demo model): chat and completions, streaming or not,
usage, n, logprobs, stop strings, seeds, vLLM extras (logit_bias, allowed_token_ids, echo,
continue_final_message, truncate_prompt_tokens),
response_format json_schema, tool
calling with tool_choice auto / none / required / named plus a full tool round trip, and the
Responses API (/v1/responses) against the chat route.

The demo model has random weights, so checks are about the serving contract (what the engine
must guarantee: constraints hold, streaming equals non-streaming, seeds reproduce, stops cut),
never about the meaning of the text. One tritonserver and one frontend for the module.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from client.local_server import triton_home
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import serve_in_thread, start_triton, wait_kv_blocks_free

MODEL = "demo"
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0}

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}, "verbose": {"type": "boolean"}},
    "required": ["zone", "verbose"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone",
                                      "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}


@pytest.fixture(scope="module")
def triton(demo_model_path, tmp_path_factory):
    if not (triton_home() / "backends" / "python" / "triton_python_backend_stub").exists():
        pytest.skip("tritonserver's Python backend stub is not installed (scripts/setup.sh)")
    # This server trusts chat templates in requests (vLLM's --trust-request-chat-template); the
    # one in test_frontend_triton.py does not, and refuses them. It also loads the tests'
    # example logits processors (vLLM's --logits-processor-pattern).
    server = start_triton(demo_model_path, tmp_path_factory.mktemp("triton") / "server.log",
                          env={"LLM_TRUST_REQUEST_CHAT_TEMPLATE": "1",
                               "LLM_LOGITS_PROCESSOR_PATTERN": r"tests\.logits_processor_examples\."})
    yield server
    server.stop(timeout=10)


@pytest.fixture(scope="module")
def client(triton):
    settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, tool_call_parser="qwen25")
    with serve_in_thread(create_app(settings)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(demo_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_path)


@pytest.fixture(autouse=True)
def _blocks_freed(triton):
    yield
    wait_kv_blocks_free(triton.metrics_url)


def _template_tokens(tok, messages, tools=None) -> int:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tok(text).input_ids)


def _stream_chat(client, **kwargs):
    """(texts by choice, finish reasons by choice, usage, chunks) of a streamed chat completion."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage, chunks


# ---------------------------------------------------------------------------------------------
# chat and completions
# ---------------------------------------------------------------------------------------------


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_streaming_equals_non_streaming_with_usage(client, tok):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=16, **GREEDY)
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == _template_tokens(tok, MESSAGES)
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None  # the engine's prefix-cache count

    texts, finish, usage, chunks = _stream_chat(client, stream_options={"include_usage": True}, **kwargs)
    assert texts == {0: choice.message.content} and finish == {0: choice.finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.completion_tokens == r.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []

    # max_completion_tokens is the newer name of max_tokens
    short = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_completions_streaming_equals_non_streaming(client, tok):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert r.object == "text_completion" and r.usage.prompt_tokens == len(tok(prompt).input_ids)
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, stream=True, **GREEDY) if ch.choices)
    assert text == r.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, echo=True, **GREEDY)
    assert echo.choices[0].text == prompt + r.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=tok(prompt).input_ids, max_tokens=12, **GREEDY)
    assert by_ids.choices[0].text == r.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[prompt, "Hello"], max_tokens=12, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == r.choices[0].text


def test_n_choices_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, n=2, seed=1234, temperature=1.0,
                  extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 24
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    texts, finish, _, _ = _stream_chat(client, **kwargs)  # the same seed streams the same samples
    assert texts == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert finish == {0: "length", 1: "length"}
    other = client.chat.completions.create(**{**kwargs, "seed": 4321})
    assert [c.message.content for c in other.choices] != [c.message.content for c in r.choices]

    # completions: a batch of 2 prompts x n=2 -> choices 0..3, prompt-major
    batch = client.completions.create(model=MODEL, prompt=["Once", "Twice"], max_tokens=4, n=2, seed=9,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 16


def test_best_of_returns_the_samples_with_the_best_logprob_per_token(client):
    # Samples are seeded per index, so n=4 shows the four samples best_of=4 chooses from.
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, seed=77, temperature=1.0)
    every = client.completions.create(n=4, logprobs=0, **kwargs)
    mean = {c.text: sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices}
    assert len(mean) == 4  # four different samples
    best = client.completions.create(n=2, best_of=4, **kwargs)
    assert [c.text for c in best.choices] == sorted(mean, key=lambda t: -mean[t])[:2]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == sum(len(c.logprobs.token_logprobs) for c in every.choices
                                               if c.text in {b.text for b in best.choices})


def _reference_beam_search(model, prompt: list[int], width: int, steps: int, eos: set[int]) -> list[tuple[list[int], float]]:
    """vLLM's algorithm on the Hugging Face model itself: full forward passes, no KV cache."""
    import torch

    live, done = [([], 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
            lps = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lps, 2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t in eos else grown).append((tokens + [t], cum + lp))
        live = sorted(grown, key=lambda b: b[1] / (len(prompt) + len(b[0])), reverse=True)[:width]

    def score(b):
        return b[1] / (len(prompt) + len(b[0]) - (b[0][-1] in eos))

    return sorted(done + live, key=score, reverse=True)[:width]


def test_beam_search_equals_a_reference_beam_search_on_the_model(triton, demo_model_path, tok):
    from transformers import AutoModelForCausalLM

    settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, tokenizer_path=str(demo_model_path))
    with serve_in_thread(create_app(settings)) as url:
        beam = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = beam.completions.create(model=MODEL, prompt="Once upon a time", n=3, max_tokens=5, logprobs=1,
                                    extra_body={"use_beam_search": True})
    model = AutoModelForCausalLM.from_pretrained(demo_model_path, torch_dtype="float32").eval()
    eos = json.loads((demo_model_path / "generation_config.json").read_text())["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    prompt = tok("Once upon a time").input_ids
    expected = _reference_beam_search(model, prompt, 3, 5, eos)
    assert [c.text for c in r.choices] == [tok.decode([t for t in b if t not in eos]) for b, _ in expected]
    assert r.usage.completion_tokens == sum(len(b) for b, _ in expected)
    # usage has the shape of every other response: the prompt's cache hits, from the first step
    assert r.usage.prompt_tokens_details is not None and 0 <= r.usage.prompt_tokens_details.cached_tokens <= len(prompt)
    for choice, (_, cum) in zip(r.choices, expected):  # each beam's logprobs are its own tokens'
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(cum, abs=1e-3)


def test_logprob_bytes_join_the_pieces_of_a_character(triton, demo_model_path):
    # A token that is part of a character reads U+FFFD as text; its bytes (OpenAI's field for
    # exactly this) are its own, so the client can join them into the text (vLLM sends U+FFFD's).
    settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, tokenizer_path=str(demo_model_path))
    with serve_in_thread(create_app(settings)) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, logprobs=True, top_logprobs=2,
                                        **GREEDY, extra_body={"guided_regex": "語😀 ok"})
    content = r.choices[0].logprobs.content
    assert "\ufffd" in "".join(item.token for item in content)  # some tokens are pieces of a character
    assert r.choices[0].message.content == "語😀 ok"  # the EOS that ends it has a logprob, not text
    assert bytes(b for item in content for b in item.bytes).decode("utf-8") == "語😀 ok<|im_end|>"
    assert content[0].top_logprobs[0].bytes == content[0].bytes


def test_logprobs_chat_and_completions(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, logprobs=True, top_logprobs=3, **GREEDY,
                  extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the top one
        assert abs(item.top_logprobs[0].logprob - item.logprob) < 1e-4
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
    tokens = "".join(item.token for item in content)
    if "\ufffd" not in tokens:  # tokens that are whole characters spell the text
        assert tokens == r.choices[0].message.content
    streamed = [lp for ch in client.chat.completions.create(stream=True, **kwargs)
                for c in ch.choices if c.logprobs and c.logprobs.content for lp in c.logprobs.content]
    assert [(x.token, round(x.logprob, 4)) for x in streamed] == [(x.token, round(x.logprob, 4)) for x in content]

    ids = client.chat.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True,
                                                                    "return_tokens_as_token_ids": True}})
    assert all(item.token.startswith("token_id:") for item in ids.choices[0].logprobs.content)

    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=2, **GREEDY,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-4)
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset)
    zero = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=0, **GREEDY).choices[0].logprobs
    assert zero.top_logprobs == [{t: v} for t, v in zip(zero.tokens, zero.token_logprobs)]


def test_echo_with_logprobs_scores_the_prompt(client, tok):
    # What lm-evaluation-harness sends for loglikelihood: echo, logprobs, max_tokens 0.
    prompt = "The quick brown fox"
    n_prompt = len(tok(prompt).input_ids)
    plain = dict(model=MODEL, prompt=prompt, **GREEDY, extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    scored = client.completions.create(max_tokens=0, echo=True, logprobs=2, **plain)
    choice, lp = scored.choices[0], scored.choices[0].logprobs
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == n_prompt == len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) <= 3 for t in lp.top_logprobs[1:])
    # OpenAI's legacy top_logprobs hold the chosen (here: prompt) token too, first.
    assert all(next(iter(t.items())) == (tok_, v) for t, tok_, v in zip(lp.top_logprobs[1:], lp.tokens[1:],
                                                                           lp.token_logprobs[1:]))
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    # A one-token prompt (no logits of its own to score) still gets its entry.
    assert len(tok("The").input_ids) == 1
    one = client.completions.create(**{**plain, "prompt": "The"}, max_tokens=0, echo=True, logprobs=2).choices[0]
    assert one.text == "The" and one.logprobs.tokens == ["The"] and one.logprobs.token_logprobs == [None]

    # With new tokens: the prompt's entries (the same as scored alone), then the generated ones
    # (the same as without echo); streamed alike.
    gen = client.completions.create(max_tokens=6, logprobs=1, **plain)
    both = client.completions.create(max_tokens=6, echo=True, logprobs=1, **plain)
    blp = both.choices[0].logprobs
    assert both.choices[0].text == prompt + gen.choices[0].text and len(blp.tokens) == n_prompt + 6
    assert blp.token_logprobs[0] is None
    assert blp.token_logprobs[1:n_prompt] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert blp.token_logprobs[n_prompt:] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-4)
    streamed = [c.choices[0] for c in client.completions.create(max_tokens=6, echo=True, logprobs=1, stream=True,
                                                                 **plain) if c.choices]
    assert "".join(c.text for c in streamed) == both.choices[0].text
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == blp.tokens
    streamed_lps = [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed_lps[0] is None and streamed_lps[1:] == pytest.approx(blp.token_logprobs[1:], abs=1e-4)


def test_vllm_prompt_logprobs(client, tok):
    prompt = "The quick brown fox"
    ids = tok(prompt).input_ids
    plain = dict(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=3, **GREEDY)
    echoed = client.completions.create(**plain).choices[0].logprobs  # the same numbers, OpenAI's format
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY,
                                  extra_body={"prompt_logprobs": 3})
    plp = r.choices[0].prompt_logprobs  # vLLM's field (the SDK keeps unknown fields)
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        entry = plp[pos]
        own = entry[str(ids[pos])]
        assert own["logprob"] == pytest.approx(echoed.token_logprobs[pos], abs=1e-4)
        assert own["rank"] >= 1 and own["decoded_token"] == echoed.tokens[pos]
        tops = sorted((v for k, v in entry.items() if v["rank"] <= 3), key=lambda v: v["rank"])
        assert [v["rank"] for v in tops][:3] == [1, 2, 3]
        assert [v["logprob"] for v in tops] == sorted((v["logprob"] for v in tops), reverse=True)
        assert len(entry) in (3, 4)  # the top 3, and the prompt token when it is not among them
    assert r.choices[0].logprobs is None  # output logprobs were not asked for

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=True,
                                          top_logprobs=1, extra_body={"prompt_logprobs": 2})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert all(len(item.top_logprobs) == 1 for item in chat.choices[0].logprobs.content)  # not 2
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_return_hidden_states_as_sglang_openai(client):
    # SGLang's OpenAI extension: each choice's hidden_states is the row of the last position the
    # model ran; streamed, it comes in an event of its own after the finish reason.
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, n=2,
                  extra_body={"return_hidden_states": True, "ignore_eos": True})
    done = client.chat.completions.create(**kwargs)
    rows = [c.model_extra["hidden_states"] for c in done.choices]
    assert all(len(r) == 128 and all(isinstance(v, float) for v in r) for r in rows)
    assert rows[0] == pytest.approx(rows[1], abs=1e-3)  # greedy: both choices ran the same tokens
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = {c.index: c.delta.model_extra["hidden_states"] for ch in chunks for c in ch.choices
                if (c.delta.model_extra or {}).get("hidden_states") is not None}
    assert sorted(streamed) == [0, 1] and streamed[0] == pytest.approx(rows[0], abs=1e-3)
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                     extra_body={"return_hidden_states": True})
    assert len(comp.choices[0].model_extra["hidden_states"]) == 128
    # One generated token: only the prompt's rows exist, so the choice's hidden_states is [].
    one = client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, extra_body={"return_hidden_states": True})
    assert one.choices[0].model_extra["hidden_states"] == []
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert "hidden_states" not in (plain.choices[0].model_extra or {})
    with pytest.raises(openai.BadRequestError, match="return_hidden_states"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=2,
                                  extra_body={"return_hidden_states": True, "use_beam_search": True})


def test_predicted_outputs_keep_the_output_and_report_what_they_saved(client):
    """OpenAI's Predicted Outputs: the reply is the one without a prediction, streaming or not,
    and usage says how many of the prediction's tokens it took (accepted) and did not (rejected)."""
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")

    def num_tokens(text: str) -> int:
        return httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}
                          ).json()["count"]

    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=48, **GREEDY)
    plain = client.chat.completions.create(**kwargs)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None
    r = client.chat.completions.create(prediction={"type": "content", "content": text}, **kwargs)
    assert r.choices[0].message.content == text
    assert r.usage.completion_tokens == plain.usage.completion_tokens
    details = r.usage.completion_tokens_details
    assert 0 < details.accepted_prediction_tokens <= r.usage.completion_tokens
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == num_tokens(text)
    texts, _, usage, _ = _stream_chat(client, prediction={"type": "content", "content": text},
                                      stream_options={"include_usage": True}, **kwargs)
    assert texts == {0: text}
    assert usage.completion_tokens_details == details
    # An unrelated prediction costs nothing but the drafts it never makes.
    r = client.chat.completions.create(prediction={"type": "content", "content": "Nothing like it " * 20}, **kwargs)
    assert r.choices[0].message.content == text
    details = r.usage.completion_tokens_details  # none of it taken: all of it rejected
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, num_tokens("Nothing like it " * 20))
    # SGLang's /generate passes sampling_params on: OpenAI's object works there as plain text
    # does, and a wrong shape is one 400 naming the forms.
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    ref = httpx.post(base + "/generate", json=body).json()
    for form in (ref["text"], {"type": "content", "content": [{"type": "text", "text": ref["text"]}]}):
        got = httpx.post(base + "/generate", json={**body, "sampling_params": {**body["sampling_params"],
                                                                               "prediction": form}}).json()
        assert got["text"] == ref["text"] and got["meta_info"]["accepted_prediction_tokens"] > 0, got
    bad = httpx.post(base + "/generate", json={**body, "sampling_params": {"prediction": {"content": "x"}}})
    assert bad.status_code == 400 and "must be text, a list of token ids, or" in bad.json()["error"]["message"], bad.text


def test_stop_strings_and_stop_token_ids(client):
    base = dict(model=MODEL, prompt="Tell me a story about a dragon.", max_tokens=24, **GREEDY)
    full = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    # a stop string first occurring in the middle of the output
    for start in range(len(full) // 3, len(full) - 3):
        stop = full[start:start + 3]
        if full.find(stop) == start and stop.strip():
            break
    else:
        pytest.skip("no usable stop string in this output")
    cut = client.completions.create(**base, stop=[stop, "\x00never"], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[:start] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        **base, stop=stop, stream=True, extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == full[:start]
    kept = client.completions.create(**base, stop=stop, extra_body={"ignore_eos": True,
                                                                     "include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:start + len(stop)]

    # stop_token_ids (vLLM extra): the ids come from return_tokens_as_token_ids
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=10, logprobs=True, **GREEDY)
    r = client.chat.completions.create(**chat, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(item.token.split(":")[1]) for item in r.choices[0].logprobs.content]
    target = ids[4]
    stopped = client.chat.completions.create(**chat, extra_body={"ignore_eos": True, "stop_token_ids": [target]})
    assert stopped.usage.completion_tokens == ids.index(target) + 1
    assert stopped.choices[0].finish_reason == "stop"


def test_vllm_extra_sampling_parameters(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=10)
    greedy = client.chat.completions.create(**kwargs, **GREEDY, extra_body={"ignore_eos": True})
    top1 = client.chat.completions.create(**kwargs, temperature=1.0, extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    r = client.chat.completions.create(**kwargs, extra_body={
        "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 10, "seed": 3})
    assert r.usage.completion_tokens == 10
    r = client.chat.completions.create(**kwargs, frequency_penalty=0.5, presence_penalty=0.5, top_p=0.9, seed=5)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs, temperature=-1)
    assert "temperature" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**kwargs, extra_body={"no_such_parameter": 1})
    # vLLM's priority reaches the engine, which serves first come, first served by default.
    with pytest.raises(openai.BadRequestError, match="scheduling_policy=priority"):
        client.chat.completions.create(**kwargs, extra_body={"priority": 2})
    assert client.chat.completions.create(**kwargs, extra_body={"priority": 0}).choices
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_cache_salt_keeps_tenants_prefix_caches_apart(client):
    """vLLM's cache_salt through the SDK: a long system prompt cached under one salt is a miss
    under another, streamed or not, and a hit again under its own."""
    messages = [{"role": "system", "content": "You answer questions about the cache salt. " * 12},
                {"role": "user", "content": "Who may share my cached blocks?"}]

    def cached(salt: str, stream: bool = False) -> int:
        kwargs = dict(model=MODEL, messages=messages, max_tokens=2, extra_body={"cache_salt": salt}, **GREEDY)
        if stream:
            *_, usage, _ = _stream_chat(client, stream_options={"include_usage": True}, **kwargs)
        else:
            usage = client.chat.completions.create(**kwargs).usage
        return usage.prompt_tokens_details.cached_tokens

    salts = [f"salt-{i}-{id(messages)}" for i in range(3)]  # unused before in this server
    assert cached(salts[0]) == 0
    assert cached(salts[0]) > 0
    assert cached(salts[1], stream=True) == 0
    assert cached(salts[1], stream=True) > 0
    prompt = "You answer questions about the cache salt. " * 12

    def completion_cached(salt: str) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens

    assert completion_cached(salts[2]) == 0 and completion_cached(salts[2]) > 0 and completion_cached(salts[0]) == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt") as exc:
        cached("")
    assert exc.value.body["param"] == "cache_salt"


def test_return_token_ids_streamed_and_not(client, tok):
    """vLLM's return_token_ids: the prompt's ids the model saw and each choice's output ids,
    the same streamed as not (RL and agent frameworks train on exactly these ids)."""
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=12, extra_body={"return_token_ids": True}, **GREEDY)
    templated = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    want_prompt = tok(templated).input_ids
    r = client.chat.completions.create(**chat)
    assert r.prompt_token_ids == want_prompt
    ids = r.choices[0].token_ids
    assert len(ids) == r.usage.completion_tokens and tok.decode(ids, skip_special_tokens=True) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert chunks[0].prompt_token_ids == want_prompt
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])] == ids

    prompt = "Count with me: one, two,"
    comp = dict(model=MODEL, prompt=prompt, max_tokens=6, n=2, extra_body={"return_token_ids": True, "seed": 5})
    r = client.completions.create(**comp)
    for choice in r.choices:
        assert choice.prompt_token_ids == tok(prompt).input_ids
        assert tok.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    streamed: dict[int, list] = {0: [], 1: []}
    prompts: dict[int, list] = {0: [], 1: []}
    for c in client.completions.create(stream=True, **comp):
        for ch in c.choices:
            streamed[ch.index] += getattr(ch, "token_ids", None) or []
            if getattr(ch, "prompt_token_ids", None) is not None:
                prompts[ch.index].append(ch.prompt_token_ids)
    assert streamed == {c.index: c.token_ids for c in r.choices}
    assert prompts == {0: [tok(prompt).input_ids], 1: [tok(prompt).input_ids]}
    beams = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=3,
                                      extra_body={"use_beam_search": True, "return_token_ids": True})
    for choice in beams.choices:
        assert choice.prompt_token_ids == tok(prompt).input_ids and len(choice.token_ids) == 3
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_bad_words(client, tok):
    """vLLM's bad_words through the server: a word the greedy answer wrote is never written,
    at the start of the text or after a space, streamed or not."""
    kwargs = dict(model=MODEL, prompt="The kettle on the stove", max_tokens=16, **GREEDY)
    base = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    word = next(w for w in base.choices[0].text.split() if w.isalpha() and len(w) > 2)
    banned = [tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)]
    extra = {"bad_words": [word], "return_token_ids": True}
    r = client.completions.create(**kwargs, extra_body=extra)
    ids = r.choices[0].token_ids
    assert not any(ids[k:k + len(w)] == w for w in banned for k in range(len(ids))), (word, r.choices[0].text)
    assert r.choices[0].text != base.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs, extra_body=extra)
                       if c.choices)
    assert streamed == r.choices[0].text
    with pytest.raises(openai.BadRequestError, match="bad_words") as err:
        client.completions.create(**kwargs, extra_body={"bad_words": ["  "]})
    assert err.value.body["param"] == "bad_words"


def test_logit_bias_and_allowed_token_ids(client, tok):
    target = tok.encode(" dragon", add_special_tokens=False)[-1]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, **GREEDY,
                                  logit_bias={str(target): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([target] * 6)
    allowed = [int(t) for t in tok.encode(" the cat sat on a mat", add_special_tokens=False)]
    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=4, logprobs=True)
    r = client.chat.completions.create(**chat, extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                                           "return_tokens_as_token_ids": True})
    ids = [int(item.token.split(":")[1]) for item in r.choices[0].logprobs.content]
    assert len(ids) == 12 and set(ids) <= set(allowed)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**chat, logit_bias={"1": 500})
    assert "logit_bias" in str(err.value)


def test_continue_final_message_continues_the_prefilled_reply(client, tok):
    prefill = MESSAGES + [{"role": "assistant", "content": "The forecast for Paris is"}]
    rendered = tok.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    assert rendered.endswith("The forecast for Paris is")  # left open: no end-of-turn after it
    extra = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    chat = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=8, **GREEDY, extra_body=extra)
    same = client.completions.create(model=MODEL, prompt=rendered, max_tokens=8, **GREEDY,
                                     extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens == len(tok(rendered).input_ids) == same.usage.prompt_tokens
    assert chat.choices[0].message.content == same.choices[0].text
    echoed = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=8, **GREEDY,
                                            extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == "The forecast for Paris is" + same.choices[0].text


def test_request_chat_template_and_documents(client, tok):
    # A RAG template sent with the request (the server trusts request templates), and the
    # documents it reads: the prompt is that template's rendering, token for token.
    template = ("{% for d in documents %}<doc title={{ d.title }}>{{ d.text }}</doc>\n{% endfor %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    docs = [{"title": "Paris", "text": "Rain all week."}, {"title": "Lima", "text": "Dry."}]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **GREEDY,
                                       extra_body={"chat_template": template, "documents": docs})
    rendered = tok.apply_chat_template(MESSAGES, chat_template=template, documents=docs, tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.startswith("<doc title=Paris>Rain all week.</doc>\n<doc title=Lima>")
    assert r.usage.prompt_tokens == len(tok(rendered).input_ids)
    # The model's own template does not read documents: they would be dropped, so it is a 400.
    with pytest.raises(openai.BadRequestError, match="does not use documents"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body={"documents": docs})


def test_reasoning_effort_is_a_chat_template_variable(client, tok):
    """OpenAI's reasoning_effort, passed to the chat template as vLLM passes it (gpt-oss's reads
    it); a template that does not read it would ignore it, so that is a 400."""
    template = ("{% if reasoning_effort %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, reasoning_effort="low",
                                       extra_body={"chat_template": template, "return_token_ids": True})
    assert tok.decode(r.prompt_token_ids).startswith("<|im_start|>system\nReasoning: low<|im_end|>")
    for kwargs, message in [({}, "does not read reasoning_effort"),
                            ({"extra_body": {"chat_template": template, "chat_template_kwargs": {"reasoning_effort": "high"}}},
                             "differ")]:
        with pytest.raises(openai.BadRequestError, match=message) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, reasoning_effort="low", **kwargs)
        assert err.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError, match="must be one of") as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"reasoning_effort": "max"})


def test_truncate_prompt_tokens(client):
    long = "one two three four five six seven eight nine ten " * 8
    kwargs = dict(model=MODEL, prompt=long, max_tokens=4, **GREEDY)
    r = client.completions.create(**kwargs, extra_body={"truncate_prompt_tokens": 12, "ignore_eos": True})
    assert r.usage.prompt_tokens == 12 and r.usage.completion_tokens == 4
    assert client.completions.create(**kwargs).usage.prompt_tokens > 12


def test_streamed_chat_keeps_cjk_and_emoji(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "写一首关于月亮的诗 🌙 please, with  spaces"}],
                  max_tokens=40, seed=11, temperature=1.0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    texts, _, _, _ = _stream_chat(client, **kwargs)
    assert texts[0] == whole


# ---------------------------------------------------------------------------------------------
# structured output
# ---------------------------------------------------------------------------------------------


def test_response_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 120},
                       "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                  response_format=fmt, max_tokens=120, seed=2)
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    texts, _, _, _ = _stream_chat(client, **kwargs)
    assert texts[0] == r.choices[0].message.content
    obj = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                         max_tokens=120, seed=2)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no", "maybe not"]})
    assert choice.choices[0].text in ("yes", "no", "maybe not")
    regex = client.completions.create(model=MODEL, prompt="A date:", max_tokens=20,
                                      extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"})
    assert len(regex.choices[0].text) == 10 and regex.choices[0].text.startswith("20")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}})


def test_logits_processors(client, tok):
    """vLLM's logits_processors, loaded inside tritonserver by qualified name."""
    examples = "tests.logits_processor_examples"
    prompt = "Replay me, token by token."
    n = len(tok(prompt).input_ids)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"logits_processors": [f"{examples}.replay_prompt"]})
    assert r.choices[0].text == prompt and r.usage.completion_tokens == n
    counted = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, n=2, stream=False, extra_body={"ignore_eos": True,
        "logits_processors": [{"qualname": f"{examples}.CountUp", "args": [300], "kwargs": {"step": 1}}]})
    want = tok.decode([300, 301, 302, 303])
    assert [c.message.content for c in counted.choices] == [want, want]
    for extra, message in [(["os.system"], "does not match the server's logits_processor_pattern"),
                           ([f"{examples}.nope"], "cannot be loaded")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"logits_processors": extra})
        assert message in err.value.body["message"] and err.value.body["param"] == "logits_processors"
    with pytest.raises(openai.APIError, match="fail_after_two' failed: boom"):
        list(client.completions.create(model=MODEL, prompt="x", max_tokens=8, stream=True, extra_body={
            "ignore_eos": True, "logits_processors": [f"{examples}.fail_after_two"]}))


def _stream_reasoning(client, **kwargs) -> tuple[str, str]:
    """(reasoning_content, content) of a streamed chat completion, reassembled."""
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    return reasoning, content


def test_reasoning_parser_on_the_real_server(client, triton, tok):
    """--reasoning-parser qwen3 on real model output (a regex makes the random model think)."""
    settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, reasoning_parser="qwen3")
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=80, seed=5, temperature=1.0,
                  extra_body={"guided_regex": r"<think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[a-z]{2,8}( [a-z]{2,8}){1,3}"})
    raw = client.chat.completions.create(**kwargs).choices[0].message.content
    thought, answer = raw.split("</think>")
    # The parsing frontend would apply the regex after the reasoning, so there the same text is
    # replayed by a logits processor instead.
    ids = tok(raw, add_special_tokens=False).input_ids
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=len(ids), extra_body={"logits_processors": [
        {"qualname": "tests.logits_processor_examples.ForceAfter", "kwargs": {"after": 0, "tokens": ids}}]})
    with serve_in_thread(create_app(settings)) as url:
        thinking = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        msg = thinking.chat.completions.create(**kwargs).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == (thought[len("<think>"):].strip(), answer.strip())
        assert _stream_reasoning(thinking, **kwargs) == (msg.model_extra["reasoning_content"], msg.content)


def test_a_template_that_opens_the_reasoning_section_on_the_real_server(triton, tok):
    """A Qwen3-Thinking-2507 / Qwen3.5 style template writes <think> into the generation prompt:
    with --reasoning-parser qwen3 the output starts inside the section (it was all content), and
    enable_thinking false, which closes the section in the prompt, makes it content."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n{% if enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}")
    settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, reasoning_parser="qwen3")

    def forced(text: str, **extra) -> dict:
        ids = tok(text, add_special_tokens=False).input_ids
        return dict(model=MODEL, messages=MESSAGES, max_tokens=len(ids), extra_body={
            "chat_template": template, **extra, "logits_processors": [
                {"qualname": "tests.logits_processor_examples.ForceAfter", "kwargs": {"after": 0, "tokens": ids}}]})

    with serve_in_thread(create_app(settings)) as url:
        thinking = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for kwargs, want in ((forced("Adding two.\n</think>\n\nFour."), ("Adding two.", "Four.")),
                             (forced("Four.", chat_template_kwargs={"enable_thinking": False}), (None, "Four."))):
            msg = thinking.chat.completions.create(**kwargs).choices[0].message
            assert (msg.model_extra["reasoning_content"], msg.content) == want
            assert _stream_reasoning(thinking, **kwargs) == (want[0] or "", want[1])


def test_thinking_token_budget_on_the_real_server(client, triton, tok):
    """vLLM's thinking_token_budget: after N tokens inside the reasoning section the engine
    forces its closing marker; the reasoning is those N tokens, the answer follows, streamed or
    not. A template that opens the section in the prompt (Qwen3.5's) starts the count at once."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n")
    settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, reasoning_parser="qwen3")
    marker = tok("</think>", add_special_tokens=False).input_ids
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=24, **GREEDY)
    body = {"chat_template": template, "return_token_ids": True, "ignore_eos": True}
    free = client.chat.completions.create(**kwargs, extra_body=body).choices[0].token_ids
    with serve_in_thread(create_app(settings)) as url:
        thinking = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        limited = {**kwargs, "extra_body": {**body, "thinking_token_budget": 6}}
        choice = thinking.chat.completions.create(**limited).choices[0]
        ids = choice.token_ids
        assert ids[:6] == free[:6] and ids[6:6 + len(marker)] == marker and len(ids) == 24
        assert choice.message.model_extra["reasoning_content"] == tok.decode(free[:6]).strip()
        assert choice.message.content == tok.decode(ids[6 + len(marker):]).strip()
        assert _stream_reasoning(thinking, **limited) == (choice.message.model_extra["reasoning_content"],
                                                         choice.message.content)
        # The default template opens no section and the random model writes no <think>: no effect.
        plain = thinking.chat.completions.create(**kwargs, extra_body={"return_token_ids": True, "ignore_eos": True,
                                                                      "thinking_token_budget": 0})
        assert plain.choices[0].token_ids == client.chat.completions.create(
            **kwargs, extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0].token_ids
    # A server without a reasoning parser cannot say where thinking ends.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs, extra_body={"thinking_token_budget": 6})
    assert err.value.body["param"] == "thinking_token_budget"


def test_structured_output_after_reasoning_on_the_real_server(triton, tok):
    """deepseek_r1: the model reasons freely (here: 6 tokens, then a processor writes the closing
    marker), then response_format's schema holds for the content."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    marker = tok("</think>", add_special_tokens=False).input_ids
    settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, reasoning_parser="deepseek_r1")
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, seed=2,
                  response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
                  extra_body={"logits_processors": [{"qualname": "tests.logits_processor_examples.ForceAfter",
                                                     "kwargs": {"after": 6, "tokens": marker}}]})
    with serve_in_thread(create_app(settings)) as url:
        thinking = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = thinking.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", r
        assert msg.model_extra["reasoning_content"] and "</think>" not in msg.model_extra["reasoning_content"]
        jsonschema.validate(json.loads(msg.content), schema)
        assert _stream_reasoning(thinking, **kwargs) == (msg.model_extra["reasoning_content"], msg.content)
        # vLLM's compact JSON (it was a 400 with a reasoning parser): the reasoning stays free
        kwargs["extra_body"] = {**kwargs["extra_body"], "structured_outputs": {"disable_any_whitespace": True}}
        msg = thinking.chat.completions.create(**kwargs).choices[0].message
        assert msg.model_extra["reasoning_content"] and msg.content == json.dumps(json.loads(msg.content),
                                                                                   separators=(",", ":"))


def test_guided_whitespace_pattern(client):
    """vLLM's guided_whitespace_pattern: compact JSON with "", and the same text streamed."""
    from tests.test_grammar import _gaps

    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "JSON please."}], max_tokens=200, seed=3,
                  response_format={"type": "json_object"}, extra_body={"guided_whitespace_pattern": ""})
    r = client.chat.completions.create(**kwargs)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{") and _gaps(text) == [], text
    assert _stream_chat(client, **kwargs)[0][0] == text
    c = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, seed=1,
                                  extra_body={"guided_json": {"type": "array", "items": {"type": "integer"}},
                                              "guided_whitespace_pattern": " "})
    if c.choices[0].finish_reason == "stop":
        assert all(g == " " for g in _gaps(c.choices[0].text)) and json.loads(c.choices[0].text) is not None
    for extra, message in [({"guided_json": {}, "guided_whitespace_pattern": r"\s*"}, "not JSON whitespace"),
                           ({"guided_whitespace_pattern": " "}, "needs a JSON constraint")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
        assert message in err.value.body["message"], err.value.body


def test_vllm_structured_outputs(client):
    """vLLM 0.11's structured_outputs through the real server: a schema with no whitespace
    (streamed the same), a choice, and its refusals."""
    from tests.test_grammar import _gaps

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {
        "type": "string", "maxLength": 5}, "maxItems": 3}}, "required": ["n", "tags"]}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "JSON please."}], max_tokens=120, seed=4,
                  extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    r = client.chat.completions.create(**kwargs)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(text), schema)
    assert _gaps(text) == [], text
    assert _stream_chat(client, **kwargs)[0][0] == text
    c = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=5,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe not"]}})
    assert c.choices[0].text in ("yes", "no", "maybe not")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"json": {"type": "no-such-type"}}})
    assert err.value.body["param"] == "structured_outputs.json", err.value.body


# ---------------------------------------------------------------------------------------------
# tools
# ---------------------------------------------------------------------------------------------


def _check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def _stream_tool_calls(client, **kwargs):
    """Tool calls reassembled from streamed deltas: the first delta of a call has id, type and
    name; later ones only argument fragments."""
    calls: dict[int, dict] = {}
    content = ""
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in calls and d.function.name and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finish


def test_tool_choice_named_is_enforced_streaming_equals_non_streaming(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=5,
                  tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    args = _check_call(choice.message.tool_calls[0])
    calls, content, finish = _stream_tool_calls(client, **kwargs)
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", args)]
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_tool_choice_required_is_enforced(client):
    for seed in (1, 2):
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=seed,
                      tool_choice="required", parallel_tool_calls=False)
        r = client.chat.completions.create(**kwargs)
        choice = r.choices[0]
        # one call and nothing else: the grammar ends after it
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content and len(choice.message.tool_calls) == 1
        assert choice.message.tool_calls[0].function.name in SCHEMAS
        _check_call(choice.message.tool_calls[0])
        calls, content, finish = _stream_tool_calls(client, **kwargs)
        assert finish == "tool_calls" and not content
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (t.function.name, t.function.arguments) for t in choice.message.tool_calls]

    # parallel calls allowed: one or more calls separated by newlines, no other text. (A random
    # model may keep calling until max_tokens cuts the last call short: as in OpenAI's API, and
    # as a stream of it ends, that one is a call with the arguments written so far.)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, seed=3,
                                       tool_choice="required")
    choice = r.choices[0]
    assert len(choice.message.tool_calls) >= 1 and not choice.message.content
    complete = choice.message.tool_calls[:-1] if choice.finish_reason == "length" else choice.message.tool_calls
    for call in complete:
        _check_call(call)
    assert choice.finish_reason in ("tool_calls", "length")


def test_tool_choice_auto_and_none_both_render_the_tools(client, tok):
    auto = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                          max_tokens=30, seed=1)
    assert auto.usage.prompt_tokens == _template_tokens(tok, MESSAGES, TOOLS)
    choice = auto.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:  # a random model rarely calls; if it does, it parses
        assert call.function.name in SCHEMAS
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=5)
    assert none.usage.prompt_tokens == _template_tokens(tok, MESSAGES, TOOLS)  # seen, not called (vLLM)
    assert not none.choices[0].message.tool_calls


def test_tool_round_trip(client, tok):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=7,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    args = _check_call(call)
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=20, seed=7)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tool call and its result were rendered by the chat template (arguments as an object)
    reference = [
        *MESSAGES,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    rendered = tok.apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    call_json = json.dumps({"name": call.function.name, "arguments": args})
    assert f"<|im_start|>assistant\n<tool_call>\n{call_json}\n</tool_call><|im_end|>" in rendered
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in rendered
    assert second.usage.prompt_tokens == len(tok(rendered).input_ids)


# ---------------------------------------------------------------------------------------------
# streaming parity, randomized
# ---------------------------------------------------------------------------------------------


def _chat_result(r) -> dict:
    out = {}
    for c in r.choices:
        lp = c.logprobs.content if c.logprobs and c.logprobs.content else []
        out[c.index] = {
            "content": c.message.content or "", "finish": c.finish_reason,
            "calls": [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []],
            "tokens": [e.token for e in lp], "logprobs": [e.logprob for e in lp],
            "top": [sorted(t.token for t in e.top_logprobs) for e in lp],
        }
    return out


def _chat_streamed(chunks) -> tuple[dict, object]:
    out: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "finish": None, "calls": {}, "tokens": [], "logprobs": [],
                                         "top": []})
            o["content"] += c.delta.content or ""
            o["finish"] = c.finish_reason or o["finish"]
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    o["calls"][d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    o["calls"][d.index][1] += d.function.arguments or ""
            for e in (c.logprobs.content if c.logprobs and c.logprobs.content else []):
                o["tokens"].append(e.token)
                o["logprobs"].append(e.logprob)
                o["top"].append(sorted(t.token for t in e.top_logprobs))
    for o in out.values():
        o["calls"] = [tuple(o["calls"][i]) for i in sorted(o["calls"])]
    return out, usage


def _completion_result(choices, streamed: bool) -> dict:
    out: dict[int, dict] = {}
    for c in choices:
        o = out.setdefault(c.index, {"text": "", "finish": None, "tokens": [], "logprobs": []})
        o["text"] += c.text
        o["finish"] = c.finish_reason or o["finish"]
        if c.logprobs:
            o["tokens"] += c.logprobs.tokens
            o["logprobs"] += c.logprobs.token_logprobs
    return out


def _same(a: dict, b: dict, where) -> None:
    assert a.keys() == b.keys(), where
    for i in a:
        x, y = dict(a[i]), dict(b[i])
        lx, ly = x.pop("logprobs"), y.pop("logprobs")
        assert x == y, (where, i)
        assert lx == pytest.approx(ly, abs=1e-5), (where, i)


def test_random_requests_stream_exactly_what_they_return(client):
    """Random combinations of n, seeds, stops, logprobs, echo, tools and tool_choice, and
    response_format: each request streamed (text, tool calls and logprobs reassembled from the
    deltas, usage from the final chunk) equals the same request not streamed."""
    import random

    rng = random.Random(2024)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    for case in range(16):
        chat = rng.random() < 0.6
        kw: dict = {"model": MODEL, "max_tokens": rng.randint(1, 40), "n": rng.choice([1, 1, 2])}
        kw.update(GREEDY if rng.random() < 0.5 else {"temperature": 0.9, "seed": rng.randrange(1000)})
        extra: dict = {}
        if rng.random() < 0.3:
            kw["stop"] = [rng.choice(["e", " the", ".", "\n"])]
        if rng.random() < 0.3:
            extra["ignore_eos"] = True
        if chat:
            kw["messages"] = MESSAGES
            if rng.random() < 0.4:
                kw.update(logprobs=True, top_logprobs=rng.randint(0, 3))
            shape = rng.choice(["text", "tools", "tools", "schema"])
            if shape == "tools":
                kw.update(tools=TOOLS, tool_choice=rng.choice(
                    ["auto", "required", "none", {"type": "function", "function": {"name": "get_time"}}]))
                kw["max_tokens"] = rng.choice([kw["max_tokens"], 120])
            elif shape == "schema":
                kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
                kw["max_tokens"] = rng.choice([kw["max_tokens"], 60])
            where = (case, {k: v for k, v in kw.items() if k not in ("messages", "tools")}, extra)
            plain = client.chat.completions.create(**kw, extra_body=extra)
            chunks = list(client.chat.completions.create(**kw, extra_body=extra, stream=True,
                                                         stream_options={"include_usage": True}))
            streamed, usage = _chat_streamed(chunks)
            _same(_chat_result(plain), streamed, where)
        else:
            prompts = ["The quick brown fox", "Once upon a time", "日本語の文章と 🙂 emoji"]
            kw["prompt"] = rng.choice(prompts) if rng.random() < 0.7 else rng.sample(prompts, 2)  # a batch too
            if rng.random() < 0.4:
                kw["logprobs"] = rng.randint(0, 3)
            if rng.random() < 0.3:
                kw["echo"] = True
            where = (case, kw, extra)
            plain = client.completions.create(**kw, extra_body=extra)
            chunks = list(client.completions.create(**kw, extra_body=extra, stream=True,
                                                    stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            _same(_completion_result(plain.choices, False),
                  _completion_result([c for ch in chunks for c in ch.choices], True), where)
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            plain.usage.prompt_tokens, plain.usage.completion_tokens), where


def test_context_limits_and_param_names_as_vllm(client):
    """No max_tokens: up to the end of the context (not a hidden 128). One that cannot fit: a 400
    naming max_tokens. Engine-side errors name the OpenAI parameter, not the engine's."""
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    max_len = httpx.get(base + "/get_server_info").json()["engine"]["config"]["max_model_len"]
    prompt = [7] * (max_len - 200)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=None, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 200 and r.choices[0].finish_reason == "length"
    for kwargs, param in ((dict(max_tokens=201), "max_tokens"), (dict(extra_body={"min_tokens": -1}), "min_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=prompt, **kwargs)
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=max_len)
    assert err.value.body["param"] == "max_completion_tokens" and "at most" in err.value.body["message"]
    assert "(max_completion_tokens must be" in err.value.body["message"]  # the client's word, not max_new_tokens
    # vLLM's words and OpenAI's code, which clients match to trim a history (LiteLLM)
    assert err.value.body["message"].startswith(f"This model's maximum context length is {max_len} tokens.")
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * max_len}])
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "messages"
    # A constraint the engine refuses is named as the request gave it, whichever of the names.
    for extra, param in (({"guided_regex": "[0-9"}, "guided_regex"), ({"regex": "[0-9"}, "regex"),
                         ({"guided_grammar": "root ::= "}, "guided_grammar"),
                         ({"guided_json": {"type": "nope"}}, "guided_json"),
                         ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": "x+"}, "guided_whitespace_pattern"),
                         ({"chat_template_kwargs": {"messages": "x"}}, "chat_template_kwargs"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
                          "response_format")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
        assert err.value.body["param"] == param, (extra, err.value.body)


# ---------------------------------------------------------------------------------------------
# /v1/responses (OpenAI's Responses API, served by the chat route)
# ---------------------------------------------------------------------------------------------

RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


def test_responses_answer_as_the_chat_route_streamed_and_not(client, tok):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
                                          max_tokens=24, **GREEDY)
    kwargs = dict(model=MODEL, instructions="Be brief.", input=MESSAGES[0]["content"], max_output_tokens=24, **GREEDY)
    r = client.responses.create(**kwargs)
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.output_text == chat.choices[0].message.content and [o.type for o in r.output] == ["message"]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    events = list(client.responses.create(stream=True, **kwargs))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    done = events[-1].response
    assert done.output_text == r.output_text
    assert (done.usage.input_tokens, done.usage.output_tokens) == (r.usage.input_tokens, r.usage.output_tokens)
    with client.responses.stream(**kwargs) as stream:  # the SDK's accumulator over the same events
        last = list(stream)[-1]
    # A cut by max_output_tokens ends as OpenAI's does, with response.incomplete.
    assert last.type == f"response.{r.status}" and last.response.output_text == r.output_text


def test_responses_previous_response_id_reuses_the_cached_history(client):
    first = client.responses.create(model=MODEL, input="Tell me about the weather in Paris today, in detail.",
                                    max_output_tokens=20, **GREEDY)
    second = client.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=first.id,
                                     max_output_tokens=8, **GREEDY)
    # The stored turn is the prompt's start, and the engine's prefix cache still holds it.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)


def test_responses_function_calls_are_held_to_their_schema_streamed_and_not(client):
    kwargs = dict(model=MODEL, input=MESSAGES[0]["content"], tools=RESPONSES_TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=200, **GREEDY)
    r = client.responses.create(**kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(**kwargs) as stream:
        streamed = stream.get_final_response()
    assert [(o.type, o.name, o.arguments) for o in streamed.output] == [("function_call", call.name, call.arguments)]
    # The call's result continues the conversation; the model then answers (tool_choice none).
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=RESPONSES_TOOLS, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"forecast": "sunny"}'}], max_output_tokens=8, **GREEDY)
    assert [o.type for o in follow.output] == ["message"]


def test_responses_tools_are_strict_unless_their_schema_cannot_be_held(client):
    # `not` is a keyword the grammar cannot enforce (backend/grammar.py): strict mode refuses it.
    loose = {"type": "object", "properties": {"city": {"type": "string", "not": {"const": "Oslo"}}}}
    tool = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": loose}
    kwargs = dict(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=8, **GREEDY)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(tools=[{**tool, "strict": True}], **kwargs)
    assert "not" in info.value.body["message"]
    # Left out, strict is tried and falls back (OpenAI's rule), so the request is served.
    assert client.responses.create(tools=[tool], **kwargs).status in ("completed", "incomplete")


def test_responses_in_the_background_finish_as_in_the_foreground_and_a_cancel_frees_the_engine(client, triton):
    kwargs = dict(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=16, **GREEDY)
    foreground = client.responses.create(**kwargs)
    r = client.responses.create(background=True, **kwargs)
    assert r.status == "queued" and r.background
    deadline = time.monotonic() + 60
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        r = client.responses.retrieve(r.id)
    assert r.status == foreground.status and r.output_text == foreground.output_text
    # A long one, streamed, left by its client and followed again, then cancelled: the engine
    # request is aborted (the fixture waits for every KV block to be free).
    events = client.responses.create(background=True, stream=True, **{**kwargs, "max_output_tokens": 900})
    seen = []
    for event in events:
        seen.append(event)
        if len(seen) == 8:
            break
    events.close()
    rid = seen[0].response.id
    again = client.responses.retrieve(rid, stream=True, starting_after=5)
    assert next(iter(again)).sequence_number == 6
    again.close()
    cancelled = client.responses.cancel(rid)
    assert cancelled.status == "cancelled" and 0 < len(cancelled.output_text) < 900 * 4, cancelled
    assert client.responses.retrieve(rid).status == "cancelled"


def test_a_conversation_carries_responses_turns_and_the_prefix_cache_serves_them(client):
    conv = client.conversations.create(items=[{"type": "message", "role": "user",
                                               "content": "Tell me about the weather in Paris today, in detail."}])
    first = client.responses.create(model=MODEL, input="Please.", conversation=conv.id, max_output_tokens=12, **GREEDY)
    second = client.responses.create(model=MODEL, input="And tomorrow?", conversation=conv.id, max_output_tokens=8,
                                     **GREEDY)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [i.type for i in items] == ["message"] * 5
    assert items[2].content[0].text == first.output_text and items[4].content[0].text == second.output_text
    # The same turns sent as items give the same answer (greedy): the conversation is the prompt.
    again = client.responses.create(model=MODEL, input=[i.model_dump(exclude_none=True) for i in items[:4]],
                                    max_output_tokens=8, **GREEDY)
    assert again.output_text == second.output_text


def test_responses_truncation_auto_fits_a_history_past_the_context(client):
    # The test server's context is 1024 tokens (LLM_MAX_MODEL_LEN): eight turns of ~150 tokens each.
    history = []
    for i in range(8):
        history += [{"role": "user", "content": f"Question {i}: " + "tell me about the weather " * 12},
                    {"role": "assistant", "content": f"Answer {i}: " + "it is sunny and warm " * 12}]
    kwargs = dict(model=MODEL, input=history + [{"role": "user", "content": "And tomorrow?"}],
                  max_output_tokens=16, **GREEDY)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kwargs)
    assert info.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(truncation="auto", **kwargs)
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert r.usage.input_tokens <= 1024 - 16
    # What it kept is the longest tail of whole turns that fits, and answers as that tail sent alone.
    for k in range(0, len(history), 2):
        try:
            alone = client.responses.create(**{**kwargs, "input": kwargs["input"][k:]})
        except openai.BadRequestError:
            continue
        break
    assert k > 0 and (alone.usage.input_tokens, alone.output_text) == (r.usage.input_tokens, r.output_text)
    # /v1/responses/input_tokens counts the prompt as generation renders it, truncated or not.
    count = client.responses.input_tokens.count
    assert count(model=MODEL, input=kwargs["input"][k:]).input_tokens == r.usage.input_tokens
    assert count(model=MODEL, input=kwargs["input"]).input_tokens > 1024
    assert r.usage.input_tokens <= count(model=MODEL, input=kwargs["input"], truncation="auto").input_tokens < 1024
    tools = dict(model=MODEL, instructions="Be brief.", input="Weather in Paris?", tools=RESPONSES_TOOLS)
    assert count(**tools).input_tokens == client.responses.create(max_output_tokens=2, **tools).usage.input_tokens


def test_embeddings_are_the_model_s_normalized_hidden_states(triton, tok, demo_model_path):
    """/v1/embeddings on tritonserver (--embeddings-pooling): the last prompt token's final-norm
    hidden state, or the prompt's mean, L2-normalized, equal to Hugging Face's; a batch in order,
    `dimensions` cut and normalized again; the prefix cache does not change an embedding."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()
    texts = ["Embeddings from a decoder", "a second, longer input: 中文 and 🙂"]
    with torch.no_grad():
        states = [hf(torch.tensor([tok(t).input_ids]), output_hidden_states=True).hidden_states[-1][0] for t in texts]
    for pooling in ("last", "mean"):
        settings = Settings(triton_url=triton.grpc_url, model_name=MODEL, embeddings_pooling=pooling)
        with serve_in_thread(create_app(settings)) as url:
            sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            for _ in range(2):  # the second time the prompts are in the prefix cache
                r = sdk.embeddings.create(model=MODEL, input=texts)
                assert r.usage.prompt_tokens == sum(len(tok(t).input_ids) for t in texts)
                for d, h in zip(r.data, states):
                    want = h[-1] if pooling == "last" else h.mean(0)
                    torch.testing.assert_close(torch.tensor(d.embedding), want / want.norm(), atol=2e-5, rtol=1e-4)
            cut = sdk.embeddings.create(model=MODEL, input=texts[0], dimensions=32).data[0].embedding
            want = (states[0][-1] if pooling == "last" else states[0].mean(0))[:32]
            torch.testing.assert_close(torch.tensor(cut), want / want.norm(), atol=2e-5, rtol=1e-4)

"""openai_frontend/reasoning.py: thinking models' output split into reasoning and content, the
same streamed in any chunking as parsed whole; and the frontend's reasoning_content, streamed
and not, on a scripted engine through the OpenAI SDK."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from openai_frontend.reasoning import FORMAT_NAMES, ReasoningStreamer, get_reasoning_format, split_reasoning
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import FakeLLMClient, serve_in_thread, text_chunks

R1, QWEN3, GRANITE = (get_reasoning_format(n) for n in ("deepseek-r1", "qwen3", "granite"))


@pytest.mark.parametrize("fmt, text, want", [
    (QWEN3, "<think>\nLet me see.\n</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    (QWEN3, "  <think>a</think>b", ("a", "b")),
    (QWEN3, "It is 4.", (None, "It is 4.")),
    (QWEN3, "  plain <think>x</think>", (None, "  plain <think>x</think>")),
    (QWEN3, "<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    (QWEN3, "<think></think>\n\nNo thinking.", ("", "No thinking.")),  # enable_thinking false
    (QWEN3, "<think>a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),
    (QWEN3, "<thinking>not a marker", (None, "<thinking>not a marker")),
    (R1, "Hmm, 2+2.\n</think>\n\n4", ("Hmm, 2+2.", "4")),  # the template opened the section
    (R1, "<think>Hmm</think>4", ("Hmm", "4")),
    (R1, "never closed", ("never closed", "")),
    (R1, "思考。</think>答案：四", ("思考。", "答案：四")),
    (GRANITE, "Here's my thought process: x y Here is my response: z", ("x y", "z")),
    (GRANITE, "Just z", (None, "Just z")),
    (get_reasoning_format("kimi"), "◁think▷a◁/think▷b", ("a", "b")),
])
def test_split(fmt, text, want):
    assert split_reasoning(fmt, text) == want


def _stream(fmt, pieces: list[str]) -> tuple[str, str, bool]:
    s = ReasoningStreamer(fmt)
    r, c = "", ""
    for p in pieces:
        dr, dc = s.feed(p)
        r, c = r + dr, c + dc
    dr, dc = s.finish()
    return r + dr, c + dc, s.saw_reasoning


def _random_output(rng: random.Random, fmt) -> str:
    words = ["a", "b c", "思考", " ", "\n", "\n\n", "<", "</", "</thi", "<th", "think", ">", "Here", "'s my",
             " response", ":", "◁", "▷", "x" * 5]
    parts = []
    for _ in range(rng.randint(0, 12)):
        roll = rng.random()
        if roll < 0.12:
            parts.append(rng.choice(fmt.starts))
        elif roll < 0.3:
            parts.append(rng.choice(fmt.ends))
        else:
            parts.append(rng.choice(words))
    return "".join(parts)


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_fuzz_stream_result_does_not_depend_on_chunking(name):
    fmt = get_reasoning_format(name)
    rng = random.Random(name)
    for _ in range(300):
        text = _random_output(rng, fmt)
        reasoning, content = split_reasoning(fmt, text)
        whole = (reasoning or "", content, reasoning is not None)
        assert _stream(fmt, list(text)) == whole, text
        for _ in range(4):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 5))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert _stream(fmt, pieces) == whole, (text, pieces)
        # nothing is lost but the markers and the whitespace around the reasoning
        if reasoning is None:
            assert content == text


def test_streaming_holds_back_only_a_possible_marker():
    s = ReasoningStreamer(QWEN3)
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>Step one") == ("Step one", "")
    assert s.feed(". Then </th") == (". Then", "")  # " </th" may still be the closing marker
    assert s.feed("ink>\n\nDone") == ("", "Done")
    assert s.finish() == ("", "")


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; expected one of deepseek_r1"):
        get_reasoning_format("nope")


# ------------------------------------------------------------------ the frontend, scripted engine
MODEL = "demo-model"
MESSAGES = [{"role": "user", "content": "2+2?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OUTPUT = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def served():
    fake = FakeLLMClient()
    settings = Settings(model_name=MODEL, tool_call_parser="qwen25", reasoning_parser="qwen3")
    with serve_in_thread(create_app(settings, client=fake)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), fake, url


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _collect(stream) -> dict:
    got = {"reasoning": "", "reasoning_new_name": "", "content": "", "calls": {}, "finish": [], "reasoning_events": 0}
    for chunk in stream:
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            if extra.get("reasoning_content"):
                got["reasoning"] += extra["reasoning_content"]
                got["reasoning_events"] += 1
            got["reasoning_new_name"] += extra.get("reasoning") or ""
            got["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = got["calls"].setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            if c.finish_reason:
                got["finish"].append(c.finish_reason)
    return got


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_reasoning_then_tool_call_streamed_equals_whole(served, size):
    client, fake, _ = served
    fake.script = lambda req: text_chunks(_pieces(OUTPUT, size))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER])
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "The user wants weather."
    assert msg.content == "Let me check."
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"]  # vLLM 0.11+'s name, and SGLang's
    got = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True))
    assert got["reasoning"] == msg.model_extra["reasoning_content"] and got["content"] == msg.content
    assert got["reasoning_new_name"] == got["reasoning"]
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [("get_weather", '{"city": "Paris"}')]
    assert got["finish"] == ["tool_calls"]


@pytest.mark.parametrize("output", ["<think>\n\n</think>\n\nanswer", "<think></think>answer"])
def test_an_empty_reasoning_section_is_null_streamed_or_not(served, output):
    """QA s20: Qwen3's section when it does not think was "" whole and absent streamed (SGLang: null)."""
    client, fake, _ = served
    fake.script = lambda req: text_chunks(_pieces(output, 3))
    msg = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
    assert msg.model_extra["reasoning_content"] is None and msg.content == "answer"
    got = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert (got["reasoning_events"], got["content"]) == (0, "answer")


def test_reasoning_request_switches(served):
    client, fake, url = served
    text = "<think>a b c</think>answer"
    fake.script = lambda req: text_chunks(_pieces(text, 2))
    # SGLang's stream_reasoning false: the whole reasoning in one delta, when it ends
    got = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                  extra_body={"stream_reasoning": False}))
    assert (got["reasoning"], got["content"], got["reasoning_events"]) == ("a b c", "answer", 1)
    assert _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))["reasoning_events"] > 1
    # vLLM's include_reasoning false: no reasoning at all; SGLang's separate_reasoning false: markers stay
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"include_reasoning": False})
    assert r.choices[0].message.content == "answer" and "reasoning_content" not in (r.choices[0].message.model_extra or {})
    got = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                  extra_body={"include_reasoning": False}))
    assert (got["reasoning"], got["content"]) == ("", "answer")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"separate_reasoning": False})
    assert r.choices[0].message.content == text
    # no reasoning section: reasoning_content is null, content untouched
    fake.script = lambda req: text_chunks(["Just ", "4."])
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert r.choices[0].message.content == "Just 4." and r.choices[0].message.model_extra["reasoning_content"] is None
    # SGLang's /separate_reasoning
    body = httpx.post(url + "/separate_reasoning", json={"text": "Hmm</think>4", "reasoning_parser": "deepseek-r1"}).json()
    assert body == {"text": "4", "reasoning_text": "Hmm"}
    bad = httpx.post(url + "/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_parser"


def test_no_reasoning_parser_leaves_the_text_alone():
    fake = FakeLLMClient()
    fake.script = lambda req: text_chunks(["<think>a</think>", "b"])
    with serve_in_thread(create_app(Settings(model_name=MODEL), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msg = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
        assert msg.content == "<think>a</think>b" and "reasoning_content" not in (msg.model_extra or {})
        r = httpx.post(url + "/separate_reasoning", json={"text": "x"})
        assert r.status_code == 400 and "reasoning_parser is required" in r.json()["error"]["message"]


def test_constraints_apply_after_the_reasoning(served):
    """response_format / guided_* / tool_choice required reach the engine wrapped: free reasoning,
    then the constraint."""
    client, fake, _ = served
    fake.script = lambda req: text_chunks(["<think>x</think>", '{"a": 1}'])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    sp = fake.requests[-1].sampling_params
    assert "json_schema" not in sp
    fmt = json.loads(sp["structural_tag"])["format"]
    thinking, direct = fmt["elements"]  # qwen3 need not think
    assert direct == {"type": "json_schema", "json_schema": schema}
    assert thinking["elements"][0] == {"type": "tag", "begin": "<think>", "content": {"type": "any_text"},
                                       "end": "</think>"}
    assert thinking["elements"][2] == direct
    client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"guided_choice": ["yes", "no"]})
    fmt = json.loads(fake.requests[-1].sampling_params["structural_tag"])["format"]
    assert fmt["elements"][1] == {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required")
    fmt = json.loads(fake.requests[-1].sampling_params["structural_tag"])["format"]
    assert fmt["type"] == "or" and fmt["elements"][0]["elements"][0]["end"] == "</think>"
    # separate_reasoning false only leaves the reasoning in content: the model still thinks first,
    # so the constraint still follows the reasoning (SGLang; QA: the plain regex held the reasoning)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"guided_regex": "[0-9]+",
                                                                               "separate_reasoning": False})
    sp = fake.requests[-1].sampling_params
    assert "regex" not in sp and json.loads(sp["structural_tag"])["format"]["elements"][1] == {
        "type": "regex", "pattern": "[0-9]+"}
    # vLLM's whitespace pattern goes into the schema's element (it was a 400 with a reasoning parser)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"guided_json": schema,
                                                                               "guided_whitespace_pattern": ""})
    sp = fake.requests[-1].sampling_params
    assert "whitespace_pattern" not in sp and json.loads(sp["structural_tag"])["format"]["elements"][1] == {
        "type": "json_schema", "json_schema": schema, "whitespace_pattern": ""}
    # SGLang's legacy structural tag, read as xgrammar reads it (it was a 400 too)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"structural_tag": {
        "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], "triggers": ["<a"]}})
    fmt = json.loads(fake.requests[-1].sampling_params["structural_tag"])["format"]
    assert fmt["elements"][1] == {"type": "triggered_tags", "triggers": ["<a"], "tags": [
        {"type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "json_schema", "json_schema": {}}}]}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"structural_tag": {"tags": []}})
    assert err.value.body["param"] == "structural_tag"


def test_a_constraint_that_is_not_json_is_a_400_naming_its_parameter(served):
    """Review: with a reasoning parser the frontend parses the constraint to wrap it, and JSON text
    that did not parse was a 500 (without the parser the engine refuses it as a 400)."""
    client, fake, _ = served
    sent = len(fake.requests)
    for extra, param in [({"guided_json": "{not json"}, "guided_json"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{bad"}}},
                          "response_format"),
                         ({"structural_tag": "{bad"}, "structural_tag")]:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream, extra_body=extra)
            assert err.value.body["param"] == param and "not valid JSON" in err.value.body["message"], err.value.body
    assert len(fake.requests) == sent


@pytest.mark.parametrize("tool_parser", ["qwen25", None])
def test_a_forced_tool_call_after_reasoning_parses_with_separate_reasoning_false(tool_parser):
    # QA: a constraint follows the reasoning also under separate_reasoning false; a forced call's
    # text, reasoning first, must then still read as the call (the JSON array fallback found none).
    fake = FakeLLMClient()
    settings = Settings(model_name=MODEL, tool_call_parser=tool_parser, reasoning_parser="qwen3")
    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' if tool_parser
            else '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    fake.script = lambda req: text_chunks(_pieces("<think>Need the weather.</think>\n\n" + call, 4))
    with serve_in_thread(create_app(settings, client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                  extra_body={"separate_reasoning": False})
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        assert "structural_tag" in fake.requests[-1].sampling_params  # the model may think first
        assert [(t.function.name, t.function.arguments) for t in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
        assert msg.content is None and "reasoning_content" not in msg.model_extra
        assert r.choices[0].finish_reason == "tool_calls"
        got = _collect(client.chat.completions.create(**kw, stream=True))
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [("get_weather", '{"city": "Paris"}')]
        assert (got["content"], got["reasoning_events"], got["finish"]) == ("", 0, ["tool_calls"])


@pytest.mark.parametrize("output", ["<think>still thinking", "<think>done</think>"])
def test_an_output_that_is_all_reasoning_has_null_content(served, output):
    # QA: content was "" (vLLM: null), though an empty reasoning section is null already.
    client, fake, _ = served
    fake.script = lambda req: text_chunks(_pieces(output, 3))
    msg = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
    assert msg.content is None and msg.model_extra["reasoning_content"] in ("still thinking", "done")
    with_tools = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER]).choices[0].message
    assert with_tools.content is None and not with_tools.tool_calls
    got = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert got["content"] == "" and got["reasoning"] == msg.model_extra["reasoning_content"]


# ------------------------------------------------------------------ the generation prompt's tail
def test_the_generation_prompt_decides_where_the_output_starts():
    from openai_frontend.reasoning import for_prompt

    assert for_prompt(QWEN3, "<|im_start|>assistant\n<think>\n").starts_in_reasoning  # Qwen3-Thinking-2507, Qwen3.5
    assert not for_prompt(QWEN3, "assistant\n<think>\n\n</think>\n\n").starts_in_reasoning  # enable_thinking false
    assert not for_prompt(R1, "<｜Assistant｜></think>").starts_in_reasoning  # DeepSeek-V3.1, thinking false
    assert for_prompt(R1, "<｜Assistant｜><think>\n").starts_in_reasoning
    for tail in (None, "", "<|im_start|>assistant\n", "<think>x"):  # no marker at the end: the parser's rule
        assert for_prompt(QWEN3, tail) is QWEN3 and for_prompt(R1, tail) is R1
    assert for_prompt(GRANITE, "Here is my thought process: ").starts_in_reasoning


class TemplatedFake(FakeLLMClient):
    """A server whose chat template opens the reasoning section in the generation prompt, as
    Qwen3-Thinking-2507's and Qwen3.5's do (closed and empty with enable_thinking false)."""

    def __init__(self) -> None:
        super().__init__()
        self.probes = 0

    async def tokenize(self, request):
        self.probes += 1
        off = (request.chat_template_kwargs or {}).get("enable_thinking") is False
        text = "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if off else "<think>\n")
        return list(text.encode())


def test_a_template_that_opens_the_reasoning_section_is_followed():
    """Closing note's gap: with --reasoning-parser qwen3, a Qwen3-Thinking-2507 / Qwen3.5 model's
    output (its template writes <think> into the prompt) came back as content, </think> and all."""
    fake = TemplatedFake()
    with serve_in_thread(create_app(Settings(model_name=MODEL, reasoning_parser="qwen3"), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        fake.script = lambda req: text_chunks(_pieces("The user adds.\n</think>\n\nIt is 4.", 3))
        for _ in range(3):
            msg = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
            assert (msg.model_extra["reasoning_content"], msg.content) == ("The user adds.", "It is 4.")
            got = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
            assert (got["reasoning"], got["content"]) == ("The user adds.", "It is 4.")
        assert fake.probes == 1  # asked once, not per request
        # cut by max_tokens before the closing marker: all reasoning
        fake.script = lambda req: text_chunks(_pieces("Still adding", 3), finish="length")
        msg = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == ("Still adding", None)
        # enable_thinking false closes the section in the prompt: the output is content
        fake.script = lambda req: text_chunks(_pieces("It is 4.", 3))
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        msg = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=off).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == (None, "It is 4.")
        got = _collect(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, extra_body=off))
        assert (got["reasoning"], got["content"]) == ("", "It is 4.")
        assert fake.probes == 2
        # a reply that continues the last message has no generation prompt: the parser's own rule
        fake.script = lambda req: text_chunks(_pieces("more text", 3))
        msg = client.chat.completions.create(
            model=MODEL, messages=[*MESSAGES, {"role": "assistant", "content": "So"}],
            extra_body={"continue_final_message": True, "add_generation_prompt": False}).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == (None, "more text")
        assert fake.probes == 2


def test_the_prompt_tail_cache_keeps_digests_and_drops_expired_answers(monkeypatch):
    """QA: the probe's cache was keyed by the kwargs' (and template's) whole text and dropped an
    expired entry only when the same key came back: 4 MB kwargs, new each request, kept ~4 MB of
    frontend memory each until 256 others came."""
    import asyncio
    from types import SimpleNamespace

    from openai_frontend import common

    clock = [1000.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: clock[0])
    fake = TemplatedFake()
    ctx = common.Context(Settings(model_name=MODEL), fake, SimpleNamespace(max_model_len=4096))

    async def ask(kwargs):
        return await ctx.generation_prompt_tail(None, kwargs)

    big = "x" * 1_000_000
    for i in range(5):
        assert asyncio.run(ask({"blob": big + str(i)})).endswith("<think>\n")
    assert fake.probes == 5
    assert all(isinstance(k, bytes) and len(k) == 32 for k in ctx._prompt_tails)  # no text kept
    assert asyncio.run(ask({"blob": big + "4"})) and fake.probes == 5  # a hit within the TTL
    clock[0] += common.ENGINE_INFO_TTL_S + 1
    assert asyncio.run(ask({"enable_thinking": False})).endswith("</think>\n\n")
    assert len(ctx._prompt_tails) == 1 and fake.probes == 6  # the five expired ones are gone


def test_a_prompt_that_closed_the_reasoning_holds_the_constraint_from_the_first_token():
    """QA: with enable_thinking false (the prompt ends with </think>) a response_format still
    let the model open a new <think> section and write free text there (vLLM holds the grammar
    from the first token once the prompt has ended the reasoning)."""
    fake = TemplatedFake()
    fake.script = lambda req: text_chunks(['{"a": 1}'])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with serve_in_thread(create_app(Settings(model_name=MODEL, reasoning_parser="qwen3"), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        formats = {}
        for name, extra in (("off", {"chat_template_kwargs": {"enable_thinking": False}}), ("on", {})):
            msg = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, extra_body=extra,
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).choices[0].message
            assert msg.content == ('{"a": 1}' if name == "off" else None)  # "on": all of it was reasoning
            formats[name] = json.loads(fake.requests[-1].sampling_params["structural_tag"])["format"]
    assert formats["off"] == {"type": "json_schema", "json_schema": schema}
    assert formats["on"]["type"] == "sequence"  # the prompt opened the section: think, then answer


def test_thinking_token_budget_carries_the_parsers_markers_to_the_engine():
    """vLLM's thinking_token_budget: the engine forces the closing marker after N reasoning
    tokens (backend/thinking_budget.py); the frontend says which markers, and whether the prompt
    opened the section."""
    fake = TemplatedFake()
    fake.script = lambda req: text_chunks(["It is 4."])
    with serve_in_thread(create_app(Settings(model_name=MODEL, reasoning_parser="qwen3"), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for extra, inside in (({}, True), ({"chat_template_kwargs": {"enable_thinking": False}}, False)):
            client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                           extra_body={"thinking_token_budget": 3, **extra})
            assert fake.requests[-1].sampling_params["thinking_budget"] == {
                "budget": 3, "starts": ["<think>"], "end": "</think>", "inside": inside}
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "thinking_token_budget": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text
    with serve_in_thread(create_app(Settings(model_name=MODEL), client=FakeLLMClient())) as url:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "thinking_token_budget": 2})
        assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "thinking_token_budget"


def test_a_template_that_needs_a_system_message_is_probed_with_one():
    class SystemFirst(TemplatedFake):
        async def tokenize(self, request):
            if request.messages[0]["role"] != "system":
                raise RuntimeError("the first message must be the system's")
            return await super().tokenize(request)

    fake = SystemFirst()
    fake.script = lambda req: text_chunks(_pieces("The user adds.\n</think>\n\nIt is 4.", 3))
    with serve_in_thread(create_app(Settings(model_name=MODEL, reasoning_parser="qwen3"), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msg = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == ("The user adds.", "It is 4.")


def test_a_template_that_cannot_be_probed_leaves_the_parsers_rule():
    class Failing(FakeLLMClient):
        async def tokenize(self, request):
            raise RuntimeError("preprocessing is down")

    fake = Failing(lambda req: text_chunks(["Hmm</think>4"]))
    with serve_in_thread(create_app(Settings(model_name=MODEL, reasoning_parser="deepseek_r1"), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msg = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == ("Hmm", "4")

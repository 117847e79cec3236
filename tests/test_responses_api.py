"""/v1/responses (openai_frontend/responses.py, response_items.py, response_store.py) with the official openai SDK against the frontend on
a scripted engine: the request as the chat request it becomes, output items streamed and not
(the same items either way, in every chunking), stored responses and previous_response_id, and
every refusal naming its place in the body. The real server's side is in test_openai_sdk.py."""

from __future__ import annotations

import json
import random
import time

import httpx
import openai
import pytest

from openai_frontend.engine_types import EngineChunk
from openai_frontend.errors import APIError, timed_out
from openai_frontend.response_store import ResponseStore
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import FakeLLMClient, serve_in_thread, text_chunks

MODEL = "m"
THINK = ["<think>", "Let me", " see", "</think>", "It is", " sunny", "."]
CALL = ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}\n</tool_call>']
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient()


@pytest.fixture(scope="module")
def sdk(fake):
    settings = Settings(model_name=MODEL, tool_call_parser="qwen25", reasoning_parser="qwen3")
    with serve_in_thread(create_app(settings, client=fake)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(autouse=True)
def _default_script(fake):
    fake.script = lambda req: text_chunks(THINK)
    fake.delay = 0.0
    yield


def _plain(items) -> list[dict]:
    """Output items without their ids (made per response, a call's too)."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True) if hasattr(item, "model_dump") else dict(item)
        d.pop("id", None)
        d.pop("call_id", None)
        out.append(d)
    return out


def _refusal(sdk, **kwargs) -> dict:
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as info:
        sdk.responses.create(**{"model": MODEL, **kwargs})
    return info.value.body


def test_text_and_reasoning_come_back_as_items_with_usage(sdk, fake):
    r = sdk.responses.create(model=MODEL, input="Weather?", instructions="Be brief.", max_output_tokens=50,
                             temperature=0.5, top_p=0.9, metadata={"k": "v"})
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me see"
    assert r.output_text == "It is sunny."
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (7, 7, 14)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.top_p, r.metadata) == (
        "Be brief.", 50, 0.5, 0.9, {"k": "v"})
    req = fake.requests[-1]
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    sp = req.sampling_params
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"]) == (50, 0.5, 0.9)
    # Not streaming, the engine sends the answer in one response, unless logprobs follow the chunks.
    assert req.stream is False
    list(sdk.responses.create(model=MODEL, input="Weather?", stream=True))
    assert fake.requests[-1].stream is True
    sdk.responses.create(model=MODEL, input="Weather?", top_logprobs=1)
    assert fake.requests[-1].stream is True


@pytest.mark.parametrize("pieces", [THINK, CALL, ["Hi"] + CALL, ["<think>", "x</think>"] + CALL])
def test_streamed_items_equal_the_non_streamed_ones_in_every_chunking(sdk, fake, pieces):
    rng = random.Random(len(pieces))
    text = "".join(pieces)
    fake.script = lambda req: text_chunks(pieces)
    whole = sdk.responses.create(model=MODEL, input="q", tools=TOOLS)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        split = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        fake.script = lambda req: text_chunks(split)
        events = list(sdk.responses.create(model=MODEL, input="q", tools=TOOLS, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert _plain(events[-1].response.output) == _plain(whole.output), split
        # The SDK's own accumulator agrees with the events it is given.
        with sdk.responses.stream(model=MODEL, input="q", tools=TOOLS) as stream:
            final = stream.get_final_response()
        assert _plain(final.output) == _plain(whole.output)


def test_reasoning_tokens_are_the_reasoning_text_s_tokens_with_a_tokenizer(demo_model_path):
    from tokenizers import Tokenizer

    thinking = "Let me count the ways. One, two, three."
    fake = FakeLLMClient(lambda req: text_chunks(["<think>", thinking, "</think>", "Three."]))
    settings = Settings(model_name=MODEL, reasoning_parser="qwen3", tokenizer_path=str(demo_model_path))
    with serve_in_thread(create_app(settings, client=fake)) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = sdk.responses.create(model=MODEL, input="count")
        events = list(sdk.responses.create(model=MODEL, input="count", stream=True))
    want = len(Tokenizer.from_file(str(demo_model_path / "tokenizer.json")).encode(thinking, add_special_tokens=False).ids)
    assert r.output[0].content[0].text == thinking and want > 5
    assert r.usage.output_tokens_details.reasoning_tokens == want
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == want


def test_function_calls_and_their_outputs_continue_a_conversation(sdk, fake):
    fake.script = lambda req: text_chunks(CALL)
    r = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="auto")
    (call,) = r.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert fake.requests[-1].tools[0]["function"]["name"] == "get_weather"
    # strict by default, as OpenAI's Responses API: a call, once begun, is held to its schema
    assert "structural_tag" in fake.requests[-1].sampling_params
    sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[{**TOOLS[0], "strict": False}])
    assert "structural_tag" not in fake.requests[-1].sampling_params
    fake.script = lambda req: text_chunks(["Sunny."])
    follow = [{"role": "user", "content": "Weather in Paris?"}, *r.output,
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}]
    assert sdk.responses.create(model=MODEL, input=follow, tools=TOOLS).output_text == "Sunny."
    assert fake.requests[-1].messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'},
    ]


def test_namespace_tools_are_their_functions_and_calls_name_the_namespace(sdk, fake):
    shell = {"type": "function", "name": "shell", "description": "Run a command",
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}
    codex = {"type": "namespace", "name": "codex", "description": "Codex tools", "tools": [shell]}
    fake.script = lambda req: text_chunks(['<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>'])
    for stream in (False, True):
        if stream:
            with sdk.responses.stream(model=MODEL, input="list", tools=[codex, *TOOLS]) as events:
                r = events.get_final_response()
        else:
            r = sdk.responses.create(model=MODEL, input="list", tools=[codex, *TOOLS])
        (call,) = r.output
        assert (call.name, call.namespace, json.loads(call.arguments)) == ("shell", "codex", {"cmd": "ls"})
    assert [t["function"]["name"] for t in fake.requests[-1].tools] == ["shell", "get_weather"]
    assert _refusal(sdk, input="x", tools=[codex, {**shell}])["param"] == "tools[1].name"
    custom = {**codex, "tools": [{"type": "custom", "name": "patch"}]}
    assert _refusal(sdk, input="x", tools=[custom])["param"] == "tools[0].tools[0].type"


def test_a_schema_strict_mode_cannot_hold_falls_back_when_strict_was_left_out(sdk, fake):
    def engine(req):
        if "structural_tag" in req.sampling_params:  # as the engine refuses a schema its grammar cannot enforce
            return APIError(400, "invalid json_schema: 'not' at /properties/a is not supported", param="tools")
        return text_chunks(["fine"])

    fake.script = engine
    before = len(fake.requests)
    assert sdk.responses.create(model=MODEL, input="x", tools=TOOLS).output_text == "fine"
    assert len(fake.requests) == before + 2  # strict first, as OpenAI tries, then not
    assert [t["function"]["strict"] for t in fake.requests[-1].tools] == [False]
    # Asked for by name, strict stays: the refusal is the answer.
    assert _refusal(sdk, input="x", tools=[{**TOOLS[0], "strict": True}])["param"] == "tools"


def test_reasoning_items_go_to_the_assistant_turn_after_them(sdk, fake):
    thought = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]}
    sdk.responses.create(model=MODEL, input=[{"role": "user", "content": "q"}, thought,
                                             {"role": "assistant", "content": "a"}, thought,
                                             {"role": "user", "content": "q2"}])
    assert fake.requests[-1].messages == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "hm"},
        {"role": "assistant", "content": "", "reasoning_content": "hm"}, {"role": "user", "content": "q2"}]


def test_previous_response_id_continues_the_stored_conversation(sdk, fake):
    first = sdk.responses.create(model=MODEL, input="Hi", instructions="Only the first turn's.")
    fake.script = lambda req: text_chunks(["Again."])
    second = sdk.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "More"}]}],
                                  previous_response_id=first.id, stream=False)
    assert second.previous_response_id == first.id
    # The stored turn with its reasoning and answer, then the new input; instructions are not carried over.
    assert fake.requests[-1].messages == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Let me see"},
        {"role": "user", "content": "More"},
    ]
    # A streamed turn is stored too, and chains on.
    events = list(sdk.responses.create(model=MODEL, input="Third", previous_response_id=second.id, stream=True))
    third = events[-1].response
    sdk.responses.create(model=MODEL, input="Fourth", previous_response_id=third.id)
    assert [m["content"] for m in fake.requests[-1].messages] == ["Hi", "It is sunny.", "More", "Again.", "Third",
                                                                  "Again.", "Fourth"]
    assert sdk.responses.retrieve(first.id).output_text == "It is sunny."
    body = _refusal(sdk, input="x", previous_response_id="resp_0123456789abcdef")
    assert body["param"] == "previous_response_id" and "not found" in body["message"]


def test_stored_responses_can_be_read_and_deleted_and_store_false_keeps_none(sdk):
    kept = sdk.responses.create(model=MODEL, input="a")
    assert kept.store is True and sdk.responses.retrieve(kept.id).id == kept.id
    sdk.responses.delete(kept.id)
    for missing in (kept.id, "resp_ffffffffffffffff", "nonsense"):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(missing)
    unkept = sdk.responses.create(model=MODEL, input="a", store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unkept.id)
    assert _refusal(sdk, input="b", previous_response_id=unkept.id)["param"] == "previous_response_id"


def test_input_items_list_a_response_s_own_input_in_pages(sdk):
    given = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "input_text", "text": "u1"}]},
             {"role": "assistant", "content": "a"}, {"type": "function_call", "call_id": "call_1", "name": "f",
                                                      "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "42"}, {"role": "user", "content": "u2"}]
    r = sdk.responses.create(model=MODEL, input=given)
    newest_first = list(sdk.responses.input_items.list(r.id))  # the SDK pages through `after`
    assert [i.type for i in newest_first] == ["message", "function_call_output", "function_call", "message",
                                               "message", "message"]
    assert newest_first[0].content[0].text == "u2" and newest_first[2].name == "f"
    assert newest_first[3].content[0].type == "output_text" and newest_first[5].content[0].type == "input_text"
    page = sdk.responses.input_items.list(r.id, order="asc", limit=4)
    assert [i.id for i in page.data] == [i.id for i in reversed(newest_first)][:4] and page.has_more
    rest = sdk.responses.input_items.list(r.id, order="asc", limit=4, after=page.last_id)
    assert [i.id for i in rest.data] == [i.id for i in reversed(newest_first)][4:] and not rest.has_more
    text = sdk.responses.create(model=MODEL, input="plain")
    (item,) = sdk.responses.input_items.list(text.id).data
    assert (item.role, item.content[0].text, item.content[0].type) == ("user", "plain", "input_text")
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_x"}, "after")):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.responses.input_items.list(r.id, **query)
        assert info.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        sdk.responses.input_items.list("resp_0123456789abcdef")


def test_frontend_processes_with_one_metrics_dir_continue_each_other_s_responses(fake, tmp_path):
    """--workers gives its processes one directory (metrics_dir): a turn stored by one is found
    by the other, whichever accepts the next connection."""
    settings = Settings(model_name=MODEL, metrics_dir=str(tmp_path))
    with serve_in_thread(create_app(settings, client=fake)) as one, \
            serve_in_thread(create_app(settings, client=fake)) as two:
        first = openai.OpenAI(base_url=one + "/v1", api_key="x", max_retries=0).responses.create(model=MODEL, input="a")
        other = openai.OpenAI(base_url=two + "/v1", api_key="x", max_retries=0)
        assert other.responses.retrieve(first.id).output_text == first.output_text
        other.responses.create(model=MODEL, input="b", previous_response_id=first.id)
        assert [m["content"] for m in fake.requests[-1].messages][:1] == ["a"]


def test_a_server_that_keeps_no_responses_says_so(fake):
    with serve_in_thread(create_app(Settings(model_name=MODEL, responses_store_size=0), client=fake)) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = sdk.responses.create(model=MODEL, input="a")
        assert r.store is False
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(r.id)
        # Nor background responses, which live in the same store.
        with pytest.raises(openai.BadRequestError) as info:
            sdk.responses.create(model=MODEL, input="a", background=True)
        assert info.value.body["param"] == "background" and "--responses-store-size 0" in info.value.body["message"]
        # Conversations have a store of their own: a response in one is added to it.
        conv = sdk.conversations.create()
        sdk.responses.create(model=MODEL, input="b", conversation=conv.id)
        assert len(sdk.conversations.items.list(conv.id).data) == 2


def test_text_format_and_reasoning_effort_become_the_chat_request_s(sdk, fake):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fake.script = lambda req: text_chunks(['{"a": 1}'])
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "json"}])
    for text, response_format in [
        ({"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
         {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}),
        ({"format": {"type": "json_object"}, "verbosity": "medium"}, {"type": "json_object"}),
    ]:
        r = sdk.responses.create(model=MODEL, input="json", text=text)
        assert json.loads(r.output_text) == {"a": 1} and r.text.format.type == text["format"]["type"]
        assert r.text.verbosity == "medium"  # OpenAI's default, the only one honoured
        constrained = fake.requests[-1].sampling_params
        sdk.chat.completions.create(response_format=response_format, **chat)
        assert constrained == fake.requests[-1].sampling_params and "structural_tag" in constrained
    sdk.responses.create(model=MODEL, input="think hard", reasoning={"effort": "high"})
    assert fake.requests[-1].chat_template_kwargs == {"reasoning_effort": "high"}


def test_logprobs_on_output_text_streamed_and_not(sdk, fake):
    def with_logprobs(req):
        meta = [json.dumps({"output_token_logprobs": [[-0.5, 100 + i, None]],
                            "output_top_logprobs": [[[-0.5, 100 + i, None], [-1.5, 7, None]]]}) for i in range(3)]
        return text_chunks(["a", "b", "c"], meta=meta)

    fake.script = with_logprobs
    r = sdk.responses.create(model=MODEL, input="x", include=["message.output_text.logprobs"], top_logprobs=2)
    lps = r.output[0].content[0].logprobs
    assert [lp.logprob for lp in lps] == [-0.5] * 3 and all(len(lp.top_logprobs) == 2 for lp in lps)
    events = list(sdk.responses.create(model=MODEL, input="x", include=["message.output_text.logprobs"],
                                       top_logprobs=2, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert sum(len(e.logprobs) for e in deltas) == 3
    assert _plain(events[-1].response.output) == _plain(r.output)

    # With reasoning and calls, the message carries its own tokens' logprobs (and a marker's just
    # before its text: </think>'s), streamed and not alike; reasoning and call tokens have none.
    for pieces, tokens in ((THINK, [103, 104, 105, 106]), (["<think>", "a", "</think>"] + CALL, None), (CALL, None)):
        meta = [json.dumps({"output_token_logprobs": [[-1.0, 100 + i, None]],
                            "output_top_logprobs": [[[-1.0, 100 + i, None]]]}) for i in range(len(pieces))]
        fake.script = lambda req: text_chunks(pieces, meta=meta)
        kwargs = dict(model=MODEL, input="x", tools=TOOLS, include=["message.output_text.logprobs"])
        whole = sdk.responses.create(**kwargs)
        events = list(sdk.responses.create(stream=True, **kwargs))
        assert _plain(events[-1].response.output) == _plain(whole.output), pieces
        messages = [o for o in whole.output if o.type == "message"]
        if tokens is None:
            assert not messages and whole.output[-1].type == "function_call"
        else:
            assert [lp.token for lp in messages[0].content[0].logprobs] == [f"token_id:{t}" for t in tokens]


def test_max_output_tokens_cut_is_incomplete_streamed_and_not(sdk, fake):
    fake.script = lambda req: text_chunks(["a", "b"], finish="length")
    r = sdk.responses.create(model=MODEL, input="x", max_output_tokens=2)
    assert (r.status, r.incomplete_details.reason, r.output[0].status) == ("incomplete", "max_output_tokens", "incomplete")
    events = list(sdk.responses.create(model=MODEL, input="x", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_an_engine_error_mid_stream_is_an_error_event_then_a_failed_response(sdk, fake):
    fake.script = lambda req: [EngineChunk("a", [1], None, 3, 1), APIError(500, "the engine stopped")]
    events = list(sdk.responses.create(model=MODEL, input="x", stream=True))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert "the engine stopped" in events[-2].message and events[-1].response.status == "failed"
    # Not streaming, the error is the answer, with its own status and headers: a 504 for a
    # generation past --stream-timeout, which the SDK is told not to retry.
    fake.script = lambda req: [EngineChunk("a", [1], None, 3, 1), timed_out("generation ran past 5 s")]
    r = httpx.post(str(sdk.base_url) + "responses", json={"model": MODEL, "input": "x"}, timeout=30)
    assert (r.status_code, r.headers.get("x-should-retry")) == (504, "false"), r.text
    assert "ran past" in r.json()["error"]["message"]


def test_a_disconnected_stream_cancels_the_engine_request(sdk, fake):
    fake.script = lambda req: [EngineChunk("t", [1], None, 3, i + 1) for i in range(10_000)]
    fake.delay = 0.01
    fake.closed_early.clear()
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", str(sdk.base_url) + "responses", json={"model": MODEL, "input": "x", "stream": True}) as r:
            deltas = 0
            for line in r.iter_lines():
                deltas += line.startswith("event: response.output_text.delta")
                if deltas >= 3:
                    break
    assert fake.closed_early.wait(5), "the engine stream was not closed after the client left"


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}, "bogus": 1}]}, "tools[0].bogus"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"conversation": 5}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"verbosity": "high"}}, "text.verbosity"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options.include_obfuscation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"n": 2}, "n"),
])
def test_refusals_name_their_place_in_the_body(sdk, kwargs, param):
    kwargs = {"input": "x", **kwargs}
    extra = {k: kwargs.pop(k) for k in ("n",) if k in kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=MODEL, extra_body=extra or None, **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_chat_s_own_refusals_use_the_responses_names(sdk):
    assert _refusal(sdk, input=[])["param"] == "input"


def test_a_store_in_a_directory_is_shared_and_bounded(tmp_path):
    one, two = ResponseStore(40, str(tmp_path)), ResponseStore(40, str(tmp_path))
    ids = [f"resp_{i:016x}" for i in range(100)]
    for i, rid in enumerate(ids):
        one.put(rid, {"response": {"id": rid}, "turn": [i], "previous": ids[i - 1] if i else None})
        time.sleep(0.001)  # distinct modification times
    assert two.get(ids[-1])["turn"] == [99]
    left = sorted(p.name for p in tmp_path.glob("resp_*.json"))
    assert 40 <= len(left) < 40 + 32 and f"{ids[-1]}.json" in left and f"{ids[0]}.json" not in left
    # A conversation is its chain of turns: gone once a turn before it has been pruned.
    assert two.chain(ids[-1]) is None
    assert ResponseStore(40, str(tmp_path / "b")).chain("resp_0123456789abcdef") is None
    assert two.delete(ids[-1]) and one.get(ids[-1]) is None and not one.delete(ids[-1])
    assert one.get("../etc/passwd") is None and not one.delete("../x")


def test_a_conversation_in_use_keeps_its_turns_in_a_store(tmp_path):
    for store in (ResponseStore(6), ResponseStore(6, str(tmp_path))):
        chain = [f"resp_{i:016x}" for i in range(3)]
        for i, rid in enumerate(chain):
            store.put(rid, {"response": {}, "turn": [f"t{i}"], "previous": chain[i - 1] if i else None})
        assert store.chain(chain[-1]) == ["t0", "t1", "t2"]
        # Other responses come and go; each continued turn reads (and so keeps) the chain.
        for k in range(40):
            time.sleep(0.002)
            store.put(f"resp_{1000 + k:016x}", {"response": {}, "turn": [], "previous": None})
            if k % 3 == 0:
                assert store.chain(chain[-1]) == ["t0", "t1", "t2"], k
        if store.directory is not None:
            store._prune()
        assert store.chain(chain[-1]) == ["t0", "t1", "t2"]


def test_junk_anywhere_in_the_body_is_a_400_never_a_500(sdk, fake):
    """Random values put at random places of a full request: each answer is a 200 or a 400 (a
    404 for an unknown model), never a server error."""
    rng = random.Random(7)
    fake.script = lambda req: text_chunks(["ok"])
    base = {"model": MODEL, "instructions": "i", "max_output_tokens": 8, "temperature": 0.5, "top_p": 0.9,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                      {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c", "output": "x"},
                      {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}], "summary": []}],
            "tools": [{**TOOLS[0]}, {"type": "namespace", "name": "ns", "description": "d",
                                     "tools": [{"type": "function", "name": "g", "parameters": {}}]}],
            "tool_choice": {"type": "function", "name": "get_weather"}, "text": {"format": {"type": "text"}},
            "reasoning": {"effort": "low"}, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
            "metadata": {"a": "b"}, "store": True, "stream": False, "previous_response_id": None,
            "stream_options": {"include_obfuscation": False}, "background": False, "truncation": "disabled",
            "conversation": None}
    junk = [None, 0, -1, 1.5, "", "x", [], {}, [1], {"type": 3}, True, "\u0000", [None], {"a": []}]

    def places(value, path=()):
        yield path
        if isinstance(value, dict):
            for k, v in value.items():
                yield from places(v, path + (k,))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from places(v, path + (i,))

    paths = [p for p in places(base) if p]
    with httpx.Client(base_url=str(sdk.base_url), timeout=30) as http:
        for _ in range(300):
            body = json.loads(json.dumps(base))
            body["stream"] = rng.random() < 0.5
            path = rng.choice(paths)
            target = body
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = rng.choice(junk)
            r = http.post("responses", json=body)
            # An unknown model or conversation: 404, as OpenAI's.
            expected = (200, 400, 404) if path in (("model",), ("conversation",)) else (200, 400)
            assert r.status_code in expected, (path, target, r.status_code, r.text)
            if r.status_code != 200:
                assert r.json()["error"]["message"], (path, r.text)
            elif body["stream"] is True:
                assert r.text.rstrip().rsplit("\n", 1)[-1].startswith('data: {"type":"response.completed"'), r.text


def test_a_store_keeps_within_its_bytes(tmp_path):
    big = "x" * 10_000
    for store in (ResponseStore(100, max_bytes=50_000), ResponseStore(100, str(tmp_path), max_bytes=50_000)):
        ids = [f"resp_{i:016x}" for i in range(40)]
        for rid in ids:
            store.put(rid, {"response": {}, "turn": [big], "previous": None})
            time.sleep(0.001)
        kept = [rid for rid in ids if store.get(rid) is not None]
        assert 1 <= len(kept) <= 5 and kept == ids[-len(kept):], kept
        huge = ResponseStore(100, max_bytes=1000)
        huge.put(ids[0], {"turn": [big]})  # larger than the budget alone: the newest stays
        assert huge.get(ids[0]) == {"turn": [big]}



# -- background responses ------------------------------------------------------------------------


def _until(sdk, rid: str, statuses: tuple[str, ...], timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        r = sdk.responses.retrieve(rid)
        if r.status in statuses or time.monotonic() > deadline:
            return r
        time.sleep(0.01)


def _long(fake, delay: float = 0.01) -> None:
    fake.script = lambda req: [EngineChunk("t", [1], None, 3, i + 1) for i in range(10_000)]
    fake.delay = delay
    fake.closed_early.clear()


def test_a_background_response_answers_queued_and_finishes_with_the_foreground_s_output(sdk, fake):
    fake.script = lambda req: text_chunks(THINK)
    foreground = sdk.responses.create(model=MODEL, input="Weather?", tools=TOOLS)
    fake.delay = 0.3  # the first token comes after the POST has answered
    r = sdk.responses.create(model=MODEL, input="Weather?", tools=TOOLS, background=True)
    assert (r.status, r.background, r.output) == ("queued", True, [])
    assert sdk.responses.retrieve(r.id).status == "queued"
    assert _until(sdk, r.id, ("in_progress", "completed")).status == "in_progress"
    done = _until(sdk, r.id, ("completed",))
    assert done.status == "completed" and done.background is True
    assert _plain(done.output) == _plain(foreground.output) and done.usage.output_tokens == foreground.usage.output_tokens
    # A background turn streams from the engine, so that it is in progress from its first token.
    assert fake.requests[-1].stream is True
    # It continues a conversation once it has finished.
    fake.delay = 0.0
    sdk.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=r.id)
    assert [m["role"] for m in fake.requests[-1].messages][-3:] == ["user", "assistant", "user"]


def test_a_background_stream_is_replayed_from_any_sequence_number_and_followed_to_its_end(sdk, fake):
    fake.script = lambda req: text_chunks(["It", " is", " sunny", "."])
    fake.delay = 0.05
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", str(sdk.base_url) + "responses",
                         json={"model": MODEL, "input": "x", "background": True, "stream": True}) as r:
            first = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first.append(json.loads(line[6:]))
                if len(first) == 5:
                    break  # the client leaves: the turn goes on
    rid = first[0]["response"]["id"]
    assert [e["type"] for e in first[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert first[0]["response"]["status"] == "queued" and first[2]["response"]["status"] == "in_progress"
    rest = list(sdk.responses.retrieve(rid, stream=True, starting_after=4))
    assert rest[0].sequence_number == 5 and rest[-1].type == "response.completed"
    whole = list(sdk.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    assert [e["type"] for e in first] + [e.type for e in rest] == [e.type for e in whole]
    assert whole[-1].response.output_text == "It is sunny." == _until(sdk, rid, ("completed",)).output_text
    # The SDK's own stream manager resumes from a number too.
    with sdk.responses.stream(response_id=rid, starting_after=2) as stream:
        assert stream.get_final_response().output_text == "It is sunny."
    assert fake.finished[-1] == "completed"


def test_a_cancelled_background_response_aborts_its_engine_request(sdk, fake):
    _long(fake)
    r = sdk.responses.create(model=MODEL, input="x", background=True, stream=False)
    assert _until(sdk, r.id, ("in_progress",)).status == "in_progress"
    time.sleep(0.1)
    cancelled = sdk.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.output_text.startswith("ttt")
    assert fake.closed_early.wait(5), "the engine stream was not closed"
    assert sdk.responses.retrieve(r.id).status == "cancelled"
    assert sdk.responses.cancel(r.id).status == "cancelled"  # again: as it was
    # A streamed one: its followers' streams end with the events they had.
    _long(fake)
    events = sdk.responses.create(model=MODEL, input="x", background=True, stream=True)
    rid = next(iter(events)).response.id
    sdk.responses.cancel(rid)
    rest = list(events)
    assert rest and rest[-1].type not in ("response.completed", "response.failed")
    assert list(sdk.responses.retrieve(rid, stream=True, starting_after=len(rest))) == []


def test_cancel_refuses_foreground_finished_and_unknown_responses(sdk, fake):
    fake.script = lambda req: text_chunks(["ok"])
    foreground = sdk.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        sdk.responses.cancel(foreground.id)
    done = sdk.responses.create(model=MODEL, input="x", background=True)
    _until(sdk, done.id, ("completed",))
    with pytest.raises(openai.BadRequestError, match="already completed"):
        sdk.responses.cancel(done.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.cancel("resp_0123456789abcdef")
    with pytest.raises(openai.BadRequestError, match="no stream to replay"):
        sdk.responses.retrieve(done.id, stream=True)


def test_background_refusals_and_query_errors(sdk, fake):
    assert _refusal(sdk, input="x", background=True, store=False)["param"] == "store"
    _long(fake)
    running = sdk.responses.create(model=MODEL, input="x", background=True, stream=True)
    rid = next(iter(running)).response.id
    body = _refusal(sdk, input="y", previous_response_id=rid)
    assert body["param"] == "previous_response_id" and "has not finished" in body["message"]
    with httpx.Client(base_url=str(sdk.base_url), timeout=10) as http:
        for query, param in (({"stream": "yes"}, "stream"), ({"stream": "true", "starting_after": "x"}, "starting_after"),
                             ({"starting_after": "3"}, "starting_after"), ({"bogus": "1"}, "bogus"),
                             ({"include_obfuscation": "true"}, "include_obfuscation")):
            r = http.get(f"responses/{rid}", params=query)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), (query, r.text)
        # DELETE stops a turn still running, then forgets it.
        assert http.delete(f"responses/{rid}").json()["deleted"] is True
    assert fake.closed_early.wait(5)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(rid)
    running.close()


def test_a_background_response_that_cannot_start_fails_with_the_reason(sdk, fake):
    fake.script = lambda req: APIError(400, "the prompt is longer than the model's context", param="input")
    r = sdk.responses.create(model=MODEL, input="x", background=True)
    failed = _until(sdk, r.id, ("failed",))
    assert failed.status == "failed" and "longer than the model" in failed.error.message


def test_workers_sharing_a_store_see_follow_and_cancel_each_other_s_background_responses(fake, tmp_path):
    settings = Settings(model_name=MODEL, metrics_dir=str(tmp_path))
    with serve_in_thread(create_app(settings, client=fake)) as one, \
            serve_in_thread(create_app(settings, client=fake)) as two:
        a = openai.OpenAI(base_url=one + "/v1", api_key="x", max_retries=0)
        b = openai.OpenAI(base_url=two + "/v1", api_key="x", max_retries=0)
        fake.script = lambda req: text_chunks(["It", " is", " sunny", "."])
        fake.delay = 0.05
        rid = next(iter(a.responses.create(model=MODEL, input="x", background=True, stream=True))).response.id
        events = list(b.responses.retrieve(rid, stream=True))  # followed from the other worker to its end
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "It is sunny."
        assert b.responses.retrieve(rid).status == "completed"
        _long(fake)
        r = a.responses.create(model=MODEL, input="x", background=True)
        assert _until(b, r.id, ("in_progress",)).status == "in_progress"
        assert b.responses.cancel(r.id).status == "cancelled"  # asked through the store
        assert fake.closed_early.wait(5) and a.responses.retrieve(r.id).status == "cancelled"
        # A turn still running when its frontend stops ends failed, saying so.
        _long(fake)
        r = b.responses.create(model=MODEL, input="x", background=True)
        assert _until(a, r.id, ("in_progress",)).status == "in_progress"
    record = ResponseStore(10, str(tmp_path / "responses")).get(r.id)
    assert record["response"]["status"] == "failed" and "shut down" in record["response"]["error"]["message"]


def test_a_background_response_whose_worker_is_gone_reads_as_failed(tmp_path):
    import subprocess

    from openai_frontend.background import BackgroundRuns

    gone = subprocess.Popen(["true"])
    gone.wait()
    store = ResponseStore(10, str(tmp_path))
    runs = BackgroundRuns(store)
    response = {"id": "resp_00000000000000aa", "status": "in_progress", "background": True}
    for worker, status in ((f"{gone.pid}:abcd", "failed"), (runs.worker, "failed"),
                           (f"{__import__('os').getpid()}:other", "in_progress")):
        view = runs.view({"response": response, "worker": worker})
        assert view["status"] == status, worker
    assert "exited" in runs.view({"response": response, "worker": f"{gone.pid}:abcd"})["error"]["message"]


def test_a_store_forgets_a_response_s_stream_and_cancel_with_it(tmp_path):
    for store in (ResponseStore(2), ResponseStore(2, str(tmp_path))):
        ids = [f"resp_{i:016x}" for i in range(3)]
        store.put(ids[0], {"response": {}})
        assert store.events(ids[0]) is None
        store.open_events(ids[0])
        for k in range(3):
            store.add_event(ids[0], {"sequence_number": k})
        assert [e["sequence_number"] for e in store.events(ids[0], 0)] == [1, 2]
        store.ask_cancel(ids[0])
        assert store.cancel_asked(ids[0]) and not store.cancel_asked(ids[1])
        for rid in ids[1:]:
            time.sleep(0.002)
            store.put(rid, {"response": {}})
        if store.directory is not None:
            store._prune()
        assert store.get(ids[0]) is None and store.events(ids[0]) is None and not store.cancel_asked(ids[0])
        if store.directory is not None:
            assert sorted(p.suffix for p in tmp_path.iterdir() if p.name.startswith("resp_")) == [".json", ".json"]


# -- truncation "auto" ---------------------------------------------------------------------------


def test_truncated_drops_the_fewest_oldest_turns_and_keeps_the_instructions():
    import asyncio

    from openai_frontend.truncation import truncated

    msgs = [{"role": "system", "content": "s"}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": "a" * 10},
                 {"role": "tool", "content": "t"}]
    counted = []

    async def tokens(m):
        counted.append(len(m))
        return sum(len(x["content"]) for x in m)

    def run(limit):
        return asyncio.run(truncated(msgs, tokens, limit))

    assert run(10_000) == msgs[:1] + msgs[4:]  # the search never returns the whole (already refused)
    for limit in (14, 30, 60):
        got = run(limit)
        assert got[0]["role"] == "system" and got[1]["role"] == "user"
        assert sum(len(x["content"]) for x in got) <= limit
        # One turn more would not have fitted.
        longer = msgs[:1] + msgs[msgs.index(got[1]) - 3:]
        assert sum(len(x["content"]) for x in longer) > limit
    counted.clear()
    assert run(13) is None and len(counted) <= 3  # even the last turn is over: searched by halves
    assert asyncio.run(truncated(msgs[:2], tokens, 0)) is None  # nothing to drop


def test_truncation_auto_drops_the_oldest_turns_a_prompt_past_the_context_cannot_hold(fake):
    from openai_frontend.errors import context_exceeded

    context = 400

    def script(req):
        prompt = len(json.dumps(req.messages).encode())  # the fake's tokenize: the messages' JSON bytes
        if prompt + req.sampling_params.get("max_new_tokens", 1) > context:
            return context_exceeded(context, prompt)
        return text_chunks([f"{prompt}"])

    fake.script = script
    fake.max_model_len = context
    try:
        with serve_in_thread(create_app(Settings(model_name=MODEL), client=fake)) as url:
            sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            history = []
            for i in range(8):
                history += [{"role": "user", "content": f"question {i} " + "x" * 40},
                            {"role": "assistant", "content": f"answer {i} " + "y" * 40}]
            kwargs = dict(model=MODEL, instructions="Be brief.", max_output_tokens=20,
                          input=history + [{"role": "user", "content": "last"}])
            with pytest.raises(openai.BadRequestError) as info:
                sdk.responses.create(**kwargs)
            assert info.value.body["code"] == "context_length_exceeded"
            for stream in (False, True):
                r = (sdk.responses.create(truncation="auto", **kwargs) if not stream else
                     list(sdk.responses.create(truncation="auto", stream=True, **kwargs))[-1].response)
                assert r.truncation == "auto" and int(r.output_text) + 20 <= context
                sent = fake.requests[-1].messages
                assert sent[0] == {"role": "system", "content": "Be brief."} and sent[1]["role"] == "user"
                assert sent[-1]["content"] == "last" and sent[1:] == kwargs["input"][-len(sent) + 1:]
                # The fewest dropped: one turn more would not have fitted.
                more = [sent[0]] + kwargs["input"][-len(sent) - 1:]
                assert len(json.dumps(more).encode()) + 20 > context
            # Counted with truncation "auto", the prompt is what is left with one token to generate.
            whole = sdk.responses.input_tokens.count(model=MODEL, instructions="Be brief.", input=kwargs["input"])
            cut = sdk.responses.input_tokens.count(model=MODEL, instructions="Be brief.", input=kwargs["input"],
                                                   truncation="auto")
            assert whole.input_tokens > context and int(r.output_text) <= cut.input_tokens < context
            # An input that alone is past the context is still refused, saying so.
            with pytest.raises(openai.BadRequestError) as info:
                sdk.responses.create(**{**kwargs, "input": "z" * 1000}, truncation="auto")
            assert info.value.body["code"] == "context_length_exceeded"
    finally:
        fake.max_model_len = None


def test_input_tokens_counts_the_prompt_a_request_would_have(sdk, fake):
    first = sdk.responses.create(model=MODEL, input="Weather?")
    kwargs = dict(model=MODEL, input="And tomorrow?", instructions="Be brief.", previous_response_id=first.id,
                  tools=TOOLS, tool_choice="auto")
    counted = sdk.responses.input_tokens.count(**kwargs)
    assert counted.object == "response.input_tokens"
    sdk.responses.create(**kwargs)
    # The fake's tokenize is the messages' JSON bytes: the count is that of the prompt generation got.
    assert counted.input_tokens == len(json.dumps(fake.requests[-1].messages).encode())
    with httpx.Client(base_url=str(sdk.base_url), timeout=10) as http:
        for body, param in (({"input": "x", "personality": "friendly"}, "personality"),
                            ({"input": "x", "temperature": 0.5}, "temperature"),
                            ({"input": "x", "previous_response_id": "resp_0123456789abcdef"}, "previous_response_id"),
                            ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role")):
            r = http.post("responses/input_tokens", json=body)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text


def test_reasoning_comes_back_as_encrypted_content_a_stateless_next_turn_reads(sdk, fake):
    """Codex's way without stored responses: store false, include reasoning.encrypted_content,
    and the reasoning items passed back with the next turn's input."""
    import base64
    import zlib

    for stream in (False, True):
        kwargs = dict(model=MODEL, input="Weather?", store=False, include=["reasoning.encrypted_content"])
        r = (sdk.responses.create(**kwargs) if not stream else
             list(sdk.responses.create(stream=True, **kwargs))[-1].response)
        rs = r.output[0]
        assert rs.type == "reasoning" and rs.encrypted_content.startswith("trllm-rs1:")
        passed = [{"type": "reasoning", "id": rs.id, "summary": [], "encrypted_content": rs.encrypted_content}]
        sdk.responses.create(model=MODEL, store=False, input=[{"role": "user", "content": "Weather?"}, *passed,
                                                               {"role": "assistant", "content": r.output_text},
                                                               {"role": "user", "content": "Tomorrow?"}])
        assert fake.requests[-1].messages[1] == {"role": "assistant", "content": "It is sunny.",
                                                 "reasoning_content": "Let me see"}
    assert "encrypted_content" not in sdk.responses.create(model=MODEL, input="Weather?").output[0].model_dump(
        exclude_none=True)
    bomb = "trllm-rs1:" + base64.urlsafe_b64encode(zlib.compress(b"0" * (80 << 20))).decode()
    for blob in ("gAAAAB-openai", bomb, "trllm-rs1:!!", "trllm-rs1:" + base64.urlsafe_b64encode(b"x").decode()):
        body = _refusal(sdk, input=[{"type": "reasoning", "summary": [], "encrypted_content": blob}])
        assert body["param"] == "input[0].encrypted_content" and "not made by this server" in body["message"]

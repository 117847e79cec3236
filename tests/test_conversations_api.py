"""/v1/conversations (openai_frontend/conversations.py) with the official openai SDK against the
frontend on a scripted engine: the conversation and its items, responses that read a
conversation as their history and add their turn to it, and the refusals. The real server's side
is in test_openai_sdk.py."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from openai_frontend.engine_types import EngineChunk
from openai_frontend.errors import APIError
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import FakeLLMClient, serve_in_thread, text_chunks

MODEL = "m"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def fake():
    return FakeLLMClient()


@pytest.fixture(scope="module")
def sdk(fake):
    settings = Settings(model_name=MODEL, tool_call_parser="qwen25")
    with serve_in_thread(create_app(settings, client=fake)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(autouse=True)
def _default_script(fake):
    fake.script = lambda req: text_chunks(["Sunny", "."])
    yield


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_a_conversation_and_its_items_are_created_read_paged_changed_and_deleted(sdk):
    conv = sdk.conversations.create(items=[_user(f"m{i}") for i in range(5)], metadata={"topic": "weather"})
    assert conv.object == "conversation" and conv.id.startswith("conv_") and conv.metadata == {"topic": "weather"}
    assert sdk.conversations.retrieve(conv.id) == conv
    page = sdk.conversations.items.list(conv.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["m0", "m1"] and page.has_more
    rest = sdk.conversations.items.list(conv.id, order="asc", after=page.last_id, limit=10)
    assert [i.content[0].text for i in rest.data] == ["m2", "m3", "m4"] and not rest.has_more
    newest = sdk.conversations.items.list(conv.id)  # desc by default, as OpenAI's
    assert [i.content[0].text for i in newest.data] == ["m4", "m3", "m2", "m1", "m0"]
    assert all(i.id.startswith("msg_") and i.status == "completed" and i.role == "user" for i in newest.data)
    added = sdk.conversations.items.create(conv.id, items=[_user("m5"), {"type": "message", "role": "assistant",
                                                                         "content": "ok"}])
    assert [i.content[0].type for i in added.data] == ["input_text", "output_text"]
    one = sdk.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert one.content[0].text == "m5"
    assert sdk.conversations.items.delete(added.data[0].id, conversation_id=conv.id).id == conv.id
    assert len(sdk.conversations.items.list(conv.id, limit=100).data) == 6
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert sdk.conversations.update(conv.id, metadata={"topic": "rain"}).metadata == {"topic": "rain"}
    assert sdk.conversations.retrieve(conv.id).metadata == {"topic": "rain"}
    assert sdk.conversations.delete(conv.id).deleted is True
    for call in (lambda: sdk.conversations.retrieve(conv.id), lambda: sdk.conversations.items.list(conv.id),
                 lambda: sdk.conversations.delete(conv.id), lambda: sdk.conversations.retrieve("../etc/passwd")):
        with pytest.raises(openai.NotFoundError):
            call()


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_in_a_conversation_reads_it_and_adds_its_turn(sdk, fake, stream):
    conv = sdk.conversations.create(items=[_user("I am in Paris.")])

    def ask(text: str, **kwargs):
        if not stream:
            return sdk.responses.create(model=MODEL, input=text, conversation=conv.id, **kwargs)
        return list(sdk.responses.create(model=MODEL, input=text, conversation=conv.id, stream=True, **kwargs))[-1].response

    first = ask("Weather?", instructions="Be brief.")
    assert first.conversation.id == conv.id and first.output_text == "Sunny."
    assert fake.requests[-1].messages == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "I am in Paris."},
                                          {"role": "user", "content": "Weather?"}]
    # The turn's input and output items are the conversation's next items, with the response's ids.
    items = sdk.conversations.items.list(conv.id, order="asc").data
    assert [i.id for i in items[1:]] == [i.id for i in sdk.responses.input_items.list(first.id).data] + [
        o.id for o in first.output]
    fake.script = lambda req: text_chunks(['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                           '</tool_call>'])
    call = ask("And tomorrow?", tools=TOOLS).output[0]
    assert call.type == "function_call"
    fake.script = lambda req: text_chunks(["Rain", "."])
    ask([{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}], tools=TOOLS)
    assert [m["role"] for m in fake.requests[-1].messages] == ["user", "user", "assistant", "user", "assistant", "tool"]
    assert fake.requests[-1].messages[4]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert [i.type for i in sdk.conversations.items.list(conv.id, order="asc").data] == [
        "message", "message", "message", "message", "function_call", "function_call_output", "message"]
    # One that fails adds nothing.
    fake.script = lambda req: [EngineChunk("a", [1], None, 3, 1), APIError(500, "the engine stopped")]
    if stream:
        assert ask("x").status == "failed"
    else:
        with pytest.raises(openai.InternalServerError):
            ask("x")
    assert len(sdk.conversations.items.list(conv.id).data) == 7


def test_items_passed_back_as_a_session_does_keep_their_ids_and_render(sdk, fake):
    """The Agents SDK's OpenAIConversationsSession adds a run's items itself (with their ids and
    statuses) and lists them back newest first."""
    fake.script = lambda req: text_chunks(["Sunny", "."])
    r = sdk.responses.create(model=MODEL, input="Weather?")
    conv = sdk.conversations.create()
    given = [_user("Weather?")] + [o.model_dump(exclude_none=True) for o in r.output]
    added = sdk.conversations.items.create(conv.id, items=given)
    assert added.data[1].id == r.output[0].id
    # An id the conversation already has is not taken twice.
    again = sdk.conversations.items.create(conv.id, items=given[1:])
    assert again.data[0].id != r.output[0].id
    listed = sdk.conversations.items.list(conv.id, limit=10, order="desc").data
    assert [i.id for i in listed[::-1]] == [i.id for i in added.data + again.data]
    sdk.responses.create(model=MODEL, input="Tomorrow?", conversation=conv.id)
    assert [m["content"] for m in fake.requests[-1].messages] == ["Weather?", "Sunny.", "Sunny.", "Tomorrow?"]


@pytest.mark.parametrize("body, param", [
    ({"items": [_user("x")] * 21}, "items"),
    ({"items": [{"type": "message", "role": "tool", "content": "x"}]}, "items[0].role"),
    ({"items": [{"type": "item_reference", "id": "msg_1"}]}, "items[0].type"),
    ({"items": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "items[0].content[0]"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"bogus": 1}, "bogus"),
])
def test_conversation_refusals_name_their_place(sdk, body, param):
    with httpx.Client(base_url=str(sdk.base_url), timeout=10) as http:
        r = http.post("conversations", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
        conv = http.post("conversations", json={}).json()["id"]
        if "items" in body:
            r = http.post(f"conversations/{conv}/items", json=body)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
        for path, query, want in ((f"conversations/{conv}/items", {"limit": "0"}, "limit"),
                                  (f"conversations/{conv}/items", {"order": "up"}, "order"),
                                  (f"conversations/{conv}/items", {"after": "msg_x"}, "after"),
                                  (f"conversations/{conv}/items", {"include[]": "x"}, "include[]"),
                                  (f"conversations/{conv}/items", {"bogus": "1"}, "bogus")):
            r = http.get(path, params=query)
            assert (r.status_code, r.json()["error"]["param"]) == (400, want), (query, r.text)
        assert http.post(f"conversations/{conv}/items", json={"items": []}).status_code == 400
        assert http.post(f"conversations/{conv}", json={}).json()["error"]["param"] == "metadata"


def test_responses_refuse_a_conversation_with_previous_response_id_or_unknown(sdk):
    conv = sdk.conversations.create()
    r = sdk.responses.create(model=MODEL, input="x")
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=MODEL, input="y", conversation=conv.id, previous_response_id=r.id)
    assert info.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError) as info:
        sdk.responses.create(model=MODEL, input="y", conversation="conv_0123456789abcdef")
    assert info.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.responses.create(model=MODEL, input="y", extra_body={"conversation": {"name": "c"}})
    assert info.value.body["param"] == "conversation"
    with pytest.raises(openai.NotFoundError):  # a response's id is no conversation's
        sdk.conversations.retrieve(r.id)


def test_workers_sharing_a_store_add_to_one_conversation_without_losing_items(fake, tmp_path):
    settings = Settings(model_name=MODEL, metrics_dir=str(tmp_path))
    with serve_in_thread(create_app(settings, client=fake)) as one, \
            serve_in_thread(create_app(settings, client=fake)) as two:
        sdks = [openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0) for u in (one, two)]
        conv = sdks[0].conversations.create()
        errors = []

        def add(k: int) -> None:
            try:
                for i in range(10):
                    sdks[k % 2].conversations.items.create(conv.id, items=[_user(f"{k}-{i}")])
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=add, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        texts = sorted(i.content[0].text for i in sdks[1].conversations.items.list(conv.id, limit=100).data)
        assert texts == sorted(f"{k}-{i}" for k in range(4) for i in range(10))
        sdks[1].responses.create(model=MODEL, input="last", conversation=conv.id)
        assert len(sdks[0].conversations.items.list(conv.id, limit=100).data) == 42


@pytest.mark.parametrize("workers", [False, True])
def test_conversations_have_a_store_of_their_own_that_responses_never_evict(fake, tmp_path, workers):
    """OpenAI keeps a conversation however many responses follow; here a store of 2 responses
    lets more go by (past a directory's pruning interval) and the conversation stays, while conversations evict each other past their own
    size (the least recently used first), and a size of 0 keeps none."""
    settings = Settings(model_name=MODEL, responses_store_size=2, conversations_store_size=2,
                        metrics_dir=str(tmp_path) if workers else None)
    with serve_in_thread(create_app(settings, client=fake)) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        first = sdk.conversations.create(items=[_user("keep me")])
        ids = [sdk.responses.create(model=MODEL, input=f"q{i}").id for i in range(40 if workers else 6)]
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(ids[0])  # the responses' store did evict
        sdk.responses.create(model=MODEL, input="and now", conversation=first.id)
        assert [i.content[0].text for i in sdk.conversations.items.list(first.id, order="asc").data] == \
            ["keep me", "and now", "Sunny."]
        with pytest.raises(openai.NotFoundError):
            sdk.conversations.retrieve(ids[-1])  # a response's id is no conversation
        second = sdk.conversations.create()
        sdk.conversations.retrieve(first.id)  # used last: the second is now the older
        sdk.conversations.create()
        if workers:  # a directory is pruned every few writes; make this one count
            for _ in range(32):
                sdk.conversations.update(first.id, metadata={"n": "x"})
        with pytest.raises(openai.NotFoundError):
            sdk.conversations.retrieve(second.id)
        assert sdk.conversations.retrieve(first.id).id == first.id
    with serve_in_thread(create_app(Settings(model_name=MODEL, conversations_store_size=0), client=fake)) as url:
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--conversations-store-size 0"):
            sdk.conversations.create()
        assert sdk.responses.retrieve(sdk.responses.create(model=MODEL, input="a").id).status == "completed"

"""Chat template rendering (Qwen2.5 format), prompt encoding, preprocessing adapter, paths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backend.tokenizer import encode_prompt, load_tokenizer, render_chat
from backend.triton_utils import (
    chat_template_from_config, instance_count, model_path_from_config, preprocess_arrays, repo_root,
    check_serving_config, trust_request_chat_template,
)
from conftest import FakeRequest, load_triton_model

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER_TOOL)
    + "\n"
    + json.dumps({"type": "function", "function": {"name": "noop", "parameters": {}}})
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
TOOLS = [WEATHER_TOOL, {"type": "function", "function": {"name": "noop", "parameters": {}}}]


@pytest.fixture(scope="module")
def tok(demo_model_path):
    return load_tokenizer(demo_model_path)


def test_load_tokenizer_missing_dir_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m backend.demo_model"):
        load_tokenizer(tmp_path / "nope")


def test_plain_chat_default_system(tok):
    got = render_chat(tok, [{"role": "user", "content": "Hi there"}])
    assert got == (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_developer_role_is_the_system_message_where_the_template_lacks_it(tok):
    # Qwen2.5's template skips a role it does not know: `developer` (OpenAI's system
    # instructions) would vanish from the prompt.
    user = {"role": "user", "content": "hi"}
    as_system = render_chat(tok, [{"role": "system", "content": "dev msg"}, user])
    assert render_chat(tok, [{"role": "developer", "content": "dev msg"}, user]) == as_system
    assert "dev msg" in as_system
    # A template that names the role gets it as sent.
    own = "{% for m in messages %}[{{ m.role }}{% if m.role == 'developer' %}!{% endif %}]{% endfor %}"
    assert render_chat(tok, [{"role": "developer", "content": "x"}, user], chat_template=own) == "[developer!][user]"


def test_system_and_multi_turn_without_generation_prompt(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "你好 😀"},
    ]
    got = render_chat(tok, json.dumps(msgs), add_generation_prompt=False)
    assert got == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n"
        "<|im_start|>user\n你好 😀<|im_end|>\n"
    )


def test_tools_with_default_system(tok):
    got = render_chat(tok, [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS)
    assert got == (
        f"<|im_start|>system\n{QWEN_SYSTEM}{TOOLS_BLOCK}"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_call_round_trip(tok):
    msgs = [
        {"role": "system", "content": "You check weather."},
        {"role": "user", "content": "Paris and 東京?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                # OpenAI sends arguments as a JSON string; it is rendered as an object.
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "b", "content": '{"temp": 18}'},
        {"role": "assistant", "content": "Thinking.", "tool_calls": [{"function": {"name": "noop", "arguments": "{}"}}]},
        {"role": "tool", "content": "done"},
    ]
    got = render_chat(tok, msgs, tools=json.dumps(TOOLS))
    assert got == (
        f"<|im_start|>system\nYou check weather.{TOOLS_BLOCK}"
        "<|im_start|>user\nParis and 東京?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
        "<tool_response>\n{\"temp\": 18}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThinking.\n"
        '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_call_arguments_as_vllm_reads_them(tok):
    """Chat QA against vLLM's _postprocess_messages: arguments "" or none are {} (they rendered as
    the string ""), text that is not JSON is refused (it rendered as a string), a JSON string of a
    JSON string is decoded once (the frontend and preprocessing each decoded it), and
    `tool_calls: []` takes the template's plain assistant path."""
    def call(args):
        return [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "noop", "arguments": args}}]}]
    for args in ("", None, "{}"):
        assert '{"name": "noop", "arguments": {}}' in render_chat(tok, call(args)), args
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        render_chat(tok, call("{bad"))
    assert '"arguments": "{\\"a\\": 1}"' in render_chat(tok, call(json.dumps('{"a": 1}')))
    empty = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "hi", "tool_calls": []}]
    # Llama 3.1's template tests `'tool_calls' in message` (and raises unless there is one call).
    keyed = "{% for m in messages %}{% if 'tool_calls' in m %}[calls]{% else %}{{ m.content }}{% endif %}{% endfor %}"
    assert render_chat(tok, empty, chat_template=keyed) == "xhi"


def test_content_parts_and_continue_final_message(tok):
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]},
        {"role": "assistant", "content": "Once upon"},
    ]
    got = render_chat(tok, msgs, add_generation_prompt=False, continue_final_message=True)
    assert got.endswith("<|im_start|>user\nline one\nline two<|im_end|>\n<|im_start|>assistant\nOnce upon")
    # An assistant's refusal part (as OpenAI returns refusals) is text, as vLLM reads it.
    refusal = [{"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
               {"role": "user", "content": "ok"}]
    assert "<|im_start|>assistant\nNo.<|im_end|>" in render_chat(tok, refusal)
    with pytest.raises(ValueError, match="refusal"):
        render_chat(tok, [{"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}])
    # So is the message-level `refusal` OpenAI returns (SDK QA: the template dropped it unseen).
    level = [{"role": "assistant", "content": None, "refusal": "No."}, {"role": "user", "content": "ok"}]
    assert "<|im_start|>assistant\nNo.<|im_end|>" in render_chat(tok, level)
    with pytest.raises(ValueError, match=r"messages\[0\]\.audio"):
        render_chat(tok, [{"role": "assistant", "content": None, "audio": {"id": "audio_1"}}])


def test_chat_template_kwargs_and_custom_template(tok):
    template = "{% for m in messages %}[{{ m.role }}|{{ greeting }}]{{ m.content }}{% endfor %}"
    got = render_chat(tok, [{"role": "user", "content": "x"}], chat_template=template, chat_template_kwargs='{"greeting": "hey"}')
    assert got == "[user|hey]x"


@pytest.mark.parametrize(
    "messages, match",
    [
        ("not json", "not valid JSON"),
        ('{"role": "user"}', "non-empty JSON list"),
        ([], "non-empty JSON list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\].role"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "unsupported content part 'image_url'"),
        ([{"role": "assistant", "content": "", "tool_calls": "x"}], "tool_calls must be a list"),
    ],
)
def test_bad_messages_raise_value_error(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(tok, messages)


def test_other_bad_inputs(tok):
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError, match="tools must be"):
        render_chat(tok, user, tools='{"a": 1}')
    with pytest.raises(ValueError, match="may not set tokenize"):
        render_chat(tok, user, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="chat_template_kwargs must be a JSON object"):
        render_chat(tok, user, chat_template_kwargs="[1]")
    with pytest.raises(ValueError, match="cannot both be true"):
        render_chat(tok, user, continue_final_message=True)
    with pytest.raises(ValueError, match="chat template error: boom"):
        render_chat(tok, user, chat_template="{{ raise_exception('boom') }}")
    # Unknown roles pass through to the template (Qwen's drops them).
    got = render_chat(tok, [{"role": "critic", "content": "meh"}])
    assert got == f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>assistant\n"


def test_encode_prompt_sources(tok):
    chat = encode_prompt(tok, messages=[{"role": "user", "content": "Hi"}])
    assert chat == tok.encode(render_chat(tok, [{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    assert chat[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(encode_prompt(tok, text="Hello world")) == "Hello world"
    assert encode_prompt(tok, input_ids=np.array([5, 6, 7], dtype=np.int32)) == [5, 6, 7]
    # Empty values count as absent.
    assert encode_prompt(tok, text="", messages=None, input_ids=[9]) == [9]
    with pytest.raises(ValueError, match="exactly one of text_input, messages, input_ids, input_embeds is required$"):
        encode_prompt(tok)
    # Sent but empty is said so (QA: it read as if no prompt had been sent).
    with pytest.raises(ValueError, match=r"^the prompt is empty \(text_input given empty\)$"):
        encode_prompt(tok, text="")
    with pytest.raises(ValueError, match=r"^the prompt is empty \(input_ids given empty\)$"):
        encode_prompt(tok, input_ids=np.array([], dtype=np.int32))
    with pytest.raises(ValueError, match=r"\(got text_input, input_ids\)"):
        encode_prompt(tok, text="a", input_ids=[1])
    with pytest.raises(ValueError, match="out of range"):
        encode_prompt(tok, input_ids=[1, len(tok)])
    # The chat-only inputs with text or ids: refused, not dropped; their defaults pass.
    for kwargs, names in (({"tools": [{"type": "function"}]}, "tools"), ({"documents": [{"text": "d"}]}, "documents"),
                          ({"chat_template_kwargs": {"x": 1}, "continue_final_message": True},
                           "chat_template_kwargs, continue_final_message"),
                          ({"add_generation_prompt": False}, "add_generation_prompt"),
                          ({"chat_template": "{{ x }}"}, "chat_template")):
        for source in ({"text": "Hi"}, {"input_ids": [1, 2]}):
            with pytest.raises(ValueError, match=f"^{names} only apply to messages, not to "):
                encode_prompt(tok, **source, **kwargs)
    assert encode_prompt(tok, input_ids=[1, 2], add_generation_prompt=True, continue_final_message=False) == [1, 2]


def test_preprocess_arrays(tok):
    msgs = json.dumps([{"role": "user", "content": "Weather?"}])
    out = preprocess_arrays(
        tok,
        {
            "messages": np.array([msgs.encode()], dtype=object),
            "tools": np.array([json.dumps(TOOLS).encode()], dtype=object),
            "add_generation_prompt": np.array([False]),
        },
    )
    ids = out["prompt_ids"]
    assert ids.dtype == np.int32 and ids.ndim == 1
    text = tok.decode(ids.tolist())
    assert "# Tools" in text and not text.endswith("<|im_start|>assistant\n")
    text_only = preprocess_arrays(tok, {"text_input": np.array(["Hi".encode()], dtype=object)})
    assert tok.decode(text_only["prompt_ids"].tolist()) == "Hi"


def test_preprocess_arrays_input_embeds(tok):
    # Only checked here: the llm step reads the rows from the ensemble input and gets no ids.
    rows = np.zeros((3, 128), dtype=np.float32)
    out = preprocess_arrays(tok, {"input_embeds": rows, "text_input": np.array([b""], dtype=object)})
    assert out["prompt_ids"].dtype == np.int32 and out["prompt_ids"].shape == (0,)
    with pytest.raises(ValueError, match="either input_embeds or input_ids, not both"):
        preprocess_arrays(tok, {"input_embeds": rows, "input_ids": np.array([1, 2], dtype=np.int32)})
    for bad in (np.zeros((0, 128), np.float32), np.zeros(128, np.float32)):
        with pytest.raises(ValueError, match=r"shape \[num_tokens, hidden_size\]"):
            preprocess_arrays(tok, {"input_embeds": bad})
    # What applies to messages only is refused here too, as with text or ids (QA: dropped).
    for name, value in (("tools", np.array([b"[]"], dtype=object)), ("documents", np.array([b"[]"], dtype=object)),
                        ("chat_template_kwargs", np.array([b"{}"], dtype=object)),
                        ("add_generation_prompt", np.array([False])), ("continue_final_message", np.array([True]))):
        with pytest.raises(ValueError, match=f"{name} only apply to messages, not to input_embeds"):
            preprocess_arrays(tok, {"input_embeds": rows, name: value})
    for name, value in (("add_generation_prompt", np.array([True])), ("continue_final_message", np.array([False])),
                        ("add_special_tokens", np.array([True]))):  # defaults, and what a token prompt ignores
        preprocess_arrays(tok, {"input_embeds": rows, name: value})
    with pytest.raises(ValueError, match="does not accept chat templates in requests"):
        preprocess_arrays(tok, {"input_embeds": rows, "chat_template": np.array([b"{{ x }}"], dtype=object)})


RAG_TEMPLATE = ("{% for d in documents %}<doc title={{ d.title }}>{{ d.text }}</doc>{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")


def test_documents_reach_a_template_that_reads_them(tok):
    msgs = [{"role": "user", "content": "Where?"}]
    docs = [{"title": "Paris", "text": "It rains."}]
    assert render_chat(tok, msgs, documents=json.dumps(docs), chat_template=RAG_TEMPLATE) == (
        "<doc title=Paris>It rains.</doc><user>Where?")
    # A template that never reads them would drop them: an error, not silence.
    with pytest.raises(ValueError, match="does not use documents"):
        render_chat(tok, msgs, documents=docs)
    with pytest.raises(ValueError, match="string values"):
        render_chat(tok, msgs, documents=[{"title": 1}], chat_template=RAG_TEMPLATE)
    # A template that fails on the input it got (here: no documents to iterate) is a 400 too.
    with pytest.raises(ValueError, match="chat template error: TypeError"):
        render_chat(tok, msgs, chat_template=RAG_TEMPLATE)
    # QA: arithmetic (the sandbox's range limit, 1/0) was a 500; a template that renders more than
    # any context holds kept preprocessing busy for minutes tokenizing it.
    with pytest.raises(ValueError, match="chat template error: OverflowError"):
        render_chat(tok, msgs, chat_template="{% for i in range(10**9) %}x{% endfor %}")
    with pytest.raises(ValueError, match="chat template error: ZeroDivisionError"):
        render_chat(tok, msgs, chat_template="{{ 1/0 }}")
    with pytest.raises(ValueError, match="the rendered prompt has 100000000 characters"):
        render_chat(tok, msgs, chat_template='{{ "x" * 100000000 }}')


def test_reasoning_effort_reaches_only_a_template_that_reads_it(tok):
    msgs = [{"role": "user", "content": "Why?"}]
    effort = "{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}{{ messages[0].content }}"
    assert render_chat(tok, msgs, chat_template=effort, chat_template_kwargs={"reasoning_effort": "high"}) == (
        "Reasoning: high\nWhy?")
    with pytest.raises(ValueError, match="^reasoning_effort: the chat template does not read reasoning_effort"):
        render_chat(tok, msgs, chat_template_kwargs={"reasoning_effort": "high"})  # the demo's own template
    assert "Why?" in render_chat(tok, msgs, chat_template_kwargs={"enable_thinking": False})  # others unchecked


def test_bad_words_are_banned_at_the_start_and_after_a_space(tok):
    from backend.tokenizer import bad_word_token_ids

    bare, spaced = tok.encode("boils", add_special_tokens=False), tok.encode(" boils", add_special_tokens=False)
    assert len(bare) != len(spaced)  # the spelling vLLM's rule leaves out on a byte-level BPE
    assert bad_word_token_ids(tok, ["boils", " boils"]) == [bare, spaced]


def _with_bos(tok):
    """The demo tokenizer with a BOS, as Llama's adds one (the demo's Qwen tokenizer adds none)."""
    import copy

    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    inner = copy.deepcopy(tok.backend_tokenizer)
    bos = "<|endoftext|>"
    inner.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.convert_tokens_to_ids(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=bos, chat_template=tok.chat_template)


def test_add_special_tokens_overrides_each_default(tok):
    bos_tok = _with_bos(tok)
    bos = bos_tok.convert_tokens_to_ids("<|endoftext|>")
    plain = tok.encode("Hi there", add_special_tokens=False)
    assert encode_prompt(bos_tok, text="Hi there") == [bos, *plain]  # text: BOS by default
    assert encode_prompt(bos_tok, text="Hi there", add_special_tokens=False) == plain
    msgs = [{"role": "user", "content": "Hi"}]
    chat = encode_prompt(bos_tok, messages=msgs)
    assert chat[0] != bos  # messages: the template's own tokens only, by default
    assert encode_prompt(bos_tok, messages=msgs, add_special_tokens=True) == [bos, *chat]
    assert encode_prompt(bos_tok, input_ids=[5, 6], add_special_tokens=True) == [5, 6]  # ids as given
    arrays = {"text_input": np.array([b"Hi there"], dtype=object), "add_special_tokens": np.array([False])}
    assert preprocess_arrays(bos_tok, arrays)["prompt_ids"].tolist() == plain


def test_request_chat_templates_need_the_servers_trust(tok):
    arrays = {"messages": np.array([json.dumps([{"role": "user", "content": "x"}]).encode()], dtype=object),
              "chat_template": np.array([b"[{{ messages[0].content }}]"], dtype=object)}
    with pytest.raises(ValueError, match="LLM_TRUST_REQUEST_CHAT_TEMPLATE"):
        preprocess_arrays(tok, arrays)
    assert tok.decode(preprocess_arrays(tok, arrays, trust_request_template=True)["prompt_ids"].tolist()) == "[x]"
    assert trust_request_chat_template({"model_config": "{}"}, env={}) is False
    on = {"model_config": json.dumps({"parameters": {"trust_request_chat_template": {"string_value": "true"}}})}
    assert trust_request_chat_template(on, env={}) is True
    assert trust_request_chat_template({"model_config": "{}"}, env={"LLM_TRUST_REQUEST_CHAT_TEMPLATE": "1"}) is True


def test_model_path_from_config(tmp_path):
    args = {"model_config": json.dumps({"parameters": {"model_path": {"string_value": "models/other"}}})}
    assert model_path_from_config(args, env={}) == repo_root() / "models" / "other"
    assert model_path_from_config({"model_config": "{}"}, env={}) == repo_root() / "models" / "demo"
    assert model_path_from_config(args, env={"LLM_MODEL_PATH": str(tmp_path)}) == tmp_path
    assert repo_root() == Path(__file__).resolve().parents[1]


PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def test_chat_template_setting(tmp_path):
    def args(value: str) -> dict:
        return {"model_config": json.dumps({"parameters": {"chat_template": {"string_value": value}}})}

    assert chat_template_from_config(args(""), env={}) is None
    assert chat_template_from_config({"model_config": "{}"}, env={}) is None
    assert chat_template_from_config(args(PLAIN_TEMPLATE), env={}) == PLAIN_TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(PLAIN_TEMPLATE)
    assert chat_template_from_config(args("x"), env={"LLM_CHAT_TEMPLATE": str(path)}) == PLAIN_TEMPLATE
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        chat_template_from_config(args("no/such/file.jinja"), env={})


def test_preprocessing_uses_the_chat_template_setting(fake_pb_utils, demo_model_path, monkeypatch, tok):
    monkeypatch.setenv("LLM_MODEL_PATH", str(demo_model_path))
    model = load_triton_model("preprocessing").TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {"chat_template": {"string_value": PLAIN_TEMPLATE}}})})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (response,) = model.execute([FakeRequest(messages=np.array([json.dumps(messages).encode()], dtype=object))])
    want = tok.encode("<system>Be brief.\n<user>Hi\n<assistant>", add_special_tokens=False)
    assert response.outputs()["prompt_ids"].tolist() == want


def test_preprocessing_model_py(fake_pb_utils, demo_model_path, monkeypatch):
    monkeypatch.setenv("LLM_MODEL_PATH", str(demo_model_path))
    mod = load_triton_model("preprocessing")
    model = mod.TritonPythonModel()
    config = (repo_root() / "model_repository" / "preprocessing" / "config.pbtxt").read_text()
    assert 'string_value: "models/demo"' in config and "KIND_CPU" in config
    model.initialize({"model_config": json.dumps({"parameters": {"model_path": {"string_value": "models/demo"}}})})
    good = FakeRequest(text_input=np.array([b"Hello"], dtype=object))
    bad = FakeRequest(messages=np.array([b"[1, 2]"], dtype=object))
    empty = FakeRequest()
    responses = model.execute([good, bad, empty])
    assert len(responses) == 3
    assert responses[0].error is None and responses[0].outputs()["prompt_ids"].dtype == np.int32
    assert responses[1].error is not None and "messages[0]" in responses[1].error.message()
    assert responses[1].error.code() == "INVALID_ARG"
    assert "exactly one of" in responses[2].error.message()


def test_an_assistants_reasoning_reaches_the_template_under_either_name():
    # QA: vLLM (0.11+) returns thinking as `reasoning`, SGLang as `reasoning_content`; a client
    # sends back what it got, and a template reads one of them (Qwen3's: reasoning_content).
    from backend.tokenizer import normalize_messages

    for key in ("reasoning", "reasoning_content"):
        [_, m] = normalize_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "t"}])
        assert m["reasoning"] == m["reasoning_content"] == "t", key
    [m] = normalize_messages([{"role": "assistant", "content": "a", "reasoning": "new", "reasoning_content": "old"}])
    assert (m["reasoning"], m["reasoning_content"]) == ("new", "old")  # both given: as sent
    [m] = normalize_messages([{"role": "user", "content": "q", "reasoning": "x"}])
    assert "reasoning_content" not in m


def _instances(*groups, decoupled: bool = True) -> dict:
    return {"model_config": json.dumps({"instance_group": list(groups),
                                        "model_transaction_policy": {"decoupled": decoupled}})}


def test_instance_count_reads_the_normalized_instance_groups():
    assert instance_count({"model_config": "{}"}) == 1  # Triton always adds one group; a bare config means one
    assert instance_count(_instances({"kind": "KIND_CPU", "count": 1, "gpus": []})) == 1
    assert instance_count(_instances({"kind": "KIND_CPU", "count": 2})) == 2
    # KIND_GPU: one instance per count and GPU listed (Triton lists every visible GPU when none is named)
    assert instance_count(_instances({"kind": "KIND_GPU", "count": 1, "gpus": [0, 1]})) == 2
    assert instance_count(_instances({"kind": "KIND_CPU", "count": 1}, {"kind": "KIND_CPU", "count": 1, "passive": True})) == 2


def test_check_serving_config_names_every_problem_with_its_reason():
    one = {"kind": "KIND_GPU", "count": 1, "gpus": [3]}
    check_serving_config(_instances(one), "llm", one_instance="alone", decoupled="streams")
    check_serving_config(_instances(one, decoupled=False), "postprocessing", one_instance="in order")  # not asked
    check_serving_config({"model_config": "{}"}, "m", one_instance="alone")
    with pytest.raises(ValueError, match=r"^llm config.pbtxt: its instance_group gives 4 instances; it must have "
                                         r"exactly one \(.*\): alone$"):
        check_serving_config(_instances({"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}), "llm", one_instance="alone")
    with pytest.raises(ValueError, match=r"^llm config.pbtxt: its instance_group gives 2 .*: alone; it must be "
                                         r"decoupled \(model_transaction_policy \{ decoupled: true \}\): streams$"):
        check_serving_config(_instances({"count": 2}, decoupled=False), "llm", one_instance="alone", decoupled="streams")
    with pytest.raises(ValueError, match=r"^m config.pbtxt: it must be decoupled .*: streams$"):
        check_serving_config({"model_config": "{}"}, "m", decoupled="streams")


def test_check_serving_config_refuses_parameters_the_model_does_not_read_but_not_the_python_backends():
    def args(**params):
        return {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})}

    known = frozenset({"model_path", "chat_template"})
    # Triton's Python backend reads these two itself, in any Python model.
    check_serving_config(args(model_path="m", EXECUTION_ENV_PATH="$$TRITON_MODEL_DIRECTORY/env.tar.gz",
                              FORCE_CPU_ONLY_INPUT_TENSORS="no"), "preprocessing", parameters=known)
    check_serving_config(args(anything="x"), "preprocessing")  # not asked
    with pytest.raises(ValueError, match=r"^preprocessing config.pbtxt: unknown parameter\(s\) foo, tokenizer_dir "
                                         r"\(here: model_path\) \(it reads chat_template, model_path\)$"):
        check_serving_config(args(tokenizer_dir="/t", foo="1", model_path="m"), "preprocessing", parameters=known)


def test_postprocessing_model_py_refuses_a_second_instance(fake_pb_utils, demo_model_path, monkeypatch):
    monkeypatch.setenv("LLM_MODEL_PATH", str(demo_model_path))
    model = load_triton_model("postprocessing").TritonPythonModel()
    with pytest.raises(ValueError, match="postprocessing config.pbtxt: its instance_group gives 2 instances.*sent them out of order"):
        model.initialize(_instances({"kind": "KIND_CPU", "count": 2}))

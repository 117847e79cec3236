"""Structured output end to end: the real tritonserver, the real tritonclient, the demo model.

The demo model has random weights, so at temperature 1.0 everything it writes comes from the
grammar: whatever it samples must still be valid. Requests are sent concurrently (the engine
batches them), with every spelling a client may use: SGLang's ``json_schema`` / ``regex`` /
``ebnf`` / ``structural_tag``, vLLM's ``guided_*`` and OpenAI's ``response_format``.

This module's server runs with jump-forward decoding on (``LLM_ENABLE_JUMP_FORWARD=1``), so every
constraint here is also checked with the text it forces appended unsampled; the other server
tests (``test_triton_server``, ``test_openai_sdk``, ...) send constraints to the default, off.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from tritonclient.utils import InferenceServerException

from client.triton_stream import TritonStreamClient
from tests.test_grammar import EXPR_EBNF, REGEX, SCHEMA, parse_expr

# Pure sampling at temperature 1.0 (the model's generation_config defaults would narrow it).
T1 = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}
MAX_NEW = 512  # the schema's documents take about 150-300 tokens of the demo model


@pytest.fixture(scope="module")
def server(start_triton):
    with start_triton(num_kv_blocks=2048, max_model_len=1024, env={"LLM_ENABLE_JUMP_FORWARD": "1"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return TritonStreamClient(server.grpc_url)


def generate_all(client, requests: list[dict], model: str = "ensemble") -> list[dict]:
    """Send every request at once, each on its own stream; results in order."""
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(lambda values: client.generate(model, values, timeout=300), requests))


def ask(prompt: str, params: dict, model: str = "ensemble") -> dict:
    key = "text_input" if model == "ensemble" else "input_ids"
    return {key: prompt, "sampling_parameters": json.dumps(params)}


def json_schema_spelling(i: int) -> dict:
    """The same schema as SGLang, vLLM and OpenAI spell it."""
    return [
        {"json_schema": json.dumps(SCHEMA)},
        {"guided_json": SCHEMA},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}},
    ][i % 3]


def test_json_schema_50_requests_at_temperature_1_validate(client):
    requests = [
        ask(f"Record {i}: write it as JSON.", {**T1, "max_new_tokens": MAX_NEW, "seed": i, **json_schema_spelling(i)})
        for i in range(50)
    ]
    t0 = time.monotonic()
    outs = generate_all(client, requests)
    elapsed = time.monotonic() - t0
    texts = set()
    for i, out in enumerate(outs):
        assert out["finish_reason"] == "stop", (i, out["finish_reason"], out["text_output"][-200:])
        doc = json.loads(out["text_output"])
        jsonschema.validate(doc, SCHEMA)
        texts.add(out["text_output"])
    assert len(texts) == 50  # really sampled
    print(f"50 JSON-schema requests in {elapsed:.1f} s")


def test_forced_text_is_jumped_over_and_counted(server, client):
    from tests.test_metrics import scrape, value

    form = r"Answer: (yes|no)\. Confidence: [0-9]{2}%\."
    before = value(scrape(server), "llm_jump_forward_tokens_total")
    outs = generate_all(client, [ask(f"Q{i}:", {**T1, "max_new_tokens": 64, "seed": i, "regex": form}) for i in range(4)])
    for out in outs:
        assert out["finish_reason"] == "stop" and re.fullmatch(form, out["text_output"]), out["text_output"]
    # Metrics are published at most once a second.
    deadline = time.monotonic() + 10
    while (jumped := value(scrape(server), "llm_jump_forward_tokens_total") - before) < 4 * 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert jumped >= 4 * 4  # "Answer: " and ". Confidence: " less their last tokens, per request


def test_regex_outputs_fullmatch(client):
    requests = [
        ask(f"Code {i}:", {**T1, "max_new_tokens": 128, "seed": i, ("regex" if i % 2 else "guided_regex"): REGEX})
        for i in range(12)
    ]
    for out in generate_all(client, requests):
        assert out["finish_reason"] == "stop"
        assert re.fullmatch(REGEX, out["text_output"]), out["text_output"]


def test_ebnf_outputs_parse(client):
    requests = [
        ask(f"Sum {i}:", {**T1, "max_new_tokens": 256, "seed": i, ("ebnf" if i % 2 else "guided_grammar"): EXPR_EBNF})
        for i in range(12)
    ]
    outs = generate_all(client, requests)
    for out in outs:
        assert out["finish_reason"] == "stop"
        assert parse_expr(out["text_output"]), out["text_output"]
    assert len({o["text_output"] for o in outs}) > 3


def test_guided_choice_returns_exactly_one_choice(client):
    choices = ["positive", "negative", "neutral", "não sei"]
    requests = [ask(f"Sentiment {i}:", {**T1, "max_new_tokens": 32, "seed": i, "guided_choice": choices}) for i in range(16)]
    outs = generate_all(client, requests)
    for out in outs:
        assert out["finish_reason"] == "stop"
        assert out["text_output"] in choices
    assert len({o["text_output"] for o in outs}) >= 2


def test_structural_tag_response_format(client):
    inner = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    fmt = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": inner}, "end": "</answer>"}}
    requests = [ask(f"Trip {i}:", {**T1, "max_new_tokens": 256, "seed": i, "response_format": fmt}) for i in range(6)]
    for out in generate_all(client, requests):
        assert out["finish_reason"] == "stop"
        m = re.fullmatch(r"<answer>(.*)</answer>", out["text_output"], re.S)
        assert m, out["text_output"]
        jsonschema.validate(json.loads(m.group(1)), inner)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"json_schema": '{"type": "object", "properties": {"a": {"type": "strin"}}}'}, r"invalid json_schema: .*strin"),
        ({"guided_json": '{"type": "object", "required": "a"}'}, r"invalid json_schema: .*"),
        ({"regex": "(unclosed"}, r"invalid regex: .*parenthesis"),
        ({"guided_grammar": "root ::= missing_rule"}, r'invalid ebnf: .*"missing_rule" is not defined'),
        ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}}, r"invalid structural_tag"),
        ({"regex": "a+", "ebnf": 'root ::= "a"'}, r"only one"),
        ({"json_schema": "{}", "whitespace_pattern": "[ x]"}, r"invalid whitespace_pattern: it can produce 'x'"),
        ({"regex": "a+", "guided_whitespace_pattern": ""}, r"whitespace_pattern applies only to a json_schema"),
    ],
)
def test_invalid_constraint_is_a_clear_error_before_any_token(client, params, message):
    responses = []
    with pytest.raises(InferenceServerException, match=message):
        for chunk in client.stream_generate("llm", {"input_ids": [1, 2, 3], "stream": True,
                                                    "sampling_parameters": json.dumps({"max_new_tokens": 8, **params})},
                                            timeout=60):
            responses.append(chunk)
    assert responses == []  # nothing was generated
    # the server keeps serving
    ok = client.generate("llm", {"input_ids": [1, 2, 3], "max_tokens": 4,
                                 "sampling_parameters": json.dumps({"temperature": 0, "ignore_eos": True})})
    assert len(ok["output_ids"]) == 4


def test_whitespace_pattern_shapes_every_gap_between_json_tokens(client):
    from tests.test_grammar import _gaps

    for pattern, gap in [("", None), ("\n", "\n")]:
        requests = [ask(f"Record {i}:", {**T1, "max_new_tokens": MAX_NEW, "seed": i, "guided_json": SCHEMA,
                                         "guided_whitespace_pattern": pattern}) for i in range(4)]
        for out in generate_all(client, requests):
            assert out["finish_reason"] == "stop", out
            jsonschema.validate(json.loads(out["text_output"]), SCHEMA)
            gaps = _gaps(out["text_output"])
            assert all(g == gap for g in gaps) and (gap is None) == (not gaps), (pattern, out["text_output"])


def test_mixed_batch_unconstrained_greedy_rows_match_alone(client, demo_model_path):
    from backend.tokenizer import load_tokenizer

    tok = load_tokenizer(demo_model_path)
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
    plain = [{"input_ids": tok(f"Unconstrained prompt number {i} goes here.").input_ids,
              "sampling_parameters": json.dumps(greedy)} for i in range(4)]
    alone = [client.generate("llm", values)["output_ids"] for values in plain]  # one at a time

    constrained = [
        {"input_ids": tok(f"Constrained {i}:").input_ids,
         "sampling_parameters": json.dumps({**T1, "max_new_tokens": MAX_NEW, "seed": 100 + i, "json_schema": json.dumps(SCHEMA)})}
        for i in range(6)
    ] + [
        {"input_ids": tok(f"Greedy constrained {i}:").input_ids,
         "sampling_parameters": json.dumps({"temperature": 0, "max_new_tokens": 64, "regex": REGEX})}
        for i in range(2)
    ]
    with ThreadPoolExecutor(max_workers=len(constrained) + len(plain)) as pool:
        c_futures = [pool.submit(client.generate, "llm", values) for values in constrained]
        time.sleep(0.5)  # the constrained rows are running when the plain ones arrive
        p_futures = [pool.submit(client.generate, "llm", values) for values in plain]
        mixed = [f.result(timeout=300)["output_ids"] for f in p_futures]
        c_outs = [f.result(timeout=300) for f in c_futures]
    assert mixed == alone
    assert all(c["finish_reason"] == "stop" for c in c_outs)
    for c in c_outs[:6]:
        ids = [t for t in c["output_ids"] if t not in (4091, 4093)]
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
    for c in c_outs[6:]:
        assert re.fullmatch(REGEX, tok.decode(c["output_ids"], skip_special_tokens=True))

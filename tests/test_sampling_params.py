import json

import pytest

from backend.sampling_params import SamplingParamsError, load_model_defaults, parse_sampling_params


@pytest.mark.parametrize(
    "raw, name",
    [
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_p": 2}, "min_p"),
    ],
)
def test_out_of_range_values_name_the_parameter(raw, name):
    with pytest.raises(SamplingParamsError, match=name):
        parse_sampling_params(raw)


def test_unsupported_parameters_are_refused_not_ignored():
    with pytest.raises(SamplingParamsError, match="image"):
        parse_sampling_params({"image_data": "x.png"})
    with pytest.raises(SamplingParamsError, match="unknown sampling parameter"):
        parse_sampling_params({"temprature": 0.5})
    # "off" values of unimplemented features are harmless and accepted.
    assert parse_sampling_params({"n": 1, "return_logprob": False}).max_new_tokens == 128


def test_tensorrt_llm_names_are_refused_with_the_way_here_or_accepted_when_off():
    # QA: a TensorRT-LLM backend body ({"bad_words": "", "stop_words": "", ...}, its client's
    # beam_width 1 / exclude_input_in_output true) was "unknown sampling parameter(s)".
    off = {"bad_words": "", "beam_width": 1, "exclude_input_in_output": True, "return_log_probs": False,
           "return_context_logits": False, "return_generation_logits": False, "num_return_sequences": 1}
    assert parse_sampling_params(off).max_new_tokens == 128 and parse_sampling_params(off).bad_words is None
    # bad_words works (vLLM's meaning): a word or a list of them
    assert parse_sampling_params({"bad_words": "x"}).bad_words == ["x"]
    assert parse_sampling_params({"bad_words": ["x", "y z"]}).restricts_tokens
    for raw, says in [({"beam_width": 2}, "use_beam_search"),
                      ({"beam_width": True}, "use_beam_search"), ({"exclude_input_in_output": False}, "never includes"),
                      ({"return_log_probs": True}, "return_logprob"), ({"num_return_sequences": 2}, "use n"),
                      ({"end_id": 2}, "stop_token_ids"), ({"pad_id": 0}, "padding"), ({"min_length": 4}, "min_new_tokens")]:
        with pytest.raises(SamplingParamsError, match=f"unsupported parameter '{next(iter(raw))}'.*{says}"):
            parse_sampling_params(raw)


@pytest.mark.parametrize("raw, name", [
    ({"max_new_tokens": "8"}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 8.0}, "max_new_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"temperature": "0.5"}, "temperature"),
    ({"stop_token_ids": [True, 2]}, "stop_token_ids"), ({"logit_bias": {"5": "1"}}, "logit_bias"),
])
def test_values_are_not_coerced_across_json_types(raw, name):
    # QA: "8" was taken as 8, true as 1 and "yes" as true (pydantic's lax mode); OpenAI refuses them.
    with pytest.raises(SamplingParamsError, match=name):
        parse_sampling_params(raw)
    # What JSON cannot say otherwise stays accepted: an integer for a float, a number in an object key.
    p = parse_sampling_params({"temperature": 1, "logit_bias": {"5": 2}})
    assert p.temperature == 1.0 and p.logit_bias == {5: 2.0}


def test_defaults_apply_under_request_values():
    p = parse_sampling_params({"top_p": 0.5}, defaults={"temperature": 0.7, "top_p": 0.8})
    assert p.temperature == 0.7 and p.top_p == 0.5
    assert parse_sampling_params({"stop": "x"}).stop == ["x"]


def test_edge_values_mean_what_sglang_and_vllm_mean():
    # Below float precision a temperature is greedy (SGLang's 1e-6), not an unscaled draw.
    assert parse_sampling_params({"temperature": 1e-50}).greedy
    assert not parse_sampling_params({"temperature": 1e-5}).greedy
    # A top_k past any vocabulary is no cut (it must not overflow the sampler's int32 tensor).
    assert parse_sampling_params({"top_k": 2**40}).top_k == -1
    # An explicit null limit is the whole context; an absent one is the default.
    assert parse_sampling_params({"max_new_tokens": None}).max_new_tokens is None
    assert parse_sampling_params({}).max_new_tokens == 128
    with pytest.raises(SamplingParamsError, match="min_new_tokens must be at most max_new_tokens=4"):
        parse_sampling_params({"max_new_tokens": 4, "min_new_tokens": 5})


def test_sglang_sampling_seed_is_the_seed():
    # SGLang's newer name for the per-request seed; refused as unknown before.
    assert parse_sampling_params({"sampling_seed": 7}).seed == 7
    assert parse_sampling_params({"sampling_seed": 7, "seed": 7}).seed == 7
    with pytest.raises(SamplingParamsError, match="sampling_seed"):
        parse_sampling_params({"sampling_seed": 7, "seed": 8})
    assert parse_sampling_params({"sampling_seed": -1}).seed == -1  # any int64, as vLLM
    with pytest.raises(SamplingParamsError, match="seed"):
        parse_sampling_params({"sampling_seed": 2**63})


def test_generation_config_defaults_are_checked_at_load(tmp_path):
    """A bad sampling default in generation_config.json stops the engine at load, naming the file
    and the key, instead of failing every request with a 400 about a value no client sent."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 0}))
    assert load_model_defaults(tmp_path) == {"temperature": 0.7, "top_p": 0.8, "top_k": -1}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation_config.json: a sampling default is invalid .*top_p"):
        load_model_defaults(tmp_path)

"""backend/triton_io.py: how the llm model reads its settings (config.pbtxt parameter, env LLM_<NAME>),
and names parameters in its errors."""

import pytest

from backend.triton_io import engine_config_overrides, llm_setting


def test_env_wins_and_auto_or_empty_means_default():
    params = {"response_senders": "2", "max_responses_per_step": "auto", "stream_interval": ""}
    assert llm_setting(params, {}, "response_senders") == "2"
    assert llm_setting(params, {"LLM_RESPONSE_SENDERS": "8"}, "response_senders") == "8"
    assert llm_setting(params, {}, "max_responses_per_step") is None
    assert llm_setting(params, {}, "stream_interval") is None
    assert llm_setting(params, {}, "not_set") is None
    # an empty env var is unset (docker -e X=, compose's ${X:-}): the parameter applies; "auto"
    # asks for the default
    assert llm_setting(params, {"LLM_RESPONSE_SENDERS": ""}, "response_senders") == "2"
    assert llm_setting(params, {"LLM_RESPONSE_SENDERS": "auto"}, "response_senders") is None


def test_engine_config_overrides_cast_through_the_same_rule():
    params = {"max_num_seqs": "32", "enable_prefix_caching": "false", "block_size": "auto"}
    env = {"LLM_MAX_NUM_SEQS": "8", "LLM_SEED": "3"}
    assert engine_config_overrides(params, env) == {"max_num_seqs": 8, "enable_prefix_caching": False, "seed": 3}
    assert engine_config_overrides({"scheduling_policy": "fcfs"}, {"LLM_SCHEDULING_POLICY": "priority"}) == {
        "scheduling_policy": "priority"}
    assert engine_config_overrides({"kv_cache_dtype": "auto"}, {}) == {}
    assert engine_config_overrides({"kv_cache_dtype": "auto"}, {"LLM_KV_CACHE_DTYPE": "bfloat16"}) == {
        "kv_cache_dtype": "bfloat16"}
    assert engine_config_overrides({"calculate_kv_scales": "false"}, {"LLM_CALCULATE_KV_SCALES": "1"}) == {
        "calculate_kv_scales": True}
    assert engine_config_overrides({"speculative_config": ""}, {}) == {}
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert engine_config_overrides({"speculative_config": ""}, {"LLM_SPECULATIVE_CONFIG": spec}) == {
        "speculative_config": spec}



def test_a_control_input_comes_alone_and_a_false_switch_is_no_control():
    import numpy as np
    import pytest

    from backend.sampling_params import SamplingParamsError
    from backend.triton_io import control_input, parse_abort_client, parse_llm_inputs

    ids = np.array([1, 2], dtype=np.int32)
    off, on = np.array([False]), np.array([True])
    # A client that fills every optional input with its default: a plain generation.
    arrays = {"input_ids": ids, "reset_prefix_cache": off, "engine_info": off}
    assert control_input(arrays) is None and set(arrays) == {"input_ids"}
    assert control_input({"engine_info": on}) == "engine_info"
    assert control_input({"abort_request_id": np.array([b"r1"], dtype=object)}) == "abort_request_id"
    for arrays, message in (({"input_ids": ids, "engine_info": on}, "engine_info comes alone in its request; "
                             "it was sent with input_ids"),
                            ({"input_ids": ids, "abort_request_id": np.array([b"r"], dtype=object)}, "abort_request_id"),
                            ({"reset_prefix_cache": on, "engine_info": on}, "reset_prefix_cache comes alone")):
        with pytest.raises(SamplingParamsError, match=message):
            control_input(arrays)
    assert control_input({"abort_client": np.array([b'{"frontend": "f"}'], dtype=object)}) == "abort_client"
    assert parse_abort_client(np.array([b'{"frontend": "f", "rid": "r"}'], dtype=object)) == ("f", "r")
    assert parse_abort_client(np.array([b'{"frontend": "f", "rid": null}'], dtype=object)) == ("f", None)
    for raw, message in ((b'{"frontend": ', "must be a JSON object"), (b'["f"]', 'needs "frontend"'),
                         (b'{"rid": "r"}', 'needs "frontend"'), (b'{"frontend": "f", "rid": ""}', "non-empty string"),
                         (b'{"frontend": "f", "rids": ["r"]}', "unknown field")):
        with pytest.raises(SamplingParamsError, match=message):
            parse_abort_client(np.array([raw], dtype=object))
    # "stream" inside sampling_parameters is a JSON boolean ("false" is not false)
    raw = np.array([b'{"stream": "false", "max_new_tokens": 3}'], dtype=object)
    with pytest.raises(SamplingParamsError, match="stream must be true or false"):
        parse_llm_inputs({"input_ids": ids, "sampling_parameters": raw})
    assert parse_llm_inputs({"input_ids": ids, "sampling_parameters": np.array([b'{"stream": true}'], dtype=object)})[2]


def test_request_parameters_are_sampling_parameters():
    # QA: the generate endpoint's keys that are no inputs (and gRPC `parameters`) arrive as request
    # parameters; they were ignored, so max_new_tokens gave the default length and a typo passed.
    import json

    import numpy as np
    import pytest

    from backend.sampling_params import SamplingParamsError
    from backend.triton_io import parse_llm_inputs

    ids = np.array([1, 2], dtype=np.int32)
    params = json.dumps({"max_new_tokens": 4, "temperature": 0, "triton_enable_empty_final_response": True})
    _, raw, stream = parse_llm_inputs({"input_ids": ids}, params)
    assert raw == {"max_new_tokens": 4, "temperature": 0} and not stream
    # A tensor and another source that agree are one value (an FP32 tensor's 0.7 too); ones that
    # differ are refused, each named as sent (QA: the tensor won without a word, so a TensorRT-LLM
    # body's max_tokens and stop_words silently undid max_new_tokens and stop).
    _, raw, _ = parse_llm_inputs({"input_ids": ids, "temperature": np.array([0], dtype=np.float32)}, params)
    assert raw["temperature"] == 0
    sp = np.array([b'{"max_new_tokens": 8}'], dtype=object)
    sp07 = np.array([b'{"temperature": 0.7}'], dtype=object)
    _, raw, _ = parse_llm_inputs({"input_ids": ids, "sampling_parameters": sp07,
                                  "temperature": np.array([0.7], dtype=np.float32)})
    assert raw["temperature"] == pytest.approx(0.7)
    for arrays, parameters, message in [
        ({"temperature": np.array([0.5], dtype=np.float32)}, params,
         "the input temperature (0.5) and temperature as a request parameter (0) differ: give it once"),
        ({"max_tokens": np.array([16], dtype=np.int32)}, params,
         "the input max_tokens (16) and max_new_tokens as a request parameter (4) differ: give it once"),
        ({"max_tokens": np.array([16], dtype=np.int32), "sampling_parameters": sp}, "",
         "the input max_tokens (16) and max_new_tokens in sampling_parameters (8) differ: give it once"),
        ({"random_seed": np.array([5], dtype=np.uint64)}, json.dumps({"seed": 6}),
         "the input random_seed (5) and seed as a request parameter (6) differ: give it once"),
        ({"stream": np.array([False])}, json.dumps({"stream": True}),
         "the input stream (False) and stream as a request parameter (True) differ: give it once"),
        # Review: whole numbers near each other (rel_tol 1e-6) passed, the tensor's winning.
        ({"random_seed": np.array([4000000000], dtype=np.uint64)}, json.dumps({"seed": 4000003000}),
         "the input random_seed (4000000000) and seed as a request parameter (4000003000) differ: give it once"),
    ]:
        with pytest.raises(SamplingParamsError) as err:
            parse_llm_inputs({"input_ids": ids, **arrays}, parameters)
        assert str(err.value) == message
        from backend.triton_io import error_message

        assert error_message(err.value, arrays) == message  # not renamed after the tensor
    # QA: named after the max_tokens tensor, this said "max_tokens given both ..." of max_new_tokens
    twice = {"sampling_parameters": sp, "max_tokens": np.array([8], dtype=np.int32)}
    with pytest.raises(SamplingParamsError) as err:
        parse_llm_inputs({"input_ids": ids, **twice}, params)
    assert error_message(err.value, twice).startswith("max_new_tokens given both as a request parameter")
    # stop_words and a stop parameter both apply
    words = np.array([b"zzzz", b""], dtype=object)
    _, raw, _ = parse_llm_inputs({"input_ids": ids, "stop_words": words}, json.dumps({"stop": "clap"}))
    assert raw["stop"] == ["zzzz", "clap"]
    # Review: a stop that is no string or list was dropped beside stop_words; validation refuses it
    _, raw, _ = parse_llm_inputs({"input_ids": ids, "stop_words": words}, json.dumps({"stop": 5}))
    assert raw["stop"] == 5
    # random_seed is UINT64, as TensorRT-LLM's seed: its upper half is the int64 seeds of the same bits
    _, raw, _ = parse_llm_inputs({"input_ids": ids, "random_seed": np.array([2**64 - 1], dtype=np.uint64)})
    assert raw["seed"] == -1
    with pytest.raises(SamplingParamsError, match="max_new_tokens given both as a request parameter"):
        parse_llm_inputs({"input_ids": ids, "sampling_parameters": sp}, params)
    assert parse_llm_inputs({"input_ids": ids}, "")[1] == {}
    assert parse_llm_inputs({"input_ids": ids}, "{}")[1] == {}


def test_errors_name_the_scalar_tensor_the_client_sent():
    from backend.triton_io import named_as_sent

    arrays = {"max_tokens": [9], "random_seed": [1]}  # only the names matter
    assert named_as_sent("max_new_tokens must be at most 5: ...; got 9", arrays) == "max_tokens must be at most 5: ...; got 9"
    assert named_as_sent("seed must be an integer", arrays) == "random_seed must be an integer"
    # min_new_tokens is not max_new_tokens; without the tensor, the parameter's own name stays.
    assert named_as_sent("min_new_tokens must be at most max_new_tokens=9", arrays) == (
        "min_new_tokens must be at most max_tokens=9")
    assert named_as_sent("max_new_tokens must be at most 5", {}) == "max_new_tokens must be at most 5"


def test_an_llm_env_variable_that_names_no_setting_is_reported():
    """QA: LLM_MAX_NUM_SEQ=2 (for max_num_seqs) was ignored without a word."""
    import re
    from pathlib import Path

    from backend.triton_io import LLM_SETTINGS, llm_setting, unknown_llm_env, unknown_llm_params

    config = (Path(__file__).resolve().parents[1] / "model_repository" / "llm" / "config.pbtxt").read_text()
    params = {key: "" for key in re.findall(r'key: "(\w+)"', config)}
    assert set(params) == LLM_SETTINGS and unknown_llm_params(params) == []  # each parameter is a setting
    env = {"LLM_MAX_NUM_SEQ": "2", "LLM_MAX_NUM_SEQS": "2", "LLM_MODEL_PATH": "m", "LLM_SEED": "3", "PATH": "/bin"}
    assert unknown_llm_env(env) == ["LLM_MAX_NUM_SEQ"]
    assert unknown_llm_env({f"LLM_{name.upper()}": "1" for name in LLM_SETTINGS}) == []
    # QA: a config.pbtxt typo was ignored, and made the env typo of the same name look known; a
    # trimmed config.pbtxt made real settings look unknown.
    assert unknown_llm_params({**params, "max_num_seq": "4"}) == ["max_num_seq"]
    # The Python backend's own parameters are Triton's, in any Python model (QA: they were refused).
    assert unknown_llm_params({**params, "EXECUTION_ENV_PATH": "env.tar.gz", "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}) == []
    assert unknown_llm_env({"LLM_STREAM_INTERVAL": "5"}) == []
    # QA: an empty variable replaced the parameter with the default; it is unset instead.
    assert llm_setting({"max_num_seqs": "8"}, {"LLM_MAX_NUM_SEQS": ""}, "max_num_seqs") == "8"
    assert llm_setting({"max_num_seqs": "8"}, {"LLM_MAX_NUM_SEQS": "auto"}, "max_num_seqs") is None



def test_a_setting_that_cannot_be_read_is_named():
    # A bare int() or boolean message did not say which of several LLM_* variables was wrong (QA).
    from backend.triton_io import engine_config_overrides, read_setting

    with pytest.raises(ValueError, match=r"^max_num_seqs \(env LLM_MAX_NUM_SEQS or the config.pbtxt parameter\): "
                                         r"expected an integer, got 'abc'$"):
        engine_config_overrides({"max_num_seqs": "8"}, {"LLM_MAX_NUM_SEQS": "abc"})
    with pytest.raises(ValueError, match=r"^enable_prefix_caching .*: expected a boolean .*, got 'maybe'$"):
        engine_config_overrides({"enable_prefix_caching": "maybe"}, {})
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization .*: expected a number, got '90%'$"):
        engine_config_overrides({}, {"LLM_GPU_MEMORY_UTILIZATION": "90%"})
    # the serving settings the llm model reads itself: unreadable or out of range, refused by name
    with pytest.raises(ValueError, match=r"^stream_interval .*: must be at least 1, got '0'$"):
        read_setting({}, {"LLM_STREAM_INTERVAL": "0"}, "stream_interval", int, minimum=1)
    with pytest.raises(ValueError, match=r"^response_senders .*: expected an integer, got 'x'$"):
        read_setting({"response_senders": "x"}, {}, "response_senders", int, minimum=1)
    assert read_setting({"response_senders": "auto"}, {}, "response_senders", int, minimum=1) is None
    assert read_setting({}, {"LLM_MAX_RESPONSES_PER_STEP": "0"}, "max_responses_per_step", int, minimum=0) == 0
    with pytest.raises(ValueError, match="response_senders .*must be at most 256, got '100000000'"):
        read_setting({}, {"LLM_RESPONSE_SENDERS": "100000000"}, "response_senders", int, minimum=1, maximum=256)


def test_the_engine_config_refuses_an_unknown_device_and_a_broken_pattern():
    from pydantic import ValidationError

    from backend.config import EngineConfig

    with pytest.raises(ValidationError, match="device must be cpu, cuda or cuda:N, got 'tpu'"):
        EngineConfig(model_path="m", device="tpu")
    with pytest.raises(ValidationError, match="device must be cpu, cuda or cuda:N, got 'cuda:x'"):
        EngineConfig(model_path="m", device="cuda:x")
    assert EngineConfig(model_path="m", device="cuda:1").device == "cuda:1"
    # checked at load: matched per request, it made every request with logits_processors a 500 (QA)
    with pytest.raises(ValidationError, match=r"logits_processor_pattern '\(' is not a valid regular expression"):
        EngineConfig(model_path="m", logits_processor_pattern="(")
    assert EngineConfig(model_path="m", logits_processor_pattern=r"^os\.").logits_processor_pattern == r"^os\."


def test_max_waiting_requests_is_at_least_one():
    # QA: 0 was accepted and refused every request as overloaded, an idle server's too (a request
    # counts as waiting until a step starts it).
    import pytest
    from pydantic import ValidationError

    from backend.config import EngineConfig

    with pytest.raises(ValidationError, match="max_waiting_requests"):
        EngineConfig(model_path="m", max_waiting_requests=0)
    assert EngineConfig(model_path="m", max_waiting_requests=1).max_waiting_requests == 1


def test_more_torch_threads_than_cpus_is_warned_about():
    from backend.triton_io import oversubscribed_threads

    assert oversubscribed_threads(2, cores=2) is None and oversubscribed_threads(1, cores=16) is None
    assert oversubscribed_threads(64, cores=2) == (
        "torch_threads 64 is more than the 2 CPU(s) this process may use; the extra threads only wait")
    assert oversubscribed_threads(10**6) is not None  # the CPUs this process may use, read here


def test_a_request_is_named_by_its_triton_id_or_a_rid_parameter():
    """Triton's HTTP generate endpoint gives a request no id: a `rid` or `id` request parameter
    names it for abort_request_id (QA: a dropped HTTP ensemble stream could not be stopped)."""
    import json

    import numpy as np
    import pytest

    from backend.sampling_params import SamplingParamsError
    from backend.triton_io import parse_llm_inputs, request_name

    assert request_name("") == ("", False) and request_name("t-1", "") == ("t-1", False)
    assert request_name("", json.dumps({"rid": "job", "max_new_tokens": 2})) == ("job", True)
    assert request_name("", json.dumps({"id": "job"})) == ("job", True)
    assert request_name("job", json.dumps({"rid": "job", "id": "job"})) == ("job", True)  # the same name, said thrice
    for triton_id, params, message in (("", {"rid": 5}, "rid must be a non-empty string"),
                                       ("", {"id": ""}, "id must be a non-empty string"),
                                       ("", {"rid": "a", "id": "b"}, "named twice"),
                                       ("t-1", {"rid": "a"}, "the Triton request id 't-1' and rid 'a'")):
        with pytest.raises(SamplingParamsError, match=message):
            request_name(triton_id, json.dumps(params))
    # not a sampling parameter
    _, raw, _ = parse_llm_inputs({"input_ids": np.array([1], dtype=np.int32)}, json.dumps({"rid": "job", "top_k": 2}))
    assert raw == {"top_k": 2}


def test_every_llm_setting_is_in_the_readmes_engine_settings_table():
    import re
    from pathlib import Path

    from backend.triton_io import LLM_SETTINGS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = [line for line in readme.split("## Engine settings", 1)[1].split("\n## ", 1)[0].splitlines()
            if line.startswith("| `")]
    named = {n for line in rows for n in re.findall(r"`([a-z_0-9]+)`", line.split("|")[1])}
    assert named <= set(LLM_SETTINGS), sorted(named - set(LLM_SETTINGS))  # no row for a setting that is gone
    mentioned = {n for line in rows for n in re.findall(r"`([a-z_0-9]+)`", line)}
    assert set(LLM_SETTINGS) <= mentioned, sorted(set(LLM_SETTINGS) - mentioned)

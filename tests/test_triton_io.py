"""backend/triton_io.py: how the llm model reads its settings (config.pbtxt parameter, env LLM_<NAME>)."""

from backend.triton_io import engine_config_overrides, llm_setting


def test_env_wins_and_auto_or_empty_means_default():
    params = {"response_senders": "2", "max_responses_per_step": "auto", "stream_interval": ""}
    assert llm_setting(params, {}, "response_senders") == "2"
    assert llm_setting(params, {"LLM_RESPONSE_SENDERS": "8"}, "response_senders") == "8"
    assert llm_setting(params, {}, "max_responses_per_step") is None
    assert llm_setting(params, {}, "stream_interval") is None
    assert llm_setting(params, {}, "not_set") is None
    # an empty env var means the default, not the parameter (the same rule for every setting)
    assert llm_setting(params, {"LLM_RESPONSE_SENDERS": ""}, "response_senders") is None


def test_engine_config_overrides_cast_through_the_same_rule():
    params = {"max_num_seqs": "32", "enable_prefix_caching": "false", "block_size": "auto"}
    env = {"LLM_MAX_NUM_SEQS": "8", "LLM_SEED": "3"}
    assert engine_config_overrides(params, env) == {"max_num_seqs": 8, "enable_prefix_caching": False, "seed": 3}
    assert engine_config_overrides({"scheduling_policy": "fcfs"}, {"LLM_SCHEDULING_POLICY": "priority"}) == {
        "scheduling_policy": "priority"}
    assert engine_config_overrides({"kv_cache_dtype": "auto"}, {}) == {}
    assert engine_config_overrides({"kv_cache_dtype": "auto"}, {"LLM_KV_CACHE_DTYPE": "bfloat16"}) == {
        "kv_cache_dtype": "bfloat16"}


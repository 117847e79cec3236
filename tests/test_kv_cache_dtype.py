"""kv_cache_dtype: a KV cache narrower than the model (vLLM's / SGLang's --kv-cache-dtype).

Under the float32 demo model a bfloat16 or float16 cache holds twice the tokens, fp8 four times; every
attention path reads the same rounded rows and computes in float32, so the paths agree with each
other exactly as they do on a float32 cache, and prefix caching stays exact."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from backend.config import EngineConfig
from backend.engine import LLMEngine, ModelRunnerSizing
from backend.model_runner import ModelRunner
from tests.test_engine import TEST_DEVICE, hf_model, mixed_step, mixed_step_hf_logits  # noqa: F401  (the fixture)


def _engine(path, **kw) -> LLMEngine:
    kw = {"num_kv_blocks": 128, "block_size": 16, "max_num_batched_tokens": 256, "max_model_len": 512, **kw}
    return LLMEngine(EngineConfig(model_path=path, device=TEST_DEVICE, dtype="float32", **kw))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 4000) for _ in range(rng.randint(5, 70))] for _ in range(n)]


def _greedy(eng: LLMEngine, n: int = 8):
    return eng.parse_params({"temperature": 0, "max_new_tokens": n, "ignore_eos": True})


@pytest.mark.parametrize("name,dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                        ("fp8_e5m2", torch.float8_e5m2), ("bfloat16", torch.bfloat16)])
def test_vllm_names_map_to_torch_dtypes(demo_model_path, name, dtype):
    assert EngineConfig(model_path=demo_model_path, kv_cache_dtype=name).kv_torch_dtype() == dtype


def test_an_unknown_dtype_is_refused(demo_model_path):
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(model_path=demo_model_path, kv_cache_dtype="int4")


@pytest.mark.parametrize("kv,times", [("bfloat16", 2), ("float16", 2), ("fp8", 4), ("fp8_e5m2", 4)])
def test_the_same_memory_holds_more_blocks(demo_model_path, kv, times):
    base = dict(model_path=demo_model_path, device="cpu", dtype="float32", kv_cache_memory_mb=16)
    wide = ModelRunnerSizing(demo_model_path, EngineConfig(**base)).num_blocks
    narrow = ModelRunnerSizing(demo_model_path, EngineConfig(**base, kv_cache_dtype=kv)).num_blocks
    assert narrow == times * wide
    assert ModelRunnerSizing(demo_model_path, EngineConfig(**base, kv_cache_dtype="auto")).num_blocks == wide


def test_engine_reports_and_allocates_the_cache_dtype(demo_model_path):
    eng = _engine(demo_model_path, kv_cache_dtype="bfloat16")
    try:
        assert eng.model.k_cache.dtype == eng.model.v_cache.dtype == torch.bfloat16
        assert eng.model.dtype == torch.float32
        config = eng.info()["config"]
        assert config["kv_cache_dtype"] == "bfloat16" and config["dtype"] == "float32"
    finally:
        eng.shutdown()
    eng = _engine(demo_model_path)
    try:
        assert eng.info()["config"]["kv_cache_dtype"] == "float32"  # auto: the model's dtype
    finally:
        eng.shutdown()


@pytest.mark.parametrize("kv,bound", [(torch.bfloat16, 0.02), (torch.float16, 0.004), (torch.float8_e4m3fn, 0.25),
                                      (torch.float8_e5m2, 0.6)])
def test_one_step_with_a_narrow_cache_stays_near_hf_logits(demo_model_path, hf_model, kv, bound):  # noqa: F811
    """Prefill chunks (first and continuing) and a decode in one step, as in test_engine's float32
    check: only the cached K/V are rounded, so the logits move by about the cache dtype's
    precision (mantissa bits: fp16 11, bf16 8, e4m3 4, e5m2 3) relative to their scale, and no
    more. The random demo model spreads its logits thinly, so fp8 moves many of its choices."""
    logits = {d: mixed_step(ModelRunner(demo_model_path, 64, 16, device=TEST_DEVICE, dtype=torch.float32, kv_dtype=d))[1]
              for d in (torch.float32, kv)}
    want = mixed_step_hf_logits(hf_model)
    torch.testing.assert_close(logits[torch.float32], want, atol=2e-4, rtol=1e-4)
    narrow_err = (logits[kv] - want).abs().max().item()
    # Rounded (so the cache really is narrow), and only by about its precision. Measured on
    # this step, against logits up to 17.7: fp16 0.033, bf16 0.22, e4m3 3.0, e5m2 8.3.
    assert 0 < narrow_err < bound * want.abs().max().item()


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
def test_every_attention_path_reads_a_narrow_cache_alike(demo_model_path, kv):
    """The C++ kernel, the Triton kernel (interpreted here) and the gathered torch attention widen
    the same cached rows: the same greedy tokens, and every block back in the pool."""
    import kernels.triton_ops as ops

    if TEST_DEVICE == "cpu":
        paths = ["cpu", "gather"] + (["triton"] if ops.interpreted() else [])
    else:
        paths = ["triton", "gather"]
    prompts = _prompts(5, seed=3)
    outputs = {}
    for path in paths:
        eng = _engine(demo_model_path, kv_cache_dtype=kv, enable_prefix_caching=False)
        eng.model.decode_attention = path
        try:
            outputs[path] = [o.new_token_ids for o in eng.generate(prompts, _greedy(eng, 10))]
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        finally:
            eng.shutdown()
    first = outputs[paths[0]]
    assert all(len(ids) == 10 for ids in first)
    assert all(outputs[p] == first for p in paths[1:]), outputs


@pytest.mark.parametrize("kv", ["bfloat16", "fp8"])
def test_prefix_caching_over_a_narrow_cache_gives_identical_outputs(demo_model_path, kv):
    rng = random.Random(6)
    shared = [rng.randrange(100, 4000) for _ in range(100)]
    prompts = [shared + [rng.randrange(100, 4000) for _ in range(5 + i)] for i in range(4)]
    results = {}
    for caching in (False, True):
        eng = _engine(demo_model_path, kv_cache_dtype=kv, enable_prefix_caching=caching)
        try:
            p = _greedy(eng, 10)
            first = eng.generate(prompts[:1], [p])
            rest = eng.generate(prompts[1:], [p] * 3)
            results[caching] = [o.new_token_ids for o in first + rest]
            assert [o.cached_tokens for o in rest] == ([96] * 3 if caching else [0] * 3)
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
        finally:
            eng.shutdown()
    assert results[True] == results[False]


@pytest.mark.parametrize("kv,limit", [(torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)])
def test_fp8_writes_saturate_instead_of_overflowing(demo_model_path, kv, limit):
    runner = ModelRunner(demo_model_path, 8, 16, device=TEST_DEVICE, dtype=torch.float32, kv_dtype=kv)
    kvh, d = runner.config.num_kv_heads, runner.config.head_dim
    k = torch.full((2, kvh, d), 1e6, device=TEST_DEVICE)
    k[1] = -1e6
    v = torch.full((2, kvh, d), 0.5, device=TEST_DEVICE)
    runner._store(0, torch.tensor([3, 17], device=TEST_DEVICE), k, v)
    stored = runner.k_cache[0][:, [3, 17]].float()
    assert torch.equal(stored[:, 0], torch.full_like(stored[:, 0], limit))
    assert torch.equal(stored[:, 1], torch.full_like(stored[:, 1], -limit))
    assert torch.equal(runner.v_cache[0][:, [3, 17]].float(), torch.full((kvh, 2, d), 0.5, device=TEST_DEVICE))


def test_a_cpu_pool_larger_than_the_host_memory_is_refused_at_load(demo_model_path, monkeypatch):
    # Zeroing it would run until the OOM killer ended the process with no reason given.
    import backend.engine as engine_module

    from pathlib import Path

    weights = (Path(demo_model_path) / "model.safetensors").stat().st_size
    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda: weights + 64 * 2**20)
    base = dict(model_path=demo_model_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=rf"the KV pool needs 100 MiB and the weights at least {weights / 2**20:.0f} "
                                         rf"MiB, and this host has {(weights + 64 * 2**20) / 2**20:.0f} MiB available"):
        ModelRunnerSizing(demo_model_path, EngineConfig(**base, kv_cache_memory_mb=100))
    sizing = ModelRunnerSizing(demo_model_path, EngineConfig(**base, kv_cache_memory_mb=16))
    with pytest.raises(ValueError, match="lower kv_cache_memory_mb or num_kv_blocks"):
        ModelRunnerSizing(demo_model_path, EngineConfig(**base, num_kv_blocks=sizing.num_blocks * 5))
    monkeypatch.undo()
    assert 0 < engine_module.available_memory_bytes() < 2**50  # read from this host's /proc/meminfo

"""backend/lora.py: multi-LoRA serving. Engine outputs under an adapter equal Hugging Face's
model with the adapter merged into its weights, token for token (greedy); base and adapter
requests share batches; prefix caching never hands one adapter's KV blocks to another."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.config import EngineConfig
from backend.engine import LLMEngine, RequestError
from backend.lora import LoraError, parse_lora_modules

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Phi-3's fused projections, which its adapters target.
FUSED_MODULES = {"qkv_proj": "self_attn", "gate_up_proj": "mlp"}


def make_adapter(model_path: Path, out: Path, seed: int, rank: int = 4, alpha: float = 8.0,
                 targets: tuple[str, ...] = tuple(MODULES)) -> dict[str, torch.Tensor]:
    """A random PEFT adapter for the model; returns the merged weight deltas (HF names)."""
    cfg = json.loads((model_path / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
              "qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden), "gate_up_proj": (2 * inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    vocab = cfg["vocab_size"]
    if "embed_tokens" in targets:  # PEFT: parameters A [r, vocab], B [hidden, r], no ".weight"
        a = torch.randn(rank, vocab, generator=g) * 0.3
        b = torch.randn(hidden, rank, generator=g) * 0.3
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = a
        tensors["base_model.model.model.embed_tokens.lora_embedding_B"] = b
        deltas["model.embed_tokens.weight"] = (alpha / rank) * (b @ a).t()
    if "lm_head" in targets:
        a = torch.randn(rank, hidden, generator=g) * 0.3
        b = torch.randn(vocab, rank, generator=g) * 0.3
        tensors["base_model.model.lm_head.lora_A.weight"] = a
        tensors["base_model.model.lm_head.lora_B.weight"] = b
        deltas["lm_head.weight"] = (alpha / rank) * (b @ a)
    for layer in range(cfg["num_hidden_layers"]):
        for module in (t for t in targets if t in MODULES or t in FUSED_MODULES):
            out_f, in_f = shapes[module]
            a = torch.randn(rank, in_f, generator=g) * 0.3
            b = torch.randn(out_f, rank, generator=g) * 0.3
            part = MODULES.get(module) or FUSED_MODULES[module]
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            deltas[f"model.layers.{layer}.{part}.{module}.weight"] = (alpha / rank) * (b @ a)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets)}))
    return deltas


@pytest.fixture(scope="module")
def adapters(demo_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "sql": (root / "sql", make_adapter(demo_model_path, root / "sql", seed=1)),
        "attn": (root / "attn", make_adapter(demo_model_path, root / "attn", seed=2, rank=2, alpha=4.0,
                                             targets=("q_proj", "v_proj"))),
    }


@pytest.fixture(scope="module")
def engine(demo_model_path, adapters):
    eng = LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", dtype="float32", num_kv_blocks=256,
                                 block_size=16, lora_modules={n: str(p) for n, (p, _) in adapters.items()}))
    yield eng
    eng.shutdown()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         min_new_tokens=max_new, repetition_penalty=1.0, temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


def merged_model(demo_model_path, deltas):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()
    if deltas and {"model.embed_tokens.weight", "lm_head.weight"} & set(deltas):
        # The demo model ties lm_head to the embeddings; PEFT's embed_tokens LoRA changes the
        # input embedding only, and lm_head's its own: untie before merging.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    if deltas:
        state = model.state_dict()
        with torch.no_grad():
            for name, delta in deltas.items():
                state[name].add_(delta)
    return model


def check_mixed_batch_matches_merged(engine, demo_model_path, deltas: dict[str, dict], names: list, seed: int,
                                     max_new: int, alone: tuple[int, int]) -> None:
    """One batch of random prompts under `names` (None: the base model): each output equals HF's
    greedy output with that adapter's `deltas` merged. Then the two requests at `alone` (one
    adapter) run as a batch of their own, which takes the path without row gathering."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 4000) for _ in range(rng.randint(5, 40))] for _ in names]
    greedy = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, "repetition_penalty": 1.0}
    params = [engine.parse_params({**greedy, **({"lora_path": n} if n else {})}) for n in names]
    outs = engine.generate(prompts, params)
    for name in {*names}:
        model = merged_model(demo_model_path, deltas[name] if name else None)
        for prompt, n, out in zip(prompts, names, outs):
            if n == name:
                assert out.new_token_ids == hf_greedy(model, prompt, max_new), name
    i, j = alone
    again = engine.generate([prompts[i], prompts[j]], [params[i], params[j]])
    assert [o.new_token_ids for o in again] == [outs[i].new_token_ids, outs[j].new_token_ids]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_adapters_match_merged_weights_in_one_mixed_batch(engine, adapters, demo_model_path):
    check_mixed_batch_matches_merged(engine, demo_model_path, {n: d for n, (_, d) in adapters.items()},
                                     [None, "sql", "attn", "sql", None, "attn"], seed=0, max_new=10, alone=(1, 3))


def test_embed_tokens_and_lm_head_adapters_match_merged_weights(demo_model_path, tmp_path):
    made = {
        "edges": make_adapter(demo_model_path, tmp_path / "edges", seed=5, targets=("embed_tokens", "lm_head", "q_proj")),
        "embed": make_adapter(demo_model_path, tmp_path / "embed", seed=6, rank=2, alpha=2.0, targets=("embed_tokens",)),
        "head": make_adapter(demo_model_path, tmp_path / "head", seed=7, targets=("lm_head",)),
    }
    eng = LLMEngine(EngineConfig(model_path=demo_model_path, device="cpu", dtype="float32", num_kv_blocks=256,
                                 block_size=16, lora_modules={n: str(tmp_path / n) for n in made}))
    try:
        check_mixed_batch_matches_merged(eng, demo_model_path, made, ["edges", None, "embed", "head", "edges"],
                                         seed=1, max_new=8, alone=(0, 4))
    finally:
        eng.shutdown()


def test_phi3_adapters_on_its_fused_projections_match_merged_weights(demo_model_path, tmp_path):
    """Phi-3's PEFT adapters target qkv_proj and gate_up_proj, the projections its checkpoint
    stores fused (and which the runner fuses in the same order for every model)."""
    from tests.test_architectures import _build

    model_dir = tmp_path / "phi3"
    _build("phi3", Path(demo_model_path), model_dir)
    deltas = make_adapter(model_dir, tmp_path / "fused", seed=5, targets=("qkv_proj", "o_proj", "gate_up_proj",
                                                                           "down_proj"))
    eng = LLMEngine(EngineConfig(model_path=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128,
                                 block_size=16, lora_modules={"fused": str(tmp_path / "fused")}))
    try:
        check_mixed_batch_matches_merged(eng, model_dir, {"fused": deltas}, ["fused", None, "fused"], seed=6,
                                         max_new=6, alone=(0, 2))
    finally:
        eng.shutdown()


def test_prefix_cache_is_per_adapter(engine):
    prompt = list(range(100, 180))  # five full blocks
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    base = engine.generate([prompt], engine.parse_params(greedy))[0]
    hits_before = engine.block_manager.num_hit_tokens
    sql = engine.generate([prompt], engine.parse_params({**greedy, "lora_path": "sql"}))[0]
    assert engine.block_manager.num_hit_tokens == hits_before  # the base model's blocks are not reused
    assert sql.new_token_ids != base.new_token_ids
    again = engine.generate([prompt], engine.parse_params({**greedy, "lora_path": "sql"}))[0]
    assert engine.block_manager.num_hit_tokens > hits_before  # its own blocks are
    assert again.new_token_ids == sql.new_token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_adapter_errors_are_clear(engine, demo_model_path, tmp_path):
    with pytest.raises(RequestError, match="LoRA adapter 'nope' is not loaded; loaded adapters: attn, sql"):
        engine.add_request([1, 2, 3], engine.parse_params({"lora_path": "nope"}), lambda o: None)
    assert parse_lora_modules("a=/x, b=/y") == {"a": "/x", "b": "/y"}
    # vLLM's space-separated form, and a path with a space in it (QA: refused over "adapter")
    assert parse_lora_modules("a=/x b=/y") == {"a": "/x", "b": "/y"}
    assert parse_lora_modules("a=/tmp/my adapter,b=/y") == {"a": "/tmp/my adapter", "b": "/y"}
    with pytest.raises(LoraError, match="name=path"):
        parse_lora_modules("just-a-path")
    bad = tmp_path / "bad"
    make_adapter(demo_model_path, bad, seed=3)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))  # weights have rank 4
    with pytest.raises(LoraError, match="layer 0 .* has lora_A \\(4, .*this model needs \\(8, "):
        engine.model.load_lora("bad", bad)
    bad_embed = tmp_path / "bad_embed"
    make_adapter(demo_model_path, bad_embed, seed=3, targets=("embed_tokens",))
    cfg = json.loads((bad_embed / "adapter_config.json").read_text())
    (bad_embed / "adapter_config.json").write_text(json.dumps({**cfg, "r": 8}))
    with pytest.raises(LoraError, match="embed_tokens has A \\(4, 4096\\) .*this model needs \\(8, 4096\\)"):
        engine.model.load_lora("bad_embed", bad_embed)
    # NaN weights made NaN logits, and the C++ top-k read past its candidates (a crashed server).
    nan = tmp_path / "nan"
    make_adapter(demo_model_path, nan, seed=3)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match=f"tensor '{re.escape(first)}' holds NaN or infinite values"):
        engine.model.load_lora("nan", nan)
    # A corrupt weights file is the adapter's fault (a 400 on load_lora_adapter), not an internal error.
    corrupt = tmp_path / "corrupt"
    make_adapter(demo_model_path, corrupt, seed=3)
    (corrupt / "adapter_model.safetensors").write_text("garbage")
    with pytest.raises(LoraError, match="LoRA adapter 'corrupt': cannot read adapter_model.safetensors"):
        engine.model.load_lora("corrupt", corrupt)
    # Per-module rank / alpha: refused by name, not loaded with the adapter's own for every module.
    for key, value in (("alpha_pattern", {"q_proj": 16}), ("rank_pattern", {"q_proj": 8})):
        pattern = tmp_path / key
        make_adapter(demo_model_path, pattern, seed=3)
        cfg = json.loads((pattern / "adapter_config.json").read_text())
        (pattern / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(LoraError, match=f"{key} .* is not supported"):
            engine.model.load_lora(key, pattern)


def test_an_adapter_reloaded_with_new_weights_does_not_reuse_its_old_prefix_cache(engine, demo_model_path, tmp_path):
    # The cache salt was the adapter's name and path: rewritten files loaded again under them
    # hit the old weights' K/V (QA). Every load now salts its own chain.
    path = tmp_path / "swap"
    prompt = list(range(700, 780))  # five full blocks
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.0}
    make_adapter(demo_model_path, path, seed=11)
    engine.load_lora("swap", str(path))
    engine.generate([prompt], engine.parse_params({**greedy, "lora_path": "swap"}))
    engine.unload_lora("swap")
    deltas = make_adapter(demo_model_path, path, seed=12)
    engine.load_lora("swap", str(path))
    try:
        hits = engine.block_manager.num_hit_tokens
        out = engine.generate([prompt], engine.parse_params({**greedy, "lora_path": "swap"}))[0]
        assert engine.block_manager.num_hit_tokens == hits
        assert out.new_token_ids == hf_greedy(merged_model(demo_model_path, deltas), prompt, 6)
    finally:
        engine.unload_lora("swap")


def test_a_request_on_an_unloaded_adapter_runs_beside_its_reloaded_namesake(engine, demo_model_path, tmp_path):
    # Review: a step grouped its rows by adapter name, so a request still running on the old
    # weights and a new one on the weights loaded again under that name got one of the two.
    old_path, new_path = tmp_path / "v1", tmp_path / "v2"
    old, new = make_adapter(demo_model_path, old_path, seed=11), make_adapter(demo_model_path, new_path, seed=12)
    greedy = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, "repetition_penalty": 1.0, "lora_path": "swap"}
    first, second = list(range(500, 530)), list(range(700, 725))
    engine.load_lora("swap", str(old_path))
    got = {"first": [], "second": []}
    engine.add_request(first, engine.parse_params(greedy), got["first"].append)
    engine.step()
    engine.unload_lora("swap")
    engine.load_lora("swap", str(new_path))
    try:
        engine.add_request(second, engine.parse_params(greedy), got["second"].append)
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.unload_lora("swap")
    tokens = {k: [t for o in v for t in o.new_token_ids] for k, v in got.items()}
    assert tokens["first"] == hf_greedy(merged_model(demo_model_path, old), first, 8)
    assert tokens["second"] == hf_greedy(merged_model(demo_model_path, new), second, 8)


def test_runtime_load_and_unload(engine, adapters, demo_model_path, tmp_path):
    """SGLang's /load_lora_adapter at the engine: a new adapter serves at once; an unloaded one
    refuses new requests, while a running request finishes under it."""
    path = tmp_path / "late"
    deltas = make_adapter(demo_model_path, path, seed=9)
    prompt = list(range(500, 530))
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.0}
    engine.load_lora("late", str(path))
    with pytest.raises(RequestError, match="already loaded"):
        engine.load_lora("late", str(path))
    assert engine.lora_adapters()["late"] == str(path)
    out = engine.generate([prompt], engine.parse_params({**greedy, "lora_path": "late"}))[0]
    assert out.new_token_ids == hf_greedy(merged_model(demo_model_path, deltas), prompt, 6)
    # unloaded while it runs: the request keeps its adapter to the end
    outs = []
    engine.add_request(prompt, engine.parse_params({**greedy, "max_new_tokens": 6, "lora_path": "late"}), outs.append)
    engine.step()
    engine.unload_lora("late")
    while engine.has_unfinished():
        engine.step()
    assert outs[-1].error is None and outs[-1].finish_reason == "length"
    assert [t for o in outs for t in o.new_token_ids] == out.new_token_ids
    with pytest.raises(RequestError, match="'late' is not loaded"):
        engine.add_request(prompt, engine.parse_params({**greedy, "lora_path": "late"}), lambda o: None)
    with pytest.raises(RequestError, match="not loaded"):
        engine.unload_lora("late")
    assert sorted(engine.lora_adapters()) == ["attn", "sql"]


# ------------------------------------------------------------------ the frontend, scripted engine
def test_frontend_routes_adapter_names(tmp_path):
    import httpx
    import openai

    from openai_frontend.server import create_app
    from openai_frontend.settings import Settings
    from openai_frontend.testing import FakeLLMClient, serve_in_thread, text_chunks

    fake = FakeLLMClient()
    fake.script = lambda req: text_chunks(["a", "b"])
    with serve_in_thread(create_app(Settings(model_name="demo", lora_modules=("sql",)), client=fake)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        models = client.models.list().data
        assert [(m.id, m.model_extra.get("parent")) for m in models] == [("demo", None), ("sql", "demo")]
        assert client.models.retrieve("sql").id == "sql"
        r = client.completions.create(model="sql", prompt="x", max_tokens=2)
        assert r.model == "sql" and fake.requests[-1].sampling_params["lora_path"] == "sql"
        r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}],
                                           extra_body={"lora_path": "sql"})
        assert r.model == "demo" and fake.requests[-1].sampling_params["lora_path"] == "sql"
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}])
        assert "lora_path" not in fake.requests[-1].sampling_params
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="sql", prompt="x", extra_body={"lora_path": "other"})
        assert err.value.body["param"] == "lora_path"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")
        body = httpx.post(url + "/generate", json={"text": ["a", "b"], "lora_path": ["sql", None],
                                                   "sampling_params": {"max_new_tokens": 2}}).json()
        assert len(body) == 2
        assert [r.sampling_params.get("lora_path") for r in fake.requests[-2:]] == ["sql", None]


def test_frontend_runtime_lora_endpoints():
    import httpx

    from openai_frontend.server import create_app
    from openai_frontend.settings import Settings
    from openai_frontend.testing import FakeLLMClient, serve_in_thread, text_chunks

    fake = FakeLLMClient()
    fake.script = lambda req: text_chunks(["a"])
    with serve_in_thread(create_app(Settings(model_name="demo"), client=fake)) as url:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"})
        assert r.status_code == 400 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
    settings = Settings(model_name="demo", allow_runtime_lora_updating=True)
    with serve_in_thread(create_app(settings, client=fake)) as url, \
            serve_in_thread(create_app(settings, client=fake)) as other:
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/p"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'x' added successfully."
        body = httpx.post(url + "/load_lora_adapter", json={"lora_name": "y", "lora_path": "/q"}).json()
        assert body == {"success": True, "error_message": "", "loaded_adapters": {"x": "/p", "y": "/q"}}
        again = httpx.post(url + "/load_lora_adapter", json={"lora_name": "y", "lora_path": "/q"})
        assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
        # another worker learns of them from the engine
        assert [m["id"] for m in httpx.get(other + "/v1/models").json()["data"]] == ["demo", "x", "y"]
        r = httpx.post(other + "/v1/completions", json={"model": "y", "prompt": "p", "max_tokens": 1})
        assert r.status_code == 200 and fake.requests[-1].sampling_params["lora_path"] == "y"
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "y"}).status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "y", "prompt": "p", "max_tokens": 1})
        assert r.status_code == 404


# ------------------------------------------------------------------ the real tritonserver
def test_adapters_through_tritonserver_and_the_frontend(start_triton, demo_model_path, adapters):
    import httpx
    import openai

    from openai_frontend.server import create_app
    from openai_frontend.settings import Settings
    from openai_frontend.testing import serve_in_thread

    modules = f"sql={adapters['sql'][0]}"  # attn is loaded at runtime below
    prompt = list(range(300, 340))
    want = hf_greedy(merged_model(demo_model_path, adapters["sql"][1]), prompt, 8)
    base = hf_greedy(merged_model(demo_model_path, None), prompt, 8)
    assert want != base
    with start_triton(num_kv_blocks=256, max_model_len=1024, name="lora",
                      env={"LLM_LORA_MODULES": modules, "LLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as srv:
        settings = Settings(triton_url=srv.grpc_url, model_name="demo", lora_modules=("sql",),
                            allow_runtime_lora_updating=True)
        with serve_in_thread(create_app(settings)) as url:
            greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.0}
            outs = httpx.post(url + "/generate", timeout=120, json={
                "input_ids": [prompt, prompt], "lora_path": ["sql", None], "sampling_params": greedy}).json()
            assert [o["output_ids"] for o in outs] == [want, base]
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            r = client.completions.create(model="sql", prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
            assert r.choices[0].text == outs[0]["text"] and r.model == "sql"
            with pytest.raises(openai.BadRequestError, match="LoRA adapter 'missing' is not loaded"):
                client.completions.create(model="demo", prompt="x", extra_body={"lora_path": "missing"})
            # vLLM's runtime loading, through the llm model's lora_update control input
            r = httpx.post(url + "/v1/load_lora_adapter", timeout=120,
                           json={"lora_name": "attn", "lora_path": str(adapters["attn"][0])})
            assert r.status_code == 200, r.text
            attn = client.completions.create(model="attn", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
            gen = httpx.post(url + "/generate", timeout=120, json={
                "input_ids": prompt, "lora_path": "attn", "sampling_params": greedy}).json()
            assert gen["output_ids"] == hf_greedy(merged_model(demo_model_path, adapters["attn"][1]), prompt, 8)
            assert attn.choices[0].text == gen["text"]
            assert [m.id for m in client.models.list().data] == ["demo", "sql", "attn"]
            bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
            assert bad.status_code == 400 and "cannot read" in bad.json()["error"]["message"]
            assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 200
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="attn", prompt="x", max_tokens=2)

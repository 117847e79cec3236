"""A model of another architecture than the demo's, served by the real tritonserver: a tiny random
Qwen3-MoE (mixture-of-experts MLPs, per-head q/k norms) set as the repository's model path, called
with the real tritonclient, greedy-equal to Hugging Face through both the `llm` model (token ids)
and the ensemble (text), its KV blocks all free after."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from client.triton_stream import TritonStreamClient
from tests.test_architectures import _build
from tests.test_triton_server import wait_blocks_free

MAX_NEW = 12
GREEDY = json.dumps({"temperature": 0, "ignore_eos": True})


@pytest.fixture(scope="module")
def moe(demo_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_moe")
    return out, _build("qwen3_moe", Path(demo_model_path), out)


@pytest.fixture(scope="module")
def server(start_triton, moe):
    with start_triton(num_kv_blocks=128, max_model_len=512, name="qwen3_moe",
                      env={"LLM_MODEL_PATH": str(moe[0])}) as srv:
        yield srv


def _hf_greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_a_mixture_of_experts_model_serves_greedy_equal_to_hf(server, moe):
    from transformers import AutoTokenizer

    model_dir, hf = moe
    tok = AutoTokenizer.from_pretrained(model_dir)
    client = TritonStreamClient(server.grpc_url)
    prompt = "Experts route each token: 中文 and emoji 🙂 too."
    ids = tok(prompt).input_ids
    want = _hf_greedy(hf, ids)
    chunks = list(client.stream_generate("llm", {"input_ids": ids, "max_tokens": MAX_NEW, "stream": True,
                                                 "sampling_parameters": GREEDY}))
    assert np.concatenate([np.asarray(c["output_ids"]).reshape(-1) for c in chunks]).tolist() == want
    chunks = list(client.stream_generate("ensemble", {"text_input": prompt, "max_tokens": MAX_NEW, "stream": True,
                                                      "sampling_parameters": GREEDY}))
    assert "".join(c["text_output"] for c in chunks) == tok.decode(want, skip_special_tokens=True)
    wait_blocks_free(server)

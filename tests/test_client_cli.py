"""The command-line client (`python -m client`) and its library functions, against the real tritonserver."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from client.cli import StreamPiece, _InOrder, build_inputs, build_sampling, generate_text, stream_pieces
from client.local_server import REPO_ROOT

MAX_NEW = 12
GREEDY = {"temperature": 0.0, "json_params": {"ignore_eos": True}, "max_tokens": MAX_NEW}


def test_build_sampling_merges_json_then_named_options():
    params = build_sampling(max_tokens=5, temperature=0.5, stop=["x"], json_params='{"temperature": 1, "ignore_eos": true}')
    assert params == {"temperature": 0.5, "ignore_eos": True, "max_new_tokens": 5, "stop": ["x"]}
    with pytest.raises(ValueError, match="json-params"):
        build_sampling(json_params="{not json")
    values = build_inputs("ensemble", "hi", chat=True, system="sys", sampling=params)
    assert json.loads(values["messages"]) == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert values["stream"] is True and json.loads(values["sampling_parameters"]) == params


def test_out_of_order_responses_are_put_back_in_generation_order():
    def piece(ids, total, finish=""):
        return StreamPiece(text="".join(f"<{i}>" for i in ids), token_ids=ids, finish_reason=finish,
                           prompt_tokens=3, completion_tokens=total, meta_info={}, time_s=0.0)

    order = _InOrder()
    arrivals = [piece([1], 1), piece([3], 3), piece([], 3, "length"), piece([2], 2)]  # 2 overtaken by 3 and the end
    out = [p for a in arrivals for p in order.push(a)] + order.flush()
    assert [p.token_ids for p in out] == [[1], [2], [3], []] and out[-1].finish_reason == "length"
    assert order.reordered == 2


@pytest.fixture(scope="module")
def server(start_triton):
    with start_triton(num_kv_blocks=256, max_model_len=1024, name="triton_cli") as srv:
        yield srv


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)


def test_ensemble_and_llm_paths_agree(server, demo_model_path):
    prompt = "Streaming text: spaces, 中文 and emoji 🙂."
    ens = generate_text(prompt, model="ensemble", url=server.grpc_url, **GREEDY)
    llm = generate_text(prompt, model="llm", url=server.grpc_url, tokenizer_path=demo_model_path, **GREEDY)
    assert ens.num_responses == MAX_NEW and ens.finish_reason == "length" and ens.completion_tokens == MAX_NEW
    assert llm.token_ids == ens.token_ids and len(ens.token_ids) == MAX_NEW
    assert llm.text == ens.text  # local incremental detokenization == the postprocessing model's
    from backend.tokenizer import load_tokenizer

    tok = load_tokenizer(demo_model_path)
    assert ens.text == tok.decode(ens.token_ids, skip_special_tokens=True)
    # Leaving the stream early cancels cleanly and a new request still works.
    pieces = stream_pieces(prompt, url=server.grpc_url, max_tokens=200, temperature=0)
    next(pieces)
    pieces.close()
    assert generate_text(prompt, url=server.grpc_url, **GREEDY).token_ids == ens.token_ids


def test_cli_streams_text_and_ids(server, demo_model_path):
    prompt = "Hello, world"
    ref = generate_text(prompt, url=server.grpc_url, **GREEDY)
    common = ["--url", server.grpc_url, "--max-tokens", str(MAX_NEW), "--temperature", "0",
              "--json-params", '{"ignore_eos": true}']
    text = run_cli(prompt, *common, "--stats")
    assert text.returncode == 0, text.stderr
    assert text.stdout == ref.text + "\n"
    assert "finish_reason=length" in text.stderr and f"completion_tokens={MAX_NEW}" in text.stderr
    ids = run_cli(prompt, *common, "--model", "llm", "--ids", "--tokenizer-path", str(demo_model_path))
    assert ids.returncode == 0, ids.stderr
    assert [int(t) for t in ids.stdout.split()] == ref.token_ids
    chat = run_cli("Say hi", *common, "--chat", "--no-stream", "--stop", "zzzz")
    assert chat.returncode == 0 and chat.stdout.strip()


def test_cli_sends_input_embeds_to_either_model(server, demo_model_path, tmp_path):
    # The model's own embedding rows of a prompt generate what its ids do (the demo model's
    # default repetition penalty counts prompt tokens, which embeddings have none of: off).
    import numpy as np
    from safetensors.numpy import load_file

    ids = [40, 41, 42, 43, 44]
    rows = load_file(str(demo_model_path / "model.safetensors"))["model.embed_tokens.weight"][ids]
    np.save(tmp_path / "prompt.npy", rows)
    params = {"ignore_eos": True, "repetition_penalty": 1.0}
    ref = generate_text(input_ids=ids, url=server.grpc_url, temperature=0.0, max_tokens=MAX_NEW, json_params=params)
    common = ["--url", server.grpc_url, "--max-tokens", str(MAX_NEW), "--temperature", "0", "--json-params",
              json.dumps(params), "--input-embeds", str(tmp_path / "prompt.npy"), "--ids"]
    for model in ("ensemble", "llm"):
        out = run_cli(*common, "--model", model)
        assert out.returncode == 0, out.stderr
        assert [int(t) for t in out.stdout.split()] == ref.token_ids
    both = run_cli("some text", "--input-embeds", str(tmp_path / "prompt.npy"))
    assert both.returncode == 2 and "a prompt and --input-embeds" in both.stderr
    np.save(tmp_path / "wrong.npy", rows[:, :64])
    bad = run_cli("--url", server.grpc_url, "--input-embeds", str(tmp_path / "wrong.npy"))
    assert bad.returncode == 1 and "hidden size" in bad.stderr


def test_cli_reports_server_errors(server):
    bad = run_cli("hi", "--url", server.grpc_url, "--json-params", '{"no_such_parameter": 1}')
    assert bad.returncode == 1
    assert "no_such_parameter" in bad.stderr

"""The command-line client (`python -m client`) and its library functions, against the real tritonserver."""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np
import pytest

import client.cli as cli
from client.cli import (GenerateResult, SampleWriter, StreamPiece, _InOrder, build_inputs, build_sampling,
                        generate_text, stats_lines, stream_pieces)
from client.local_server import REPO_ROOT, free_port
from client.triton_stream import TritonStreamClient

MAX_NEW = 12
GREEDY = {"temperature": 0.0, "json_params": {"ignore_eos": True}, "max_tokens": MAX_NEW}


def test_build_sampling_merges_json_then_named_options():
    assert build_sampling(prediction="def f():")["prediction"] == "def f():"
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


def _piece(index, ids, total, finish="", t=0.0, text=None):
    return StreamPiece(text="".join(f"<{index}:{i}>" for i in ids) if text is None else text, token_ids=ids,
                       finish_reason=finish, prompt_tokens=3, completion_tokens=total,
                       meta_info={"index": index}, time_s=t, index=index)


def _write(pieces, n, ids=False):
    out = io.StringIO()
    writer = SampleWriter(out, n=n, ids=ids)
    seen = []
    for p in pieces:
        writer.feed(p)
        seen.append(out.getvalue())
    writer.close()
    return out.getvalue(), seen


def test_single_sample_streams_plain_text_and_ids():
    pieces = [_piece(0, [1], 1), _piece(0, [2, 3], 3), _piece(0, [], 3, "stop")]
    text, seen = _write(pieces, n=1)
    assert text == "<0:1><0:2><0:3>\n" and seen[0] == "<0:1>"  # as it arrives, no header
    assert _write(pieces, n=1, ids=True)[0] == "1 2 3\n"


# Sample 1 is ahead of sample 0 and finishes first; arrival order interleaves them.
INTERLEAVED = [_piece(0, [10], 1, t=0.10), _piece(1, [20], 1, t=0.11), _piece(1, [21], 2, t=0.12),
               _piece(0, [11], 2, t=0.13), _piece(1, [22], 3, "stop", t=0.14), _piece(0, [12], 3, t=0.15),
               _piece(0, [13], 4, "length", t=0.16)]


def test_interleaved_samples_are_grouped_by_index_and_labelled():
    text, seen = _write(INTERLEAVED, n=2)
    assert text == "[sample 0]\n<0:10><0:11><0:12><0:13>\n[sample 1]\n<1:20><1:21><1:22>\n"
    # Sample 0 streams live; sample 1 is held until sample 0 ends.
    assert seen[0] == "[sample 0]\n<0:10>" and seen[4] == "[sample 0]\n<0:10><0:11>"
    assert seen[-1] == text  # everything out once the last sample finished
    ids, _ = _write(INTERLEAVED, n=2, ids=True)
    assert ids == "[sample 0]\n10 11 12 13\n[sample 1]\n20 21 22\n"


def test_next_sample_goes_live_after_the_live_one_finishes():
    pieces = [_piece(0, [1], 1), _piece(2, [30], 1), _piece(1, [20], 1), _piece(2, [31], 2, "stop"),
              _piece(0, [2], 2, "stop"), _piece(1, [21], 2), _piece(1, [22], 3, "length")]
    text, seen = _write(pieces, n=3)
    # Sample 0 ends: sample 1's held text comes out under its header, then it goes on live.
    assert seen[4] == "[sample 0]\n<0:1><0:2>\n[sample 1]\n<1:20>"
    assert seen[5] == seen[4] + "<1:21>"
    assert text == ("[sample 0]\n<0:1><0:2>\n[sample 1]\n<1:20><1:21><1:22>\n"
                    "[sample 2]\n<2:30><2:31>\n")


def test_no_stream_samples_arrive_whole_in_any_order():
    pieces = [_piece(1, [20, 21], 2, "length"), _piece(0, [10, 11], 2, "stop")]
    text, seen = _write(pieces, n=2)
    assert seen[0] == ""  # sample 1 waits for sample 0
    assert text == "[sample 0]\n<0:10><0:11>\n[sample 1]\n<1:20><1:21>\n"


def test_a_cut_short_stream_still_prints_every_sample_apart():
    out = io.StringIO()
    writer = SampleWriter(out, n=3)
    for p in [_piece(0, [1], 1), _piece(2, [30], 1), _piece(0, [2], 2)]:
        writer.feed(p)
    writer.close()  # e.g. the server failed: no finish reasons
    assert out.getvalue() == "[sample 0]\n<0:1><0:2>\n[sample 2]\n<2:30>\n"
    out = io.StringIO()
    SampleWriter(out, n=2).close()  # nothing arrived (an error before the first response): no empty blocks
    assert out.getvalue() == ""
    # A sample index the request did not ask for never lands inside sample 0's text.
    text, _ = _write([_piece(0, [1], 1), _piece(1, [5], 1, "stop"), _piece(0, [2], 2, "stop")], n=1)
    assert text == "<0:1><0:2>\n[sample 1]\n<1:5>\n"


def test_out_of_order_responses_of_interleaved_samples_are_reordered_per_sample():
    order = _InOrder()
    arrivals = [_piece(0, [10], 1), _piece(1, [21], 2), _piece(0, [11], 2), _piece(1, [20], 1),
                _piece(1, [], 2, "stop"), _piece(0, [], 2, "length")]
    out = [p for a in arrivals for p in order.push(a)] + order.flush()
    assert [(p.index, p.token_ids) for p in out if p.index == 1] == [(1, [20]), (1, [21]), (1, [])]
    assert [(p.index, p.token_ids) for p in out if p.index == 0] == [(0, [10]), (0, [11]), (0, [])]


def _stats(pieces):
    samples = {}
    for p in pieces:
        samples.setdefault(p.index, GenerateResult(index=p.index)).add(p)
    return samples


def test_stats_per_sample_and_total():
    samples = _stats(INTERLEAVED)
    s0, s1 = samples[0], samples[1]
    assert (s0.completion_tokens, s0.finish_reason, s0.ttft_s, s0.total_s) == (4, "length", 0.10, 0.16)
    assert s0.itl_s == pytest.approx(0.02) and s1.itl_s == pytest.approx(0.015)
    lines = stats_lines(list(samples.values()), n=2)
    assert len(lines) == 3
    assert lines[0].startswith("[sample 0: finish_reason=length prompt_tokens=3 completion_tokens=4 ttft=0.100s "
                               "itl=20.00ms total=0.160s")
    assert lines[1].startswith("[sample 1: finish_reason=stop prompt_tokens=3 completion_tokens=3 ttft=0.110s "
                               "itl=15.00ms total=0.140s")
    assert lines[2].startswith("[total: samples=2/2 prompt_tokens=3 completion_tokens=7 "
                               "finish_reasons=length:1,stop:1 ttft=0.100s total=0.160s")
    # n == 1: the one line of old; a response carrying all tokens at once has no ITL.
    one = stats_lines(list(_stats([_piece(0, [1, 2, 3], 3, "stop", t=0.5)]).values()), n=1)
    assert len(one) == 1 and one[0].startswith("[finish_reason=stop prompt_tokens=3 completion_tokens=3 "
                                               "ttft=0.500s itl=n/a total=0.500s decode=n/a meta=")


class FakeStreamClient:
    """Stands in for TritonStreamClient: replays ensemble responses (sample index in meta_info)."""

    def __init__(self, url="fake", abort_model="llm"):
        self.url = url
        self.values = None

    def stream_generate(self, model, values, timeout=300.0):
        self.values = values
        n = json.loads(values.get("sampling_parameters", "{}")).get("n", 1)
        tokens = {index: [100 * index + t for t in (1, 2, 3)] for index in range(n)}
        if values["stream"]:  # a token per response, samples interleaved
            arrivals = [(i, [t]) for i, t in ((0, 0), (1, 0), (1, 1), (0, 1), (1, 2), (0, 2)) if i < n]
        else:  # one response per sample, the last sample first
            arrivals = [(i, tokens[i]) for i in reversed(range(n))]
        sent = {index: 0 for index in tokens}
        for index, chunk in arrivals:
            ids = tokens[index][sent[index]:sent[index] + 1] if values["stream"] else chunk
            sent[index] += len(ids)
            yield {"text_output": "".join(f"<{i}>" for i in ids), "output_ids": np.asarray(ids, dtype=np.int32),
                   "finish_reason": "length" if sent[index] == 3 else "",
                   "prompt_tokens": np.asarray([2], dtype=np.int32),
                   "completion_tokens": np.asarray([sent[index]], dtype=np.int32),
                   "meta_info": json.dumps({"index": index})}


class _FailingTriton:
    """A fake tritonclient gRPC client: the ensemble request gets `answers` responses, then the
    error `message`; an abort request (to llm) is recorded and answered."""

    aborts: list = []

    def __init__(self, url, answers=1, message="postprocessing internal error: RuntimeError: boom"):
        self.answers, self.message = answers, message

    def start_stream(self, callback):
        self.callback = callback

    def async_stream_infer(self, model_name, inputs, request_id, **_):
        from types import SimpleNamespace

        from tritonclient.utils import InferenceServerException

        response = SimpleNamespace(parameters={}, outputs=[SimpleNamespace(name="text_output")])
        result = SimpleNamespace(get_response=lambda: response, as_numpy=lambda name: np.array([b"a"], dtype=np.object_))
        if model_name == "llm":
            self.aborts.append(request_id)
            self.callback(result, None)
            return
        for _ in range(self.answers):
            self.callback(result, None)
        self.callback(None, InferenceServerException(self.message))

    def stop_stream(self, cancel_requests=False):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("answers, message, aborted", [
    # A failed postprocessing step ends the ensemble's stream while its llm step generates on
    # (Triton 2.51 does not stop an ensemble's other steps): the library aborts it, as on a break.
    (1, "postprocessing internal error: RuntimeError: boom", True),
    (0, "postprocessing internal error: RuntimeError: boom", True),
    (1, "in ensemble 'ensemble', some step failed", True),
    (0, "invalid sampling parameter top_p: must be in (0, 1]", False),  # refused: nothing runs
    (1, "Stub process 'llm_0_0' is not healthy.", False),  # nothing left to abort on
    (1, "Stub process 'postprocessing_0_0' is not healthy.", True),  # the engine runs on
])
def test_a_stream_that_fails_after_the_engine_started_is_aborted(monkeypatch, answers, message, aborted):
    import client.triton_stream as triton_stream
    from tritonclient.utils import InferenceServerException

    monkeypatch.setattr(_FailingTriton, "aborts", [])
    monkeypatch.setattr(triton_stream.grpcclient, "InferenceServerClient",
                        lambda url: _FailingTriton(url, answers, message))
    got = []
    with pytest.raises(InferenceServerException):
        for chunk in TritonStreamClient("fake:1").stream_generate("ensemble", {"text_input": "hi"}, request_id="r1"):
            got.append(chunk)
    assert len(got) == answers
    assert _FailingTriton.aborts == (["abort.r1"] if aborted else [])


def test_generate_text_keeps_samples_apart():
    fake = FakeStreamClient()
    result = generate_text("hi", client=fake, json_params={"n": 2})
    assert [(s.index, s.text, s.token_ids, s.finish_reason) for s in result.samples] == [
        (0, "<1><2><3>", [1, 2, 3], "length"), (1, "<101><102><103>", [101, 102, 103], "length")]
    assert result.text == "<1><2><3>" and result.num_responses == 6  # top level: sample 0, whole request
    single = generate_text("hi", client=fake)
    assert single.text == "<1><2><3>" and len(single.samples) == 1 and single.samples[0].text == single.text


@pytest.mark.parametrize("stream", [True, False])
def test_cli_main_prints_labelled_samples_and_per_sample_stats(monkeypatch, capsys, stream):
    monkeypatch.setattr(cli, "TritonStreamClient", FakeStreamClient)
    extra = [] if stream else ["--no-stream"]
    assert cli.main(["hi", "--json-params", '{"n": 2}', "--stats", *extra]) == 0
    out, err = capsys.readouterr()
    assert out == "[sample 0]\n<1><2><3>\n[sample 1]\n<101><102><103>\n"
    lines = err.splitlines()
    assert [line.split(" ")[0:2] for line in lines[:2]] == [["[sample", "0:"], ["[sample", "1:"]]
    assert "completion_tokens=3" in lines[0] and "finish_reason=length" in lines[1]
    assert lines[2].startswith("[total: samples=2/2 prompt_tokens=2 completion_tokens=6 finish_reasons=length:2")
    assert "nan" not in err  # --no-stream: one response per sample, no decode rate to give: "n/a"
    if not stream:
        assert all("decode=n/a" in line for line in lines[:2])
    # --n is the same request; n == 1 streams plain text and one stats line.
    assert cli.main(["hi", "--n", "2", *extra]) == 0
    assert capsys.readouterr().out == out
    assert cli.main(["hi", "--stats", *extra]) == 0
    out, err = capsys.readouterr()
    assert out == "<1><2><3>\n" and err.startswith("[finish_reason=length") and len(err.splitlines()) == 1


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
    # one response per token unless the llm model's senders fell behind (then merged, backend/outbox.py)
    assert 1 < ens.num_responses <= MAX_NEW and ens.finish_reason == "length" and ens.completion_tokens == MAX_NEW
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


def test_streamed_logprobs_are_joined_as_the_unstreamed_ones(server):
    # QA: a sample's meta_info was the last response's, so a streamed generation kept one token's
    # logprobs (--stats printed 1 of 8); each streamed response has only its own tokens' entries.
    params = {**GREEDY, "json_params": {"ignore_eos": True, "return_logprob": True, "top_logprobs_num": 2}}
    whole = generate_text("Hello", url=server.grpc_url, stream=False, **params)
    streamed = generate_text("Hello", url=server.grpc_url, **params)
    assert streamed.num_responses > 1 and streamed.token_ids == whole.token_ids
    def entries(meta: dict) -> list:
        return [meta["output_token_logprobs"], *meta["output_top_logprobs"]]

    assert len(whole.meta_info["output_token_logprobs"]) == len(whole.meta_info["output_top_logprobs"]) == MAX_NEW
    for got, want in zip(entries(streamed.meta_info), entries(whole.meta_info), strict=True):
        assert [e[1] for e in got] == [e[1] for e in want]
        assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-4)
    assert [e[1] for e in streamed.meta_info["output_token_logprobs"]] == whole.token_ids


def test_ids_past_the_tensor_type_are_refused_not_wrapped():
    # QA: numpy 1.x wrapped 2**32 + 5 to 5 (the engine generated from token 5), and 5e9 was refused
    # under its wrapped value.
    from client.triton_stream import to_array

    assert to_array("input_ids", [1, 2]).tolist() == [1, 2]
    assert to_array("random_seed", 2**64 - 1).tolist() == [2**64 - 1]
    assert to_array("max_tokens", 8.0).tolist() == [8]  # a whole float is that integer
    with pytest.raises(ValueError, match="max_tokens must be a whole number"):
        to_array("max_tokens", 2.5)
    for name, value in (("input_ids", [2**32 + 5]), ("input_ids", np.array([5, 2**40])), ("random_seed", -1),
                        ("max_tokens", 2**31), ("max_tokens", 5e9), ("input_ids", np.array([5e9])),
                        ("top_k", 3e10)):
        with pytest.raises(ValueError, match=f"{name} out of range"):
            to_array(name, value)
    r = run_cli("--url", "localhost:1", "--input-ids", "4294967301")
    assert r.returncode == 1 and "input_ids out of range for int32" in r.stderr and "4294967301" in r.stderr, r


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


def test_cli_prediction_from_a_file_keeps_the_output(server, tmp_path):
    prompt = "Hello, world"
    ref = generate_text(prompt, url=server.grpc_url, **GREEDY)
    (tmp_path / "predicted.txt").write_text(ref.text, encoding="utf-8")
    common = ["--url", server.grpc_url, "--max-tokens", str(MAX_NEW), "--temperature", "0",
              "--json-params", '{"ignore_eos": true}']
    out = run_cli(prompt, *common, "--prediction", f"@{tmp_path / 'predicted.txt'}", "--stats")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ref.text + "\n"
    meta = json.loads(out.stderr.split(" meta=", 1)[1].rsplit("]", 1)[0])
    assert meta["accepted_prediction_tokens"] > 0
    missing = run_cli(prompt, *common, "--prediction", f"@{tmp_path / 'absent.txt'}")
    assert missing.returncode == 2 and "--prediction" in missing.stderr


def test_cli_keeps_n_samples_apart(server, demo_model_path):
    # Two seeded samples, streamed (their responses interleave) and not: each its own block.
    params = {"n": 2, "seed": 1, "ignore_eos": True}
    ref = generate_text("Hello", url=server.grpc_url, max_tokens=MAX_NEW, json_params=params)
    assert [s.index for s in ref.samples] == [0, 1]
    assert all(s.completion_tokens == MAX_NEW == len(s.token_ids) and s.finish_reason == "length" for s in ref.samples)
    assert ref.samples[0].token_ids != ref.samples[1].token_ids
    expected = "".join(f"[sample {s.index}]\n{s.text}\n" for s in ref.samples)
    common = ["--url", server.grpc_url, "--max-tokens", str(MAX_NEW), "--json-params", json.dumps(params), "--stats"]
    for extra in ([], ["--no-stream"], ["--model", "llm", "--tokenizer-path", str(demo_model_path)]):
        out = run_cli("Hello", *common, *extra)
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected, extra
        lines = out.stderr.splitlines()
        assert lines[0].startswith("[sample 0: finish_reason=length") and lines[1].startswith("[sample 1: ")
        assert all(f"completion_tokens={MAX_NEW}" in line for line in lines[:2])
        assert lines[2].startswith(f"[total: samples=2/2 prompt_tokens={ref.prompt_tokens} "
                                   f"completion_tokens={2 * MAX_NEW} finish_reasons=length:2")
    ids = run_cli("Hello", *common, "--ids", "--model", "llm", "--tokenizer-path", str(demo_model_path))
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout == "".join(f"[sample {s.index}]\n{' '.join(map(str, s.token_ids))}\n" for s in ref.samples)


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


def test_stop_takes_one_string_and_leaves_the_prompt(monkeypatch, capsys):
    made = []
    monkeypatch.setattr(cli, "TritonStreamClient", lambda *a, **k: made.append(FakeStreamClient()) or made[-1])
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin"))
    assert cli.main(["--stop", "xyz", "--stop", "abc", "Hello"]) == 0
    values = made[-1].values
    assert values["text_input"] == "Hello"  # not a third stop string, nor stdin
    assert json.loads(values["sampling_parameters"])["stop"] == ["xyz", "abc"]
    capsys.readouterr()
    assert cli.main([""]) == 2 and "the prompt is empty" in capsys.readouterr().err


def test_options_checked_before_anything_is_sent(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["hi", "--system", "be brief"])
    assert exit_.value.code == 2 and "--system needs --chat" in capsys.readouterr().err
    for bad in ("-1", "nan", "0"):  # 0 timed out right after sending (QA)
        with pytest.raises(SystemExit) as exit_:
            cli.main(["hi", "--timeout", bad])
        assert exit_.value.code == 2 and "--timeout must be a number of seconds > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs chat"):
        build_inputs("ensemble", "hi", system="be brief")


def test_chat_needs_a_text_prompt(capsys):
    # Token ids are past the chat template: --chat with them would be dropped without a word.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--chat", "--input-ids", "1,2,3"])
    assert exit_.value.code == 2 and "--chat needs a text prompt" in capsys.readouterr().err
    with pytest.raises(ValueError, match="chat needs a text prompt"):
        build_inputs("ensemble", None, chat=True, input_ids=[1, 2, 3])


def test_cli_prints_the_library_warnings_as_one_line_each(capsys):
    cli._log_warnings_to_stderr()
    cli._log_warnings_to_stderr()  # once, however often main runs
    logging.getLogger("client.triton_stream").warning("abort of request %s failed", "r1")
    assert capsys.readouterr().err == "warning: abort of request r1 failed\n"


def test_cli_names_an_unreachable_server_in_one_line():
    url = f"localhost:{free_port()}"  # nothing listens there
    out = run_cli("hi", "--url", url)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "no longer in valid state" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"cannot reach Triton at {url}" in lines[0], lines


# ----------------------------------------------------------------- leaving a stream early aborts it
LONG = 1000  # tokens a request would run to (fits max_model_len 1024): far longer than any check below


def _metrics(server) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()


def _metric(text: str, name: str, **labels) -> float:
    for m in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def _finished(server) -> dict[str, float]:
    text = _metrics(server)
    return {r: _metric(text, "llm_request_finished_total", finish_reason=r) for r in ("abort", "length")}


def _assert_engine_aborted(server, before: dict[str, float], timeout: float = 5.0,
                           may_not_have_started: bool = False) -> None:
    """The engine ended the request as aborted (not at its length) and holds nothing, within `timeout`.
    (The llm model publishes its metrics every 0.2 s while busy.)

    `may_not_have_started`: the request may have been cancelled before the ensemble ran its llm
    step (Triton does pass a cancellation on to steps not yet scheduled), so the engine never
    saw it: then it must be idle at `timeout`, and never have run the request to its length
    (LONG tokens end well within `timeout`, so a request that did run on unaborted is caught)."""
    deadline = time.monotonic() + timeout
    while True:
        text = _metrics(server)
        aborted = _metric(text, "llm_request_finished_total", finish_reason="abort") - before["abort"]
        idle = _metric(text, "llm_kv_blocks_used") == 0 and _metric(text, "llm_num_requests_running") == 0
        if aborted >= 1 and idle:
            break
        if time.monotonic() >= deadline:
            assert may_not_have_started and idle, (f"the engine did not stop within {timeout}s: aborted={aborted} "
                                                   f"idle={idle}")
            break
        time.sleep(0.1)
    assert _metric(text, "llm_request_finished_total", finish_reason="length") == before["length"]


def test_leaving_an_ensemble_stream_early_aborts_it_in_the_engine(server):
    # Triton 2.51 does not pass the ensemble's cancellation on to the running llm step: without
    # the client's explicit abort the engine would generate on to `length`.
    before = _finished(server)
    stream = TritonStreamClient(server.grpc_url).stream_generate(
        "ensemble", {"text_input": "x", "max_tokens": LONG, "stream": True,
                     "sampling_parameters": json.dumps({"ignore_eos": True})})
    for seen, _ in enumerate(stream, 1):
        if seen == 3:
            break
    stream.close()
    _assert_engine_aborted(server, before)
    # The library's own iterator: closing it early does the same.
    before = _finished(server)
    pieces = stream_pieces("x", url=server.grpc_url, max_tokens=LONG, json_params={"ignore_eos": True})
    next(pieces), next(pieces)
    pieces.close()
    _assert_engine_aborted(server, before)


def _sigint_as_at_a_terminal() -> None:
    # A shell runs a background command with SIGINT ignored (no job control), and children keep
    # that: launched so (`.ci/run &`), the CLI would never see the interrupt. Ctrl-C at a
    # terminal meets the default disposition, which Python turns into KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_cli_interrupt_aborts_the_ensemble_request(server, sig, code, said):
    # SIGTERM too (QA: `kill`, `timeout` and supervisors send it; the request ran on to its limit).
    before = _finished(server)
    proc = subprocess.Popen([sys.executable, "-m", "client", "x", "--url", server.grpc_url, "--max-tokens", str(LONG),
                             "--json-params", '{"ignore_eos": true}'], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_sigint_as_at_a_terminal)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)  # text is streaming: the request runs
        assert ready and os.read(proc.stdout.fileno(), 1), proc.stderr.read()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code and f"[{said}: request cancelled]" in err.decode(), err.decode()
    assert "Traceback" not in err.decode()
    _assert_engine_aborted(server, before)


def test_a_second_interrupt_during_the_abort_does_not_skip_it(server):
    # QA: two SIGINTs 1 ms apart (a supervisor signalling twice) interrupted the cleanup between
    # the cancel and the abort, and the request ran on in the engine while the CLI said cancelled.
    interrupted = 0
    for trial in range(6):
        before = _finished(server)
        proc = subprocess.Popen([sys.executable, "-m", "client", "x", "--url", server.grpc_url, "--max-tokens",
                                 str(LONG), "--json-params", '{"ignore_eos": true}'], cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_as_at_a_terminal)
        try:
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready and os.read(proc.stdout.fileno(), 1), proc.stderr.read()
            # CI, once: the CLI had exited 0 when its first byte was read, so the signals went
            # nowhere (Popen.send_signal sends nothing to an exited process). Not reproduced;
            # likely the text came in one burst at the stream's end on the loaded host (merged
            # responses, or held behind a late first one). Such a run interrupts nothing: no
            # trial. A CLI still running here must end by the interrupt.
            finished_first = proc.poll() is not None
            if not finished_first:
                proc.send_signal(signal.SIGINT)
                time.sleep(0.001)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if finished_first:
            assert proc.returncode == 0 and len(out) > LONG // 10, (proc.returncode, err.decode())
            continue
        # ended by the interrupt either way; one after the cleanup may end it at once (-2)
        assert proc.returncode in (130, -signal.SIGINT), err.decode()
        _assert_engine_aborted(server, before)
        interrupted += 1
        if interrupted == 3:
            break
    assert interrupted == 3


def test_cli_timeout_is_a_clear_error_and_aborts_the_request(server):
    before = _finished(server)
    out = run_cli("x", "--url", server.grpc_url, "--timeout", "0.001", "--max-tokens", str(LONG),
                  "--json-params", '{"ignore_eos": true}')
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == "error: no response within 0.001 s"
    # After 1 ms the request is still in preprocessing: Triton's cancellation may end it there,
    # or the abort reaches the llm model first, and the engine ends the request as it arrives.
    _assert_engine_aborted(server, before, timeout=3.0, may_not_have_started=True)
    # The library raises a TimeoutError with that message, still a queue.Empty as it was before.
    before = _finished(server)
    with pytest.raises(TimeoutError, match=r"^no response within 0\.001 s$") as raised:
        list(TritonStreamClient(server.grpc_url).stream_generate(
            "ensemble", {"text_input": "x", "max_tokens": LONG, "stream": True,
                         "sampling_parameters": json.dumps({"ignore_eos": True})}, timeout=0.001))
    assert isinstance(raised.value, queue.Empty)
    _assert_engine_aborted(server, before, timeout=3.0, may_not_have_started=True)


def test_a_failed_abort_does_not_hide_why_the_stream_ended(server, caplog):
    rid = uuid.uuid4().hex
    before = _finished(server)
    bad = TritonStreamClient(server.grpc_url, abort_model="no_such_model")
    stream = bad.stream_generate("ensemble", {"text_input": "x", "max_tokens": LONG, "stream": True,
                                              "sampling_parameters": json.dumps({"ignore_eos": True})}, request_id=rid)
    next(stream), next(stream)
    with caplog.at_level(logging.WARNING, logger="client.triton_stream"):
        with pytest.raises(RuntimeError, match="^what ended the stream$"):
            stream.throw(RuntimeError("what ended the stream"))  # as if raised in the stream: it cancels, aborts
    assert any(rid in r.getMessage() and "no_such_model" in r.getMessage() for r in caplog.records), caplog.text
    TritonStreamClient(server.grpc_url).abort(rid)  # the public call: what the failed one left running
    _assert_engine_aborted(server, before)

@pytest.mark.parametrize("abort_model", ["llm", None])
def test_leaving_an_llm_stream_early_stops_the_engine_with_or_without_the_abort(server, demo_model_path,
                                                                                abort_model):
    # The engine alone sees its stream's cancellation; the extra abort changes nothing there.
    before = _finished(server)
    pieces = stream_pieces("x", model="llm", url=server.grpc_url, tokenizer_path=demo_model_path, max_tokens=LONG,
                           json_params={"ignore_eos": True}, abort_model=abort_model)
    next(pieces), next(pieces)
    pieces.close()
    _assert_engine_aborted(server, before)


def test_the_library_knows_every_input_tensors_type():
    """A plain Python value goes as the type config.pbtxt declares (QA: lora_update, documents,
    chat_template, the switches were not known, and a str failed inside tritonclient)."""
    from pathlib import Path

    import numpy as np

    from client.triton_stream import INPUT_DTYPES

    triton_types = {"TYPE_STRING": np.object_, "TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32,
                    "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64}
    repo = Path(__file__).resolve().parents[1] / "model_repository"
    for model in ("ensemble", "llm"):
        config = (repo / model / "config.pbtxt").read_text()
        inputs = config[config.index("input ["):config.index("output [")]
        for name, kind in re.findall(r'name: "(\w+)", data_type: (TYPE_\w+)', inputs):
            assert INPUT_DTYPES.get(name) is triton_types[kind], (model, name, kind)



def _short_perf_inputs(path) -> None:
    entry = {"text_input": ["Hello there"], "max_tokens": [4], "stream": [True],
             "sampling_parameters": ['{"ignore_eos": true, "max_new_tokens": 4}']}
    path.write_text(json.dumps({"data": [entry] * 4}))


def test_perf_sweep_reruns_into_the_same_directory(server, tmp_path):
    # QA: a second run with the same --out failed every level (perf_analyzer refuses an existing
    # --profile-export-file) beside the first run's merged csv; a level given twice failed the same way.
    from client.perf import run_perf_analyzer as pa

    if pa.missing_libraries():
        pytest.skip(f"perf_analyzer cannot load {pa.missing_libraries()} (run_perf_analyzer.py --install)")
    data = tmp_path / "inputs.json"
    _short_perf_inputs(data)
    out = tmp_path / "perf"
    for run in range(2):
        summary = pa.sweep("ensemble", server.grpc_url, data, [1, 2, 1], out, request_count=4, log=lambda *_: None)
        assert list(summary["levels"]) == ["1", "2"], run
        for c, level in summary["levels"].items():
            assert "error" not in level, (run, c, level.get("error"))
            assert level["profile"]["requests"] >= 4 and level["profile"]["output_tokens"] >= 16, (run, c, level)
        assert (out / "perf_analyzer.csv").exists() and json.loads((out / "summary.json").read_text()) == summary


def test_perf_runner_says_what_is_wrong_before_it_runs(tmp_path, monkeypatch, capsys):
    from client.perf import run_perf_analyzer as pa

    monkeypatch.setenv("PERF_ANALYZER", str(tmp_path / "nowhere"))
    assert pa.main(["--out", str(tmp_path / "o")]) == 2  # was a FileNotFoundError traceback
    assert "error: perf_analyzer not found at" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    for args, said in ((["--out", str(tmp_path / "file")], "is a file"), (["--request-count", "0"], "at least 1"),
                       (["--concurrency", "8", "-1"], "at least 1")):
        with pytest.raises(SystemExit) as exit_:
            pa.main(args)
        assert exit_.value.code == 2 and said in capsys.readouterr().err, args


def test_make_inputs_refuses_data_no_request_could_use(tmp_path, capsys):
    # QA: --num 0 made a set perf_analyzer dies on, empty or past-the-context prompts a set the
    # server refuses request by request, and min > max a traceback.
    from client.perf import make_inputs

    for args, said in ((["--num", "0"], "--num must be at least 1"),
                       (["--min-prompt", "0", "--max-prompt", "5"], "need 1 <= --min-prompt <= --max-prompt"),
                       (["--min-new", "50", "--max-new", "10"], "need 1 <= --min-new <= --max-new"),
                       (["--max-prompt", "4000", "--max-new", "200"], "past the model's context of 4096")):
        with pytest.raises(SystemExit) as exit_:
            make_inputs.main(["--out", str(tmp_path), *args])
        assert exit_.value.code == 2 and said in capsys.readouterr().err, args
    assert not list(tmp_path.iterdir())
    make_inputs.main(["--out", str(tmp_path), "--num", "2", "--max-prompt", "20", "--max-new", "20"])
    assert len(json.loads((tmp_path / "llm_ids.json").read_text())["data"]) == 2


def test_a_failed_perf_analyzer_level_keeps_its_error_line():
    """QA: the summary kept the last 2000 characters, perf_analyzer's usage text, not its error."""
    from client.perf.run_perf_analyzer import failure_text

    output = "Error: Streaming is only allowed with gRPC protocol and Triton C API.\n" + "usage: -m <model>\n" * 500
    text = failure_text(output)
    assert text.startswith("Error: Streaming is only allowed with gRPC") and len(text) <= 2000
    assert text.endswith("usage: -m <model>\n")  # the tail after it
    assert failure_text("plain failure\n" * 3) == "plain failure\n" * 3


def test_url_takes_a_grpc_endpoint_not_an_http_url(capsys, monkeypatch):
    assert cli.parse_args(["hi", "--url", "localhost:9001"]).url == "localhost:9001"
    with pytest.raises(SystemExit):
        cli.parse_args(["hi", "--url", "http://localhost:8001"])
    assert "Triton's gRPC endpoint as host:port (8001 by default), not a URL: 'http://localhost:8001'" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_GRPC_URL", "https://triton:8001")  # the default, from the environment, too
    with pytest.raises(SystemExit):
        cli.parse_args(["hi"])

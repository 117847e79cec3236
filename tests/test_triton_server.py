"""Integration: the real tritonserver on model_repository/, called with the real tritonclient."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.request

import numpy as np
import pytest
import torch

from client.local_server import REPO_ROOT, LocalTritonServer
from client.triton_stream import TritonStreamClient
from tritonclient.utils import InferenceServerException

MAX_NEW = 20


@pytest.fixture(scope="module")
def server(start_triton):
    with start_triton(num_kv_blocks=256, max_model_len=1024) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return TritonStreamClient(server.grpc_url)


@pytest.fixture(scope="module")
def hf(demo_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_model_path)
    model = AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(hf, ids: list[int], max_new: int = MAX_NEW) -> list[int]:
    _, model = hf
    out = model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0,
    )
    return out[0, len(ids):].tolist()


# HF generate applies the model's default repetition penalty (1.05) to the prompt's tokens too:
# vLLM's rule, which the engine follows when asked (its own is SGLang's, output tokens only).
GREEDY = json.dumps({"temperature": 0, "ignore_eos": True, "repetition_penalty_counts_prompt": True})


def kv_blocks_used(server: LocalTritonServer) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    match = re.search(r"^llm_kv_blocks_used(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    assert match, "llm_kv_blocks_used missing from the metrics"
    return float(match.group(1))


def wait_blocks_free(server: LocalTritonServer, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while kv_blocks_used(server) != 0:
        assert time.monotonic() < deadline, "KV blocks still in use"
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def _pool_free_after(server):
    yield
    if server.process is not None and server.process.poll() is None:  # (a test may stop it)
        wait_blocks_free(server)


def test_llm_streams_token_ids_equal_to_hf(client, hf):
    tok, _ = hf
    ids = tok("The quick brown fox jumps over the lazy dog.").input_ids
    chunks = list(client.stream_generate("llm", {
        "input_ids": ids, "max_tokens": MAX_NEW, "stream": True, "sampling_parameters": GREEDY,
    }))
    got = np.concatenate([np.asarray(c["output_ids"]).reshape(-1) for c in chunks]).tolist()
    # one response per token while the senders keep up; merged when they fall behind (backend/outbox.py)
    assert 1 < len(chunks) <= MAX_NEW and all(np.asarray(c["output_ids"]).size for c in chunks)
    assert got == hf_greedy(hf, ids)
    assert chunks[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] == "" for c in chunks[:-1])


def test_ensemble_streams_text_equal_to_reference_decode(client, hf):
    tok, _ = hf
    prompt = "Streaming text: spaces, 中文字符 and emoji 🙂 should survive."
    ref_ids = hf_greedy(hf, tok(prompt).input_ids)
    chunks = list(client.stream_generate("ensemble", {
        "text_input": prompt, "max_tokens": MAX_NEW, "stream": True, "sampling_parameters": GREEDY,
    }))
    assert 1 < len(chunks) <= MAX_NEW
    text = "".join(c["text_output"] for c in chunks)
    assert text == tok.decode(ref_ids, skip_special_tokens=True)
    assert np.concatenate([np.asarray(c["output_ids"]).reshape(-1) for c in chunks]).tolist() == ref_ids
    assert int(np.asarray(chunks[-1]["completion_tokens"]).reshape(-1)[0]) == MAX_NEW


def test_ensemble_chat_messages_through_template(client, hf):
    tok, _ = hf
    messages = [{"role": "user", "content": "Say hi"}]
    ref_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref_ids = hf_greedy(hf, tok(ref_prompt).input_ids)
    out = client.generate("ensemble", {
        "messages": json.dumps(messages), "max_tokens": MAX_NEW, "sampling_parameters": GREEDY,
    })
    assert out["num_responses"] == 1  # stream defaults to false
    assert out["output_ids"] == ref_ids
    assert out["text_output"] == tok.decode(ref_ids, skip_special_tokens=True)


def test_ensemble_n_samples_with_logprobs_and_penalties(client, hf):
    """n > 1 interleaves its samples on one stream, each response tagged with its index;
    logprobs ride in meta_info; the siblings reuse the prompt's cached blocks."""
    tok, _ = hf
    prompt = "Sampling surface through the ensemble: " * 3
    params = {"temperature": 0.9, "seed": 5, "n": 3, "max_new_tokens": 8, "ignore_eos": True,
              "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1,
              "return_logprob": True, "top_logprobs_num": 2}
    chunks = list(client.stream_generate("ensemble", {
        "text_input": prompt, "stream": True, "sampling_parameters": json.dumps(params),
    }))
    by_index: dict[int, list[dict]] = {}
    for c in chunks:
        meta = json.loads(c["meta_info"])
        by_index.setdefault(meta["index"], []).append({**c, "meta": meta})
    assert sorted(by_index) == [0, 1, 2]
    n_prompt = len(tok(prompt).input_ids)
    for index, items in by_index.items():
        ids = np.concatenate([np.asarray(i["output_ids"]).reshape(-1) for i in items]).tolist()
        assert len(ids) == 8 and items[-1]["finish_reason"] == "length"
        assert "".join(i["text_output"] for i in items) == tok.decode(ids, skip_special_tokens=True)
        lps = [e for i in items for e in i["meta"].get("output_token_logprobs", [])]
        assert [t for _, t, _ in lps] == ids and all(lp <= 0 for lp, _, _ in lps)
        tops = [t for i in items for t in i["meta"].get("output_top_logprobs", [])]
        assert len(tops) == 8 and all(len(t) == 2 for t in tops)
        cached = items[-1]["meta"]["cached_tokens"]
        assert cached == (0 if index == 0 else (n_prompt - 1) // 16 * 16)
    # Same seed, same request: same samples.
    again = list(client.stream_generate("ensemble", {
        "text_input": prompt, "stream": False, "sampling_parameters": json.dumps(params),
    }))
    assert len(again) == 3  # not streaming: one response per sample
    for c in again:
        meta = json.loads(c["meta_info"])
        want = [i for i in by_index[meta["index"]]]
        assert c["text_output"] == "".join(i["text_output"] for i in want)


def test_stop_conditions_end_to_end(client, hf):
    """stop strings (trimmed or kept), stop_token_ids, stop_regex and min_new_tokens through the
    ensemble, streamed, against an unconstrained greedy run."""
    tok, _ = hf
    prompt = "Stop conditions through the ensemble"
    base_params = {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}

    def run(**extra):
        return client.generate("ensemble", {
            "text_input": prompt, "stream": True, "sampling_parameters": json.dumps({**base_params, **extra}),
        })

    base = run()
    text, ids = base["text_output"], base["output_ids"]
    assert len(ids) == 30 and base["finish_reason"] == "length" and len(text) > 14

    stop = text[8:12]
    out = run(stop=[stop])
    assert out["text_output"] == text[: text.index(stop)] and out["finish_reason"] == "stop"
    assert json.loads(out["meta_info"])["stop_reason"] == stop
    kept = run(stop=[stop], include_stop_str_in_output=True)  # vLLM's: up to the stop string's end
    assert kept["text_output"] == text[: text.index(stop) + len(stop)]
    # SGLang's no_stop_trim: the text untouched, up to the end of the token that completed the stop
    out = run(stop=[stop], no_stop_trim=True)
    untouched = out["text_output"]
    assert untouched.startswith(kept["text_output"]) and text.startswith(untouched)
    assert untouched == tok.decode(out["output_ids"]) and out["output_ids"] == ids[: len(out["output_ids"])]

    stop_id = ids[6]
    first = ids.index(stop_id)
    out = run(stop_token_ids=[stop_id])
    assert out["output_ids"] == ids[: first + 1] and out["finish_reason"] == "stop"
    assert json.loads(out["meta_info"])["stop_reason"] == stop_id
    assert out["text_output"] == tok.decode(ids[:first], skip_special_tokens=True)  # the stop token is not text
    kept = run(stop_token_ids=[stop_id], no_stop_trim=True)
    assert kept["text_output"] == tok.decode(ids[: first + 1], skip_special_tokens=True)

    # min_new_tokens masks the stop token until enough tokens are out.
    out = run(stop_token_ids=[stop_id], min_new_tokens=first + 3)
    assert len(out["output_ids"]) >= first + 3 and stop_id not in out["output_ids"][: first + 3]
    assert out["output_ids"][:first] == ids[:first]

    target = text[10:13]
    pattern = "".join(c if c.isalnum() else "\\" + c for c in target)
    out = run(stop_regex=[pattern])
    assert out["finish_reason"] == "stop" and out["text_output"] == text[: text.index(target)]


def _http(server, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_http_generate_and_generate_stream(server, hf):
    tok, _ = hf
    prompt = "Triton generate extension"
    ref = tok.decode(hf_greedy(hf, tok(prompt).input_ids), skip_special_tokens=True)
    body = {"text_input": prompt, "max_tokens": MAX_NEW, "temperature": 0, "sampling_parameters": GREEDY}
    status, raw = _http(server, "/v2/models/ensemble/generate", body)
    assert status == 200, raw
    assert json.loads(raw)["text_output"] == ref
    status, raw = _http(server, "/v2/models/ensemble/generate_stream", {**body, "stream": True})
    assert status == 200, raw
    events = [json.loads(line[5:]) for line in raw.decode().splitlines() if line.startswith("data:")]
    # A response may carry several tokens when the stream's sender lags (the outbox merges them).
    assert 1 < len(events) <= MAX_NEW
    assert "".join(e["text_output"] for e in events) == ref
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == MAX_NEW


def test_generate_keys_that_are_no_inputs_are_sampling_parameters(server):
    # QA: Triton makes such keys request parameters, which the ensemble forwards to its steps; the
    # llm model ignored them (max_new_tokens gave the default length, a typo passed unnoticed).
    body = {"text_input": "request parameters", "max_new_tokens": 3, "ignore_eos": True}
    for model in ("ensemble", "llm"):
        if model == "llm":
            body = {"input_ids": [11, 12, 13], "max_new_tokens": 3, "ignore_eos": True}
        status, raw = _http(server, f"/v2/models/{model}/generate", body)
        assert status == 200, raw
        assert json.loads(raw)["completion_tokens"] == 3, raw
        status, raw = _http(server, f"/v2/models/{model}/generate", {**body, "temprature": 0})
        assert status == 400 and b"unknown sampling parameter(s): temprature" in raw, raw
        status, raw = _http(server, f"/v2/models/{model}/generate", {**body, "end_ids": 2, "beam_widths": 2})
        assert status == 400 and b"beam_widths, end_ids" in raw, raw
        # TensorRT-LLM's names: its README's body ("off" values) runs; others say what to use here.
        status, raw = _http(server, f"/v2/models/{model}/generate", {**body, "bad_words": "", "beam_width": 1})
        assert status == 200 and json.loads(raw)["completion_tokens"] == 3, raw
        status, raw = _http(server, f"/v2/models/{model}/generate", {**body, "end_id": 2})
        assert status == 400 and b"unsupported parameter 'end_id': use stop_token_ids" in raw, raw
        # A tensor and a request parameter that disagree: refused, each named as sent (QA: the
        # tensor won without a word).
        status, raw = _http(server, f"/v2/models/{model}/generate", {**body, "max_tokens": 16})
        assert status == 400 and (b"the input max_tokens (16) and max_new_tokens as a request parameter (3) "
                                  b"differ: give it once") in raw, raw


def _finished(server: LocalTritonServer, reason: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    match = re.search(r'^llm_request_finished_total\{[^}]*finish_reason="%s"[^}]*\} ([0-9.e+]+)$' % reason, text, re.M)
    assert match, f"llm_request_finished_total for {reason} missing from the metrics"
    return float(match.group(1))


def test_a_dropped_http_ensemble_stream_can_be_aborted_by_the_name_it_was_given(server):
    """QA: Triton 2.51 does not pass a dropped ensemble stream's cancellation to llm, and its HTTP
    generate endpoint gives a request no id, so an HTTP client that hung up left the request
    running to max_tokens with no way to stop it. A `rid` (or `id`) request parameter names it."""
    import socket
    from urllib.parse import urlsplit

    host, port = urlsplit(f"http://{server.http_url}").hostname, urlsplit(f"http://{server.http_url}").port
    body = json.dumps({"text_input": "a long generation " * 10, "max_tokens": 800, "ignore_eos": True,
                       "stream": True, "rid": "dropped-1"}).encode()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data:" not in got:  # the headers may come first, alone: read until it runs
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
    deadline = time.monotonic() + 5
    while kv_blocks_used(server) == 0:
        assert time.monotonic() < deadline, "the dropped request holds no KV blocks"
        time.sleep(0.1)
    aborted = _finished(server, "abort")
    status, raw = _http(server, "/v2/models/llm/generate", {"abort_request_id": "dropped-1"})
    assert status == 200, raw
    wait_blocks_free(server, timeout=5)
    deadline = time.monotonic() + 5  # metrics are published at most every few hundred ms
    while _finished(server, "abort") != aborted + 1:  # not run on to its 800 tokens
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)
    # SGLang's rid: a name runs once at a time; an abort that found it not running (here: a
    # request that was refused) is not held against the retry
    status, raw = _http(server, "/v2/models/ensemble/generate", {"text_input": "x", "max_tokens": 2, "top_p": 7.0,
                                                                 "rid": "retry-1"})
    assert status == 400, raw
    assert _http(server, "/v2/models/llm/generate", {"abort_request_id": "retry-1"})[0] == 200
    status, raw = _http(server, "/v2/models/ensemble/generate", {"text_input": "x", "max_tokens": 2, "ignore_eos": True,
                                                                 "rid": "retry-1"})
    assert status == 200 and json.loads(raw)["completion_tokens"] == 2, raw
    with socket.create_connection((host, port), timeout=30) as sock:
        body = json.dumps({"text_input": "twice", "max_tokens": 800, "ignore_eos": True, "stream": True,
                           "rid": "twice-1"}).encode()
        sock.sendall(b"POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data:" not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        status, raw = _http(server, "/v2/models/ensemble/generate", {"text_input": "x", "max_tokens": 2,
                                                                     "rid": "twice-1"})
        assert status == 400 and b"Duplicate request ID detected: twice-1" in raw, raw
        assert _http(server, "/v2/models/llm/generate", {"abort_request_id": "twice-1"})[0] == 200
    wait_blocks_free(server, timeout=5)
    # the name is checked: a non-string, and two names that differ, are refused
    for extra, message in (({"rid": 5}, b"rid must be a non-empty string"),
                           ({"rid": "a", "id": "b"}, b"the request is named twice")):
        status, raw = _http(server, "/v2/models/ensemble/generate", {"text_input": "x", "max_tokens": 2, **extra})
        assert status == 400 and message in raw, raw


def test_drain_waits_for_short_requests_then_abort_all_ends_the_rest(server, client):
    """client.drain (scripts/serve.sh and the Docker entrypoint run it before stopping tritonserver):
    requests that end within the grace end as usual; the rest, llm's and the ensemble's alike, are
    aborted, each ending with its final response and freeing its blocks."""
    import threading

    from client.drain import drain, open_requests

    ends: dict[str, dict] = {}

    def run(name: str, model: str, values: dict) -> None:
        chunks = list(client.stream_generate(model, {**values, "stream": True, "sampling_parameters": GREEDY},
                                             timeout=60))
        ends[name] = {"chunks": len(chunks), "finish_reason": chunks[-1].get("finish_reason")}

    jobs = {"short": ("llm", {"input_ids": [5, 6, 7], "max_tokens": 12}),
            "long-llm": ("llm", {"input_ids": [5, 6, 8], "max_tokens": 1000}),
            "long-ensemble": ("ensemble", {"text_input": "a long one", "max_tokens": 1000})}
    threads = [threading.Thread(target=run, args=(name, *job)) for name, job in jobs.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while open_requests(client) < 2 or kv_blocks_used(server) == 0:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)
    result = drain(server.grpc_url, grace_s=2.0)
    for t in threads:
        t.join(timeout=10)
    assert ends["short"]["finish_reason"] == "length"
    assert result["left"] == 2 and result["aborted"] == 2 and result["waited_s"] >= 2.0, result
    assert ends["long-llm"]["finish_reason"] == "abort" and ends["long-ensemble"]["finish_reason"] == "abort", ends
    assert open_requests(client) == 0
    assert drain(server.grpc_url, grace_s=5.0) == {"waited_s": 0.0, "left": 0, "aborted": 0}
    # a switch: abort_all false is no control at all
    with pytest.raises(InferenceServerException, match="input_ids"):
        client.generate("llm", {"abort_all": False})


def test_cancelled_stream_frees_its_blocks(server, client, hf):
    tok, _ = hf
    stream = client.stream_generate("llm", {
        "input_ids": tok("a long generation " * 20).input_ids, "max_tokens": 900, "stream": True,
        "sampling_parameters": GREEDY,
    })
    for _ in range(3):
        next(stream)
    deadline = time.monotonic() + 5  # metrics are published at most every few hundred ms
    while kv_blocks_used(server) == 0:
        assert time.monotonic() < deadline, "a running request holds no KV blocks"
        next(stream)
    stream.close()  # cancels the gRPC stream's request
    wait_blocks_free(server)


def test_streams_ending_while_cancellation_is_polled_keep_the_server_up(server, client):
    """is_cancelled() on a stream whose final response had just been sent is a use after free
    in tritonserver (it died once with SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled).
    Cancellation is polled from a thread of its own every 0.1 s; short streams ending all the
    time keep putting finished streams in that window. A use after free need not crash, so the
    deterministic check is test_cancel_watch's GuardedSender tests; this one runs the real path."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        c = TritonStreamClient(server.grpc_url)
        events = list(c.stream_generate("llm", {
            "input_ids": [3 + i % 50, 7, 11], "max_tokens": 1 + i % 6, "stream": True,
            "sampling_parameters": GREEDY,
        }, timeout=60))
        return sum(len(e["output_ids"]) for e in events)

    deadline = time.monotonic() + 3.0  # ~30 polls
    n = 0
    with ThreadPoolExecutor(24) as pool:
        while time.monotonic() < deadline:
            counts = list(pool.map(one, range(n, n + 48)))
            assert counts == [1 + i % 6 for i in range(n, n + 48)]
            n += 48
    assert server.process.poll() is None, "tritonserver died"
    ok = client.generate("llm", {"input_ids": [1, 2, 3], "max_tokens": 4, "sampling_parameters": GREEDY})
    assert len(ok["output_ids"]) == 4


@pytest.mark.parametrize(
    "values, reason",
    [
        ({"input_ids": np.zeros(0, dtype=np.int32)}, "empty"),
        ({"input_ids": [1, 2, 3], "max_tokens": -1}, "max_tokens"),
        ({"input_ids": [5] * 1100}, "context"),
        ({"input_ids": [1, 2, 3], "sampling_parameters": '{"top_p": 0}'}, "top_p"),
        ({"input_ids": [1, 2, 3], "sampling_parameters": '{"lora_path": "x"}'}, "LoRA"),
        ({"input_ids": [1, 2, 3], "sampling_parameters": "{not json"}, "JSON"),
        # Any Triton client could load adapters from server paths (QA); off unless the server allows it.
        ({"lora_update": '{"op": "load", "name": "x", "path": "/etc"}'}, "runtime LoRA updating is off"),
    ],
)
def test_bad_requests_get_clear_errors_and_server_keeps_serving(client, values, reason):
    with pytest.raises(InferenceServerException, match=reason):
        list(client.stream_generate("llm", values, timeout=60))
    ok = client.generate("llm", {"input_ids": [1, 2, 3], "max_tokens": 4, "sampling_parameters": GREEDY})
    assert len(ok["output_ids"]) == 4


@pytest.mark.parametrize("model, prompt", [("llm", {"input_ids": [5] * 1000}), ("ensemble", {"input_ids": [5] * 1000})])
def test_errors_name_the_input_tensor_the_client_sent(client, model, prompt):
    """The max_tokens tensor sets SGLang's max_new_tokens; an error about it names the tensor,
    not the parameter the client never wrote (random_seed likewise: test_triton_io)."""
    with pytest.raises(InferenceServerException) as err:
        list(client.stream_generate(model, {**prompt, "max_tokens": 500}, timeout=60))
    assert "max_tokens must be at most" in str(err.value) and "max_new_tokens" not in str(err.value), str(err.value)
    # Given in sampling_parameters, the parameter keeps its own name.
    with pytest.raises(InferenceServerException, match="max_new_tokens must be at most"):
        list(client.stream_generate(model, {**prompt, "sampling_parameters": '{"max_new_tokens": 500}'}, timeout=60))


def test_ensemble_bad_input_is_an_error(client):
    with pytest.raises(InferenceServerException, match="text_input|messages|input_ids"):
        list(client.stream_generate("ensemble", {"max_tokens": 4}, timeout=60))


def _requested(server: LocalTritonServer, model: str, values: dict, outputs: list[str]) -> list[dict]:
    """The responses' data for a stream that asks Triton for `outputs` only."""
    import queue

    import tritonclient.grpc as grpcclient

    from client.triton_stream import make_inputs

    client = grpcclient.InferenceServerClient(server.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(model, make_inputs(values), outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                                  enable_empty_final_response=True)
        data = []
        while True:
            result, error = got.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            data.append({o.name: result.as_numpy(o.name).tolist() for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                return data
    finally:
        client.stop_stream()
        client.close()


def test_ensemble_asked_for_one_llm_output_gets_no_data_on_triton_2_51(server):
    # README ("Model repository"): Triton 2.51's ensemble drops every response of a request for
    # exactly one of the outputs that come from the llm step, while two of them, text_output, or
    # the llm model asked directly work. This holds the documented behaviour: if it fails, Triton
    # was fixed and the README's advice can go.
    values = {"text_input": "Hello", "max_tokens": 4, "stream": True, "sampling_parameters": GREEDY}
    assert _requested(server, "ensemble", values, ["output_ids"]) == [{}]
    # The outbox merges a response into the next when the senders lag (a slow host), so a stream
    # of 4 tokens may come as fewer responses; what must hold is that every one carries its data.
    two = _requested(server, "ensemble", values, ["output_ids", "completion_tokens"])
    counts = [r["completion_tokens"][0] for r in two]
    assert counts == sorted(set(counts)) and counts[-1] == 4, counts
    assert [len(r["output_ids"]) for r in two] == [b - a for a, b in zip([0] + counts, counts)]
    text = _requested(server, "ensemble", values, ["text_output"])
    assert text and all(r.get("text_output") for r in text), text
    alone = _requested(server, "llm", {"input_ids": [1, 2, 3], "max_tokens": 4, "stream": True, "sampling_parameters": GREEDY},
                       ["output_ids"])
    assert alone and all(r.get("output_ids") for r in alone) and sum(len(r["output_ids"]) for r in alone) == 4, alone


@pytest.mark.parametrize("when", ["at_once_from_a_caller_that_ignores_sigint", "while_the_stubs_load"])
def test_an_interrupt_while_the_server_starts_stops_it(tmp_path, demo_model_path, monkeypatch, when):
    # Bench QA: Ctrl-C (or the bench's SIGTERM) during the start-up wait left tritonserver and its
    # stubs running, the caller having no server object to stop. Two more ways it lingered:
    # - a caller run in the background by a shell (CI) ignores SIGINT, tritonserver inherited that
    #   and only installs its handler once loaded: the stop waited its 60 s out;
    # - stopped while its stubs load, tritonserver dies at once and its stubs waited for good.
    import os

    calls = []

    def interrupted(self) -> bool:
        if when == "while_the_stubs_load":
            stubs = subprocess.run(["pgrep", "-P", str(self.process.pid), "-f", "triton_python_backend_stub"],
                                   capture_output=True, text=True).stdout.split()
            if len(stubs) < 3:
                return False
        calls.append(self.process.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(LocalTritonServer, "is_ready", interrupted)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if when.startswith("at_once") else None
    try:
        server = LocalTritonServer(env={"LLM_MODEL_PATH": str(demo_model_path)}, log_file=tmp_path / "server.log")
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            server.start(timeout=60)
        took = time.monotonic() - t0
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    assert calls and server.process is None  # stopped, and its process group with it
    with pytest.raises(ProcessLookupError):
        os.killpg(calls[0], 0)
    assert took < 15, took


def _failed_load_log(repo, tmp_path, env=None) -> str:
    """The log of a tritonserver on `repo` that must exit because a model failed to load."""
    log = tmp_path / "server.log"
    server = LocalTritonServer(model_repository=repo, env=env, log_file=log)
    try:
        with pytest.raises(RuntimeError, match="tritonserver exited"):
            server.start(timeout=120)
    finally:
        server.stop()
    return log.read_text()


def test_a_second_instance_or_a_non_decoupled_llm_is_refused_at_load(tmp_path, demo_model_path):
    # QA: with `count: 2` Triton started two engines (two KV pools) and routed each request to
    # either, so an abort or a `rid` check reached the engine that did not hold the request, and
    # two postprocessing instances reordered a stream's text. Made non-decoupled, llm answered
    # one-response requests but left every streamed or n > 1 request hanging ("Non-decoupled
    # model cannot send more than one response" in the log only). Each load fails instead, saying
    # why; so does a parameter postprocessing does not read.
    repo = tmp_path / "repository"
    for name in ("llm", "postprocessing"):
        config = (REPO_ROOT / "model_repository" / name / "config.pbtxt").read_text()
        assert "instance_group [ { count: 1, kind: KIND_CPU } ]" in config
        (repo / name / "1").mkdir(parents=True)
        config = config.replace("instance_group [ { count: 1, kind: KIND_CPU } ]", "instance_group [ { count: 2, kind: KIND_CPU } ]")
        if name == "llm":
            assert "model_transaction_policy { decoupled: true }" in config
            config = config.replace("model_transaction_policy { decoupled: true }", "model_transaction_policy { decoupled: false }")
        else:  # TensorRT-LLM's name for the tokenizer's directory: not read here
            config = config.replace("parameters [", 'parameters [\n  { key: "tokenizer_dir", value: { string_value: "/t" } },', 1)
        (repo / name / "config.pbtxt").write_text(config)
        # A link: model.py finds the repository root (backend/) from its resolved path.
        (repo / name / "1" / "model.py").symlink_to(REPO_ROOT / "model_repository" / name / "1" / "model.py")
    text = _failed_load_log(repo, tmp_path, env={"LLM_MODEL_PATH": str(demo_model_path)})
    assert "llm config.pbtxt: its instance_group gives 2 instances; it must have exactly one" in text, text[-3000:]
    assert "the engine is one KV pool and one step loop" in text
    assert "it must be decoupled (model_transaction_policy { decoupled: true }): a request's tokens stream" in text
    assert ("postprocessing config.pbtxt: unknown parameter(s) tokenizer_dir (here: model_path) (it reads model_path); "
            "its instance_group gives 2 instances") in text
    assert "llm engine ready" not in text  # refused before an engine was built


def test_an_llm_whose_ensemble_tokenizes_with_another_model_is_refused_at_load(tmp_path, demo_model_path, monkeypatch):
    # QA: llm's model_path edited alone (preprocessing and postprocessing left at the demo model)
    # loaded, then served the model another tokenizer's ids, with nothing in any log.
    from tests.test_ensemble_check import _repository, _tokenizer_copy

    monkeypatch.delenv("LLM_MODEL_PATH", raising=False)
    other = _tokenizer_copy(demo_model_path, tmp_path / "other", change=True)
    repo = _repository(tmp_path, {"llm": str(other)})
    # llm reads the other steps' config.pbtxt only: they need not load (without a model.py they fail at once).
    (repo / "llm" / "1").mkdir()
    (repo / "llm" / "1" / "model.py").symlink_to(REPO_ROOT / "model_repository" / "llm" / "1" / "model.py")
    text = _failed_load_log(repo, tmp_path)
    assert (f"llm serves {other}, but preprocessing (a step of ensemble) loads its tokenizer from "
            f"{REPO_ROOT / 'models' / 'demo'}; postprocessing (a step of ensemble)") in text, text[-3000:]
    assert "llm engine ready" not in text

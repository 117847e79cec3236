"""Integration: the real tritonserver with the llm model's engine in a process of its own
(`engine_process: separate`, backend/engine_process.py), called with the real tritonclient.

The core checks of test_triton_server.py run again against this module's server; then what only
this mode has: the child process, and what a client sees when it dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from test_triton_server import (  # noqa: F401  (fixtures and tests, run against this module's server)
    _pool_free_after,
    client,
    hf,
    test_bad_requests_get_clear_errors_and_server_keeps_serving,
    test_cancelled_stream_frees_its_blocks,
    test_ensemble_n_samples_with_logprobs_and_penalties,
    test_ensemble_streams_text_equal_to_reference_decode,
    test_llm_streams_token_ids_equal_to_hf,
    test_stop_conditions_end_to_end,
)
from tritonclient.grpc import InferenceServerClient

GREEDY = json.dumps({"temperature": 0, "ignore_eos": True})


@pytest.fixture(scope="module")
def server(start_triton):
    with start_triton(num_kv_blocks=256, max_model_len=1024, name="engine-process",
                      # cpu:0, not cpu: QA: the model compared the text, so it got the GPU defaults
                      env={"LLM_ENGINE_PROCESS": "separate", "LLM_DEVICE": "cpu:0"}) as srv:
        yield srv


def _engine_info(client) -> dict:
    [chunk] = list(client.stream_generate("llm", {"engine_info": True}))
    return json.loads(chunk["meta_info"])


def _engine_children(server) -> list[int]:
    """Pids of the engine processes under this server's process tree."""
    out = subprocess.run(["pgrep", "-f", "backend.engine_process"], capture_output=True, text=True).stdout.split()
    mine = []
    for pid in map(int, out):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{ppid}/stat") as f:
                grand = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if grand == server.process.pid:  # tritonserver -> llm stub -> engine process
            mine.append(pid)
    return mine


def test_engine_info_reports_the_separate_process(server, client):
    info = _engine_info(client)
    assert info["config"]["engine_process"] == "separate"
    # the CPU defaults for any spelling of the CPU (torch_threads: all cores but one, at least 1)
    assert info["config"]["device"] == "cpu:0" and info["config"]["max_responses_per_step"] == 16
    assert info["config"]["torch_threads"] == max(1, len(os.sched_getaffinity(0)) - 1)
    assert info["stats"]["num_kv_blocks"] == 256
    assert len(_engine_children(server)) == 1


def test_a_killed_engine_process_fails_requests_clearly_and_stops_the_server(server, client):
    # Last in this module: the server stops. Nothing would restart the engine; a server left
    # ready without one passed every health check (vLLM's server exits when its engine dies).
    [pid] = _engine_children(server)
    stream = client.stream_generate("llm", {"input_ids": [11, 12, 13], "max_tokens": 900, "stream": True,
                                            "sampling_parameters": GREEDY})
    next(stream)  # the request is running
    os.kill(pid, signal.SIGKILL)
    # "internal error": the frontend answers 500, not a 400 that tells the client not to retry.
    with pytest.raises(Exception, match="internal error: the engine process has stopped"):
        for _ in stream:
            pass
    # The stub exits after a grace period for those error responses, and its watcher stops the
    # server, so that its supervisor (serve.sh, the Docker entrypoint) starts a working one.
    deadline = time.monotonic() + 30
    while server.process.poll() is None:
        assert time.monotonic() < deadline, "tritonserver still running without its engine"
        time.sleep(0.2)
    assert not _engine_children(server)

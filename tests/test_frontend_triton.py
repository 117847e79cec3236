"""TritonLLMClient and the frontend on the real tritonserver, with a toy decoupled model.

The toy model has the ensemble's tensor interface and streams `w0 w1 ...` (max_new_tokens
responses), so this checks the gRPC streaming path without the engine: inputs as sent, the final
flag, error mapping, and that a client disconnect cancels the request inside Triton.
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest

from client.local_server import LocalTritonServer, triton_home
from openai_frontend.engine_types import EngineRequest
from openai_frontend.errors import APIError
from openai_frontend.server import create_app
from openai_frontend.settings import Settings
from openai_frontend.testing import serve_in_thread
from openai_frontend.triton_client import TritonLLMClient

TOY = "toy_llm"

CONFIG = """
name: "toy_llm"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "text_input", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "messages", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "tools", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "chat_template_kwargs", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "add_generation_prompt", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "input_ids", data_type: TYPE_INT32, dims: [ -1 ], optional: true },
  { name: "stream", data_type: TYPE_BOOL, dims: [ 1 ], optional: true },
  { name: "sampling_parameters", data_type: TYPE_STRING, dims: [ 1 ], optional: true },
  { name: "abort_request_id", data_type: TYPE_STRING, dims: [ 1 ], optional: true }
]
output [
  { name: "text_output", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "output_ids", data_type: TYPE_INT32, dims: [ -1 ] },
  { name: "finish_reason", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "meta_info", data_type: TYPE_STRING, dims: [ 1 ] },
  { name: "prompt_tokens", data_type: TYPE_INT32, dims: [ 1 ] },
  { name: "completion_tokens", data_type: TYPE_INT32, dims: [ 1 ] }
]
instance_group [{ kind: KIND_CPU }]
parameters { key: "marker_dir", value: { string_value: "%s" } }
"""

MODEL = '''
import json, os, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
NAMES = ("text_input", "messages", "tools", "chat_template_kwargs", "add_generation_prompt",
         "input_ids", "stream", "sampling_parameters", "abort_request_id")


def _value(arr):
    item = arr.reshape(-1)
    if arr.dtype == np.object_:
        return item[0].decode()
    if arr.dtype == np.bool_:
        return bool(item[0])
    return item.tolist()


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.marker_dir = cfg["parameters"]["marker_dir"]["string_value"]
        self.aborted = set()

    def execute(self, requests):
        for request in requests:
            got = {}
            for name in NAMES:
                t = pb_utils.get_input_tensor_by_name(request, name)
                if t is not None:
                    got[name] = _value(t.as_numpy())
            if "abort_request_id" in got:  # control request: stop another request
                self.aborted.add(got["abort_request_id"])
                request.get_response_sender().send(flags=FINAL)
                continue
            threading.Thread(target=self.run, args=(request.get_response_sender(), got, request.request_id()),
                             daemon=True).start()
        return None

    def run(self, sender, got, rid):
        sp = json.loads(got.get("sampling_parameters", "{}"))
        if "toy_error" in sp:
            err = pb_utils.TritonError(sp["toy_error"], pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=err), flags=FINAL)
            return
        n = sp.get("max_new_tokens", 5)
        for i in range(n):
            if rid in self.aborted:
                open(os.path.join(self.marker_dir, rid + ".aborted"), "w").close()
                sender.send(flags=FINAL)
                return
            # toy_ignore_cancel: behave like an ensemble's in-flight step, which never sees it
            if sender.is_cancelled() and not sp.get("toy_ignore_cancel"):
                open(os.path.join(self.marker_dir, rid + ".cancelled"), "w").close()
                sender.send(flags=FINAL)
                return
            text = json.dumps(got) if (sp.get("toy_echo") and i == 0) else f"w{i} "
            last = i == n - 1
            outs = {
                "text_output": np.array([text.encode()], dtype=np.object_),
                "output_ids": np.array([i], dtype=np.int32),
                "finish_reason": np.array([b"length" if last else b""], dtype=np.object_),
                "meta_info": np.array([json.dumps({"stop_reason": None}).encode()], dtype=np.object_),
                "prompt_tokens": np.array([3], dtype=np.int32),
                "completion_tokens": np.array([i + 1], dtype=np.int32),
            }
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outs.items()]))
            time.sleep(sp.get("toy_delay", 0.0))
        sender.send(flags=FINAL)
'''


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    if not (triton_home() / "backends" / "python" / "triton_python_backend_stub").exists():
        pytest.skip("tritonserver's Python backend stub is not installed (scripts/setup.sh)")
    root = tmp_path_factory.mktemp("toy_repo")
    markers = tmp_path_factory.mktemp("markers")
    (root / TOY / "1").mkdir(parents=True)
    (root / TOY / "config.pbtxt").write_text(CONFIG % markers)
    (root / TOY / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    log = root / "server.log"
    srv = LocalTritonServer(model_repository=root, log_file=log)
    try:
        srv.start(timeout=120)
    except Exception:
        print(log.read_text()[-5000:])
        raise
    srv.markers = markers
    yield srv
    srv.stop()


def _collect(client: TritonLLMClient, request: EngineRequest):
    async def run():
        try:
            return [c async for c in client.generate(request)]
        finally:
            await client.close()

    return asyncio.run(run())


def test_client_streams_until_final_and_sends_the_inputs(triton):
    client = TritonLLMClient(triton.grpc_url, TOY)
    req = EngineRequest(
        sampling_params={"max_new_tokens": 3, "toy_echo": True},
        messages=[{"role": "user", "content": "héllo"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        chat_template_kwargs={"enable_thinking": False},
        add_generation_prompt=False,
        request_id="req-1",
    )
    chunks = _collect(client, req)
    assert len(chunks) == 3
    got = json.loads(chunks[0].text)
    assert json.loads(got["messages"]) == req.messages
    assert json.loads(got["tools"]) == req.tools
    assert json.loads(got["chat_template_kwargs"]) == {"enable_thinking": False}
    assert got["add_generation_prompt"] is False and got["stream"] is True
    assert json.loads(got["sampling_parameters"]) == req.sampling_params
    assert [c.text for c in chunks[1:]] == ["w1 ", "w2 "]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert [c.completion_tokens for c in chunks] == [1, 2, 3] and chunks[0].prompt_tokens == 3
    assert chunks[2].token_ids == [2] and chunks[2].meta == {"stop_reason": None}

    ids = _collect(TritonLLMClient(triton.grpc_url, TOY),
                   EngineRequest(sampling_params={"toy_echo": True, "max_new_tokens": 1}, input_ids=[5, 6, 7]))
    assert json.loads(ids[0].text)["input_ids"] == [5, 6, 7]


def test_client_errors(triton):
    with pytest.raises(APIError) as err:
        _collect(TritonLLMClient(triton.grpc_url, TOY),
                 EngineRequest(sampling_params={"toy_error": "unsupported parameter 'x'"}, text_input="a"))
    assert err.value.status_code == 400 and "unsupported parameter 'x'" in err.value.message
    with pytest.raises(APIError) as err:
        _collect(TritonLLMClient(triton.grpc_url, "no_such_model"), EngineRequest(sampling_params={}, text_input="a"))
    assert err.value.status_code == 503

    async def ready(name):
        c = TritonLLMClient(triton.grpc_url, name)
        try:
            return await c.is_ready()
        finally:
            await c.close()

    assert asyncio.run(ready(TOY)) is True
    assert asyncio.run(ready("no_such_model")) is False


def test_frontend_on_triton_and_disconnect_cancels_in_triton(triton):
    app = create_app(Settings(triton_url=triton.grpc_url, triton_model=TOY, model_name="toy"))
    with serve_in_thread(app) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = c.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.choices[0].message.content == "w0 w1 w2 w3 " and r.choices[0].finish_reason == "length"
        text = "".join(ch.choices[0].text for ch in
                       c.completions.create(model="toy", prompt="x", max_tokens=3, stream=True) if ch.choices)
        assert text == "w0 w1 w2 "
        assert httpx.get(url + "/health").status_code == 200

        r = httpx.post(url + "/generate", json={"text": "x", "sampling_params": {"toy_error": "bad value"}})
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad value"

        with httpx.stream("POST", url + "/generate", headers={"X-Request-Id": "cancel-me"},
                          json={"text": "x", "stream": True,
                                "sampling_params": {"max_new_tokens": 10_000, "toy_delay": 0.02}}) as resp:
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
        assert _wait_marker(triton, "cancel-me.*.cancelled"), "Triton never saw the request cancelled"


def _wait_marker(triton, pattern: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if list(Path(triton.markers).glob(pattern)):
            return True
        time.sleep(0.05)
    return False


def test_abort_model_stops_a_request_that_ignores_cancellation(triton):
    app = create_app(Settings(triton_url=triton.grpc_url, triton_model=TOY, model_name="toy", abort_model=TOY))
    with serve_in_thread(app) as url:
        body = {"text": "x", "stream": True,
                "sampling_params": {"max_new_tokens": 10_000, "toy_delay": 0.02, "toy_ignore_cancel": True}}
        with httpx.stream("POST", url + "/generate", headers={"X-Request-Id": "abort-me"}, json=body) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i == 4:
                    break
        assert _wait_marker(triton, "abort-me.*.aborted"), "the abort request did not reach the model"

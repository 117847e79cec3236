"""A scripted stand-in for TritonLLMClient, and a uvicorn-in-a-thread runner (for tests).

    fake = FakeLLMClient(lambda req: text_chunks(["Hel", "lo"]))
    with serve_in_thread(create_app(Settings(model_name="m"), client=fake)) as base_url:
        openai.OpenAI(base_url=base_url + "/v1", api_key="x").chat.completions.create(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence, Union

from openai_frontend.engine_types import EngineChunk, EngineRequest
from openai_frontend.errors import APIError

Script = Callable[[EngineRequest], Union[Sequence[EngineChunk], APIError]]


def infer_response(outputs: dict[str, Any], final: bool = False, model: str = "ensemble") -> Any:
    """A Triton ModelInferResponse as the ensemble streams it: str values as BYTES [1], others as
    INT32 [n], raw contents as the server sends them; `final` sets triton_final_response."""
    import numpy as np
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import serialize_byte_tensor

    resp = service_pb2.ModelInferResponse(model_name=model)
    for name, value in outputs.items():
        out = resp.outputs.add(name=name)
        if isinstance(value, str):
            out.datatype, out.shape[:] = "BYTES", [1]
            resp.raw_output_contents.append(serialize_byte_tensor(np.array([value.encode()], dtype=np.object_)).item())
        else:
            arr = np.asarray(value, dtype=np.int32)
            out.datatype, out.shape[:] = "INT32", [arr.size]
            resp.raw_output_contents.append(arr.tobytes())
    if final:
        resp.parameters["triton_final_response"].bool_param = True
    return resp


def text_chunks(
    pieces: Sequence[str], finish: str = "stop", prompt_tokens: int = 7, stop_reason: Any = None,
    meta: Optional[Sequence[str]] = None,
) -> list[EngineChunk]:
    """One chunk per piece (one token each), the last one carrying `finish`."""
    out = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        raw = meta[i] if meta is not None else ""
        if last and stop_reason is not None and not raw:
            import json

            raw = json.dumps({"stop_reason": stop_reason})
        out.append(EngineChunk(piece, [100 + i], finish if last else None, prompt_tokens, i + 1, raw))
    return out


class FakeLLMClient:
    """Yields scripted chunks; records requests and how each stream ended.

    `script(request)` returns the chunks of one sample (or an APIError to raise before the first
    chunk, or a list whose items may be APIError to raise mid-stream); for `request.n > 1` it is
    called once per sample and the samples are interleaved, each chunk carrying its `index`, as
    the engine does. `delay` sleeps before each chunk.
    """

    def __init__(self, script: Optional[Script] = None, delay: float = 0.0,
                 eos_token_ids: Optional[list[int]] = None) -> None:
        self.script = script or (lambda req: text_chunks(["Hello", ",", " world", "!"]))
        self.eos_token_ids = eos_token_ids  # what engine_info reports (None: nothing)
        self.delay = delay
        self.requests: list[EngineRequest] = []
        self.finished: list[str] = []  # "completed" | "closed" (consumer left early) per stream
        self.closed_early = threading.Event()
        self.ready = True
        self.adapters: dict[str, str] = {}  # what lora_update loads, name -> path
        self.aborts: list[tuple[Optional[str], bool]] = []  # abort_requests calls
        self.held: list[tuple[str, asyncio.Event]] = []  # hold()'s requests in progress
        self.stats: dict[str, Any] = {}  # the engine counters engine_info reports
        self.max_model_len: Optional[int] = None  # the context engine_info reports (None: not said)

    async def lora_update(self, command: dict[str, Any]) -> dict[str, str]:
        op, name = command.get("op"), command.get("name")
        if op == "load":
            if name in self.adapters:  # param as map_stream_error names the engine's refusal
                raise APIError(400, f"LoRA adapter '{name}' is already loaded", param="lora_path")
            self.adapters[name] = command.get("path")
        elif op == "unload":
            if self.adapters.pop(name, None) is None:
                raise APIError(400, f"LoRA adapter '{name}' is not loaded", param="lora_path")
        return dict(self.adapters)

    async def abort_requests(self, rid: Optional[str] = None, abort_all: bool = False) -> int:
        self.aborts.append((rid, abort_all))
        held = [event for request_id, event in self.held if abort_all or request_id == rid]
        for event in held:
            event.set()
        return len(held)

    @contextlib.asynccontextmanager
    async def hold(self, request: EngineRequest) -> AsyncIterator[asyncio.Event]:
        """TritonLLMClient.hold, without its claims: the event is set by abort_requests."""
        entry = (request.request_id, asyncio.Event())
        self.held.append(entry)
        try:
            yield entry[1]
        finally:
            self.held.remove(entry)

    async def reset_prefix_cache(self) -> int:
        return 0

    async def engine_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"config": {"model_path": "fake"}, "stats": dict(self.stats)}
        if self.max_model_len is not None:
            info["config"]["max_model_len"] = self.max_model_len
        if self.eos_token_ids is not None:
            info["eos_token_ids"] = self.eos_token_ids
        return info

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.requests.append(request)
        outcome = "closed"
        try:
            result = self.script(request)
            if isinstance(result, APIError):
                outcome = "error"
                raise result
            if request.n > 1:
                samples = [list(result)] + [list(self.script(request)) for _ in range(request.n - 1)]
                result = []
                for step in range(max(len(s) for s in samples)):
                    for i, sample in enumerate(samples):
                        if step < len(sample):
                            item = sample[step]
                            result.append(item if isinstance(item, APIError) else dataclasses.replace(item, index=i))
            for item in result:
                if self.delay:
                    await asyncio.sleep(self.delay)
                if isinstance(item, APIError):
                    outcome = "error"
                    raise item
                yield item
            outcome = "completed"
        finally:
            self.finished.append(outcome)
            if outcome == "closed":
                self.closed_early.set()

    async def tokenize(self, request: EngineRequest) -> list[int]:
        """A stand-in tokenizer: the UTF-8 bytes of the prompt (messages as their JSON)."""
        self.requests.append(request)
        if request.input_ids is not None:
            return list(request.input_ids)
        text = request.text_input if request.text_input is not None else json.dumps(request.messages)
        return list(text.encode("utf-8"))

    async def detokenize(
        self, token_ids: list[int], skip_special_tokens: bool = False, spaces_between_special_tokens: bool = True,
        validate: bool = True,
    ) -> str:
        return bytes(t % 256 for t in token_ids).decode("utf-8", errors="replace")

    async def is_ready(self) -> bool:
        return self.ready

    async def close(self) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app: Any, timeout: float = 10.0) -> Iterator[str]:
    """Run `app` with uvicorn on a free loopback port; yields the base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


# ---------------------------------------------------------------------------------------------
# Integration-test helpers: the real tritonserver (client/local_server.py) and its metrics
# ---------------------------------------------------------------------------------------------


def start_triton(model_path: str, log_file: Any, env: Optional[dict[str, str]] = None, timeout: float = 300.0,
                 **ports: int) -> Any:
    """A started LocalTritonServer on the repository's model_repository/ (imported lazily: the
    launcher lives in the repository's `client` package, not in this one)."""
    from client.local_server import LocalTritonServer

    full_env = {"LLM_MODEL_PATH": str(model_path), "LLM_NUM_KV_BLOCKS": "256", "LLM_MAX_MODEL_LEN": "1024"}
    full_env.update(env or {})
    server = LocalTritonServer(env=full_env, log_file=log_file, **ports)
    try:
        server.start(timeout=timeout)
    except Exception:
        try:
            import pathlib

            print(pathlib.Path(log_file).read_text()[-6000:])
        except OSError:
            pass
        raise
    return server


def scrape_metric(metrics_url: str, name: str, labels: str = "") -> Optional[float]:
    """The value of sample `name` on a Prometheus page: the one whose labels are exactly `labels`
    (e.g. 'finish_reason="abort"') when given, else the first one."""
    import urllib.request

    return metric_value(urllib.request.urlopen(metrics_url, timeout=5).read().decode(), name, labels)


def metric_value(text: str, name: str, labels: str = "") -> Optional[float]:
    """scrape_metric's reading of a Prometheus page already fetched."""
    import re

    label_re = re.escape("{" + labels + "}") if labels else r"(?:\{[^}]*\})?"
    match = re.search(rf"^{re.escape(name)}{label_re} ([0-9.e+-]+|NaN)$", text, re.M)
    return float(match.group(1)) if match else None


def wait_kv_blocks_free(metrics_url: str, timeout: float = 20.0) -> float:
    """Waits until the engine's llm_kv_blocks_used is 0; returns the seconds it took."""
    start = time.monotonic()
    while True:
        used = scrape_metric(metrics_url, "llm_kv_blocks_used")
        if used == 0:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"llm_kv_blocks_used is still {used} after {timeout:.0f}s")
        time.sleep(0.1)

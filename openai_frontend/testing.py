"""A scripted stand-in for TritonLLMClient, and a uvicorn-in-a-thread runner (for tests).

    fake = FakeLLMClient(lambda req: text_chunks(["Hel", "lo"]))
    with serve_in_thread(create_app(Settings(model_name="m"), client=fake)) as base_url:
        openai.OpenAI(base_url=base_url + "/v1", api_key="x").chat.completions.create(...)
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence, Union

from openai_frontend.engine_types import EngineChunk, EngineRequest
from openai_frontend.errors import APIError

Script = Callable[[EngineRequest], Union[Sequence[EngineChunk], APIError]]


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

    `script(request)` returns the chunks (or an APIError to raise before the first chunk, or a
    list whose items may be APIError to raise mid-stream). `delay` sleeps before each chunk.
    """

    def __init__(self, script: Optional[Script] = None, delay: float = 0.0) -> None:
        self.script = script or (lambda req: text_chunks(["Hello", ",", " world", "!"]))
        self.delay = delay
        self.requests: list[EngineRequest] = []
        self.finished: list[str] = []  # "completed" | "closed" (consumer left early) per stream
        self.closed_early = threading.Event()
        self.ready = True

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.requests.append(request)
        outcome = "closed"
        try:
            result = self.script(request)
            if isinstance(result, APIError):
                outcome = "error"
                raise result
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

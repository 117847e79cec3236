"""Streaming vs non-streaming throughput of the frontend at a fixed concurrency.

    python -m openai_frontend.bench --url http://127.0.0.1:9000 [--concurrency 64] [--requests 256]
        [--max-tokens 64] [--endpoint chat|completions|generate|responses] [--modes stream,plain]

Sends `requests` generations with `concurrency` in flight (HTTP/1.1 keep-alive, one connection
per worker), all with `ignore_eos` so every request produces exactly `max_tokens` tokens, once
streaming (SSE) and once not, and prints tokens/s and requests/s for each and the
streaming/non-streaming ratio. `--client` picks the load generator: `raw` (default) counts SSE
events without parsing their JSON, so the client costs little of the machine it shares;
`httpx` parses every event's JSON; `sdk` is the OpenAI Python SDK (a pydantic object per event).

    python -m openai_frontend.bench --fake [--chunk-delay S]

runs the same load against an in-process frontend on a scripted engine (no Triton): the
frontend's own per-chunk cost, isolated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any, Awaitable, Callable, Optional

import httpx


def _body(endpoint: str, max_tokens: int, stream: bool, i: int,
          temperature: Optional[float] = None) -> tuple[str, dict[str, Any]]:
    """One request; `temperature` None keeps the model's sampling defaults (generation_config)."""
    temp = {} if temperature is None else {"temperature": temperature}
    if endpoint == "chat":
        return "/v1/chat/completions", {
            "model": "demo", "messages": [{"role": "user", "content": f"Tell me a story number {i}."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, **temp,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
    if endpoint == "responses":  # no ignore_eos there: a real model's answers may end early (usage counts them)
        return "/v1/responses", {"model": "demo", "input": f"Tell me a story number {i}.", "store": False,
                                 "max_output_tokens": max_tokens, "stream": stream, **temp}
    if endpoint == "completions":
        return "/v1/completions", {"model": "demo", "prompt": f"Story {i}: once upon a time", "max_tokens": max_tokens,
                                   "ignore_eos": True, "stream": stream, **temp,
                                   **({"stream_options": {"include_usage": True}} if stream else {})}
    return "/generate", {"text": f"Story {i}: once upon a time", "stream": stream,
                         "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True, **temp}}


async def _one(http: httpx.AsyncClient, endpoint: str, max_tokens: int, stream: bool, i: int,
               temperature: Optional[float] = None) -> int:
    path, body = _body(endpoint, max_tokens, stream, i, temperature)
    if not stream:
        r = await http.post(path, json=body)
        r.raise_for_status()
        data = r.json()
        if endpoint == "generate":
            return data["meta_info"]["completion_tokens"]
        if endpoint == "responses":
            return data["usage"]["output_tokens"]
        return data["usage"]["completion_tokens"]
    tokens = 0
    async with http.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if endpoint == "generate":
                tokens = event["meta_info"]["completion_tokens"]
            elif endpoint == "responses":
                if event.get("type") in ("response.completed", "response.incomplete"):
                    tokens = event["response"]["usage"]["output_tokens"]
            elif event.get("usage"):  # (stream_options.include_usage: events may carry several tokens)
                tokens = event["usage"]["completion_tokens"]
    return tokens


class _RawConnection:
    """A minimal HTTP/1.1 keep-alive client (asyncio streams): a load generator cheap enough not
    to be the bottleneck. It counts SSE events without parsing their JSON and reads the token
    count from the usage of the last event / the body."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def request(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        reader = self.reader
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        length, chunked = None, False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
        if not chunked:
            return status, await reader.readexactly(length or 0)
        parts = []
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        return status, b"".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _tokens_from(endpoint: str, stream: bool, raw: bytes) -> int:
    if endpoint == "responses":  # the final event (or body) is the whole response
        last = raw.rsplit(b"\ndata: ", 1)[-1] if stream else raw
        response = json.loads(last)
        response = response.get("response", response)
        if response.get("status") not in ("completed", "incomplete"):
            raise RuntimeError(f"the response ended {response.get('status')}: {response.get('error')}")
        return response["usage"]["output_tokens"]
    if not stream:
        data = json.loads(raw)
        return data["meta_info"]["completion_tokens"] if endpoint == "generate" else data["usage"]["completion_tokens"]
    if b"data: [DONE]" not in raw:
        raise RuntimeError("stream ended without [DONE]")
    events = raw.split(b"\n\ndata: ")
    last = events[-2] if len(events) > 1 else events[0]
    last = last.removeprefix(b"data: ")
    data = json.loads(last)
    if endpoint == "generate":
        return data["meta_info"]["completion_tokens"]
    if not data.get("usage"):
        raise RuntimeError("the stream's last event has no usage (stream_options.include_usage)")
    return data["usage"]["completion_tokens"]


async def _closed_loop(one: Callable[[int], Awaitable[int]], concurrency: int, requests: int) -> dict[str, float]:
    """`concurrency` workers take request indices from one queue until it is empty; `one(i)` sends
    request i and returns its completion tokens."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    totals = {"tokens": 0, "requests": 0}

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            tokens = await one(i)  # (not `totals[...] += await ...`: racy)
            totals["tokens"] += tokens
            totals["requests"] += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": totals["tokens"], "requests": totals["requests"],
            "tokens_per_s": totals["tokens"] / elapsed, "requests_per_s": totals["requests"] / elapsed}


async def run_raw_load(url: str, *, endpoint: str, stream: bool, concurrency: int, requests: int,
                       max_tokens: int, temperature: Optional[float] = None) -> dict[str, float]:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    # One keep-alive connection per worker: a worker holds one while its request runs.
    conns: asyncio.Queue = asyncio.Queue()
    for _ in range(concurrency):
        conns.put_nowait(_RawConnection(parsed.hostname or "127.0.0.1", parsed.port or 80))

    async def one(i: int) -> int:
        conn = await conns.get()
        try:
            path, body = _body(endpoint, max_tokens, stream, i, temperature)
            status, raw = await conn.request(path, body)
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {raw[:300]!r}")
            return _tokens_from(endpoint, stream, raw)
        finally:
            conns.put_nowait(conn)

    try:
        return await _closed_loop(one, concurrency, requests)
    finally:
        while not conns.empty():
            conns.get_nowait().close()


async def run_direct_load(triton_url: str, *, endpoint: str, stream: bool, concurrency: int, requests: int,
                          max_tokens: int, temperature: Optional[float] = None) -> dict[str, float]:
    """The same load straight to Triton with TritonLLMClient (no HTTP): what the Triton side
    alone costs, to set the frontend's numbers against."""
    from openai_frontend.engine_types import EngineRequest
    from openai_frontend.triton_client import TritonLLMClient

    client = TritonLLMClient(triton_url)

    async def one(i: int) -> int:
        sp = {"max_new_tokens": max_tokens, "ignore_eos": True}
        if temperature is not None:
            sp["temperature"] = temperature
        if endpoint == "chat":
            req = EngineRequest(sp, messages=[{"role": "user", "content": f"Tell me a story number {i}."}],
                                stream=stream)
        else:
            req = EngineRequest(sp, text_input=f"Story {i}: once upon a time", stream=stream)
        tokens = 0
        async for chunk in client.generate(req):
            tokens += len(chunk.token_ids)
        return tokens

    try:
        return await _closed_loop(one, concurrency, requests)
    finally:
        await client.close()


async def run_load(url: str, *, endpoint: str, stream: bool, concurrency: int, requests: int,
                   max_tokens: int, temperature: Optional[float] = None) -> dict[str, float]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        return await _closed_loop(lambda i: _one(http, endpoint, max_tokens, stream, i, temperature),
                                  concurrency, requests)


async def run_sdk_load(url: str, *, endpoint: str, stream: bool, concurrency: int, requests: int,
                       max_tokens: int, temperature: Optional[float] = None) -> dict[str, float]:
    """The same load through the OpenAI Python SDK (AsyncOpenAI): what an SDK user's client adds,
    a pydantic object per streamed event included."""
    import openai

    if endpoint == "generate":
        raise SystemExit("--client sdk: /generate is not an OpenAI endpoint")
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
                             timeout=600)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http, max_retries=0)

    async def one(i: int) -> int:
        _, body = _body(endpoint, max_tokens, stream, i, temperature)
        body.pop("stream")
        if endpoint == "responses":
            if not stream:
                return (await client.responses.create(**body)).usage.output_tokens
            tokens = 0
            async for event in await client.responses.create(**body, stream=True):
                if event.type in ("response.completed", "response.incomplete"):
                    tokens = event.response.usage.output_tokens
            return tokens
        extra = {"ignore_eos": body.pop("ignore_eos")}
        create = client.chat.completions.create if endpoint == "chat" else client.completions.create
        if not stream:
            r = await create(**body, extra_body=extra)
            return r.usage.completion_tokens
        body["stream_options"] = {"include_usage": True}
        tokens = 0
        async for chunk in await create(**body, stream=True, extra_body=extra):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    try:
        return await _closed_loop(one, concurrency, requests)
    finally:
        await client.close()


class _PacedEngine:
    """A scripted engine that makes `max_new_tokens` tokens at `token_delay` seconds each, per
    request, whether it streams them (one chunk per token) or not (one chunk at the end)."""

    def __init__(self, token_delay: float) -> None:
        self.delay = token_delay

    async def generate(self, request):
        from openai_frontend.engine_types import EngineChunk

        n = request.sampling_params.get("max_new_tokens", 16)
        meta = '{"index": 0, "cached_tokens": 0}'
        if not request.stream:
            if self.delay:
                await asyncio.sleep(self.delay * n)
            yield EngineChunk(" tok" * n, list(range(n)), "length", 12, n, meta)
            return
        for i in range(n):
            if self.delay:
                await asyncio.sleep(self.delay)
            yield EngineChunk(" tok", [i], "length" if i == n - 1 else None, 12, i + 1, meta)

    async def is_ready(self) -> bool:
        return True

    async def engine_info(self) -> dict:
        # The frontend asks the engine's context length once (prompt and max_tokens checks).
        return {"config": {"max_model_len": 1 << 20}, "stats": {}}

    async def close(self) -> None:
        pass


def _fake_app(token_delay: float, max_tokens: int):
    from openai_frontend.server import create_app
    from openai_frontend.settings import Settings

    return create_app(Settings(model_name="demo"), client=_PacedEngine(token_delay))


def _serve_fake(port: int, chunk_delay: float, max_tokens: int) -> None:
    import uvicorn

    uvicorn.run(_fake_app(chunk_delay, max_tokens), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, loop="uvloop", http="httptools")


@contextlib.contextmanager
def _fake_server(chunk_delay: float, max_tokens: int):
    """The frontend on a scripted engine, in its own process (as deployed: the load generator
    must not share its interpreter)."""
    import subprocess
    import sys

    from openai_frontend.testing import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "openai_frontend.bench", "--serve-fake", str(port),
                             "--chunk-delay", str(chunk_delay), "--max-tokens", str(max_tokens)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the fake frontend did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m openai_frontend.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:9000")
    p.add_argument("--fake", action="store_true", help="in-process frontend on a scripted engine")
    p.add_argument("--chunk-delay", type=float, default=0.0,
                   help="--fake: the scripted engine's seconds per token (streamed or not)")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions", "generate", "responses"])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 for greedy (the engine's fastest path: the most responses per second); "
                        "default: the model's sampling defaults")
    p.add_argument("--modes", default="plain,stream", help="order of the runs: plain,stream")
    p.add_argument("--warmup", type=int, default=16, help="requests sent first, not measured")
    p.add_argument("--direct-triton", default=None, metavar="HOST:PORT",
                   help="also run each mode straight against this Triton gRPC endpoint (no frontend)")
    p.add_argument("--client", default="raw", choices=["raw", "httpx", "sdk"],
                   help="raw: a minimal HTTP/1.1 load generator (default; counts SSE events without parsing "
                        "them, so the client is not the bottleneck); httpx: parse every event's JSON as a client "
                        "would; sdk: the OpenAI Python SDK (a pydantic object per event)")
    p.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_fake:
        _serve_fake(args.serve_fake, args.chunk_delay, args.max_tokens)
        return

    ctx = _fake_server(args.chunk_delay, args.max_tokens) if args.fake else contextlib.nullcontext(args.url)
    with ctx as url:
        load = {"raw": run_raw_load, "httpx": run_load, "sdk": run_sdk_load}[args.client]
        if args.warmup:
            asyncio.run(load(url, endpoint=args.endpoint, stream=True, concurrency=min(args.concurrency, args.warmup),
                             requests=args.warmup, max_tokens=args.max_tokens, temperature=args.temperature))
        runs: list[tuple[str, Any]] = []
        for mode in args.modes.split(","):
            runs.append((mode, load))
            if args.direct_triton:
                runs.append((f"triton-{mode}", None))
        sums: dict[str, list[float]] = {}
        for name, fn in runs:
            stream = name.endswith("stream")
            kwargs = dict(endpoint=args.endpoint, stream=stream, concurrency=args.concurrency,
                          requests=args.requests, max_tokens=args.max_tokens, temperature=args.temperature)
            r = asyncio.run(fn(url, **kwargs) if fn else run_direct_load(args.direct_triton, **kwargs))
            sums.setdefault(name, []).append(r["tokens_per_s"])
            print(f"{name:>14}: {r['requests']} requests, {r['tokens']} tokens in {r['seconds']:.2f} s: "
                  f"{r['tokens_per_s']:.1f} tokens/s, {r['requests_per_s']:.2f} requests/s", flush=True)
        mean = {k: sum(v) / len(v) for k, v in sums.items()}
        if "plain" in mean and "stream" in mean:
            print(f"frontend streaming / non-streaming throughput: {mean['stream'] / mean['plain']:.3f}")
        if "triton-plain" in mean and "triton-stream" in mean:
            print(f"Triton alone, streaming / non-streaming: {mean['triton-stream'] / mean['triton-plain']:.3f}")
            print(f"frontend / Triton alone: non-streaming {mean['plain'] / mean['triton-plain']:.3f}, "
                  f"streaming {mean['stream'] / mean['triton-stream']:.3f}")


if __name__ == "__main__":
    main()

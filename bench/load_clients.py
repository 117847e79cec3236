"""The benchmarks' clients: what one request looks like to its client (`Rec`), the closed loop
that sends a workload at a concurrency, the tritonclient and OpenAI-SDK requesters, and a pool of
client processes for hosts where one Python client process would be the bottleneck.

No torch here: the pool's processes import only this module and their client library.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import multiprocessing
import struct
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Optional, Sequence, Union


@dataclass
class Rec:
    """One request as its client saw it (perf_counter seconds)."""

    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrivals of responses carrying tokens
    tokens: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    error: Optional[str] = None
    cached_tokens: int = 0
    reordered: int = 0  # responses that arrived out of generation order


@dataclass
class Workload:
    prompts: list[list[int]]
    new_tokens: list[int]
    temperature: float
    seeds: list[int]
    # vLLM's cache_salt per request: a salt of its own keeps a request from every cached block,
    # so a server with prefix caching on serves it as one with caching off would.
    cache_salts: Optional[list[str]] = None

    def sampling(self, i: int) -> dict[str, Any]:
        p: dict[str, Any] = {"max_new_tokens": self.new_tokens[i], "temperature": self.temperature,
                             "ignore_eos": True}
        if self.temperature > 0:
            p["seed"] = self.seeds[i]
        if self.cache_salts is not None:
            p["cache_salt"] = self.cache_salts[i]
        return p


Requester = Callable[[int], Awaitable[Rec]]


async def closed_loop(request: Union[Requester, "ClientPool"], indices: Sequence[int], concurrency: int
                      ) -> tuple[list[Rec], float]:
    """`concurrency` clients, each sending its next request when the previous one ends: in this
    event loop, or shared out among a ClientPool's processes."""
    if isinstance(request, ClientPool):
        return await request.closed_loop(indices, concurrency)
    it = iter(indices)
    recs: dict[int, Rec] = {}

    async def client() -> None:
        for i in it:
            try:
                recs[i] = await request(i)
            except Exception as exc:  # keep measuring the others
                recs[i] = Rec(start=time.perf_counter(), end=time.perf_counter(), error=f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(max(1, min(concurrency, len(indices))))))
    wall = time.perf_counter() - t0
    return [recs[i] for i in indices], wall


def _ids_from_raw(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw[: len(raw) // 4 * 4]))


def triton_requester(url: str, wl: Workload, model: str = "ensemble"):
    import numpy as np
    import tritonclient.grpc.aio as grpc_aio
    from tritonclient.grpc import InferInput

    holder: dict[str, Any] = {}

    def client():
        if "c" not in holder:
            holder["c"] = grpc_aio.InferenceServerClient(url)
        return holder["c"]

    def inputs(i: int) -> list:
        ids = np.asarray(wl.prompts[i], dtype=np.int32)
        t_ids = InferInput("input_ids", [int(ids.size)], "INT32")
        t_ids.set_data_from_numpy(ids)
        t_stream = InferInput("stream", [1], "BOOL")
        t_stream.set_data_from_numpy(np.array([True]))
        t_params = InferInput("sampling_parameters", [1], "BYTES")
        t_params.set_data_from_numpy(np.array([json.dumps(wl.sampling(i)).encode()], dtype=np.object_))
        return [t_ids, t_stream, t_params]

    async def request(i: int) -> Rec:
        rec = Rec()
        done = asyncio.Event()
        payload = {"model_name": model, "inputs": inputs(i), "request_id": uuid.uuid4().hex,
                   "parameters": {"triton_enable_empty_final_response": True}}

        async def requests():
            yield payload
            await done.wait()

        idx = cidx = -1
        pieces: list[tuple[int, list[int]]] = []  # (position of the first token, ids)
        expected = 0
        rec.start = time.perf_counter()
        responses = client().stream_infer(requests())
        try:
            async for result, error in responses:
                now = time.perf_counter()
                if error is not None:
                    rec.error = str(error)
                    break
                resp = result.get_response()
                if resp.outputs:
                    if idx < 0:
                        names = [o.name for o in resp.outputs]
                        idx, cidx = names.index("output_ids"), names.index("completion_tokens")
                    new = _ids_from_raw(resp.raw_output_contents[idx])
                    if new:
                        rec.chunk_times.append(now)
                        # completion_tokens is cumulative: where these tokens belong. The ensemble
                        # may deliver responses out of order (postprocessing on several instances).
                        begin = _ids_from_raw(resp.raw_output_contents[cidx])[0] - len(new)
                        rec.reordered += begin != expected
                        expected = max(expected, begin + len(new))
                        pieces.append((begin, new))
                final = resp.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
        finally:
            done.set()
        rec.end = time.perf_counter()
        rec.ids = [t for _, ids in sorted(pieces, key=lambda p: p[0]) for t in ids]
        rec.tokens = len(rec.ids)
        return rec

    async def close() -> None:
        if "c" in holder:
            await holder.pop("c").close()

    return request, close


def openai_requester(base_url: str, name: str, wl: Workload, stream: bool):
    import httpx
    from openai import AsyncOpenAI

    holder: dict[str, Any] = {}

    def client() -> AsyncOpenAI:
        if "c" not in holder:
            http = httpx.AsyncClient(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=4096),
                                     timeout=httpx.Timeout(1800.0))
            holder["c"] = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, http_client=http)
        return holder["c"]

    async def request(i: int) -> Rec:
        rec = Rec()
        extra: dict[str, Any] = {"ignore_eos": True}
        if wl.cache_salts is not None:
            extra["cache_salt"] = wl.cache_salts[i]
        kwargs: dict[str, Any] = dict(model=name, prompt=list(wl.prompts[i]), max_tokens=wl.new_tokens[i],
                                      temperature=wl.temperature, extra_body=extra)
        if wl.temperature > 0:
            kwargs["seed"] = wl.seeds[i]
        rec.start = time.perf_counter()
        if stream:
            texts = []
            resp = await client().completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
            async for chunk in resp:
                now = time.perf_counter()
                if chunk.choices:
                    c = chunk.choices[0]
                    if c.text or not c.finish_reason:
                        rec.chunk_times.append(now)
                    texts.append(c.text or "")
                if chunk.usage is not None:
                    rec.tokens = chunk.usage.completion_tokens
            rec.text = "".join(texts)
        else:
            resp = await client().completions.create(stream=False, **kwargs)
            rec.tokens = resp.usage.completion_tokens
            rec.text = resp.choices[0].text
        rec.end = time.perf_counter()
        return rec

    async def close() -> None:
        if "c" in holder:
            await holder.pop("c").close()

    return request, close


# ---------------------------------------------------------------------------------------------
# Client processes
# ---------------------------------------------------------------------------------------------


def _resolve(factory: str) -> Callable[..., tuple[Requester, Callable[[], Awaitable[None]]]]:
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)


def _client_process(conn, factory: str, args: tuple) -> None:
    """A pool process: one requester (its own event loop and connections) for the pool's life;
    runs each closed loop it is sent and sends the records back."""

    async def serve() -> None:
        request, close = _resolve(factory)(*args)
        try:
            while True:
                msg = await asyncio.to_thread(conn.recv)
                if msg is None:
                    return
                indices, concurrency = msg
                conn.send(await closed_loop(request, indices, concurrency))
        finally:
            await close()

    try:
        asyncio.run(serve())
    finally:
        conn.close()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A spawned process first re-imports the parent's __main__ (its spec or file). For
    `python -m bench.serving_bench` that is torch and the engine, hundreds of MB a client; the
    clients need only this module."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def split_loop(indices: Sequence[int], concurrency: int, procs: int) -> tuple[list[list[int]], list[int]]:
    """A closed loop's requests and clients shared out among `procs` processes. Client slot j
    runs in process j % procs, and request i goes to slot i % concurrency: each process's share
    of the requests is its share of the clients, so every process's clients stay busy as long as
    the others' (QA: equal shares for 2 and 1 clients ran the last third of a level at
    concurrency 2 instead of 3)."""
    shares = [[i for pos, i in enumerate(indices) if pos % concurrency % procs == k] for k in range(procs)]
    return shares, [concurrency // procs + (k < concurrency % procs) for k in range(procs)]


class ClientPool:
    """`procs` client processes sharing each closed loop: the concurrency is split as evenly,
    and the requests in proportion to it. One Python process parsing an OpenAI SDK stream per
    token for 64 streams is near a whole core (0.91 on an H100 host at 64 streams against a
    server that kept up), so on a host with cores to spare it, not the server, would set the
    throughput measured. `factory` is "module:function" returning (request, close), as
    openai_requester does; `args` are pickled to each process (spawned: no inherited threads)."""

    def __init__(self, factory: str, args: tuple, procs: int) -> None:
        if procs < 2:
            raise ValueError("a pool needs two processes or more; use the requester itself")
        ctx = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        with _main_module_hidden():
            for _ in range(procs):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_client_process, args=(child, factory, args), daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    async def closed_loop(self, indices: Sequence[int], concurrency: int) -> tuple[list[Rec], float]:
        """As closed_loop in one process, over min(procs, concurrency) of the processes."""
        used = self._conns[: max(1, min(len(self._conns), concurrency, len(indices)))]
        m = len(used)
        shares, clients = split_loop(indices, concurrency, m)
        t0 = time.perf_counter()
        for k, conn in enumerate(used):
            conn.send((shares[k], clients[k]))
        results = await asyncio.gather(*(asyncio.to_thread(conn.recv) for conn in used))
        wall = time.perf_counter() - t0
        by_index: dict[int, Rec] = {}
        for share, (recs, _) in zip(shares, results):
            by_index.update(zip(share, recs))
        return [by_index[i] for i in indices], wall

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()

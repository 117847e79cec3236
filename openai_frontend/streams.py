"""Running one or more engine streams for a request, and SSE plumbing.

* `iterate_choices`: one engine stream per choice (n > 1, batched prompts), merged in arrival
  order as (choice index, chunk). Closing it (or cancelling its consumer) closes every stream,
  which cancels their gRPC calls.
* `start_stream`: waits for the first chunk before the HTTP response starts, so errors the
  engine reports up front (bad parameters, Triton down) get a real status code even with
  `stream: true`.
* `sse_response`: a plain StreamingResponse of preformatted `data: ...` lines (no per-event
  object overhead). Starlette cancels the body on client disconnect, which unwinds into the
  streams above.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence

from starlette.responses import StreamingResponse

from openai_frontend.engine_types import EngineChunk, EngineClient, EngineRequest

DONE_EVENT = b"data: [DONE]\n\n"
_END = object()

Item = tuple[int, EngineChunk]


async def iterate_choices(client: EngineClient, requests: Sequence[EngineRequest]) -> AsyncIterator[Item]:
    if len(requests) == 1:
        stream = client.generate(requests[0])
        try:
            async for chunk in stream:
                yield 0, chunk
        finally:
            await stream.aclose()
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, request: EngineRequest) -> None:
        stream = client.generate(request)
        try:
            async for chunk in stream:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StartedStream:
    """A choices iterator whose first item has already been received."""

    def __init__(self, it: AsyncIterator[Item], first: Optional[Item]) -> None:
        self._it = it
        self._first = first

    async def __aiter__(self) -> AsyncIterator[Item]:
        if self._first is None:
            return
        first, self._first = self._first, None
        yield first
        async for item in self._it:
            yield item

    async def aclose(self) -> None:
        await self._it.aclose()


async def start_stream(client: EngineClient, requests: Sequence[EngineRequest]) -> StartedStream:
    it = iterate_choices(client, requests)
    try:
        first = await it.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        await it.aclose()
        raise
    return StartedStream(it, first)


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(body: AsyncIterator[bytes], headers: Optional[dict[str, str]] = None) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})

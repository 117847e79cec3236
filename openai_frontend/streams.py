"""Running one or more engine streams for a request, disconnect handling, and SSE plumbing.

* `iterate_choices`: the engine streams of a request (one per prompt; each carries that prompt's
  n samples) merged in arrival order as (choice index, chunk), choice index = the prompt's first
  choice + the chunk's sample index. One prompt (the common case) needs no extra task; several
  are pumped by one task each into a queue. Closing the iterator (or cancelling its consumer)
  closes every stream, which cancels their gRPC calls.
* `sse_events`: a handler's event generator as an SSE body: errors after the start become error
  events, the engine stream is closed, `[DONE]` ends it.
* `start_stream`: waits for the first chunk before the HTTP response starts, so errors the
  engine reports up front (bad parameters, overload, Triton down) get a real status code even
  with `stream: true`.
* `run_until_disconnect`: runs a handler in the request's own task and cancels it when the
  client goes away (a watcher task on `receive`), so a disconnect stops the engine work.
* `SSEResponse`: a minimal ASGI response for preformatted `data: ...` events: one `send` per
  event, the same disconnect watcher, and the body iterator always closed (so the engine streams
  are cancelled at once, not when the generator is garbage-collected).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from openai_frontend import request_context
from openai_frontend.common import error_event
from openai_frontend.engine_types import EngineChunk, EngineClient, EngineRequest
from openai_frontend.errors import APIError

log = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"
_END = object()

Item = tuple[int, EngineChunk]


async def iterate_choices(client: EngineClient, requests: Sequence[EngineRequest]) -> AsyncIterator[Item]:
    if len(requests) == 1:
        stream = client.generate(requests[0])
        try:
            async for chunk in stream:
                yield chunk.index, chunk
        finally:
            await stream.aclose()
        return

    queue: asyncio.Queue = asyncio.Queue()
    offsets = []
    total = 0
    for r in requests:
        offsets.append(total)
        total += r.n

    async def pump(k: int, request: EngineRequest) -> None:
        stream = client.generate(request)
        base = offsets[k]
        try:
            async for chunk in stream:
                queue.put_nowait((k, base + chunk.index, chunk))
            queue.put_nowait((k, -1, _END))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            queue.put_nowait((k, -1, exc))
        finally:
            await stream.aclose()

    tasks = [asyncio.create_task(pump(k, r)) for k, r in enumerate(requests)]
    remaining = len(tasks)
    # Nothing goes out until every prompt has been heard from: a prompt the server refuses (too
    # long, say) is then the request's 400, as in vLLM, not an error event after another
    # prompt's 200 and first tokens. The prompts are prefilled together, so this holds the
    # first chunk back only by their spread in time to first token.
    unheard = set(range(len(requests)))
    held: list[Item] = []
    try:
        while remaining:
            k, index, item = await queue.get()
            unheard.discard(k)
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                held.append((index, item))
            if not unheard:
                for got in held:
                    yield got
                held.clear()
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

    @property
    def first(self) -> Optional[Item]:
        """The first item, until iteration takes it (e.g. its prompt_tokens for a role chunk)."""
        return self._first

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


async def sse_events(stream: StartedStream, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body from `events` (built on `stream`): once the response has started an error can
    only be reported in the stream, as an error event; the engine stream is always closed; the
    body ends with [DONE]."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        if exc.status_code >= 500:
            log.warning("stream ended by an error: %d %s (request %s)", exc.status_code, exc.message,
                        request_context.request_id())
        yield error_event(exc)
    except Exception as exc:
        log.exception("error while streaming (request %s)", request_context.request_id())
        yield error_event(APIError(500, f"Internal server error: {exc}"))
    finally:
        try:
            await events.aclose()  # type: ignore[attr-defined]
        finally:
            await stream.aclose()
    yield DONE_EVENT


class _Disconnect:
    """Watches `receive` for http.disconnect and cancels the task that created it."""

    __slots__ = ("task", "watcher", "disconnected", "active")

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.disconnected = False
        self.active = True
        self.watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.active:
            self.disconnected = True
            self.task.cancel()

    def stop(self) -> None:
        self.active = False
        self.watcher.cancel()

    def swallow(self) -> bool:
        """In an `except CancelledError`: True when it came from the disconnect (then undone)."""
        if self.disconnected:
            self.task.uncancel()
            return True
        return False


async def run_until_disconnect(receive: Receive, work: Awaitable[Any]) -> tuple[bool, Any]:
    """(disconnected, result): runs `work` in this task; a client disconnect cancels it."""
    guard = _Disconnect(receive)
    try:
        return False, await work
    except asyncio.CancelledError:
        if guard.swallow():
            return True, None
        raise
    finally:
        guard.stop()


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class SSEResponse(Response):
    """Streams preformatted SSE bytes. `hooks` = (on_start, on_end) feed the in-flight gauge.

    A Response subclass only so FastAPI passes it through; Response.__init__ is not used."""

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncIterator[bytes],
        status_code: int = 200,
        headers: Optional[dict[str, str]] = None,
        hooks: Optional[tuple[Callable[[], None], Callable[[], None]]] = None,
    ) -> None:
        self.body = body
        self.status_code = status_code
        self.raw_headers = SSE_HEADERS + [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        self.hooks = hooks
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.hooks:
            self.hooks[0]()
        guard = _Disconnect(receive)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not guard.swallow():
                raise
            log.debug("client disconnected mid-stream")
        except OSError:  # the connection broke while sending: the client is gone
            log.debug("client connection lost mid-stream")
        finally:
            guard.stop()
            try:
                await self.body.aclose()  # type: ignore[attr-defined]
            finally:
                if self.hooks:
                    self.hooks[1]()


def sse_response(body: AsyncIterator[bytes], headers: Optional[dict[str, str]] = None, hooks: Any = None) -> SSEResponse:
    return SSEResponse(body, headers=headers, hooks=hooks)

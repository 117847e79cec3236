"""ResponseReader: a gRPC response stream read by a task of its own, so a consumer's
cancellation (a client disconnect) never cancels a read in flight (grpc.aio leaks those)."""

from __future__ import annotations

import asyncio

import pytest

from openai_frontend.triton_client import ResponseReader


class ScriptedCall:
    """Stands in for tritonclient's response iterator: each read waits on a future the test
    resolves; cancel() ends a read in flight as grpc.aio does for a cancelled call (CancelledError
    raised inside the reading task, which nobody cancelled)."""

    def __init__(self) -> None:
        self.pending: asyncio.Future | None = None
        self.reads = 0
        self.reads_cancelled = 0  # reads whose awaiting task was cancelled: what leaks in grpc.aio
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        self.reads += 1
        self.pending = asyncio.get_running_loop().create_future()
        try:
            return await self.pending
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                self.reads_cancelled += 1
            raise
        finally:
            self.pending = None

    def deliver(self, item) -> None:
        self.pending.set_result(item)

    def end(self, exc: BaseException) -> None:
        self.pending.set_exception(exc)

    def cancel(self) -> bool:
        self.cancelled = True
        if self.pending is not None and not self.pending.done():
            self.pending.set_exception(asyncio.CancelledError())
        return True


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_items_arrive_in_order_then_the_end():
    async def main():
        call = ScriptedCall()
        reader = ResponseReader(call)
        got = []

        async def consume():
            async for item in reader:
                got.append(item)

        consumer = asyncio.ensure_future(consume())
        for item in ("a", "b", "c"):
            await _settle()
            call.deliver(item)
        await _settle()
        call.end(StopAsyncIteration())
        await asyncio.wait_for(consumer, 1)
        assert got == ["a", "b", "c"]
        with pytest.raises(StopAsyncIteration):  # and stays ended
            await reader.__anext__()

    asyncio.run(main())


def test_a_cancelled_consumer_leaves_the_read_alone_and_close_ends_it_through_the_call():
    async def main():
        call = ScriptedCall()
        reader = ResponseReader(call)
        consumer = asyncio.ensure_future(reader.__anext__())
        await _settle()
        assert call.pending is not None  # a read is in flight
        consumer.cancel()  # what a client disconnect does to the handler's task
        await _settle()
        assert consumer.cancelled()
        assert call.reads_cancelled == 0 and call.pending is not None and not call.cancelled
        reader.close()  # the handler's cleanup
        await _settle()
        assert call.cancelled and call.reads_cancelled == 0
        assert reader._task.done() and not reader._task.cancelled()
        assert call.reads == 1  # nothing read after the call ended

    asyncio.run(main())


def test_cancel_hands_the_calls_end_to_the_consumer():
    """The stopping watch cancels a silent stream's call: its consumer must hear of it."""
    async def main():
        call = ScriptedCall()
        reader = ResponseReader(call)
        consumer = asyncio.ensure_future(reader.__anext__())
        await _settle()
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(consumer, 1)
        assert call.reads_cancelled == 0

    asyncio.run(main())


def test_errors_reach_the_consumer():
    async def main():
        call = ScriptedCall()
        reader = ResponseReader(call)
        await _settle()
        call.end(RuntimeError("deadline"))
        with pytest.raises(RuntimeError, match="deadline"):
            await asyncio.wait_for(reader.__anext__(), 1)

    asyncio.run(main())


def test_reading_ahead_is_bounded_and_close_frees_a_reader_waiting_for_room():
    async def main():
        call = ScriptedCall()
        reader = ResponseReader(call)
        for i in range(ResponseReader.READ_AHEAD + 1):
            await _settle()
            call.deliver(i)
        await _settle()
        # READ_AHEAD queued and one more read, waiting for room: no further read started
        assert call.reads == ResponseReader.READ_AHEAD + 1 and call.pending is None
        assert await reader.__anext__() == 0
        await _settle()
        assert call.reads == ResponseReader.READ_AHEAD + 2  # room made, the next read began
        await _settle()
        call.deliver("x")
        await _settle()  # queue full again, the reader waits for room (not for gRPC)
        reader.close()
        await _settle()
        assert reader._task.cancelled() and call.reads_cancelled == 0

    asyncio.run(main())

"""Background responses (`background: true`): a turn that runs on whatever becomes of the request
that started it.

The POST answers at once, with the response queued, or (streaming) with a stream that follows the
response's events as a later GET /v1/responses/{id}?stream=true&starting_after=N does. The turn
runs in a task of this process; its record goes to the store at each change of status (queued,
in_progress, then completed, incomplete, failed or cancelled), so a GET from any frontend worker
sees where it is, and a streamed one's events go there as they come, for any worker to replay.

POST /v1/responses/{id}/cancel cancels the task, which closes its chat stream and so aborts the
engine request, as a client's disconnect does. A cancel that reaches another worker is asked
through the store; the worker running the turn looks for such asks while it has turns running.
A turn whose worker is gone (killed, restarted) reads as failed, not in progress forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from typing import Any, AsyncIterator, Optional, Protocol

from openai_frontend.response_store import ResponseStore

log = logging.getLogger(__name__)

# A response's statuses once it has stopped, and the stream events that end a stream.
FINAL = ("completed", "incomplete", "failed", "cancelled")
_LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed")
# How often a worker looks for cancels asked through the store, and a follower in another worker
# for new events.
POLL_S = 0.05
# How long a cancel sent to another worker waits for that worker to stop the turn.
CANCEL_WAIT_S = 10.0


class Turn(Protocol):
    """What a background run needs of the turn it runs (responses._Turn)."""

    id: str

    def snapshot(self, status: str) -> dict[str, Any]: ...

    def record(self, response: dict[str, Any]) -> None: ...


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class BackgroundRuns:
    """This process's background turns, and the view of any worker's through the store."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        # Who runs a turn, in its record: this process's pid, and which of its apps (tests run
        # several in one process).
        self.worker = f"{os.getpid()}:{secrets.token_hex(4)}"
        self._tasks: dict[str, asyncio.Task] = {}
        self._news: dict[str, asyncio.Event] = {}  # set on each new event of a streamed turn
        self._watcher: Optional[asyncio.Task] = None
        self._closing = False

    def start(self, turn: Turn, events: AsyncIterator[dict[str, Any]], streamed: bool) -> None:
        """Runs `events` (the turn's Responses events) to their end in a task of its own."""
        if streamed:
            self.store.open_events(turn.id)
            self._news[turn.id] = asyncio.Event()
        self._tasks[turn.id] = asyncio.create_task(self._run(turn, events, streamed))
        if self.store.directory is not None and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_cancels())

    async def _run(self, turn: Turn, events: AsyncIterator[dict[str, Any]], streamed: bool) -> None:
        seq = 0
        try:
            async for event in events:
                event["sequence_number"] = seq
                seq += 1
                # A status not stored otherwise (the handler stored it queued, the turn keeps it
                # completed or incomplete).
                if event["type"] in ("response.in_progress", "response.failed"):
                    turn.record(event["response"])
                if streamed:
                    self.store.add_event(turn.id, event)
                    self._notify(turn.id)
        except asyncio.CancelledError:
            if not self._closing:
                turn.record(turn.snapshot("cancelled"))
            else:
                failed = turn.snapshot("failed")
                failed["error"] = {"code": "server_error",
                                   "message": "The frontend shut down before this background response finished"}
                turn.record(failed)
        except Exception as exc:  # a bug in the translation: the response says so, the task ends
            log.exception("background response %s failed", turn.id)
            failed = turn.snapshot("failed")
            failed["error"] = {"code": "server_error", "message": f"Internal server error: {exc}"}
            turn.record(failed)
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
            self._tasks.pop(turn.id, None)
            self._notify(turn.id)
            self._news.pop(turn.id, None)

    def _notify(self, response_id: str) -> None:
        news = self._news.get(response_id)
        if news is not None:
            news.set()
            self._news[response_id] = asyncio.Event()

    # -- what a GET sees ------------------------------------------------------------------------

    def view(self, record: dict[str, Any]) -> dict[str, Any]:
        """The stored response as it stands: one left unfinished by a worker that is gone is failed."""
        response = record["response"]
        if response.get("status") in FINAL or not response.get("background"):
            return response
        worker = str(record.get("worker", ""))
        pid = worker.split(":")[0]
        if response["id"] in self._tasks or (worker != self.worker and pid.isdigit() and _alive(int(pid))):
            return response
        return {**response, "status": "failed",
                "error": {"code": "server_error",
                          "message": "The frontend process running this background response exited before it finished"}}

    async def follow(self, response_id: str, after: int) -> AsyncIterator[dict[str, Any]]:
        """The turn's stream events numbered above `after`, then each as it comes, until its last."""
        while True:
            news = self._news.get(response_id)  # taken before reading: an event after the read sets it
            events = self.store.events(response_id, after)
            if events is None:  # deleted (or pruned) meanwhile
                return
            for event in events:
                yield event
                after = event["sequence_number"]
            if events and events[-1]["type"] in _LAST_EVENTS:
                return
            if not events:
                record = self.store.get(response_id)
                if record is None or self.view(record)["status"] in FINAL:
                    return  # cancelled (a cancelled stream has no last event), or its worker gone
            if news is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(news.wait(), timeout=1.0)
            else:
                await asyncio.sleep(POLL_S)

    # -- cancel ---------------------------------------------------------------------------------

    async def cancel(self, response_id: str) -> Optional[dict[str, Any]]:
        """Stops the turn (here, or through the store in the worker running it); its record after."""
        task = self._tasks.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        else:
            self.store.ask_cancel(response_id)
            deadline = time.monotonic() + CANCEL_WAIT_S
            while time.monotonic() < deadline:
                record = self.store.get(response_id)
                if record is None or self.view(record)["status"] in FINAL:
                    break
                await asyncio.sleep(POLL_S)
        return self.store.get(response_id)

    async def _watch_cancels(self) -> None:
        while True:
            await asyncio.sleep(POLL_S * 2)
            for response_id, task in list(self._tasks.items()):
                if self.store.cancel_asked(response_id):
                    task.cancel()

    async def close(self) -> None:
        """At shutdown: the turns still running end as failed, saying why."""
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

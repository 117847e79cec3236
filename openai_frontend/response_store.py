"""Stored Responses (`store: true`, OpenAI's default): what GET /v1/responses/{id} returns and what
a later request's `previous_response_id` continues from.

A record is the response object, the chat messages of its turn (its input and its output) and
the id of the response it continued: a conversation is the chain of its turns, so each turn is
stored once however long the conversation grows. The store keeps the `capacity` records read or
written last, within `max_bytes` of JSON (reading a conversation touches each of its turns, so a
conversation in use keeps its history). With several frontend `--workers` it lives in a directory they share, one JSON
file a record, so a conversation's next turn finds its history whichever worker accepts the
connection; one process keeps them in memory.

A background response (`background: true`) also has, while it runs and after, the events of its
stream (when it was created with `stream: true`, for GET ...?stream=true&starting_after=N to
replay and follow) and may have a cancel asked of it (by whichever worker got the POST .../cancel,
for the worker running it to act on). Both go with the record: evicted, pruned or deleted with it.

The Conversations API (conversations.py) keeps its conversations in a store of this kind of its
own, one record under each "conv_" id, changed in place with update().
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

# The ids this server hands out (a response's "resp_" or a conversation's "conv_", then hex):
# anything else is no file name to open.
_ID = re.compile(r"(resp|conv)_[0-9a-f]{8,64}")
# Files are pruned to capacity every this many writes (a directory listing each time costs more).
_PRUNE_EVERY = 32


class ResponseStore:
    def __init__(self, capacity: int = 4096, directory: Optional[str] = None, max_bytes: int = 256 << 20) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes  # the records' JSON, all together (a turn may carry a whole document)
        self.directory = Path(directory) if directory else None
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._memory: OrderedDict[str, str] = OrderedDict()  # id -> the record's JSON
        self._events: dict[str, list[str]] = {}  # id -> its stream's events, JSON each (memory only)
        self._cancels: set[str] = set()  # ids a cancel was asked of (memory only)
        self._bytes = 0
        self._writes = 0
        self._written = 0  # bytes written since the directory was last pruned

    def put(self, response_id: str, record: dict[str, Any]) -> None:
        if self.capacity <= 0:
            return
        text = json.dumps(record)
        if self.directory is None:
            self._bytes += len(text) - len(self._memory.pop(response_id, ""))
            self._memory[response_id] = text
            while len(self._memory) > 1 and (len(self._memory) > self.capacity or self._bytes > self.max_bytes):
                self._forget(next(iter(self._memory)))
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.directory / f"{response_id}.json")  # readers never see half a record
        self._writes += 1
        self._written += len(text)
        if self._writes % _PRUNE_EVERY == 0 or self._written > self.max_bytes // _PRUNE_EVERY:
            self._prune()

    def get(self, response_id: str) -> Optional[dict[str, Any]]:
        if self.directory is None:
            text = self._memory.get(response_id)
            if text is None:
                return None
            self._memory.move_to_end(response_id)
            return json.loads(text)
        if not _ID.fullmatch(response_id):
            return None
        path = self.directory / f"{response_id}.json"
        try:
            record = json.loads(path.read_text())
            os.utime(path)  # pruning goes by the time of last use
        except (OSError, ValueError):
            return None
        return record

    def update(self, record_id: str, change: Callable[[dict[str, Any]], Any]) -> Any:
        """Reads the record, lets `change` edit it and writes it back, in one step for every
        worker sharing the directory; `change`'s result (None, without writing, when the record
        is not stored)."""
        with self._exclusive():
            record = self.get(record_id)
            if record is None:
                return None
            result = change(record)
            self.put(record_id, record)
            return result

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        if self.directory is None:  # one process, one event loop: nothing runs between read and write
            yield
            return
        with open(self.directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield

    def chain(self, response_id: str, limit: int = 100_000) -> Optional[list[dict[str, Any]]]:
        """The messages of every turn up to and including this response's, oldest first; None when
        the response, or a turn before it, is no longer stored."""
        turns = []
        rid: Optional[str] = response_id
        while rid is not None and len(turns) < limit:
            record = self.get(rid)
            if record is None:
                return None
            turns.append(record["turn"])
            rid = record.get("previous")
        return [message for turn in reversed(turns) for message in turn]

    def delete(self, response_id: str) -> bool:
        if self.directory is None:
            known = response_id in self._memory
            self._forget(response_id)
            return known
        if not _ID.fullmatch(response_id):
            return False
        try:
            (self.directory / f"{response_id}.json").unlink()
        except OSError:
            return False
        self._unlink_companions(self.directory / f"{response_id}.json")
        return True

    # -- a background response's stream and cancel ---------------------------------------------

    def open_events(self, response_id: str) -> None:
        """Starts the (empty) stream of a stored response: events() is a list from now on."""
        if self.directory is None:
            if response_id in self._memory:
                self._events.setdefault(response_id, [])
        else:
            (self.directory / f"{response_id}.events").touch()

    def add_event(self, response_id: str, event: dict[str, Any]) -> None:
        """Appends one event (with its sequence_number) to the response's stream."""
        line = json.dumps(event)
        if self.directory is None:
            if response_id not in self._memory:  # evicted meanwhile: its stream goes with it
                return
            self._events.setdefault(response_id, []).append(line)
            self._bytes += len(line)
            return
        with open(self.directory / f"{response_id}.events", "a") as f:
            f.write(line + "\n")  # one write: a reader sees whole lines and at most one partial last one

    def events(self, response_id: str, after: int = -1) -> Optional[list[dict[str, Any]]]:
        """The stream's events numbered above `after`; None when the response has no stream kept."""
        if self.directory is None:
            lines = self._events.get(response_id)
            if lines is None:
                return None
            return [json.loads(line) for line in lines[after + 1:]]
        if not _ID.fullmatch(response_id):
            return None
        try:
            text = (self.directory / f"{response_id}.events").read_text()
        except OSError:
            return None
        lines = text.split("\n")[:-1]  # what follows the last newline is still being written
        return [json.loads(line) for line in lines[after + 1:]]

    def ask_cancel(self, response_id: str) -> None:
        if self.directory is None:
            self._cancels.add(response_id)
        elif _ID.fullmatch(response_id):
            (self.directory / f"{response_id}.cancel").touch()

    def cancel_asked(self, response_id: str) -> bool:
        if self.directory is None:
            return response_id in self._cancels
        return (self.directory / f"{response_id}.cancel").exists()

    def _forget(self, response_id: str) -> None:
        self._bytes -= len(self._memory.pop(response_id, ""))
        self._bytes -= sum(len(line) for line in self._events.pop(response_id, ()))
        self._cancels.discard(response_id)

    @staticmethod
    def _unlink_companions(record: Path) -> None:
        for suffix in (".events", ".cancel"):
            record.with_suffix(suffix).unlink(missing_ok=True)

    def _prune(self) -> None:
        self._written = 0
        entries = []
        for path in self.directory.glob("*_*.json"):
            try:
                stat = path.stat()
            except OSError:  # another worker pruned it meanwhile
                continue
            try:
                size = stat.st_size + path.with_suffix(".events").stat().st_size
            except OSError:  # no stream kept
                size = stat.st_size
            entries.append((stat.st_mtime_ns, size, path))
        entries.sort()
        total = sum(size for _, size, _ in entries)
        for k, (_, size, path) in enumerate(entries[:-1]):  # the newest stays, whatever its size
            if len(entries) - k <= self.capacity and total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            self._unlink_companions(path)
            total -= size

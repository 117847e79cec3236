"""Replies to aborts that wait until the requests they end have sent their last response.

An abort (`abort_request_id`, `abort_client`) only asks the engine to end a request at its next
step; the request's last response leaves later, from an outbox sender. Replied at once, an abort
said nothing about the request: a client (SGLang's /abort_request, a frontend stopping) could
see "aborted" while the request still ran and still held its KV blocks. Held until those
responses are out, the reply means the request is over. Bounded: it goes out after `timeout_s`
regardless.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable

log = logging.getLogger(__name__)


class _Ack:
    def __init__(self, waiting: set[str], reply: Callable[[], None], timeout_s: float) -> None:
        self._waiting = waiting
        self._reply = reply
        self._lock = threading.Lock()
        self._fired = False
        self._timer = threading.Timer(timeout_s, self.fire)
        self._timer.daemon = True
        self._timer.start()

    def settle(self, engine_id: str) -> None:
        with self._lock:
            self._waiting.discard(engine_id)
            ready = not self._waiting
        if ready:
            self.fire()

    def fire(self) -> None:
        with self._lock:
            if self._fired:
                return
            self._fired = True
        self._timer.cancel()
        try:
            self._reply()
        except Exception:  # a reply that cannot be sent must not break the sender that settled it
            log.exception("replying to an abort failed")


class AbortAcks:
    """Which engine requests still have a response to send, and the abort replies waiting on them."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._open: dict[str, list[_Ack]] = {}  # engine id -> the acks waiting for its last response

    def opened(self, engine_id: str) -> None:
        with self._lock:
            self._open[engine_id] = []

    def sent(self, engine_id: str) -> None:
        """The request's last response is out (or will never be): settle what waits on it."""
        with self._lock:
            acks = self._open.pop(engine_id, [])
        for ack in acks:
            ack.settle(engine_id)

    def open_ids(self) -> list[str]:
        """The engine requests whose last response has not gone out."""
        with self._lock:
            return list(self._open)

    def reply_after(self, engine_ids: Iterable[str], reply: Callable[[], None]) -> None:
        """Call `reply` once every request in `engine_ids` that is still open has sent its last
        response, or after timeout_s; at once if none is open."""
        with self._lock:
            waiting = {e for e in engine_ids if e in self._open}
            if waiting:
                ack = _Ack(waiting, reply, self.timeout_s)
                for engine_id in waiting:
                    self._open[engine_id].append(ack)
        if not waiting:
            reply()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

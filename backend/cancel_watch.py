"""Polls callers' `is_cancelled` callbacks, off the engine's step loop.

Triton's `response_sender.is_cancelled()` is an IPC round trip to the server process (it
releases the GIL while it waits). Polling 64 streams from the step loop every 0.1 s cost the
engine thread about 6% of its time at concurrency 64 on 2 cores (py-spy), time the model could
have used. Here one thread of its own does the polling and hands what it finds to a callback
(the engine's `abort`, which only enqueues), as TensorRT-LLM's Triton backend does with its
`WaitForCancel` thread. Engines stepped by hand (tests, `generate`) call `poll` themselves.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Hashable, Optional

log = logging.getLogger(__name__)

IsCancelled = Callable[[], bool]


class CancelWatch:
    """`interval_s` between polls, stretched so that at most `checks_per_s` callbacks run per
    second: each is an IPC round trip that costs the server process as much as a response does.
    At 64 streams, polling every 0.1 s was 640 round trips a second on top of ~600 responses.
    Through tritonserver on 2 cores at c=64 (three alternating pairs of two runs each): polling
    every 1 s gave 1171 against 1017 tok/s, faster in every pair; this budget of 100 checks a
    second gave 1075 against 1024, faster in two pairs of three (this machine drifts by tens of
    percent). A cancel is noticed within max(interval_s, watched / checks_per_s) seconds.
    """

    def __init__(self, interval_s: float, checks_per_s: Optional[float] = None) -> None:
        self.interval_s = interval_s
        self.checks_per_s = checks_per_s
        self._checks: dict[Hashable, IsCancelled] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def watch(self, key: Hashable, is_cancelled: IsCancelled) -> None:
        with self._lock:
            self._checks[key] = is_cancelled

    def unwatch(self, key: Hashable) -> None:
        with self._lock:
            self._checks.pop(key, None)

    def __len__(self) -> int:
        return len(self._checks)

    def poll(self) -> list[Hashable]:
        """Ask every watched request; return (and stop watching) the cancelled ones.

        The checks run outside the lock, so one may run just after its request finished (and
        was unwatched): callbacks must stay safe to call then (Triton's is not once the final
        response is sent; backend.triton_utils.GuardedSender makes it so).
        """
        with self._lock:
            checks = list(self._checks.items())
        cancelled = []
        for key, is_cancelled in checks:
            try:
                if is_cancelled():
                    cancelled.append(key)
            except Exception:  # a broken callback must not stop the others being polled
                log.exception("is_cancelled failed for %s", key)
        if cancelled:
            with self._lock:
                for key in cancelled:
                    self._checks.pop(key, None)
        return cancelled

    def next_interval(self) -> float:
        """Seconds to the next poll: interval_s, or longer when many requests are watched."""
        if not self.checks_per_s:
            return self.interval_s
        return max(self.interval_s, len(self._checks) / self.checks_per_s)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, on_cancelled: Callable[[Hashable], None]) -> None:
        if self._thread is not None:
            return

        def run() -> None:
            while not self._stop.wait(self.next_interval()):
                for key in self.poll():
                    on_cancelled(key)

        self._stop.clear()
        self._thread = threading.Thread(target=run, name="llm-cancel-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

"""Noticing, inside the llm model, that tritonserver has been told to stop.

Triton 2.51 tells a Python model nothing when the server gets SIGTERM/SIGINT: it waits up to its
exit timeout for in-flight requests, and a decoupled model's streams are in flight until the
model sends their final responses. A model that keeps generating past that timeout is torn down
mid-request, and 2.51 then crashed on its way out (SIGSEGV/SIGABRT in the Python backend's
teardown, 5 runs of 5) and could hang in its crash handler for good.

What the model can see: once the server is stopping, `pb_utils.is_model_ready` raises "Server
not ready" (the server's state left READY, which it never re-enters). One probe is all it takes,
and one is all that is made: in our runs, repeated probes against a stopping server killed the
stub within seconds, and a probe during `initialize` aborted the server, so polling starts at
the first request (`arm`) and ends at the first answer that is not "ready".

When the stop is noticed, new generations are refused, those in flight get `grace_s` to finish
(the server's exit timeout less a margin for the model to unload), and the rest are aborted, each
ending with its final response (finish reason "abort"): the server then finds nothing in flight
and exits cleanly. An explicit unload of the model alone (`--model-control-mode explicit`) makes
the probe answer False instead; Triton drains the model's requests to their end then, as before.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

DEFAULT_EXIT_TIMEOUT_S = 30.0  # tritonserver's --exit-timeout-secs default
UNLOAD_MARGIN_S = 10.0  # of the exit timeout, left for final responses and the model's unload
STOPPING_MESSAGE = "Server not ready"


def exit_timeout_s(server_pid: int) -> float:
    """The --exit-timeout-secs tritonserver (the stub's parent) was started with."""
    try:
        with open(f"/proc/{server_pid}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return DEFAULT_EXIT_TIMEOUT_S
    value: Optional[str] = None
    for i, arg in enumerate(args):
        if arg.startswith("--exit-timeout-secs="):
            value = arg.split("=", 1)[1]
        elif arg == "--exit-timeout-secs" and i + 1 < len(args):
            value = args[i + 1]
    try:
        return float(value) if value is not None else DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S


def stop_grace_s(exit_timeout: float) -> float:
    return max(0.0, exit_timeout - UNLOAD_MARGIN_S)


class ServerStopWatch:
    """Polls `probe` (is this model ready?) every `interval_s` once armed; on a "Server not
    ready" error it sets `stopping`, waits `grace_s` (or until `idle()` says nothing is left),
    then calls `on_stop` once."""

    def __init__(self, probe: Callable[[], bool], on_stop: Callable[[], None], grace_s: float,
                 idle: Callable[[], bool] = lambda: False, interval_s: float = 0.5,
                 log: Optional[Any] = None) -> None:
        self._probe = probe
        self._on_stop = on_stop
        self.grace_s = grace_s
        self._idle = idle
        self._interval_s = interval_s
        self._log = log
        self._closed = threading.Event()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def arm(self) -> None:
        """Start polling: call once the server serves (from the model's first execute)."""
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="server-stop-watch", daemon=True)
                self._thread.start()

    def close(self) -> None:
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        if not self._wait_for_stop():
            return
        self._stopping.set()
        self._say("log_info", f"the server is stopping: new requests are refused; those in flight have "
                              f"{self.grace_s:g} s to finish before they are aborted")
        deadline = time.monotonic() + self.grace_s
        while not self._idle() and not self._closed.is_set() and (left := deadline - time.monotonic()) > 0:
            self._closed.wait(min(0.25, left))
        if not self._closed.is_set():
            self._on_stop()

    def _wait_for_stop(self) -> bool:
        while not self._closed.wait(self._interval_s):
            try:
                if not self._probe():
                    return False  # this model alone is being unloaded: Triton drains it
            except Exception as exc:
                if STOPPING_MESSAGE in str(exc):
                    return True
                self._say("log_warn", f"cannot tell whether the server is stopping ({exc}); not watching")
                return False
        return False

    def _say(self, level: str, message: str) -> None:
        if self._log is not None:
            getattr(self._log, level)(message)

"""Noticing, inside the llm model, that tritonserver has been told to stop.

Triton 2.51 tells a Python model nothing when the server gets SIGTERM/SIGINT: it waits up to its
exit timeout for in-flight requests, and a decoupled model's streams are in flight until the
model sends their final responses. A model that keeps generating past that timeout is torn down
mid-request, and 2.51 then crashed on its way out (SIGSEGV/SIGABRT in the Python backend's
teardown, 5 runs of 5) and could hang in its crash handler for good.

What the model can see: a stopping 2.51 answers gRPC ServerLive with UNAVAILABLE "Server exiting"
(its gRPC listener stays open) and closes its HTTP listener at once (open streams go on). So the
watch asks the server's own endpoint (gRPC ServerLive; HTTP /v2/health/live when gRPC is off,
where a refusal after a first answer is the verdict; ports from tritonserver's command line)
whether it is live, at the model's first request and twice a second from then on. Not
`pb_utils.is_model_ready`, although it raises "Server not ready" then: that call crosses the
stub's IPC queue, and during the stop it killed the stub or aborted the server (boost
lock_exception) in several runs here.

When the stop is noticed, new generations are refused, those in flight get `grace_s` to finish
(the server's exit timeout less a margin for the model to unload), and the rest are aborted, each
ending with its final response (finish reason "abort"): the server then finds nothing in flight
and exits cleanly. An explicit unload of the model alone (`--model-control-mode explicit`) is no
stop: the server stays live, and Triton drains the model's requests to their end, as before.
"""

from __future__ import annotations

import http.client
import threading
import time
from typing import Any, Callable, Optional

DEFAULT_EXIT_TIMEOUT_S = 30.0  # tritonserver's --exit-timeout-secs default
UNLOAD_MARGIN_S = 10.0  # of the exit timeout, for final responses and the unload (docker-entrypoint.sh too)

# True: serving; False: stopping; None: cannot tell (no answer yet, or a timeout).
Probe = Callable[[], Optional[bool]]


def server_args(server_pid: int) -> list[str]:
    """tritonserver's command line (the stub's parent), or [] when it cannot be read."""
    try:
        with open(f"/proc/{server_pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def server_option(args: list[str], name: str) -> Optional[str]:
    """The last value of `--name=value` or `--name value` on tritonserver's command line. Its
    getopt_long takes any unambiguous abbreviation (`--exit-timeout=5`, QA), so a prefix of the
    name counts: one that tritonserver did not take would not have let it start."""
    value: Optional[str] = None
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, eq, given = arg[2:].partition("=")
        if not key or not name.startswith(key):
            continue
        if eq:
            value = given
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def exit_timeout_s(args: list[str]) -> float:
    try:
        return float(server_option(args, "exit-timeout-secs") or DEFAULT_EXIT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S


def stop_grace_s(exit_timeout: float) -> float:
    return max(0.0, exit_timeout - UNLOAD_MARGIN_S)


def _enabled(args: list[str], name: str) -> bool:
    return (server_option(args, name) or "true").lower() not in ("false", "0", "no", "off")


def _host(address: Optional[str]) -> str:
    """Where to reach a listener bound to `address` from this host."""
    if not address or address == "0.0.0.0":
        return "127.0.0.1"
    if address in ("::", "[::]"):
        return "::1"
    return address.strip("[]")


class _HttpLive:
    """HTTP /v2/health/live. A stopping 2.51 closes its HTTP listener at once, so a refused
    connection is the verdict, but only once this endpoint has answered: before, it may be
    bound where we do not look. http.client, not urllib: a stub's environment may name a proxy."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self._host, self._port, self._timeout_s = host, port, timeout_s
        self._answered = False

    def __call__(self) -> Optional[bool]:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            conn.request("GET", "/v2/health/live")
            response = conn.getresponse()
            response.read()
            self._answered = True
            return response.status == 200
        except ConnectionRefusedError:
            return False if self._answered else None
        except OSError:  # a timeout, a reset: a busy server, not a verdict
            return None
        finally:
            conn.close()


class _GrpcLive:
    """gRPC ServerLive, with grpcio alone: the request is an empty message and a live server's
    reply is `live: true` (bytes 08 01). A stopping 2.51 keeps its gRPC listener open and answers
    UNAVAILABLE "Server exiting": a verdict that needs no earlier answer. The channel is made on
    the first call, from the watch's thread: none exists before the model's first request."""

    _LIVE = b"\x08\x01"

    def __init__(self, target: str, timeout_s: float) -> None:
        self._target = target
        self._timeout_s = timeout_s
        self._call: Optional[Callable[..., bytes]] = None

    def __call__(self) -> Optional[bool]:
        import grpc

        if self._call is None:
            channel = grpc.insecure_channel(self._target)
            self._call = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
        try:
            return self._call(b"", timeout=self._timeout_s) == self._LIVE
        except grpc.RpcError as exc:
            exiting = exc.code() == grpc.StatusCode.UNAVAILABLE and "exiting" in (exc.details() or "").lower()
            return False if exiting else None  # unreachable, a deadline: no verdict


def liveness_probe(args: list[str], timeout_s: float = 2.0) -> Optional[Probe]:
    """A probe of the server's liveness from its command line: gRPC ServerLive, or HTTP
    /v2/health/live when gRPC is off; None when neither endpoint is on."""
    try:
        if _enabled(args, "allow-grpc"):
            host, port = _host(server_option(args, "grpc-address")), int(server_option(args, "grpc-port") or 8001)
            return _GrpcLive(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", timeout_s)
        if _enabled(args, "allow-http"):
            host, port = _host(server_option(args, "http-address")), int(server_option(args, "http-port") or 8000)
            return _HttpLive(host, port, timeout_s)
    except ValueError:  # a port that is no number: tritonserver itself would not have started
        return None
    return None


class ServerStopWatch:
    """Polls `probe` at once when armed, then every `interval_s`. "Not serving" (False) sets
    `stopping`, waits `grace_s` (or until `idle()` says nothing is left), then calls `on_stop`
    once. A probe that cannot tell (None) changes nothing."""

    def __init__(self, probe: Optional[Probe], on_stop: Callable[[], None], grace_s: float,
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
        if self._thread is not None or self._probe is None:
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
        self._say(f"the server is stopping: new requests are refused; those in flight have "
                  f"{self.grace_s:g} s to finish before they are aborted")
        deadline = time.monotonic() + self.grace_s
        while not self._idle() and not self._closed.is_set() and (left := deadline - time.monotonic()) > 0:
            self._closed.wait(min(0.25, left))
        if not self._closed.is_set():
            self._on_stop()

    def _wait_for_stop(self) -> bool:
        assert self._probe is not None
        # The first probe at once: a stop that comes right after the first request is seen too.
        while not self._closed.is_set():
            if self._probe() is False:
                return True
            self._closed.wait(self._interval_s)
        return False

    def _say(self, message: str) -> None:
        if self._log is not None:
            self._log.log_info(message)

"""backend/server_stop.py: the llm model noticing that tritonserver is stopping (fake probes and
endpoints; the real server's stop is in tests/test_serve_shutdown.py)."""

from __future__ import annotations

import http.server
import os
import socket
import threading
import time

from backend.server_stop import (
    DEFAULT_EXIT_TIMEOUT_S,
    ServerStopWatch,
    exit_timeout_s,
    liveness_probe,
    server_args,
    server_option,
    stop_grace_s,
)
from openai_frontend.testing import free_port


class Probe:
    """The server's liveness as the watch reads it: True (serving), False (stopping), None (cannot
    tell); the last answer repeats."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self):
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return answer


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def log_info(self, message: str) -> None:
        self.lines.append(("info", message))

    def log_warn(self, message: str) -> None:
        self.lines.append(("warn", message))


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_nothing_is_probed_before_arm_and_a_stop_ends_the_requests_after_the_grace():
    stopped = threading.Event()
    probe = Probe([True, None, True, False])
    watch = ServerStopWatch(probe, on_stop=stopped.set, grace_s=0.3, interval_s=0.01, log=Log())
    time.sleep(0.05)
    assert probe.calls == 0  # polled from the first request on
    watch.arm()
    watch.arm()  # once
    _wait(lambda: watch.stopping)
    noticed = time.monotonic()
    assert not stopped.is_set()  # the requests in flight get their grace first
    assert stopped.wait(2.0)
    assert time.monotonic() - noticed >= 0.25
    assert probe.calls == 4  # no probe after the stop was seen
    watch.close()


def test_the_grace_ends_early_once_nothing_is_in_flight():
    stopped = threading.Event()
    idle = threading.Event()
    watch = ServerStopWatch(Probe([True, False]), on_stop=stopped.set, grace_s=30, idle=idle.is_set,
                            interval_s=0.01)
    watch.arm()
    _wait(lambda: watch.stopping)
    time.sleep(0.1)
    assert not stopped.is_set()
    idle.set()
    assert stopped.wait(2.0)
    watch.close()


def test_the_first_probe_is_made_at_once():
    # QA: a stop 0.3 s after the first request came before the first probe (0.5 s on) and went
    # unnoticed over HTTP (refused, with no earlier answer): the server crashed past its timeout
    stopped = threading.Event()
    probe = Probe([False])
    watch = ServerStopWatch(probe, on_stop=stopped.set, grace_s=0, interval_s=30)
    watch.arm()
    assert stopped.wait(2.0) and probe.calls == 1
    watch.close()


def test_without_a_probe_nothing_runs():
    watch = ServerStopWatch(None, on_stop=lambda: None, grace_s=0)
    watch.arm()
    assert watch._thread is None and not watch.stopping
    watch.close()


def test_close_during_the_grace_calls_nothing():
    stopped = threading.Event()
    watch = ServerStopWatch(Probe([True, False]), on_stop=stopped.set, grace_s=30, interval_s=0.01)
    watch.arm()
    _wait(lambda: watch.stopping)
    watch.close()
    assert not stopped.wait(0.3)


def test_settings_from_the_servers_command_line():
    import subprocess
    import sys

    for args, expected in ((["--exit-timeout-secs=25"], 25.0), (["--exit-timeout-secs", "7"], 7.0),
                           ([], DEFAULT_EXIT_TIMEOUT_S), (["--exit-timeout-secs=x"], DEFAULT_EXIT_TIMEOUT_S)):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", *args])
        try:
            _wait(lambda: b"time.sleep" in open(f"/proc/{proc.pid}/cmdline", "rb").read())
            assert exit_timeout_s(server_args(proc.pid)) == expected
        finally:
            proc.kill()
            proc.wait()
    assert server_args(2**22 + os.getpid()) == []  # no such process
    assert stop_grace_s(30) == 20 and stop_grace_s(20) == 10 and stop_grace_s(5) == 0
    assert liveness_probe(["tritonserver", "--allow-http=false", "--allow-grpc=false"]) is None
    # tritonserver's getopt_long takes abbreviations: --exit-timeout=5 is --exit-timeout-secs=5 (QA)
    assert exit_timeout_s(["tritonserver", "--exit-timeout=5", "--http-port=8000"]) == 5.0
    assert exit_timeout_s(["tritonserver", "--exit-t", "7"]) == 7.0
    assert server_option(["tritonserver", "--grpc-p=9001", "--log-verbose=1"], "grpc-port") == "9001"
    assert server_option(["tritonserver", "--grpc-address=::"], "grpc-port") is None


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):
        assert self.path == "/v2/health/live"
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_http_probe_reads_live_then_a_refusal_or_an_error_as_a_stop():
    # gRPC off: HTTP. A refusal before any answer is no verdict (not up yet, or bound elsewhere).
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    early = liveness_probe(["tritonserver", "--allow-grpc=false", f"--http-port={free_port()}"])
    assert early() is None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = liveness_probe(["tritonserver", "--allow-grpc", "false", f"--http-port={port}"])
    try:
        assert probe() is True
        _Health.status = 400  # Triton: "Server exiting"
        assert probe() is False
    finally:
        _Health.status = 200
        server.shutdown()
        server.server_close()
    assert probe() is False  # the listener closed after answering: connection refused


def test_grpc_server_live_is_asked_first():
    # QA: with --allow-http=false a version watched the gRPC listener, which a stopping 2.51 keeps
    # open: the stop went unnoticed until the exit timeout, and the server crashed.
    from concurrent import futures

    import grpc

    state = {"answer": "live"}

    def server_live(request: bytes, context) -> bytes:
        assert request == b""
        if state["answer"] == "exiting":
            context.abort(grpc.StatusCode.UNAVAILABLE, "Server exiting")
        return b"\x08\x01"

    handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ServerLive": grpc.unary_unary_rpc_method_handler(server_live)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    probe = liveness_probe(["tritonserver", "--http-port=1", "--grpc-port", str(port)], timeout_s=5)
    try:
        assert probe() is True
        state["answer"] = "exiting"
        assert probe() is False  # a verdict on its own: no earlier answer needed
    finally:
        server.stop(0).wait()
    assert probe() is None  # nothing listening: the server may be gone, or not there yet

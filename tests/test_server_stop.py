"""backend/server_stop.py: the llm model noticing that tritonserver is stopping (fake probes; the
real server's stop is in tests/test_serve_shutdown.py)."""

from __future__ import annotations

import os
import threading
import time

from backend.server_stop import DEFAULT_EXIT_TIMEOUT_S, ServerStopWatch, exit_timeout_s, stop_grace_s


class Probe:
    """is_model_ready as Triton 2.51 answers it: True while serving; once the server stops, an
    error saying "Server not ready"."""

    def __init__(self, answers: list) -> None:
        self.answers = answers
        self.calls = 0

    def __call__(self) -> bool:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
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


def _stopping_error() -> Exception:
    return RuntimeError("Failed to check model readiness: Failed to process the request for model 'llm_0_0', "
                        "message: Server not ready")


def test_nothing_is_probed_before_arm_and_a_stop_ends_the_requests_after_the_grace():
    stopped = threading.Event()
    probe = Probe([True, True, _stopping_error()])
    watch = ServerStopWatch(probe, on_stop=stopped.set, grace_s=0.3, interval_s=0.01, log=Log())
    time.sleep(0.05)
    assert probe.calls == 0  # a probe while the model initializes aborted the server
    watch.arm()
    watch.arm()  # once
    _wait(lambda: watch.stopping)
    noticed = time.monotonic()
    assert not stopped.is_set()  # the requests in flight get their grace first
    assert stopped.wait(2.0)
    assert time.monotonic() - noticed >= 0.25
    assert probe.calls == 3  # no probe after the first "not ready": repeated ones killed the stub
    watch.close()


def test_the_grace_ends_early_once_nothing_is_in_flight():
    stopped = threading.Event()
    idle = threading.Event()
    watch = ServerStopWatch(Probe([_stopping_error()]), on_stop=stopped.set, grace_s=30, idle=idle.is_set,
                            interval_s=0.01)
    watch.arm()
    _wait(lambda: watch.stopping)
    time.sleep(0.1)
    assert not stopped.is_set()
    idle.set()
    assert stopped.wait(2.0)
    watch.close()


def test_an_unload_of_the_model_alone_is_left_to_triton():
    # explicit model control: is_model_ready answers False; Triton drains the model's requests
    stopped = threading.Event()
    probe = Probe([True, False, _stopping_error()])
    watch = ServerStopWatch(probe, on_stop=stopped.set, grace_s=0, interval_s=0.01)
    watch.arm()
    _wait(lambda: probe.calls >= 2)
    time.sleep(0.1)
    assert probe.calls == 2 and not watch.stopping and not stopped.is_set()
    watch.close()


def test_another_error_stops_the_watch_with_a_warning():
    log = Log()
    stopped = threading.Event()
    probe = Probe([RuntimeError("something else")])
    watch = ServerStopWatch(probe, on_stop=stopped.set, grace_s=0, interval_s=0.01, log=log)
    watch.arm()
    _wait(lambda: log.lines)
    time.sleep(0.05)
    assert probe.calls == 1 and not watch.stopping and not stopped.is_set()
    assert log.lines[0][0] == "warn" and "something else" in log.lines[0][1]
    watch.close()


def test_close_during_the_grace_calls_nothing():
    stopped = threading.Event()
    watch = ServerStopWatch(Probe([_stopping_error()]), on_stop=stopped.set, grace_s=30, interval_s=0.01)
    watch.arm()
    _wait(lambda: watch.stopping)
    watch.close()
    assert not stopped.wait(0.3)


def test_exit_timeout_from_the_servers_command_line(tmp_path):
    import subprocess
    import sys

    for args, expected in ((["--exit-timeout-secs=25"], 25.0), (["--exit-timeout-secs", "7"], 7.0),
                           ([], DEFAULT_EXIT_TIMEOUT_S), (["--exit-timeout-secs=x"], DEFAULT_EXIT_TIMEOUT_S)):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", *args])
        try:
            _wait(lambda: b"time.sleep" in open(f"/proc/{proc.pid}/cmdline", "rb").read())
            assert exit_timeout_s(proc.pid) == expected
        finally:
            proc.kill()
            proc.wait()
    assert exit_timeout_s(2**22 + os.getpid()) == DEFAULT_EXIT_TIMEOUT_S  # no such process
    assert stop_grace_s(30) == 20 and stop_grace_s(20) == 10 and stop_grace_s(5) == 0

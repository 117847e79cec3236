"""backend/triton_utils.py's stub watcher: the stub dies with the server, and the server stops
when its stub died under it (Triton 2.51 neither restarts nor reaps it: it stays a zombie)."""

from __future__ import annotations

import subprocess
import time

from backend.triton_utils import _WATCHER


def _watch(server: subprocess.Popen, stub_pid: int) -> subprocess.Popen:
    return subprocess.Popen(["/bin/sh", "-c", _WATCHER, str(server.pid), str(stub_pid), "postprocessing"],
                            stderr=subprocess.PIPE, text=True)


def test_a_stub_that_died_unreaped_stops_the_server():
    server = subprocess.Popen(["sleep", "60"])
    stub = subprocess.Popen(["sh", "-c", "exit 0"])  # never waited for: a zombie, as under 2.51
    time.sleep(0.3)
    watcher = _watch(server, stub.pid)
    try:
        assert server.wait(timeout=15) is not None  # stopped (SIGTERM) within ~3 polls
        assert watcher.wait(timeout=10) == 0
        assert "the postprocessing stub (pid" in watcher.stderr.read()
    finally:
        server.kill()
        stub.wait()


def test_a_stub_the_server_reaps_leaves_the_server_alone():
    server = subprocess.Popen(["sleep", "60"])
    stub = subprocess.Popen(["sleep", "1"])
    watcher = _watch(server, stub.pid)
    try:
        stub.wait()  # reaped at once, as when the server unloads a model
        assert watcher.wait(timeout=10) == 0
        time.sleep(0.5)
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()


def test_the_stub_dies_with_the_server():
    server = subprocess.Popen(["sleep", "60"])
    stub = subprocess.Popen(["sleep", "60"])
    watcher = _watch(server, stub.pid)
    try:
        server.kill()
        server.wait()
        assert watcher.wait(timeout=10) == 0
        assert stub.wait(timeout=5) == -9
    finally:
        stub.kill()

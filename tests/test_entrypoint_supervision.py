"""scripts/docker-entrypoint.sh's supervision, with a stand-in tritonserver (the real stack's
faults are in tests/test_faults.py and tests/test_data_parallel.py):

- its exit status when tritonserver does not stop cleanly: Triton 2.51 was seen to crash on its way
  out, and the entrypoint exited 0 over it (QA);
- a SIGINT when it was started with SIGINT ignored;
- DATA_PARALLEL_SIZE: one tritonserver per GPU, each on its ports and GPU, each restarted on its
  own while the others are watched on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.entrypoint import port_block

REPO = Path(__file__).resolve().parents[1]

# Ready on HTTP, with a child that looks like the llm model's stub to the entrypoint's watchdog;
# SIGTERM makes it die of SIGSEGV, as tritonserver 2.51 did (FAKE_CLEAN_STOP=1: exit 0). It records
# the GPUs it was given in FAKE_RECORD/<http port>, and loads (waits before it serves) while the
# file FAKE_RECORD/slow-<http port> exists.
FAKE_SERVER = textwrap.dedent('''
    import http.server, os, signal, subprocess, sys, threading, time
    port = int(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--http-port=")))
    record = os.environ.get("FAKE_RECORD")
    if record:
        with open(os.path.join(record, str(port)), "w") as f:
            f.write(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        while os.path.exists(os.path.join(record, f"slow-{port}")):
            time.sleep(0.1)
    stub = subprocess.Popen(["bash", "-c", 'exec -a "triton_python_backend_stub /m/llm/1/model.py" sleep 600'])
    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *args):
            pass
    def crash(*_):
        stub.kill()
        stub.wait()
        if os.environ.get("FAKE_CLEAN_STOP"):
            os._exit(0)
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    signal.signal(signal.SIGTERM, crash)
    server = http.server.HTTPServer(("127.0.0.1", port), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    signal.pause()
''')


def _start(tmp_path: Path, env: dict[str, str] | None = None, ready: int = 1,
           **popen) -> tuple[subprocess.Popen, Path]:
    """The entrypoint over the stand-in tritonserver, once it says `ready` servers are ready."""
    fake = tmp_path / "tritonserver"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake.py'} \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    env = {**os.environ, "TRITONSERVER": str(fake), "PYTHON": sys.executable, "FRONTEND": "0",
           "LLM_MODEL_PATH": str(tmp_path / "model"), "HTTP_PORT": str(port_block(ready)),
           "GRPC_PORT": str(port_block(ready)), "METRICS_PORT": str(port_block(ready)), "EXIT_TIMEOUT": "10",
           "WATCHDOG_INTERVAL": "1",
           "PYTHONPATH": str(REPO), **(env or {})}
    log = tmp_path / "entrypoint.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(REPO / "scripts/docker-entrypoint.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + 60
        while len(re.findall(r"tritonserver( \d+)? ready", log.read_text())) < ready:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    except BaseException:
        _kill(proc)
        raise
    return proc, log


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_tritonserver_that_crashes_while_stopping_makes_the_entrypoint_fail(tmp_path):
    proc, log = _start(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        text = log.read_text()
        assert rc == 1 and "tritonserver exited with status 139 while stopping" in text, (rc, text)
        assert "drain: could not drain llm" in text  # nothing answers gRPC here: it goes on to stop
    finally:
        _kill(proc)


def test_sigint_stops_an_entrypoint_started_with_sigint_ignored(tmp_path):
    # `docker-entrypoint.sh &` in a script starts it with SIGINT ignored, and bash cannot trap a
    # signal ignored at its start: a SIGINT did nothing (QA; serve.sh too). It starts itself
    # again with SIGINT at its default, so the trap takes it and stops everything.
    proc, log = _start(tmp_path, {"FAKE_CLEAN_STOP": "1"}, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        ignored = int(next(line.split()[1] for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                           if line.startswith("SigIgn:")), 16)
        assert not ignored & (1 << (signal.SIGINT - 1))
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
        text = log.read_text()
        assert rc == 0 and "shutting down" in text, (rc, text)
    finally:
        _kill(proc)


def _fake_pid(port: int) -> int:
    """The stand-in tritonserver serving HTTP on `port`."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"fake.py") for a in argv) and f"--http-port={port}".encode() in argv:
            return int(cmdline.parent.name)
    raise AssertionError(f"no stand-in tritonserver on port {port}")


def _wait_for(log: Path, pattern: str, count: int = 1, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while len(re.findall(pattern, log.read_text())) < count:
        assert time.monotonic() < deadline, f"{pattern!r} x{count} not in:\n{log.read_text()}"
        time.sleep(0.1)


def test_data_parallel_servers_each_on_its_gpu_and_ports_restarted_one_by_one(tmp_path):
    record = tmp_path / "record"
    record.mkdir()
    http = port_block(2)
    ports = [http, http + 3]
    env = {"DATA_PARALLEL_SIZE": "2", "CUDA_VISIBLE_DEVICES": "5,7", "FAKE_RECORD": str(record),
           "FAKE_CLEAN_STOP": "1", "STUB_GRACE": "1", "HTTP_PORT": str(http)}
    healthcheck = [str(REPO / "scripts/docker-entrypoint.sh"), "healthcheck"]
    check_env = {**os.environ, "PYTHON": sys.executable, "FRONTEND": "0", **env}
    proc, log = _start(tmp_path, env, ready=2)
    try:
        # Server i got the i-th of CUDA_VISIBLE_DEVICES, and the base ports + 3*i.
        assert [(record / str(p)).read_text() for p in ports] == ["5", "7"]
        assert subprocess.run(healthcheck, env=check_env).returncode == 0

        # Server 1 dies and loads slowly when started again; server 0 dies meanwhile: its restart
        # does not wait for server 1's.
        (record / f"slow-{ports[1]}").touch()
        first = [_fake_pid(p) for p in ports]
        os.kill(first[1], signal.SIGKILL)
        _wait_for(log, r"tritonserver 1 exited \(status 137[,)]")
        _wait_for(log, r"tritonserver 1 started", 2)
        os.kill(first[0], signal.SIGKILL)
        _wait_for(log, r"tritonserver 0 exited \(status 137[,)]", timeout=10)
        _wait_for(log, r"tritonserver 0 ready", 2, timeout=20)
        assert len(re.findall(r"tritonserver 1 ready", log.read_text())) == 1  # still loading
        # The healthcheck passes while one serves.
        assert subprocess.run(healthcheck, env=check_env).returncode == 0
        (record / f"slow-{ports[1]}").unlink()
        _wait_for(log, r"tritonserver 1 ready", 2)
        second = [_fake_pid(p) for p in ports]
        assert all(a != b for a, b in zip(first, second)), (first, second)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
        for pid in second:
            assert not Path(f"/proc/{pid}").exists() or "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    finally:
        _kill(proc)


def test_data_parallel_size_is_checked_before_anything_starts(tmp_path):
    script = str(REPO / "scripts/docker-entrypoint.sh")
    for size, devices, says in (("0", "", "takes a count"), ("two", "", "takes a count"),
                                ("3", "0,1", "CUDA_VISIBLE_DEVICES names 2 GPU(s)")):
        env = {**os.environ, "DATA_PARALLEL_SIZE": size, "CUDA_VISIBLE_DEVICES": devices,
               "TRITONSERVER": "/bin/false", "LLM_MODEL_PATH": str(tmp_path)}
        done = subprocess.run([script], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and says in done.stderr, (size, done.returncode, done.stderr)


def test_each_server_has_a_restart_budget_of_its_own(tmp_path):
    # One restart each (a driver hiccup on every GPU) is no reason to give up; one server restarted
    # past the budget is.
    http = port_block(2)
    env = {"DATA_PARALLEL_SIZE": "2", "HTTP_PORT": str(http), "FAKE_CLEAN_STOP": "1", "STUB_GRACE": "1",
           "MAX_RESTARTS": "1", "RESTART_WINDOW": "600"}
    proc, log = _start(tmp_path, env, ready=2)
    try:
        os.kill(_fake_pid(http), signal.SIGKILL)
        _wait_for(log, r"tritonserver 0 ready", 2)
        os.kill(_fake_pid(http + 3), signal.SIGKILL)
        _wait_for(log, r"tritonserver 1 ready", 2)
        assert proc.poll() is None  # one restart each: within the budget
        os.kill(_fake_pid(http), signal.SIGKILL)  # server 0's second
        assert proc.wait(timeout=60) == 1, log.read_text()
        assert "tritonserver 0: more than 1 restarts in 600s: giving up" in log.read_text()
    finally:
        _kill(proc)

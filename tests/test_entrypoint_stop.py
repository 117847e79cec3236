"""scripts/docker-entrypoint.sh's exit status when tritonserver does not stop cleanly, with a
stand-in tritonserver (the real stack's stop is in tests/test_faults.py): Triton 2.51 was seen to
crash on its way out, and the entrypoint exited 0 over it (QA)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from openai_frontend.testing import free_port

REPO = Path(__file__).resolve().parents[1]

# Ready on HTTP, with a child that looks like the llm model's stub to the entrypoint's watchdog;
# SIGTERM makes it die of SIGSEGV, as tritonserver 2.51 did (FAKE_CLEAN_STOP=1: exit 0).
FAKE_SERVER = textwrap.dedent('''
    import http.server, os, signal, subprocess, sys, threading
    port = int(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--http-port=")))
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


def _start(tmp_path: Path, env: dict[str, str] | None = None, **popen) -> tuple[subprocess.Popen, Path]:
    """The entrypoint over the stand-in tritonserver, once it says the server is ready."""
    fake = tmp_path / "tritonserver"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake.py'} \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    env = {**os.environ, "TRITONSERVER": str(fake), "PYTHON": sys.executable, "FRONTEND": "0",
           "LLM_MODEL_PATH": str(tmp_path / "model"), "HTTP_PORT": str(free_port()), "GRPC_PORT": str(free_port()),
           "METRICS_PORT": str(free_port()), "EXIT_TIMEOUT": "10", "WATCHDOG_INTERVAL": "1",
           "PYTHONPATH": str(REPO), **(env or {})}
    log = tmp_path / "entrypoint.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(REPO / "scripts/docker-entrypoint.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + 60
        while "tritonserver ready" not in log.read_text():
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

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
# SIGTERM makes it die of SIGSEGV, as tritonserver 2.51 did.
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
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    signal.signal(signal.SIGTERM, crash)
    server = http.server.HTTPServer(("127.0.0.1", port), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    signal.pause()
''')


def test_a_tritonserver_that_crashes_while_stopping_makes_the_entrypoint_fail(tmp_path):
    fake = tmp_path / "tritonserver"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'fake.py'} \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "fake.py").write_text(FAKE_SERVER)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    env = {**os.environ, "TRITONSERVER": str(fake), "PYTHON": sys.executable, "FRONTEND": "0",
           "LLM_MODEL_PATH": str(tmp_path / "model"), "HTTP_PORT": str(free_port()), "GRPC_PORT": str(free_port()),
           "METRICS_PORT": str(free_port()), "EXIT_TIMEOUT": "10", "WATCHDOG_INTERVAL": "1",
           "PYTHONPATH": str(REPO)}
    log = tmp_path / "entrypoint.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(REPO / "scripts/docker-entrypoint.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "tritonserver ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        text = log.read_text()
        assert rc == 1 and "tritonserver exited with status 139 while stopping" in text, (rc, text)
        assert "drain: could not drain llm" in text  # nothing answers gRPC here: it goes on to stop
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

"""scripts/serve.sh, the README's first command: a server that cannot start ends it with an error."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from openai_frontend.testing import free_port

REPO = Path(__file__).resolve().parents[1]


def test_serve_exits_with_an_error_when_tritonserver_cannot_load_the_models(demo_model_path, tmp_path):
    # A KV pool too small for one sequence fails the llm model's load. serve.sh waited for the
    # server to be ready before starting the frontend, and never noticed that it had exited.
    # A relative --model-path is the caller's (run from elsewhere than the repository).
    (tmp_path / "my-model").symlink_to(Path(demo_model_path).resolve())
    ports = [str(free_port()) for _ in range(4)]
    env = {**os.environ, "LLM_NUM_KV_BLOCKS": "8", "LLM_MAX_MODEL_LEN": "200"}
    proc = subprocess.run(
        [str(REPO / "scripts/serve.sh"), "--model-path", "my-model", "--http-port", ports[0], "--grpc-port", ports[1],
         "--metrics-port", ports[2], "--frontend-port", ports[3]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode != 0
    assert "tritonserver exited (status 1) before it was ready" in proc.stderr
    assert "cannot hold one sequence" in proc.stdout + proc.stderr


def test_serve_refuses_a_model_path_that_is_not_there(tmp_path):
    # It served the config's default model instead, without a word. (Free ports, and its own
    # process group killed at the end: a regression must not leave a server behind.)
    ports = [str(free_port()) for _ in range(4)]
    proc = subprocess.Popen([str(REPO / "scripts/serve.sh"), "--model-path", "nowhere", "--http-port", ports[0],
                             "--grpc-port", ports[1], "--metrics-port", ports[2], "--frontend-port", ports[3]],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2 and f"no model directory at {tmp_path}/nowhere" in stderr

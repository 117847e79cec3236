"""scripts/serve.sh, the README's first command: a server that cannot start ends it with an error."""

from __future__ import annotations

import os
import re
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


def test_sweep_shm_removes_only_the_regions_of_stubs_that_are_gone(tmp_path):
    """QA: every tritonserver killed left its stubs' shared-memory regions in /dev/shm (141 on a
    test host); a container's is 64 MiB, and a supervisor restarting tritonserver in it would
    fill it. serve.sh, the entrypoint and the tests' servers sweep before each start."""
    import mmap
    import os
    import subprocess
    import time
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "sweep-shm.sh"
    old = time.time() - 600
    regions = {name: tmp_path / f"triton_python_backend_shm_region_{name}" for name in ("gone", "mapped", "new")}
    for name, path in regions.items():
        path.write_bytes(b"\0" * 4096)
        if name != "new":
            os.utime(path, (old, old))
    other = tmp_path / "something_else"
    other.write_bytes(b"x")
    os.utime(other, (old, old))
    with open(regions["mapped"], "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a live stub's region
        run = subprocess.run([str(script)], env={**os.environ, "SHM_DIR": str(tmp_path)}, capture_output=True,
                             text=True, timeout=60)
    assert run.returncode == 0 and "removed 1 " in run.stderr, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [regions["mapped"].name, regions["new"].name, other.name])


def test_sweep_shm_kills_the_stubs_whose_tritonserver_is_gone(tmp_path):
    """A tritonserver stopped while it loaded its models left a stub that never got its initialize
    message, waiting for it for ever (Triton 2.51; seen after a fault test in CI) with its memory
    and its region. The sweep kills such stubs of this repository's models; a live server's stay."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    stub = tmp_path / "triton_python_backend_stub"  # a stand-in with a stub's command line
    stub.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(300)\n")
    stub.chmod(0o755)
    args = [str(stub), str(repo / "model_repository" / "postprocessing" / "1" / "model.py"),
            "triton_python_backend_shm_region_test"]
    orphan = subprocess.Popen(args)  # its parent (this process) is no tritonserver
    # The README's `tritonserver --model-repository model_repository` gives its stubs a relative
    # model.py, from their working directory (the sweep missed those); another repository's stays.
    relative = subprocess.Popen([str(stub), "model_repository/llm/1/model.py", "r"], cwd=repo)
    (tmp_path / "model_repository" / "llm" / "1").mkdir(parents=True)
    elsewhere = subprocess.Popen([str(stub), "model_repository/llm/1/model.py", "e"], cwd=tmp_path)
    server = tmp_path / "tritonserver"  # a parent named as tritonserver is, starting its stub
    shutil.copy(shutil.which("sh"), server)
    parent = subprocess.Popen([str(server), "-c", '"$@" & wait', "sh", *args], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not [p for p in Path("/proc").glob("[0-9]*") if p.name != str(orphan.pid)
                   and str(stub) in (p / "cmdline").read_bytes().decode(errors="replace")
                   if (p / "cmdline").exists()]:
            assert time.monotonic() < deadline, "the live server's stub did not start"
            time.sleep(0.05)
        run = subprocess.run([str(repo / "scripts" / "sweep-shm.sh")], env={**os.environ, "SHM_DIR": str(tmp_path)},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "killed 2 Triton stub(s) whose tritonserver is gone: " in run.stderr, run.stderr
        assert orphan.wait(timeout=10) == relative.wait(timeout=10) == -signal.SIGKILL
        assert parent.poll() is None and elsewhere.poll() is None  # its stub lives on, as does another repository's
    finally:
        for p in (orphan, relative, elsewhere):
            p.kill()
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_the_readmes_own_tritonserver_command_serves(demo_model_path, tmp_path):
    # The README's block for running tritonserver without serve.sh, run as it stands (ports
    # added) from the repository root: relative paths, which its stubs get as they are.
    import json
    import time
    import urllib.request

    readme = (REPO / "README.md").read_text()
    block = readme.split("To run `tritonserver` yourself", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.startswith(". scripts/env.sh") and "tritonserver --model-repository model_repository" in block
    http, grpc, metrics = free_port(), free_port(), free_port()
    script = (block.strip().replace("tritonserver ", "exec tritonserver ", 1)
              + f" --http-port {http} --grpc-port {grpc} --metrics-port {metrics}")
    env = {**os.environ, "LLM_MODEL_PATH": str(demo_model_path), "LLM_NUM_KV_BLOCKS": "256"}
    env.pop("PYTHONPATH", None)
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://localhost:{http}/v2/health/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"text_input": "Hello", "max_tokens": 4, "temperature": 0}).encode()
        out = json.loads(urllib.request.urlopen(urllib.request.Request(
            f"http://localhost:{http}/v2/models/ensemble/generate", body), timeout=60).read())
        assert out["completion_tokens"] == 4 and out["text_output"], out
    finally:
        # SIGTERM: a test run in the background (CI) hands its children SIGINT ignored.
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            log.close()
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]


def test_the_readme_lists_serve_sh_options_as_its_help_does():
    readme = (REPO / "README.md").read_text()
    block = readme.split("```bash\nscripts/serve.sh", 1)[1].split("```", 1)[0]
    listed = set(re.findall(r"--[a-z][a-z-]+", block))
    usage = subprocess.run([str(REPO / "scripts" / "serve.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 0, usage.stderr
    # Its own options are the bracketed ones; those after "--" go to the frontend.
    own = set(re.findall(r"\[(--[a-z][a-z-]+)", usage.stdout + usage.stderr))
    assert len(own) >= 15 and "--model-path" in own
    assert own <= listed, sorted(own - listed)
    assert listed <= set(re.findall(r"--[a-z][a-z-]+", usage.stdout + usage.stderr)), sorted(listed)

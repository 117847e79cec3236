"""scripts/gpu_check.sh: the wheels it fetches for a GPU host are this repository's pinned versions."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_wheel_gpu_check_fetches_is_pinned_in_constraints():
    text = SCRIPT.read_text()
    wheels = re.search(r"WHEELS=\(([^)]*)\)", text, re.S).group(1).split()
    pinned = {_normal(line.split("==")[0]) for line in (REPO / "constraints.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert wheels and not [w for w in wheels if _normal(w) not in pinned]
    # The engine's own third-party imports that a CUDA image with torch/transformers lacks.
    assert {"pydantic", "xgrammar", "jsonschema", "dill"} <= {_normal(w) for w in wheels}


def test_gpu_check_without_a_command_prints_its_usage():
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "scripts/gpu_check.sh fetch" in proc.stdout and "scripts/gpu_check.sh run" in proc.stdout


def test_a_step_past_its_limit_is_cut_off_and_the_rest_still_run(tmp_path):
    # A lent GPU's minutes are few: one stuck step must not take the others' time. A stand-in
    # python hangs in the kernels benchmark and does everything else at once.
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *kernels_vs_torch*) sleep 30 ;; esac\nexit 0\n')
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(fake), "STEP_LIMIT_kernels": "1"}
    proc = subprocess.run(["bash", str(SCRIPT), "run", str(out), "kernels", "tests"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "kernels: exit 124" in proc.stdout and "tests: exit 0" in proc.stdout
    log = (out / "gpu_check.log").read_text()
    assert "==== kernels: cut off at its 1s limit" in log and "==== tests: exit 0" in log


def test_server_env_takes_an_unpacked_tritonserver_and_lets_carried_packages_shadow_the_interpreters(monkeypatch,
                                                                                                     tmp_path):
    # gpu_check's serving step: tritonserver unpacked apart from any wheel (TRITON_HOME), and
    # carried packages (numpy < 2 for the stub) ahead of the host's own site-packages.
    import sysconfig

    from client.local_server import REPO_ROOT, server_env, triton_home

    home = tmp_path / "pytriton" / "tritonserver"
    monkeypatch.setenv("TRITON_HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", "/tmp/serving-site")
    assert triton_home() == home
    env = server_env()
    assert str(tmp_path / "nvidia_pytriton.libs") in env["LD_LIBRARY_PATH"].split(":")
    path = env["PYTHONPATH"].split(":")
    assert path[0] == str(REPO_ROOT)
    assert path.index("/tmp/serving-site") < path.index(sysconfig.get_paths()["purelib"])


def test_the_serving_step_is_a_step():
    text = SCRIPT.read_text()
    assert "serving) step serving" in text and "[serving]=" in text
    # Its packages resolve against the pins; grpcio is the host's own.
    assert re.search(r"-c constraints\.txt", text) and "SERVING_SKIP=(grpcio)" in text


def test_a_serving_variant_can_be_the_frontends_worker_count():
    # SERVING_VARIANTS="frontend_workers=4": the frontend's --workers, not an LLM_ env setting.
    text = SCRIPT.read_text()
    branch = text[text.index('if [ "$key" = frontend_workers ]'):]
    assert "--frontend-workers $val" in branch.split("else")[0] and "LLM_${key^^}" in branch.split("fi")[0]

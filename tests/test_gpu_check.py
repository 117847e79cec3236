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

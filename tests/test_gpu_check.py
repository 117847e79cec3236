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

"""backend.gc_freeze: what a serving process does to the collector after start-up."""

import gc
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# In a child process: freezing this one would keep the rest of the suite's garbage forever.
_CHILD = """
import gc
from backend.gc_freeze import freeze_startup_heap
import torch  # a serving process's start-up: a few hundred thousand long-lived objects
before = len(gc.get_objects())
frozen = freeze_startup_heap()
print(before, frozen, len(gc.get_objects()))
"""


def _run(env_value: str) -> list[float]:
    env = {"PYTHONPATH": str(REPO_ROOT), "LLM_GC_FREEZE": env_value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [float(x) for x in out.split()]


def test_freeze_takes_start_up_objects_out_of_full_collections():
    before, frozen, visible = _run("1")
    assert frozen >= before * 0.9  # what start-up made is frozen...
    assert visible < before * 0.05  # ...so a full pass no longer walks it


def test_llm_gc_freeze_0_turns_it_off():
    before, frozen, visible = _run("0")
    assert frozen == 0
    assert visible >= before * 0.9
    assert gc.get_freeze_count() == 0  # and the test process itself was never frozen

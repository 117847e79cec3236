"""Shared fixtures. `demo_model_path` builds models/demo (once, if missing or stale)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Optional

import pytest

# Without a GPU the Triton-language kernels are tested in Triton's interpreter, which must be
# chosen before anything imports triton (xgrammar does, at import). The engine itself passes
# use_triton=<tensor is on CUDA> explicitly, so this only affects the kernel tests.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEMO_MODEL_DIR = REPO_ROOT / "models" / "demo"


def ensure_demo_model(path: Path = DEMO_MODEL_DIR, seed: int = 0) -> Path:
    """Build the demo model into `path` unless a current build is already there."""
    from backend.demo_model import build_demo_model, is_current

    if is_current(path, seed):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Parallel test processes (or a server test next to a unit test run) must not build twice.
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(path, seed):
            build_demo_model(path, seed=seed)
    return path


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    """Path of the demo HF model directory (models/demo under the repository)."""
    return ensure_demo_model()


@pytest.fixture(scope="session")
def start_triton(demo_model_path, tmp_path_factory):
    """Starts the real tritonserver on model_repository/ (free ports) with the demo model:
    `with start_triton(num_kv_blocks=256, max_model_len=1024) as server: ...` (`env`: more
    LLM_* settings). Prints the end of
    the server's log when it does not come up."""
    from client.local_server import LocalTritonServer

    @contextlib.contextmanager
    def start(num_kv_blocks: int, max_model_len: int, name: str = "triton", env: Optional[dict[str, str]] = None):
        log = tmp_path_factory.mktemp(name) / "server.log"
        env = {"LLM_MODEL_PATH": str(demo_model_path), "LLM_NUM_KV_BLOCKS": str(num_kv_blocks),
               "LLM_MAX_MODEL_LEN": str(max_model_len), **(env or {})}
        server = LocalTritonServer(env=env, log_file=log)
        try:
            server.start(timeout=240)
        except Exception:
            print(log.read_text()[-5000:])
            raise
        try:
            yield server
        finally:
            server.stop()

    return start


class _FakeTensor:
    def __init__(self, name: str, array) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self):
        return self._array


class _FakeTritonError(Exception):
    INTERNAL, INVALID_ARG = "INTERNAL", "INVALID_ARG"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


class _FakeResponse:
    def __init__(self, output_tensors=None, error=None) -> None:
        self.output_tensors, self.error = list(output_tensors or []), error

    def outputs(self) -> dict:
        return {t.name(): t.as_numpy() for t in self.output_tensors}


class FakeRequest:
    """A Triton request holding numpy inputs, for driving model.py files without a server."""

    def __init__(self, **inputs) -> None:
        self._inputs = [_FakeTensor(k, v) for k, v in inputs.items()]

    def inputs(self) -> list:
        return list(self._inputs)


@pytest.fixture
def fake_pb_utils(monkeypatch):
    """A minimal `triton_python_backend_utils` (Tensor, InferenceResponse, TritonError, Logger),
    installed in sys.modules so model.py files import it."""
    import types

    mod = types.ModuleType("triton_python_backend_utils")
    mod.Tensor = _FakeTensor
    mod.TritonError = _FakeTritonError
    mod.InferenceResponse = _FakeResponse
    mod.Logger = types.SimpleNamespace(log_info=lambda msg: None, log_warn=lambda msg: None, log_error=lambda msg: None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", mod)
    # model.py's initialize freezes the heap of the process it serves in (backend/gc_freeze.py);
    # here that process is pytest, which must keep collecting the garbage of every later test.
    monkeypatch.setenv("LLM_GC_FREEZE", "0")
    return mod


def load_triton_model(name: str):
    """Import model_repository/<name>/1/model.py as a fresh module (needs fake_pb_utils)."""
    import importlib.util

    path = REPO_ROOT / "model_repository" / name / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"_triton_model_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Two lanes under pytest-xdist (scripts/test.sh: -n 2). A module that starts tritonserver,
# serve.sh or the frontend goes to the "server" lane, run in file order on one worker: those tests
# time graces and stops, and some scan /proc for their own server's processes. Everything else
# goes to the "unit" lane on the other worker, which lowers its own priority (nice 10) so that the
# server lane keeps the CPU it needs and the unit lane fills the time the server lane spends
# waiting (servers starting, streams, graces): on 2 cores the serial suite kept one busy on
# average.
_SERVER_MODULE = re.compile(r"start_triton|LocalTritonServer|tritonserver|serve\.sh|docker-entrypoint|soak\.py|"
                            r"openai_frontend\.testing|serving_bench import Frontend")
_lanes: dict[str, str] = {}


def _lane(path: Path) -> str:
    key = str(path)
    if key not in _lanes:
        _lanes[key] = "server" if _SERVER_MODULE.search(path.read_text()) else "unit"
    return _lanes[key]


def pytest_xdist_make_scheduler(config, log):
    # xdist's loadgroup marks rename node ids, which pytest 9.2's ids ignore: a scope of our own
    # instead (each scope runs whole, in order, on one worker).
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _lane(Path(config.rootpath) / nodeid.split("::", 1)[0])

    return Lanes(config, log)


_niced = False


def pytest_runtest_setup(item) -> None:
    global _niced
    if _niced or not os.environ.get("PYTEST_XDIST_WORKER") or _lane(item.path) != "unit":
        return
    os.nice(10)
    _niced = True

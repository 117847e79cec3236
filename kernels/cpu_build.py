"""Builds and loads the C++ CPU kernels in `csrc/` on first use.

torch's cpp_extension compiles a kernel with the machine's C++ compiler the first time a process
asks for it, into this checkout's `kernels/.build/` (or TORCH_EXTENSIONS_DIR when set); later
processes load the build, and a changed source rebuilds. `scripts/setup.sh` builds them ahead of
time so tritonserver's model load does not wait on the compiler. Without a compiler, or with the
kernel's environment switch at 0, `load()` returns None and the caller keeps its torch path.

Not torch's default cache in the home directory: every checkout shared it, and a build killed
there (a CI clone stopped mid-build) left torch's lock file behind, on which every later build
waited forever without a word (QA: serve.sh hung 12 minutes). Each build here runs holding an
flock (`build_guard`), which the kernel releases when its holder dies: whoever holds it next
knows a torch lock file it finds is a dead build's, and removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BUILD_ROOT = Path(__file__).parent / ".build"


class CpuKernel:
    """One csrc/ source file as a lazily built extension module."""

    def __init__(self, name: str, source: str, switch: str, cflags: Sequence[str], fallback: str) -> None:
        self.name = name
        self.source = CSRC / source
        self.switch = switch  # environment variable; "0" disables the kernel
        self.cflags = list(cflags)
        self.fallback = fallback  # what runs instead, for the warning
        self._lock = threading.Lock()
        self._module: Any = None
        self._error: Optional[str] = None

    def load(self) -> Any:
        """The compiled module, or None (disabled, or the build failed: see `error()`)."""
        if os.environ.get(self.switch, "1") == "0":
            return None
        with self._lock:
            if self._module is None and self._error is None:
                try:
                    from torch.utils.cpp_extension import load as build

                    _put_ninja_on_path()
                    name = f"{self.name}_{_cpu_tag()}"
                    directory = build_directory(name)
                    with build_guard(directory):
                        self._module = build(
                            name=name,
                            sources=[str(self.source)],
                            extra_cflags=self.cflags,
                            extra_ldflags=["-fopenmp"],
                            build_directory=str(directory),
                            verbose=False,
                        )
                except Exception as exc:  # no compiler, no ninja, headers missing: fall back, say why
                    self._error = f"{type(exc).__name__}: {exc}"
                    log.warning("%s unavailable, using %s: %s", self.name, self.fallback, self._error)
            return self._module

    def error(self) -> Optional[str]:
        return self._error

    def require(self) -> Any:
        module = self.load()
        if module is None:
            raise RuntimeError(f"{self.name} is not available: {self._error or f'disabled ({self.switch}=0)'}")
        return module


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    directory = Path(root) / name if root else BUILD_ROOT / f"py{sys.version_info[0]}{sys.version_info[1]}_cpu" / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextlib.contextmanager
def build_guard(directory: Path) -> Iterator[None]:
    """Held around torch's build in `directory`: one build at a time across processes, and none
    waiting on a dead one. torch's FileBaton is a plain file its waiters poll for as long as it
    exists; a process killed mid-build leaves it, and a mtime rule (the old one here) still left
    a waiter that started while the lock looked young polling forever. An flock is released by
    the kernel with its holder, so once it is ours a torch lock file is a dead build's."""
    with open(directory / "build.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            lock = directory / "lock"
            if lock.exists():
                log.warning("removing %s, left by a build that never finished", lock)
                lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _cpu_tag() -> str:
    # The builds use -march=native: a home directory shared by machines with different CPUs
    # must not hand one machine's build to another (illegal instruction), so the cache entry is
    # named after the CPU's instruction-set flags.
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _put_ninja_on_path() -> None:
    # torch looks for `ninja` on PATH; the pinned wheel's binary is not there when the venv is
    # not activated (tritonserver's Python stub, `.venv/bin/python -m ...`).
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + (os.pathsep + path if path else "")

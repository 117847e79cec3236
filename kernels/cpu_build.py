"""Builds and loads the C++ CPU kernels in `csrc/` on first use.

torch's cpp_extension compiles a kernel with the machine's C++ compiler into torch's extension
cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions) the first time a process asks
for it; later processes load the cached build, and a changed source rebuilds. `scripts/setup.sh`
builds them ahead of time so tritonserver's model load does not wait on the compiler. Without a
compiler, or with the kernel's environment switch at 0, `load()` returns None and the caller
keeps its torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


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
                    self._module = build(
                        name=f"{self.name}_{_cpu_tag()}",
                        sources=[str(self.source)],
                        extra_cflags=self.cflags,
                        extra_ldflags=["-fopenmp"],
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

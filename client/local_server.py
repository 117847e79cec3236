"""Start and stop a real tritonserver on this repository's model_repository/.

Used by the serve command, the integration tests and the benchmarks, so all three run the
server the same way: the binary from the nvidia-pytriton wheel, the Python backend stub for this
interpreter, this interpreter's site-packages visible to the models.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]


_LOWEST_PORT = 10000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_free(port: int) -> bool:
    """Whether nothing listens on `port` (127.0.0.1) now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range when there is room. Every
    outgoing connection takes its source port from that range, so a server restarted on such a
    port (the tests kill and restart servers, and a frontend keeps connecting meanwhile) could
    find it taken; a port below it is only ever bound on purpose. Never the same port twice in
    one process; across processes a random pick of ~20k makes a clash unlikely, and a bound port
    is skipped."""
    lo, _ = _ephemeral_range()
    pick = random.SystemRandom()
    if lo - _LOWEST_PORT >= 1000:
        for _ in range(100):
            port = pick.randrange(_LOWEST_PORT, lo)
            if port not in _handed_out and port_free(port):
                _handed_out.add(port)
                return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def triton_home() -> Path:
    """The tritonserver tree: $TRITON_HOME if set (scripts/env.sh sets it; a GPU host without the
    wheel gets an unpacked copy, scripts/gpu_check.sh), else the nvidia-pytriton wheel's."""
    if os.environ.get("TRITON_HOME"):
        return Path(os.environ["TRITON_HOME"])
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


@functools.lru_cache(maxsize=1)
def _default_sigint_prefix() -> tuple[str, ...]:
    env = shutil.which("env")
    if env is None or subprocess.run([env, "--default-signal=INT", "true"], capture_output=True).returncode != 0:
        return ()
    return (env, "--default-signal=INT")


def _with_default_signals(command: list[str]) -> list[str]:
    """tritonserver inherits an ignored SIGINT from a caller started in the background by a
    non-interactive shell (CI: `cmd &`), and it installs its own handler only once its models
    have loaded: a Ctrl-C or stop() before then was lost, and stop() waited out its timeout
    (60 s). coreutils' env restores the default first; without it, the command as given."""
    return [*_default_sigint_prefix(), *command]


def _wait_for_exec(process: subprocess.Popen, wrapper: str, timeout: float = 2.0) -> None:
    """A signal sent while `wrapper` still runs, before it restores the default and execs the
    server, is lost (seen under load: the stop then waited its 60 s out)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            if os.path.basename(os.readlink(f"/proc/{process.pid}/exe")) != wrapper:
                return
        except OSError:
            return
        time.sleep(0.005)


def _end_orphans(group: int, grace: float = 3.0) -> None:
    """A tritonserver stopped while it loads its models dies at once (its signal handler is not
    installed yet), leaving the Python stubs it launched waiting for an initialize message that
    never comes (scripts/sweep-shm.sh killed them only at the next start), each holding memory.
    After a clean exit the group is empty; whatever is left `grace` seconds after tritonserver
    has gone is killed, and waited for (a killed process lingers until it is reaped)."""
    if _group_gone(group, grace):
        return
    try:
        os.killpg(group, signal.SIGKILL)  # their shared-memory regions: the next start's sweep
    except (ProcessLookupError, PermissionError):
        return
    _group_gone(group, 5.0)


def _group_gone(group: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def server_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    site = sysconfig.get_paths()["purelib"]
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR")
    libs = triton_home().parents[1] / "nvidia_pytriton.libs"  # the wheel's layout: <site>/pytriton/tritonserver
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, str(libs), env.get("LD_LIBRARY_PATH")) if p)
    # A PYTHONPATH given to us comes before this interpreter's site-packages: on a GPU host it
    # holds carried packages that must shadow the host's (numpy < 2 for the stub).
    env["PYTHONPATH"] = ":".join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH"), site) if p)
    # The stub's embedded interpreter finds its prefix from the first python on PATH; without the
    # venv's bin first it settles on the base install and the models cannot import torch.
    env["PATH"] = ":".join(p for p in (str(Path(sys.executable).parent), env.get("PATH")) if p)
    env.update(extra or {})
    return env


class LocalTritonServer:
    def __init__(
        self,
        model_repository: Path = REPO_ROOT / "model_repository",
        http_port: Optional[int] = None,
        grpc_port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        env: Optional[dict[str, str]] = None,
        log_file: Optional[Path] = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model_repository = Path(model_repository)
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.env = env or {}
        self.log_file = log_file
        self.extra_args = extra_args
        self.process: Optional[subprocess.Popen] = None
        self._log_handle = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        home = triton_home()
        return [
            str(home / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={home / 'backends'}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--log-verbose=0",
            *self.extra_args,
        ]

    def start(self, timeout: float = 300.0) -> "LocalTritonServer":
        stub = triton_home() / "backends" / "python" / "triton_python_backend_stub"
        if not stub.exists():
            raise RuntimeError(f"{stub} is missing: run scripts/setup.sh first")
        # Regions of stubs killed before (tests kill servers on purpose) would fill /dev/shm.
        subprocess.run([str(REPO_ROOT / "scripts" / "sweep-shm.sh")], check=False)
        out = None
        if self.log_file is not None:
            self._log_handle = open(self.log_file, "ab")
            out = self._log_handle
        self.process = subprocess.Popen(
            _with_default_signals(self.command()),
            env=server_env(self.env),
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
        )
        try:
            self.wait_ready(timeout)
        except BaseException:  # Ctrl-C or SIGTERM while it starts too: the caller has nothing to stop (QA)
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        """Models ready and every endpoint listening. tritonserver starts its metrics endpoint
        after HTTP, so /v2/health/ready can answer before /metrics does (seen on a busy host)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
            with socket.create_connection(("localhost", self.metrics_port), timeout=2):
                return True
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} (see its log)")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f}s")

    def stop(self, timeout: float = 60.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            _wait_for_exec(self.process, "env")
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        _end_orphans(self.process.pid)
        self.process = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> "LocalTritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover - convenience: python -m client.local_server
    srv = LocalTritonServer(http_port=8000, grpc_port=8001, metrics_port=8002)
    print(" ".join(srv.command()), file=sys.stderr)

"""scripts/docker-entrypoint.sh run on this host with the pytriton tritonserver, for the tests of
the stack as deployed (tests/test_faults.py, tests/test_data_parallel.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from client.local_server import REPO_ROOT, free_port, port_free, server_env, triton_home


def port_block(servers: int) -> int:
    """A free port p with p + 3*i free too for every server i (the entrypoint's layout)."""
    while True:
        base = free_port()
        if all(port_free(base + 3 * i) for i in range(1, servers)):
            return base


class Entrypoint:
    """scripts/docker-entrypoint.sh as a child process, with its ports and log; with
    `data_parallel_size` > 1, that many tritonservers (server i on each port + 3*i)."""

    def __init__(self, model_path: Path, log_path: Path, data_parallel_size: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.servers = data_parallel_size
        self.ports = {name: port_block(data_parallel_size) for name in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT")}
        self.ports["FRONTEND_PORT"] = free_port()
        self.env = server_env({
            **{k: str(v) for k, v in self.ports.items()},
            "TRITONSERVER": str(triton_home() / "bin" / "tritonserver"),
            "TRITON_BACKEND_DIR": str(triton_home() / "backends"),
            "PYTHON": sys.executable, "LLM_MODEL_PATH": str(model_path), "SERVED_MODEL_NAME": "demo",
            "LLM_NUM_KV_BLOCKS": "512", "LLM_MAX_MODEL_LEN": "4096", "WATCHDOG_INTERVAL": "1", "EXIT_TIMEOUT": "5",
            "MAX_RESTARTS": "20",  # tests/test_faults.py restarts tritonserver on purpose, six times and more
            "FRONTEND_ARGS": "--log-level warning", "TRITON_ARGS": "--log-verbose=0",
            "DATA_PARALLEL_SIZE": str(data_parallel_size), **(env or {}),
        })
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['FRONTEND_PORT']}"

    def grpc_urls(self) -> list[str]:
        return [f"127.0.0.1:{self.ports['GRPC_PORT'] + 3 * i}" for i in range(self.servers)]

    def metrics_urls(self) -> list[str]:
        return [f"http://localhost:{self.ports['METRICS_PORT'] + 3 * i}/metrics" for i in range(self.servers)]

    @property
    def grpc_url(self) -> str:
        return self.grpc_urls()[0]

    @property
    def metrics_url(self) -> str:
        return self.metrics_urls()[0]

    def names(self) -> list[str]:
        """The servers as the entrypoint's log names them."""
        return [f"tritonserver {i}" for i in range(self.servers)] if self.servers > 1 else ["tritonserver"]

    def start(self) -> "Entrypoint":
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen([str(REPO_ROOT / "scripts" / "docker-entrypoint.sh")], env=self.env,
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_serving(300)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def supervisor_lines(self) -> str:
        return "\n".join(line for line in self.log().splitlines() if line.startswith("[entrypoint "))

    def all_ready(self) -> bool:
        """Whether the supervisor has seen each server's latest start ready (it polls once a second)."""
        lines = self.supervisor_lines().splitlines()
        for name in self.names():
            starts = [line for line in lines if f"{name} started" in line or f"{name} ready" in line]
            if starts and f"{name} ready" not in starts[-1]:
                return False
        return True

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                # Serving, and the supervisor has seen its latest tritonservers ready: a test that
                # stops a server sooner would test that poll's timing instead.
                if completion(self.url, timeout=10).status_code == 200 and self.all_ready():
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, "the entrypoint exited:\n" + self.log()[-4000:]
            assert time.monotonic() < deadline, "not serving:\n" + self.log()[-4000:]
            time.sleep(0.5)

    def tritonserver_pids(self) -> list[int]:
        """Server i's process at index i."""
        by_port = {}
        for pid in children(self.process.pid):
            if exe_name(pid) != "tritonserver":
                continue
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            port = next(int(a.split(b"=", 1)[1]) for a in argv if a.startswith(b"--http-port="))
            by_port[port] = pid
        assert len(by_port) == self.servers, by_port
        return [by_port[self.ports["HTTP_PORT"] + 3 * i] for i in range(self.servers)]

    def tritonserver_pid(self) -> int:
        (pid,) = self.tritonserver_pids()
        return pid

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return self.process.returncode


def children(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                out.append(int(status.parent.name))
        except OSError:
            continue
    return out


def exe_name(pid: int) -> str:
    try:
        return Path(os.readlink(f"/proc/{pid}/exe")).name
    except OSError:
        return ""


def completion(base_url: str, max_tokens: int = 4, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", timeout=timeout,
                      json={"model": "demo", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0})

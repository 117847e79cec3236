"""The engine in a process of its own, driven from the llm model's Triton stub (vLLM V1's split).

Inside the stub, the engine's step loop shares one GIL with everything that streams responses:
building each response's tensors and sending it holds the GIL ~80 µs a response (2 cores) and
the loop waits for it. On an H200 the in-stub engine thread was on a CPU half the time at c=64
while streaming (docs/BENCHMARKS.md). Here the step loop runs in a child process with a GIL of
its own; each step's outputs cross to the stub in one message, where the responders send them.

    proxy = EngineProxy(config, on_step)     # the stub side: LLMEngine's surface the model uses
    python -m backend.engine_process FD      # the child (started by EngineProxy)

The child ends with its parent: the socket's end-of-file (the stub stopped or was killed) shuts
the engine down. Exceptions raised by the engine's calls in the child (RequestError, ...) are
raised again, same type and message, in the stub.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any, Callable, Optional

from backend.cancel_watch import CancelWatch
from backend.config import EngineConfig
from backend.engine import CANCEL_CHECKS_PER_S, CANCEL_POLL_S, EngineOverloaded, EngineStats, RequestError
from backend.outputs import RequestOutput
from backend.sampling_params import SamplingParams, SamplingParamsError, parse_sampling_params
from backend.sequence import FinishReason

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
_HEADER = struct.Struct("!I")
# Exceptions that cross the process boundary as themselves (the model maps each to a Triton code).
_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls for cls in (RequestError, EngineOverloaded, SamplingParamsError, ValueError, KeyError, TimeoutError)
}


class EngineProcessError(RuntimeError):
    """The engine's process failed to start or has gone."""


class _Channel:
    """Length-prefixed pickles over a stream socket; sends from several threads are serialized."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._file = sock.makefile("rb")

    def send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            # MSG_NOSIGNAL: a peer that has gone is an EPIPE error here, never a SIGPIPE, which
            # would end a Triton stub (its embedded interpreter installs no signal handlers).
            self._sock.sendall(_HEADER.pack(len(data)) + data, socket.MSG_NOSIGNAL)

    def recv(self) -> Any:
        """The next message; EOFError when the other side has closed."""
        head = self._file.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise EOFError
        size = _HEADER.unpack(head)[0]
        data = self._file.read(size)
        if len(data) < size:
            raise EOFError
        return pickle.loads(data)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _python() -> str:
    """The interpreter for the child. Inside a Triton stub sys.executable is not a Python (the
    stub embeds one); its prefix is the venv found from PATH, whose bin/ holds the python."""
    for cand in (sys.executable, os.path.join(sys.prefix, "bin", "python3"), os.path.join(sys.prefix, "bin", "python")):
        if cand and os.path.basename(cand).startswith("python") and os.access(cand, os.X_OK):
            return cand
    raise EngineProcessError(f"no python interpreter found for the engine process (prefix {sys.prefix})")


class EngineProxy:
    """LLMEngine's surface as the llm model uses it, with the engine in a child process.

    `on_step(stats)` runs on the proxy's reader thread after each step's outputs were handed to
    their callbacks (the model ticks its outbox and publishes metrics there), as LLMEngine calls
    its `on_step` from the step loop. `on_gone(reason)` runs there once when the child died
    unasked, after every open request was failed: nothing restarts it.
    """

    call_timeout_s = 60.0  # how long add_request waits for the child to take a request

    def __init__(self, config: EngineConfig, on_step: Optional[Callable[[EngineStats], None]] = None,
                 start_timeout_s: float = 600.0) -> None:
        self.on_step = on_step
        self.on_gone: Optional[Callable[[str], None]] = None
        parent, child = socket.socketpair()
        env = dict(os.environ)
        # The child is a plain python: it honours PYTHONPATH, which the stub's isolated
        # interpreter did not; the repository must be importable there.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [_python(), "-m", "backend.engine_process", str(child.fileno())],
            pass_fds=[child.fileno()],
            env=env,
            cwd=str(REPO_ROOT),
        )
        child.close()
        self._chan = _Channel(parent)
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._callbacks: dict[str, tuple[Callable[[RequestOutput], None], list[int]]] = {}
        self._closed = False
        self._gone: Optional[str] = None
        self._cancel_watch = CancelWatch(CANCEL_POLL_S, CANCEL_CHECKS_PER_S)
        try:
            try:
                self._chan.send(("start", config))
            except OSError:
                pass  # it has exited already: _recv_start says so
            kind, payload = self._recv_start(start_timeout_s)
        except BaseException:
            self._kill()
            raise
        if kind != "ready":
            self._kill()
            raise EngineProcessError(f"the engine process failed to start: {payload}")
        self.config: EngineConfig = payload["config"]
        self.max_model_len: int = payload["max_model_len"]
        self.device: str = payload["device"]
        self.kv_dtype: str = payload["kv_dtype"]
        self._stats: EngineStats = payload["stats"]
        self._defaults: dict[str, Any] = payload["defaults"]
        self._reader = threading.Thread(target=self._read, name="llm-engine-proxy", daemon=True)
        self._reader.start()
        self._cancel_watch.start(self.abort)

    def _recv_start(self, timeout_s: float) -> tuple[str, Any]:
        """The child's first message; ("failed", why) if it exits first (an import error, say)."""
        box: list = []

        def read() -> None:
            try:
                box.append(self._chan.recv())
            except (EOFError, OSError) as exc:
                try:
                    status = self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    status = None
                box.append(("failed", f"it exited (status {status}) before it was ready: {type(exc).__name__}; "
                                      "its error is in the server's log"))

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout_s)
        if not box:
            raise EngineProcessError(f"the engine process did not start within {timeout_s:.0f} s")
        return box[0]

    # ------------------------------------------------------------------ calls
    def _call(self, op: str, *args: Any, timeout: float = 60.0) -> Any:
        fut: Future = Future()
        with self._lock:
            if self._gone is not None:
                raise EngineProcessError(self._gone)
            cid = next(self._call_ids)
            self._calls[cid] = fut
        try:
            try:
                self._chan.send(("call", cid, op, args))
            except OSError:  # the child went before the reader noticed
                raise EngineProcessError(self._gone or "the engine process has stopped") from None
            try:
                return fut.result(timeout)
            except FuturesTimeout:
                if fut.done():  # the call's own TimeoutError, from the child
                    raise
                raise EngineProcessError(f"the engine process did not answer {op} within {timeout:.0f} s") from None
        finally:
            with self._lock:
                self._calls.pop(cid, None)

    def parse_params(self, raw: dict[str, Any]) -> SamplingParams:
        # Here, not in the child: the engine's sampling defaults came with "ready", and a round
        # trip per request would wait on the child's step loop for its GIL.
        return parse_sampling_params(raw, self._defaults)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
                    request_id: Optional[str] = None, is_cancelled: Optional[Callable[[], bool]] = None,
                    input_embeds: Any = None) -> str:
        if request_id is None:
            request_id = uuid.uuid4().hex
        # Registered before the child can answer, so no output finds its request unknown; the
        # watch too: a final output can reach the reader before the call's result does, and its
        # unwatch must find the entry (a watch after it stayed, polled forever).
        with self._lock:
            self._callbacks[request_id] = (on_output, [params.n])
            if is_cancelled is not None:
                self._cancel_watch.watch(request_id, is_cancelled)
        try:
            return self._call("add_request", prompt_ids, params, request_id, input_embeds, timeout=self.call_timeout_s)
        except BaseException as exc:
            with self._lock:
                self._callbacks.pop(request_id, None)
                self._cancel_watch.unwatch(request_id)
            if isinstance(exc, EngineProcessError):
                # Unanswered, the call still waits in the child, which adds the request when it
                # gets to it: the abort follows it on the same channel, or the child would run a
                # request whose caller has had its error (QA: 4 x 4000 tokens, blocks held).
                self.abort(request_id)
            raise

    def start(self) -> None:
        """LLMEngine's: here the step loop started with the child (a no-op)."""

    def abort(self, request_id: str) -> None:
        if self._gone is None:
            try:
                self._chan.send(("abort", request_id))
            except OSError:
                pass

    def stats(self) -> EngineStats:
        return self._stats

    def control(self, kind: str, arrays: dict, serving: Optional[dict] = None,
                serving_stats: Optional[dict] = None, timeout: float = 60.0) -> Any:
        """backend.triton_io.control run against the engine, in its process."""
        return self._call("control", kind, arrays, serving, serving_stats, timeout=timeout)

    # ------------------------------------------------------------------ the reader
    def _read(self) -> None:
        try:
            while True:
                msg = self._chan.recv()
                kind = msg[0]
                if kind == "step":
                    _, outputs, stats = msg
                    self._stats = stats
                    for request_id, out in outputs:
                        self._deliver(request_id, out)
                    if self.on_step is not None:
                        try:
                            self.on_step(stats)
                        except Exception:
                            log.exception("on_step failed")
                elif kind == "result":
                    _, cid, ok, value = msg
                    with self._lock:
                        fut = self._calls.pop(cid, None)
                    if fut is not None:
                        if ok:
                            fut.set_result(value)
                        else:
                            name, text = value
                            fut.set_exception(_ERRORS.get(name, EngineProcessError)(text))
        except (EOFError, OSError):
            pass
        except Exception:
            log.exception("the engine proxy's reader failed")
        reason = "the server is shutting down" if self._closed else "the engine process has stopped"
        self._fail_all(reason)
        if not self._closed and self.on_gone is not None:
            self.on_gone(reason)

    def _deliver(self, request_id: str, out: RequestOutput) -> None:
        with self._lock:
            entry = self._callbacks.get(request_id)
            if entry is None:
                return
            callback, remaining = entry
            if out.finished:
                remaining[0] -= 1
                if remaining[0] <= 0:
                    del self._callbacks[request_id]
                    self._cancel_watch.unwatch(request_id)
        try:
            callback(out)
        except Exception:  # a broken consumer must not stop the others' outputs
            log.exception("output callback failed for %s", out.request_id)

    def _fail_all(self, reason: str) -> None:
        """The child is gone: every open request ends with an error, every pending call fails."""
        with self._lock:
            self._gone = reason
            calls, self._calls = self._calls, {}
            callbacks, self._callbacks = self._callbacks, {}
        for fut in calls.values():
            fut.set_exception(EngineProcessError(reason))
        # The server's fault, not the request's: clients see a 500 (or a 503 while shutting down),
        # as a request sent after it does, not a 400 that says not to retry.
        ended = reason if self._closed else f"internal error: {reason}"
        # Its pool went with it: nothing runs, nothing is held (what the metrics show from now).
        s = self._stats
        self._stats = dataclasses.replace(s, num_running=0, num_waiting=0, num_free_kv_blocks=s.num_kv_blocks,
                                          num_cached_kv_blocks=0)
        for request_id, (callback, remaining) in callbacks.items():
            for index in range(remaining[0]):
                try:
                    callback(RequestOutput(request_id=request_id, new_token_ids=[], window_ids=[], window_start=0,
                                           prefix_len=0, text="", prompt_tokens=0, completion_tokens=0,
                                           finish_reason=FinishReason.ABORT.value, error=ended, index=index))
                except Exception:
                    log.exception("output callback failed for %s", request_id)
        if self.on_step is not None and not self._closed:
            try:
                self.on_step(self._stats)
            except Exception:
                log.exception("on_step failed")

    # ------------------------------------------------------------------ lifetime
    @property
    def alive(self) -> bool:
        return self._gone is None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine (open requests end with an error), then the process."""
        self._cancel_watch.stop()
        self._closed = True
        try:
            self._chan.send(("shutdown",))
            self._proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()
        self._reader.join(timeout=5)

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)
        self._chan.close()


# ====================================================================== the child
def _serve(chan: _Channel) -> None:
    from backend.engine import LLMEngine
    from backend.gc_freeze import freeze_startup_heap
    from backend.triton_io import control

    kind, config = chan.recv()
    assert kind == "start", kind
    try:
        engine = LLMEngine(config)
    except Exception as exc:
        log.exception("engine start failed")
        chan.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    pending: list[tuple[str, RequestOutput]] = []
    pending_lock = threading.Lock()

    def on_step(stats: EngineStats) -> None:
        # One message per step: its outputs (the step loop's callbacks collected them) and the
        # stats after it. The idle loop calls this too (every 0.5 s at most): the stub publishes
        # its metrics on these calls, as on the in-stub engine's.
        nonlocal pending
        with pending_lock:
            batch, pending = pending, []
        try:
            chan.send(("step", batch, stats))
        except OSError:
            pass  # the stub has gone (QA: a BrokenPipeError on the engine thread); the loop below stops

    engine.on_step = on_step

    def collector(request_id: str) -> Callable[[RequestOutput], None]:
        def collect(out: RequestOutput) -> None:
            with pending_lock:
                pending.append((request_id, out))

        return collect

    def call(op: str, args: tuple) -> Any:
        if op == "add_request":
            prompt_ids, params, request_id, input_embeds = args
            return engine.add_request(prompt_ids, params, collector(request_id), request_id=request_id,
                                      input_embeds=input_embeds)
        if op == "control":
            return control(engine, *args)
        raise ValueError(f"unknown engine call {op!r}")

    freeze_startup_heap()
    # "ready" goes first: the loop's first (idle) step may send before the proxy reads on.
    chan.send(("ready", {"config": engine.config, "max_model_len": engine.max_model_len, "device": engine.device,
                         "kv_dtype": engine.kv_dtype, "stats": engine.stats(), "defaults": engine.defaults}))
    engine.start()
    try:
        while True:
            msg = chan.recv()
            if msg[0] == "call":
                _, cid, op, args = msg
                try:
                    chan.send(("result", cid, True, call(op, args)))
                except Exception as exc:
                    name = type(exc).__name__ if type(exc).__name__ in _ERRORS else "EngineProcessError"
                    chan.send(("result", cid, False, (name, str(exc))))
            elif msg[0] == "abort":
                engine.abort(msg[1])
            elif msg[0] == "shutdown":
                break
    except (EOFError, OSError):
        pass  # the stub has gone: stop
    finally:
        engine.shutdown()
        on_step(engine.stats())  # the shutdown's final outputs (aborts), if the stub still listens


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # Warnings and errors reach the server's log (this process's stderr is the stub's), as the
    # in-stub engine's do through Python's default handler.
    logging.basicConfig(level=logging.WARNING, format="[engine-process] %(levelname)s %(name)s: %(message)s")
    # The parent's SIGINT (a terminal's ^C to the server) is the parent's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    chan = _Channel(socket.socket(fileno=int(args[0])))
    try:
        _serve(chan)
    finally:
        chan.close()


if __name__ == "__main__":
    main()

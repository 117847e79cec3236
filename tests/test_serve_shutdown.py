"""Stopping scripts/serve.sh with streams in flight, on the real stack (tritonserver + frontend).

Ctrl-C (SIGINT to the whole process group) used to reach tritonserver and the frontend at once:
the shutting-down ensemble stopped passing responses on, tritonserver could not exit while the
frontend held the gRPC streams, and the frontend waited for those streams without limit, so the
clients got nothing more until their own read timeouts ended it (minutes)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from openai_frontend.testing import free_port, scrape_metric

REPO = Path(__file__).resolve().parents[1]


def _group(pgid: int) -> list[str]:
    """The live processes of a process group (zombies are their parents' business)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(f"{stat.parent.name} {(stat.parent / 'cmdline').read_bytes()[:100]!r}")
    return found


def _stream(url: str, max_tokens: int, started: threading.Event, out: dict, n: int = 1) -> None:
    body = {"model": "demo", "prompt": "x", "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "n": n}
    out["lines"] = lines = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
        out["end"] = "complete"
    except httpx.HTTPError as exc:
        out["end"] = repr(exc)
    out["at"] = time.monotonic()
    started.set()


def _start(model_path: Path, tmp_path: Path, *extra: str, sigint=signal.SIG_DFL,
           ports: Optional[list[int]] = None) -> tuple[subprocess.Popen, str, list[int], Path]:
    """scripts/serve.sh on free ports, up and answering: (process, frontend url, ports, log).
    sigint: SIGINT's disposition at its start (SIG_IGN: as from `serve.sh &` in a script)."""
    ports = ports or [free_port() for _ in range(4)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(REPO / "scripts/serve.sh"), "--model-path", str(model_path), "--http-port", str(ports[0]),
             "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--frontend-port", str(ports[3]), *extra],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            # SIG_DFL as from a terminal: a suite started in the background (`cmd &` in a
            # script) runs with SIGINT ignored, which its children inherit.
            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
        )
    url = f"http://127.0.0.1:{ports[3]}"
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the stack did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url, ports, log
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    except BaseException:
        _kill(proc, ports)
        raise


def _assert_all_gone(proc: subprocess.Popen, ports: list[int]) -> None:
    deadline = time.monotonic() + 10
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _group(proc.pid), _group(proc.pid)
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # nobody holds it any more


def _no_exit_timeout(text: str) -> None:
    """tritonserver stopped within its exit timeout. It once kept `llm` live here with nothing in
    flight: the frontend closed its channel between an abort's answer and the end of that call
    (README, "Triton 2.51 and aborts at shutdown"); any exit timeout is a failure."""
    if "Exit timeout expired" in text:
        raise AssertionError(text[text.find("Waiting for in-flight requests"):][-4000:])


def _kill(proc: subprocess.Popen, ports: list[int]) -> None:
    if proc.poll() is None or _group(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        # The frontend runs in a session of its own (serve.sh): not in the group above.
        subprocess.run(["pkill", "-KILL", "-f", f"openai_frontend --triton-url localhost:{ports[1]}[ ,]"], check=False)


def test_ctrl_c_drains_short_streams_cancels_long_ones_and_stops_everything(demo_model_path, tmp_path):
    # Ctrl-C with --frontend-workers 2 (a uvicorn supervisor) and two streams in flight: the one
    # that can finish within --graceful-shutdown-timeout gets all of it; the other is cancelled at
    # the timeout (its connection closed, its request aborted in the engine, so tritonserver then
    # has nothing in flight), and every process is gone soon after. serve.sh starts here with
    # SIGINT ignored, as `scripts/serve.sh &` in a script does, where bash cannot trap a signal
    # ignored at its start: the SIGINT did nothing until serve.sh started itself again without.
    grace = 4
    proc, url, ports, log = _start(demo_model_path, tmp_path, "--frontend-workers", "2",
                                   "--graceful-shutdown-timeout", str(grace), sigint=signal.SIG_IGN)
    try:
        streams = []
        # The long one is 8 x 3500 tokens: one 3500-token sample took 4.2 s on an idle 2-core host,
        # so it finished just as the grace ran out (clean-clone CI).
        for max_tokens, n in ((150, 1), (3500, 8)):
            started, result = threading.Event(), {}
            thread = threading.Thread(target=_stream, args=(url, max_tokens, started, result, n), daemon=True)
            thread.start()
            streams.append((thread, started, result))
        for _, started, _ in streams:
            assert started.wait(60)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        rc = proc.wait(timeout=grace + 30)
        stopped = time.monotonic() - t0
        for thread, _, _ in streams:
            thread.join(10)
            assert not thread.is_alive(), "a stream is still open after serve.sh exited"
        text = log.read_text()
        short, long = (result for _, _, result in streams)
        # Drained: every token, then [DONE].
        assert short["end"] == "complete" and short["lines"][-1] == "data: [DONE]", short
        chunks = [json.loads(line[6:]) for line in short["lines"] if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # Cancelled at the timeout (no silent freeze), and told why: an error event, then [DONE].
        assert long["end"] == "complete" and long["lines"][-1] == "data: [DONE]", long["end"]
        assert "shutting down" in json.loads(long["lines"][-2][6:])["error"]["message"], long["lines"][-2:]
        assert grace - 1 < long["at"] - t0 < grace + 10, (long["at"] - t0, text[-3000:])
        assert rc == 130 and stopped < grace + 20, (rc, stopped, text[-3000:])
        # The frontend stopped first and aborted what it cancelled: tritonserver found nothing in
        # flight (rather than waiting its exit timeout out, and crashing).
        assert "Found 0 model versions that have in-flight inferences" in text, text[-3000:]
        assert "outlived tritonserver" not in text
        _assert_all_gone(proc, ports)
        _no_exit_timeout(text)
    finally:
        _kill(proc, ports)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_ctrl_c_cancels_at_once_and_still_aborts_in_the_engine(demo_model_path, tmp_path, workers):
    # The second Ctrl-C forces the frontend out at once (uvicorn skips its lifespan's shutdown):
    # the long stream is ended right away (an error event, [DONE]), and its abort must still reach the engine, or the
    # ensemble generates on for nobody and tritonserver waits out its exit timeout (QA: 3000
    # tokens to the end, "Exit timeout expired"). With --frontend-workers 2 the workers get the
    # supervisor's SIGTERM first, then serve.sh's SIGINT.
    proc, url, ports, log = _start(demo_model_path, tmp_path, "--frontend-workers", workers,
                                   "--graceful-shutdown-timeout", "30")
    try:
        started, result = threading.Event(), {}
        thread = threading.Thread(target=_stream, args=(url, 3500, started, result), daemon=True)
        thread.start()
        assert started.wait(60)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # again: do not wait out the 30 s grace
        rc = proc.wait(timeout=40)
        stopped = time.monotonic() - t0
        thread.join(10)
        text = log.read_text()
        assert result["lines"][-1] == "data: [DONE]" and result["at"] - t0 < 8, (result.get("end"), result["at"] - t0)
        assert "shutting down" in json.loads(result["lines"][-2][6:])["error"]["message"], result["lines"][-2:]
        assert rc == 130 and stopped < 20, (rc, stopped, text[-3000:])
        assert "Found 0 model versions that have in-flight inferences" in text, text[-3000:]
        # The lifespan cancelled on the way out is not reported as an error (__main__.CancelledAtShutdown).
        assert "asyncio.exceptions.CancelledError" not in text, text[-3000:]
        _assert_all_gone(proc, ports)
        _no_exit_timeout(text)
    finally:
        _kill(proc, ports)


def test_frontend_options_pass_through(demo_model_path, tmp_path):
    # QA: the README's frontend options (a served name, custom logit processors, --max-n, ...)
    # could not be reached through scripts/serve.sh, the README's first command.
    proc, url, ports, log = _start(demo_model_path, tmp_path, "--served-model-name", "my-model",
                                   "--enable-custom-logit-processor", "--", "--max-n", "2")
    try:
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["my-model"]
        body = {"model": "my-model", "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        r = httpx.post(url + "/v1/completions", json={**body, "n": 3}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        # Enabled in the frontend and the engine: this bad processor is the engine's to refuse
        # for what it is, not a feature that is off.
        r = httpx.post(url + "/generate", json={"text": "Hi", "custom_logit_processor": "{}"}, timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "enable" not in message and "disabled" not in message, r.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        _kill(proc, ports)


def _free_with_neighbours(step: int, count: int) -> int:
    """A port p with p + step * i free for i < count (serve.sh's server i listens 3 * i above)."""
    for _ in range(100):
        port = free_port()
        try:
            for i in range(1, count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + step * i))
        except OSError:
            continue
        return port
    raise RuntimeError("no free ports")


def test_data_parallel_serves_from_every_server_and_stops_them_all(demo_model_path, tmp_path):
    """--data-parallel-size 2: two tritonservers behind the one frontend (one per GPU on a GPU
    host; here both on the CPU), each chat routed to one, and a Ctrl-C stops every process."""
    ports = [_free_with_neighbours(3, 2) for _ in range(3)] + [free_port()]
    # One frontend process: new prefixes go to the server that has seen the least (spread for sure).
    proc, url, ports, log = _start(demo_model_path, tmp_path, "--dp-size", "2", "--frontend-workers", "1", ports=ports)
    all_ports = ports + [p + 3 for p in ports[:3]]
    try:
        systems = [f"You are assistant number {i}; answer in one short sentence about topic {i}. " * 5
                   for i in range(4)]
        for system in systems:
            body = {"model": "demo", "max_tokens": 2,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
            assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        served = [scrape_metric(f"http://localhost:{ports[2] + 3 * i}/metrics", "nv_inference_request_success",
                                'model="ensemble",version="1"') for i in range(2)]
        assert sum(served) == 4 and min(served) >= 1, served  # four new prefixes: spread over both
        info = httpx.get(url + "/get_server_info", timeout=10).json()
        assert [d["url"] for d in info["engine"]["data_parallel"]] == [f"localhost:{ports[1]}", f"localhost:{ports[1] + 3}"]
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=60) == 130
        text = log.read_text()
        assert text.count("Found 0 model versions that have in-flight inferences") >= 2, text[-3000:]
        assert "outlived tritonserver" not in text and "SIGKILL" not in text
        _assert_all_gone(proc, all_ports)
        _no_exit_timeout(text)
    finally:
        _kill(proc, ports)


def test_help_lists_the_options_and_an_unknown_one_says_where_to_look():
    for args, env, message in ((["--dp-size", "0"], {}, "--data-parallel-size takes a count (1 or more), not '0'"),
                               (["--data-parallel-size", "3"], {"CUDA_VISIBLE_DEVICES": "0,1"},
                                "--data-parallel-size 3, but CUDA_VISIBLE_DEVICES names 2 GPU(s)")):
        r = subprocess.run([str(REPO / "scripts/serve.sh"), *args], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **env})
        assert r.returncode == 2 and message in r.stderr, r
    ok = subprocess.run([str(REPO / "scripts/serve.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "--graceful-shutdown-timeout" in ok.stdout and "#" not in ok.stdout[:5], ok
    bad = subprocess.run([str(REPO / "scripts/serve.sh"), "--bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown option --bogus (--help lists them)" in bad.stderr, bad
    # QA: an option's value left out was bash's "$2: unbound variable".
    bare = subprocess.run([str(REPO / "scripts/serve.sh"), "--grpc-port"], capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2 and bare.stderr == "serve.sh: --grpc-port needs a value (--help lists the options)\n", bare


def _start_without_frontend(model_path: Path, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, list[int], Path]:
    """scripts/serve.sh --no-frontend on free ports, tritonserver ready: (process, ports, log)."""
    ports = [free_port() for _ in range(3)]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(REPO / "scripts/serve.sh"), "--model-path", str(model_path), "--no-frontend",
             "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), *extra],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=2).status_code == 200:
                    return proc, ports, log
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    except BaseException:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


@pytest.mark.parametrize("second_signal", [False, True])
def test_a_direct_ensemble_stream_gets_the_grace_then_ends_and_tritonserver_exits_cleanly(
        demo_model_path, tmp_path, second_signal):
    # QA: a client streaming from the ensemble straight over gRPC (python -m client, perf_analyzer)
    # stalled as soon as tritonserver 2.51 was told to stop (it stops passing an ensemble's
    # responses on), kept it alive until its exit timeout, and then tritonserver crashed on its way
    # out (5 runs of 5) or waited for the client to hang up. serve.sh now drains before the signal
    # (client/drain.py): the stream goes on for the grace, then ends (aborted) with a final response.
    # A second signal cuts the grace short (QA: it did not reach the drain, and the grace ran out).
    grace = 20 if second_signal else 3
    proc, ports, log = _start_without_frontend(demo_model_path, tmp_path, "--graceful-shutdown-timeout", str(grace))
    client = None
    try:
        client = subprocess.Popen(
            [str(REPO / ".venv/bin/python"), "-m", "client", "--url", f"localhost:{ports[1]}", "--max-tokens", "3500",
             "--json-params", '{"ignore_eos": true}', "--timeout", "300", "--stats", "Hello"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert client.stdout.read(1)  # streaming
        arrivals: list[float] = []

        def read() -> None:
            while client.stdout.read(1):
                arrivals.append(time.monotonic())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(2)
            proc.send_signal(signal.SIGTERM)
            grace = 2  # what it got
        client.wait(timeout=grace + 30)  # ended by itself: the stream got its final response
        ended = time.monotonic() - t0
        rc = proc.wait(timeout=30)
        stopped = time.monotonic() - t0
        reader.join(timeout=5)
        text = log.read_text()
        stats = client.stderr.read().decode()
        assert rc == 143 and stopped < grace + 10, (rc, stopped, text[-3000:])
        assert grace - 0.5 <= ended <= grace + 5 and arrivals and arrivals[-1] - t0 >= grace - 1, (ended, stats)
        assert "abort" in stats, stats
        assert "drain: 1 request(s) still running" in text and "aborted 1" in text, text[-3000:]
        assert "SIGKILL" not in text and "Exit timeout expired" not in text, text[-3000:]
        _assert_all_gone(proc, ports)
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("engine_process", ["in_stub", "separate"])
def test_a_bare_tritonserver_stopped_with_llm_streams_ends_them_after_the_grace_and_exits_cleanly(
        demo_model_path, tmp_path, engine_process):
    # QA: `tritonserver` stopped (SIGTERM) with llm streams open kept generating past its exit
    # timeout and then crashed on its way out (SIGSEGV in the Python backend's teardown) or hung
    # in its crash handler. The llm model notices the stop (backend/server_stop.py): the streams
    # go on for the exit timeout less 10 s, then end with finish reason "abort". (Asking the server
    # with pb_utils.is_model_ready instead killed the stub with the engine in a separate process.)
    from client.local_server import LocalTritonServer
    from client.triton_stream import TritonStreamClient

    exit_timeout = 13
    server = LocalTritonServer(log_file=tmp_path / "triton.log", extra_args=(f"--exit-timeout-secs={exit_timeout}",),
                               env={"LLM_MODEL_PATH": str(demo_model_path), "LLM_ENGINE_PROCESS": engine_process})
    server.start()
    ends: dict[int, dict] = {}

    def run(i: int) -> None:
        count, last = 0, {}
        try:
            for last in TritonStreamClient(server.grpc_url, abort_model=None).stream_generate("llm", {
                    "input_ids": [5 + i, 6, 7], "max_tokens": 3500, "stream": True,
                    "sampling_parameters": json.dumps({"temperature": 0, "ignore_eos": True})}, timeout=120):
                count += 1
            ends[i] = {"finish_reason": last.get("finish_reason"), "at": time.monotonic(), "count": count}
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            ends[i] = {"error": repr(exc), "at": time.monotonic(), "count": count}

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(2)
        t0 = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        rc = server.process.wait(timeout=exit_timeout + 30)
        stopped = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
        text = (tmp_path / "triton.log").read_text()
        assert rc == 0 and stopped < exit_timeout, (rc, stopped, text[-3000:])
        for i, end in ends.items():
            # streamed on through the grace (3 s), then aborted with a final response
            assert end.get("finish_reason") == "abort" and 2.5 <= end["at"] - t0 <= 6, (i, end, text[-2000:])
        assert len(ends) == 3 and "the server is stopping: aborted 3 request(s)" in text, text[-3000:]
        assert "Exit timeout expired" not in text
    finally:
        if server.process is not None and server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait()
        server.process = None
        subprocess.run([str(REPO / "scripts/sweep-shm.sh")], check=False)


def test_a_dead_engine_stops_serve_with_a_failure_status(demo_model_path, tmp_path):
    # QA: the llm stub's watcher stops tritonserver with SIGTERM when the stub dies (or, with
    # engine_process separate, the engine process), tritonserver then exits 0, and so did
    # serve.sh: a supervisor that restarts on failure (systemd on-failure, Docker on-failure,
    # Kubernetes OnFailure) left the service down.
    proc, ports, log = _start_without_frontend(demo_model_path, tmp_path)
    try:
        stubs = []
        for p in (int(entry.split()[0]) for entry in _group(proc.pid)):
            try:
                cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
            except OSError:
                continue
            if b"triton_python_backend_stub" in cmdline and b"/llm/1/model.py" in cmdline:
                stubs.append(p)
        assert len(stubs) == 1, _group(proc.pid)
        os.kill(stubs[0], signal.SIGKILL)
        rc = proc.wait(timeout=120)
        text = log.read_text()
        assert rc != 0 and "serve.sh: tritonserver exited (status 0) without being asked to" in text, (rc, text[-3000:])
        _assert_all_gone(proc, ports)
    finally:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

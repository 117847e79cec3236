#!/usr/bin/env python3
"""Soak / load test of the whole stack: tritonserver (ensemble) + the OpenAI frontend.

    .venv/bin/python scripts/soak.py                      # 500 concurrent streams, prints figures
    .venv/bin/python scripts/soak.py --requests 2000 --concurrency 500 --kv-blocks 512
    .venv/bin/python scripts/soak.py --frontend-url http://127.0.0.1:9000 --metrics-url http://127.0.0.1:8002/metrics

What it does (loopback only, every wait bounded):
1. Starts tritonserver on model_repository/ and the frontend (`python -m openai_frontend`) on
   free ports, unless URLs of running ones are given.
2. Load pass: `--requests` streaming /v1/completions, `--concurrency` at a time, through the
   openai SDK. Each draws (from `--seed`) a prompt, `max_tokens`, maybe stop strings, greedy or
   seeded sampling, and maybe a disconnect after a few chunks (the client closes the stream).
3. Reference pass: the same requests again, non-streaming, `--reference-concurrency` at a time
   (default 1). Every completed stream must equal its own reference (text and finish reason);
   every disconnected stream must be a prefix of it. A mismatch means lost, doubled or
   cross-wired output.
4. Afterwards: `llm_kv_blocks_used` must return to 0 and the running/waiting gauges too (no
   leaked KV blocks), and the server must still answer a normal request.

Exit status 0 when every check passed. `run_soak` and `Stack` are the library the CI version
(tests/test_soak.py) uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "Streaming text: spaces, 中文字符 and emoji 🙂",
    "def fibonacci(n):",
    "Q: What is the capital of France?\nA:",
    "1, 2, 3, 4,",
    "Hello, world",
    "In the beginning",
    "The weather today is",
    "A list of things to do:\n-",
]
# Short, common strings so stops really fire on the demo model's text; "zzzq" never does.
STOP_CHOICES = [["e"], ["th"], [" a", "."], ["\n"], ["zzzq"], ["o", "i", "u"]]


# ---------------------------------------------------------------------------------- metrics
def scrape(metrics_url: str) -> dict[str, float]:
    """Unlabelled `llm_*` samples, plus labelled ones as `name{labels}` keys."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(llm_\w+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_drained(metrics_url: str, timeout: float = 60.0) -> tuple[bool, dict[str, float]]:
    """Wait for no KV blocks in use and no running/waiting sequence; (drained, last scrape)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(metrics_url)
        busy = m.get("llm_kv_blocks_used", -1) + m.get("llm_num_requests_running", -1) + m.get(
            "llm_num_requests_waiting", -1
        )
        if busy == 0:
            return True, m
        if time.monotonic() > deadline:
            return False, m
        time.sleep(0.25)


# ---------------------------------------------------------------------------------- the stack
def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, OSError):
        return 0


class FrontendProcess:
    """`python -m openai_frontend` as a child process on a free port."""

    def __init__(self, triton_grpc_url: str, port: Optional[int] = None, model_name: str = "demo",
                 tokenizer_path: Optional[Path] = None, extra_args: tuple[str, ...] = (),
                 log_file: Optional[Path] = None) -> None:
        from client.local_server import free_port

        self.port = port or free_port()
        self.args = [
            sys.executable, "-m", "openai_frontend", "--host", "127.0.0.1", "--port", str(self.port),
            "--triton-url", triton_grpc_url, "--model-name", model_name, "--log-level", "warning",
            *(["--tokenizer-path", str(tokenizer_path)] if tokenizer_path else []), *extra_args,
        ]
        self.log_file = log_file
        self.process: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "FrontendProcess":
        self._log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(self.args, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout
        while _get(self.url + "/v1/models") != 200:
            if self.process.poll() is not None:
                raise RuntimeError(f"the frontend exited with code {self.process.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("the frontend did not come up")
            time.sleep(0.2)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None


class Stack:
    """tritonserver on model_repository/ (demo model) + the frontend, on free loopback ports."""

    def __init__(self, model_path: Path, kv_blocks: int = 256, max_model_len: int = 1024,
                 log_dir: Optional[Path] = None, env: Optional[dict[str, str]] = None,
                 frontend_args: tuple[str, ...] = ()) -> None:
        from client.local_server import LocalTritonServer

        self.model_path = Path(model_path)
        self.log_dir = Path(log_dir) if log_dir else None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server = LocalTritonServer(
            env={"LLM_MODEL_PATH": str(model_path), "LLM_NUM_KV_BLOCKS": str(kv_blocks),
                 "LLM_MAX_MODEL_LEN": str(max_model_len), **(env or {})},
            log_file=self.log_dir / "tritonserver.log" if self.log_dir else None,
        )
        self.frontend: Optional[FrontendProcess] = None
        self.frontend_args = frontend_args

    @property
    def metrics_url(self) -> str:
        return self.server.metrics_url

    def start(self) -> "Stack":
        self.server.start(timeout=300)
        try:
            self.frontend = FrontendProcess(
                self.server.grpc_url, tokenizer_path=self.model_path, extra_args=self.frontend_args,
                log_file=self.log_dir / "frontend.log" if self.log_dir else None,
            ).start()
        except Exception:
            self.server.stop()
            raise
        return self

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        self.server.stop()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------- the load
@dataclass
class Job:
    index: int
    prompt: str
    max_tokens: int
    stop: Optional[list[str]]
    temperature: float
    seed: int
    disconnect_after: Optional[int]  # close the stream after this many chunks

    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed}
        if self.stop:
            p["stop"] = self.stop
        return p


@dataclass
class Result:
    job: Job
    text: str = ""
    finish_reason: Optional[str] = None
    chunks: int = 0
    error: Optional[str] = None
    status: Optional[int] = None
    disconnected: bool = False
    ttft: Optional[float] = None
    elapsed: float = 0.0


def make_jobs(n: int, seed: int, max_tokens: int = 64, disconnect_rate: float = 0.2,
              stop_rate: float = 0.4, disconnect_max_tokens: Optional[int] = None) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        job = Job(
            index=i,
            prompt=rng.choice(PROMPTS) + ("" if rng.random() < 0.5 else f" #{rng.randrange(1000)}"),
            max_tokens=rng.randint(1, max_tokens),
            stop=rng.choice(STOP_CHOICES) if rng.random() < stop_rate else None,
            temperature=0.0 if rng.random() < 0.5 else 0.8,
            seed=rng.randrange(2**31),
            disconnect_after=rng.randint(1, 6) if rng.random() < disconnect_rate else None,
        )
        if job.disconnect_after is not None:
            # A client that hangs up does so mid-generation: a long generation, no stop string.
            # Short ones ended before the hang-up reached the engine (merged chunks carry several
            # tokens under load): a run saw 7 disconnects and no abort. On a host with a core
            # taken, the 60 streams' first chunks reached the client when the engine had already
            # generated all 48 tokens of them (TTFT p50 1.0 s for a 1.2 s load pass): no abort
            # of 10 either. disconnect_max_tokens (> max_tokens) makes most of them outlast such a
            # lag, not all: tests/test_soak.py asserts only what holds however late the client is.
            job.max_tokens, job.stop = disconnect_max_tokens or max_tokens, None
        jobs.append(job)
    return jobs


def _client(base_url: str, max_connections: int, timeout: float):
    import httpx
    import openai

    http = httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections + 8, max_keepalive_connections=max_connections + 8),
        timeout=httpx.Timeout(timeout, connect=10.0),
    )
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="soak", http_client=http, max_retries=0)


async def _stream_one(client, model: str, job: Job, timeout: float) -> Result:
    import openai

    res = Result(job)
    start = time.monotonic()
    stream = None
    try:
        async with asyncio.timeout(timeout):
            stream = await client.completions.create(model=model, prompt=job.prompt, stream=True, **job.params())
            async for chunk in stream:
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if choice.text and res.ttft is None:
                    res.ttft = time.monotonic() - start
                res.text += choice.text or ""
                res.chunks += 1
                if choice.finish_reason:
                    res.finish_reason = choice.finish_reason
                if job.disconnect_after is not None and res.chunks >= job.disconnect_after and not res.finish_reason:
                    res.disconnected = True
                    break
    except openai.APIStatusError as exc:
        res.status, res.error = exc.status_code, f"{exc.status_code}: {exc.message}"[:300]
    except TimeoutError:
        res.error = f"timeout after {timeout}s"
    except Exception as exc:  # noqa: BLE001 - a soak records every failure kind
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if stream is not None:
            await stream.close()
    res.elapsed = time.monotonic() - start
    return res


async def _complete_one(client, model: str, job: Job, timeout: float) -> Result:
    import openai

    res = Result(job)
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            out = await client.completions.create(model=model, prompt=job.prompt, stream=False, **job.params())
        res.text, res.finish_reason = out.choices[0].text, out.choices[0].finish_reason
    except openai.APIStatusError as exc:
        res.status, res.error = exc.status_code, f"{exc.status_code}: {exc.message}"[:300]
    except Exception as exc:  # noqa: BLE001
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    res.elapsed = time.monotonic() - start
    return res


async def _run_all(base_url: str, model: str, jobs: list[Job], concurrency: int, timeout: float,
                   stream: bool) -> list[Result]:
    client = _client(base_url, concurrency, timeout)
    sem = asyncio.Semaphore(concurrency)

    async def one(job: Job) -> Result:
        async with sem:
            if stream:
                return await _stream_one(client, model, job, timeout)
            return await _complete_one(client, model, job, timeout)

    try:
        return list(await asyncio.gather(*(one(j) for j in jobs)))
    finally:
        await client.close()


def _pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


@dataclass
class Report:
    requests: int
    concurrency: int
    completed: int = 0
    matched: int = 0
    disconnected: int = 0
    disconnected_prefix_ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    status_503: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    reference_errors: int = 0
    load_seconds: float = 0.0
    reference_seconds: float = 0.0
    completion_chars: int = 0
    ttft_p50: Optional[float] = None
    ttft_p99: Optional[float] = None
    latency_p50: Optional[float] = None
    latency_p99: Optional[float] = None
    kv_drained: bool = False
    kv_blocks_used_after: Optional[float] = None
    metrics_after: dict[str, float] = field(default_factory=dict)
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)  # of the completed streams
    engine_finished: dict[str, float] = field(default_factory=dict)  # llm_request_finished_total deltas
    still_answers: bool = False

    @property
    def ok(self) -> bool:
        unexpected = {k: v for k, v in self.errors.items() if not k.startswith("503")}
        return (
            not self.mismatches and not unexpected and self.reference_errors == 0 and self.kv_drained
            and self.still_answers and self.completed > 0
            and self.disconnected_prefix_ok == self.disconnected
        )

    def summary(self) -> str:
        lines = [
            f"requests {self.requests} at concurrency {self.concurrency}: {self.completed} completed, "
            f"{self.disconnected} disconnected by the client, {sum(self.errors.values())} errors {self.errors}",
            f"completed equal to their reference: {self.matched}/{self.completed}; "
            f"disconnected streams a prefix of their reference: {self.disconnected_prefix_ok}/{self.disconnected}",
            f"finish reasons of completed streams {self.finish_reasons}; engine-side finishes {self.engine_finished}",
            f"load pass {self.load_seconds:.1f}s ({self.generation_tokens:.0f} tokens generated in all, "
            f"{self.generation_tokens / max(self.load_seconds, 1e-9):.0f} tokens/s, {self.preemptions:.0f} "
            f"preemptions), reference pass {self.reference_seconds:.1f}s",
            f"TTFT p50 {_fmt(self.ttft_p50)} p99 {_fmt(self.ttft_p99)}; "
            f"stream latency p50 {_fmt(self.latency_p50)} p99 {_fmt(self.latency_p99)}",
            f"after: KV blocks used {self.kv_blocks_used_after} (drained: {self.kv_drained}); "
            f"server still answers: {self.still_answers}",
        ]
        for m in self.mismatches[:5]:
            lines.append(f"MISMATCH {json.dumps(m, ensure_ascii=False)[:600]}")
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def _fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1000:.0f}ms"


async def run_soak(base_url: str, metrics_url: str, model: str = "demo", requests: int = 500,
                   concurrency: int = 500, seed: int = 0, max_tokens: int = 64, disconnect_rate: float = 0.2,
                   stop_rate: float = 0.4, timeout: float = 300.0, reference_concurrency: int = 1,
                   drain_timeout: float = 60.0, log=print, disconnect_max_tokens: Optional[int] = None) -> Report:
    jobs = make_jobs(requests, seed, max_tokens, disconnect_rate, stop_rate, disconnect_max_tokens)
    report = Report(requests=requests, concurrency=concurrency)
    before = scrape(metrics_url)

    t0 = time.monotonic()
    results = await _run_all(base_url, model, jobs, concurrency, timeout, stream=True)
    report.load_seconds = time.monotonic() - t0
    log(f"load pass: {requests} streams in {report.load_seconds:.1f}s")

    # Disconnects must free their blocks before the reference pass (and on their own).
    report.kv_drained, after = await asyncio.to_thread(wait_drained, metrics_url, drain_timeout)
    report.kv_blocks_used_after = after.get("llm_kv_blocks_used")
    report.metrics_after = after
    report.generation_tokens = after.get("llm_generation_tokens_total", 0) - before.get("llm_generation_tokens_total", 0)
    report.preemptions = after.get("llm_num_preemptions_total", 0) - before.get("llm_num_preemptions_total", 0)
    for reason in ("stop", "length", "abort", "error"):
        key = f'llm_request_finished_total{{finish_reason="{reason}"}}'
        report.engine_finished[reason] = after.get(key, 0) - before.get(key, 0)

    t0 = time.monotonic()
    refs = await _run_all(base_url, model, jobs, reference_concurrency, timeout, stream=False)
    report.reference_seconds = time.monotonic() - t0
    log(f"reference pass: {requests} requests in {report.reference_seconds:.1f}s")

    for res, ref in zip(results, refs):
        if ref.error is not None:
            report.reference_errors += 1
            report.mismatches.append({"index": res.job.index, "reference_error": ref.error})
            continue
        if res.error is not None:
            kind = res.error.split(":")[0]
            report.errors[kind] = report.errors.get(kind, 0) + 1
            report.status_503 += res.status == 503
            continue
        if res.disconnected:
            report.disconnected += 1
            if ref.text.startswith(res.text):
                report.disconnected_prefix_ok += 1
            else:
                report.mismatches.append({"index": res.job.index, "kind": "disconnected, not a prefix",
                                          "job": asdict(res.job), "got": res.text, "want": ref.text})
            continue
        report.completed += 1
        report.completion_chars += len(res.text)
        report.finish_reasons[str(res.finish_reason)] = report.finish_reasons.get(str(res.finish_reason), 0) + 1
        if res.text == ref.text and res.finish_reason == ref.finish_reason:
            report.matched += 1
        else:
            report.mismatches.append({"index": res.job.index, "job": asdict(res.job), "got": res.text,
                                      "got_finish": res.finish_reason, "want": ref.text,
                                      "want_finish": ref.finish_reason})
    done = [r for r in results if r.error is None and not r.disconnected]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    report.ttft_p50, report.ttft_p99 = _pct(ttfts, 0.5), _pct(ttfts, 0.99)
    report.latency_p50, report.latency_p99 = _pct([r.elapsed for r in done], 0.5), _pct([r.elapsed for r in done], 0.99)

    probe = await _run_all(base_url, model, [Job(-1, "Hello", 4, None, 0.0, 0, None)], 1, 60.0, stream=False)
    report.still_answers = probe[0].error is None and probe[0].finish_reason is not None
    drained, final = await asyncio.to_thread(wait_drained, metrics_url, drain_timeout)
    report.kv_drained = report.kv_drained and drained
    report.kv_blocks_used_after = final.get("llm_kv_blocks_used")
    return report


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--concurrency", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens is drawn from 1..this")
    p.add_argument("--disconnect-rate", type=float, default=0.2)
    p.add_argument("--disconnect-max-tokens", type=int, default=None,
                   help="max_tokens of the streams that hang up (default --max-tokens)")
    p.add_argument("--stop-rate", type=float, default=0.4)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--reference-concurrency", type=int, default=1,
                   help="concurrency of the reference pass (1: each request alone)")
    p.add_argument("--frontend-url", default=None, help="use a running frontend (else start the stack)")
    p.add_argument("--metrics-url", default=None, help="tritonserver metrics URL (with --frontend-url)")
    p.add_argument("--model-name", default="demo")
    p.add_argument("--model-path", default=str(REPO_ROOT / "models" / "demo"))
    p.add_argument("--kv-blocks", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--log-dir", default=None, help="write tritonserver.log and frontend.log here")
    p.add_argument("--json", default=None, help="write the report as JSON to this file")
    args = p.parse_args(argv)

    def go(base_url: str, metrics_url: str) -> Report:
        return asyncio.run(run_soak(
            base_url, metrics_url, model=args.model_name, requests=args.requests, concurrency=args.concurrency,
            seed=args.seed, max_tokens=args.max_tokens, disconnect_rate=args.disconnect_rate,
            stop_rate=args.stop_rate, timeout=args.timeout, reference_concurrency=args.reference_concurrency,
            log=lambda msg: print(msg, flush=True), disconnect_max_tokens=args.disconnect_max_tokens,
        ))

    if args.frontend_url:
        if not args.metrics_url:
            p.error("--frontend-url needs --metrics-url")
        report = go(args.frontend_url.rstrip("/"), args.metrics_url)
    else:
        from backend.demo_model import build_demo_model, is_current

        model_path = Path(args.model_path)
        if model_path == REPO_ROOT / "models" / "demo" and not is_current(model_path, 0):
            build_demo_model(model_path, seed=0)
        t0 = time.monotonic()
        with Stack(model_path, kv_blocks=args.kv_blocks, max_model_len=args.max_model_len,
                   log_dir=Path(args.log_dir) if args.log_dir else None) as stack:
            print(f"stack up in {time.monotonic() - t0:.0f}s: frontend {stack.frontend.url}, "
                  f"metrics {stack.metrics_url}", flush=True)
            report = go(stack.frontend.url, stack.metrics_url)
    print(report.summary())
    if args.json:
        data = asdict(report)
        data["ok"] = report.ok
        Path(args.json).write_text(json.dumps(data, indent=1, ensure_ascii=False))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

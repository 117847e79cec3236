"""The llm model's Prometheus metrics: unit tests of the bookkeeping (backend.triton_metrics with
a stand-in for pb_utils.MetricFamily), then known traffic through the real tritonserver and the
scraped numbers checked exactly."""

from __future__ import annotations

import json
import random
import re
import time
import types
import urllib.request

import numpy as np
import pytest

from client.local_server import LocalTritonServer
from client.triton_stream import TritonStreamClient
from backend import triton_metrics

GREEDY = {"temperature": 0, "ignore_eos": True}


# --------------------------------------------------------------------------- scraping helpers
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$")


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """Prometheus text format -> {(name, frozenset of (label, value)): value}."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(server: LocalTritonServer) -> dict[tuple[str, frozenset], float]:
    return parse_metrics(urllib.request.urlopen(server.metrics_url, timeout=5).read().decode())


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


def histogram(metrics: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """([(le, cumulative count)] sorted by le, sum, count) of a histogram's series."""
    buckets = sorted(
        (float(dict(labels)["le"]), v) for (n, labels), v in metrics.items() if n == f"{name}_bucket"
    )
    return buckets, value(metrics, f"{name}_sum"), value(metrics, f"{name}_count")


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def wait_settled(server: LocalTritonServer, before: dict, finished: int, timeout: float = 30.0) -> dict:
    """Scrape until `finished` more requests are counted and the engine is idle with no KV blocks."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        done = sum(
            delta(m, before, "llm_request_finished_total", finish_reason=r) for r in ("stop", "length", "abort", "error")
        )
        idle = value(m, "llm_kv_blocks_used") == 0 and value(m, "llm_num_requests_running") == 0
        if done >= finished and idle:
            return m
        assert time.monotonic() < deadline, f"metrics did not settle: finished {done}/{finished}, idle={idle}"
        time.sleep(0.2)


# --------------------------------------------------------------------------- unit: fake pb_utils
class _FakeMetric:
    def __init__(self, family, labels) -> None:
        self.family, self.labels, self.value, self.calls = family, labels, 0.0, 0

    def increment(self, v) -> None:
        assert self.family.kind == "counter" and v >= 0
        self.value += v
        self.calls += 1

    def set(self, v) -> None:
        assert self.family.kind == "gauge"
        self.value = v
        self.calls += 1


class _FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    registry: dict = {}

    def __init__(self, name, description, kind) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        _FakeFamily.registry[name] = self

    def Metric(self, labels=None):  # noqa: N802 - pb_utils' name
        metric = _FakeMetric(self, dict(labels or {}))
        self.metrics.append(metric)
        return metric


@pytest.fixture
def new_metrics():
    _FakeFamily.registry = {}
    return lambda: triton_metrics.LLMMetrics(_FakeFamily)


def fake_value(name: str, **labels) -> float:
    family = _FakeFamily.registry[name]
    return sum(m.value for m in family.metrics if m.labels == labels)


def _out(new_ids=(), finish=None, error=None, index=0, error_code="internal"):
    return types.SimpleNamespace(
        new_token_ids=list(new_ids), finish_reason=finish, error=error, index=index, error_code=error_code,
        finished=finish is not None or error is not None,
    )


def _stats(**kw):
    base = dict(
        num_running=0, num_waiting=0, num_kv_blocks=10, num_free_kv_blocks=10, num_preemptions=0, num_steps=0,
        prompt_tokens_total=0, generation_tokens_total=0,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_request_timing_histograms_and_finish_reasons(new_metrics, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(triton_metrics.time, "monotonic", lambda: clock[0])
    metrics = new_metrics()

    def run(outputs, n=1):
        timing = metrics.request_timing(n)
        for dt, out in outputs:
            clock[0] += dt
            timing.on_output(out)

    # 1 token after 0.03 s, then 2 tokens 0.18 s later (0.09 s each), then the last after 0.03 s.
    run([(0.03, _out([1])), (0.18, _out([2, 3])), (0.03, _out([4], finish="length"))])
    run([(2.0, _out([1], finish="stop"))])
    run([(0.01, _out([], finish="abort"))])  # cancelled before any token: no TTFT
    run([(0.03, _out([5])), (0.5, _out([], error="boom"))])
    run([(0.2, _out([], error="invalid regex", error_code="invalid_arg"))])  # the engine refused it: rejected
    run([(0.03, _out([7], index=0)), (0.01, _out([8], index=1)), (0.05, _out([9], index=0, finish="length")),
         (0.04, _out([], index=1, finish="abort"))], n=2)  # n=2: an aborted sample makes the request abort
    metrics.rejected("overloaded")
    metrics.rejected("invalid_argument")
    metrics.rejected("overloaded")
    metrics.update(_stats())

    assert fake_value("llm_request_rejected_total", reason="overloaded") == 2
    assert fake_value("llm_request_rejected_total", reason="invalid_argument") == 2
    assert {r: fake_value("llm_request_finished_total", finish_reason=r) for r in ("stop", "length", "abort", "error")} \
        == {"stop": 1, "length": 1, "abort": 2, "error": 1}
    assert fake_value("llm_time_to_first_token_seconds_count") == 4
    assert fake_value("llm_time_to_first_token_seconds_sum") == pytest.approx(0.03 + 2.0 + 0.03 + 0.03)
    assert fake_value("llm_time_to_first_token_seconds_bucket", le="0.02") == 0
    assert fake_value("llm_time_to_first_token_seconds_bucket", le="0.04") == 3
    assert fake_value("llm_time_to_first_token_seconds_bucket", le="1") == 3
    assert fake_value("llm_time_to_first_token_seconds_bucket", le="2.5") == 4
    assert fake_value("llm_time_to_first_token_seconds_bucket", le="+Inf") == 4
    # ITL: 2 x 0.09 and 1 x 0.03 from the first request, 0.06 for sample 0 of the last one.
    assert fake_value("llm_inter_token_latency_seconds_count") == 4
    assert fake_value("llm_inter_token_latency_seconds_sum") == pytest.approx(0.18 + 0.03 + 0.06)
    assert fake_value("llm_inter_token_latency_seconds_bucket", le="0.025") == 0
    assert fake_value("llm_inter_token_latency_seconds_bucket", le="0.05") == 1
    assert fake_value("llm_inter_token_latency_seconds_bucket", le="0.075") == 2
    assert fake_value("llm_inter_token_latency_seconds_bucket", le="0.1") == 4
    assert fake_value("llm_e2e_request_latency_seconds_count") == 5
    assert fake_value("llm_e2e_request_latency_seconds_sum") == pytest.approx(0.24 + 2.0 + 0.01 + 0.53 + 0.13)

    # Flushing again without news sends nothing (each metric call is an IPC to the server).
    calls = sum(m.calls for f in _FakeFamily.registry.values() for m in f.metrics)
    metrics.update(_stats())
    assert sum(m.calls for f in _FakeFamily.registry.values() for m in f.metrics) == calls


def test_engine_stats_published_as_deltas(new_metrics):
    metrics = new_metrics()
    metrics.update(_stats(num_running=2, num_waiting=1, num_free_kv_blocks=4, prompt_tokens_total=30,
                          generation_tokens_total=5, prefix_cache_queries=40, prefix_cache_hits=10))
    metrics.update(_stats(num_running=0, num_free_kv_blocks=10, prompt_tokens_total=50, generation_tokens_total=9,
                          num_preemptions=3, prefix_cache_queries=80, prefix_cache_hits=40, num_cached_kv_blocks=2,
                          num_steps=12, step_seconds_total=0.5, step_thread_cpu_seconds_total=0.25))
    assert fake_value("llm_prompt_tokens_total") == 50
    assert fake_value("llm_generation_tokens_total") == 9
    assert fake_value("llm_num_preemptions_total") == 3
    assert fake_value("llm_prefix_cache_queries_total") == 80
    assert fake_value("llm_prefix_cache_hits_total") == 40
    assert fake_value("llm_prefix_cache_hit_rate") == pytest.approx(0.5)
    assert fake_value("llm_kv_blocks_used") == 0
    assert fake_value("llm_kv_blocks_capacity") == 10
    assert fake_value("llm_kv_blocks_cached") == 2
    assert fake_value("llm_num_requests_running") == 0
    assert fake_value("llm_engine_steps_total") == 12
    assert fake_value("llm_engine_step_seconds_total") == pytest.approx(0.5)
    assert fake_value("llm_engine_step_thread_cpu_seconds_total") == pytest.approx(0.25)
    from backend.outbox import OutboxStats

    metrics.update(_stats(), OutboxStats(responses=7, send_cpu_s=0.002, send_wall_s=0.003))
    assert fake_value("llm_responses_sent_total") == 7
    assert fake_value("llm_response_send_thread_cpu_seconds_total") == pytest.approx(0.002)
    assert fake_value("llm_response_send_seconds_total") == pytest.approx(0.003)
    # Stats without the prefix-cache fields (an older engine) still publish.
    metrics.update(types.SimpleNamespace(**{k: v for k, v in vars(_stats()).items()}))


# --------------------------------------------------------------------------- the real server
@pytest.fixture(scope="module")
def server(start_triton):
    with start_triton(num_kv_blocks=128, max_model_len=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return TritonStreamClient(server.grpc_url)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 4000) for _ in range(n)]


def _run(client, ids, max_tokens, stream=True, **params):
    chunks = list(client.stream_generate("llm", {
        "input_ids": ids, "max_tokens": max_tokens, "stream": stream,
        "sampling_parameters": json.dumps({**GREEDY, **params}),
    }))
    tokens = np.concatenate([np.asarray(c["output_ids"]).reshape(-1) for c in chunks]).tolist()
    return tokens, chunks[-1]["finish_reason"]


def test_known_traffic_counts(server, client):
    rng = random.Random(7)
    before = scrape(server)
    assert value(before, "llm_kv_blocks_capacity") == 128

    # Three streamed requests to length; prompts under one block (16) so nothing is cached.
    prompts = [_ids(rng, n) for n in (10, 12, 14)]
    refs = []
    for ids in prompts:
        tokens, reason = _run(client, ids, 6)
        assert len(tokens) == 6 and reason == "length"
        refs.append(tokens)
    # One non-streaming request that stops on a token of its own greedy output.
    stop_at = refs[0].index(refs[0][2]) + 1
    tokens, reason = _run(client, prompts[0], 6, stream=False, stop_token_ids=[refs[0][2]])
    assert reason == "stop" and tokens == refs[0][:stop_at]
    # A 40-token prompt twice: the second finds its two full blocks (32 tokens) cached.
    long_prompt = _ids(rng, 40)
    for _ in range(2):
        _run(client, long_prompt, 3)

    after = wait_settled(server, before, finished=6)
    assert delta(after, before, "llm_request_finished_total", finish_reason="length") == 5
    assert delta(after, before, "llm_request_finished_total", finish_reason="stop") == 1
    assert delta(after, before, "llm_request_finished_total", finish_reason="abort") == 0
    assert delta(after, before, "llm_request_finished_total", finish_reason="error") == 0
    generated = 3 * 6 + stop_at + 2 * 3
    assert delta(after, before, "llm_generation_tokens_total") == generated
    assert delta(after, before, "llm_prompt_tokens_total") == 10 + 12 + 14 + 10 + 40 + (40 - 32)
    assert delta(after, before, "llm_prefix_cache_queries_total") == 10 + 12 + 14 + 10 + 40 + 40
    assert delta(after, before, "llm_prefix_cache_hits_total") == 32
    assert value(after, "llm_kv_blocks_used") == 0
    assert value(after, "llm_num_requests_waiting") == 0
    assert delta(after, before, "llm_num_preemptions_total") == 0
    steps = delta(after, before, "llm_engine_steps_total")
    assert steps >= 6  # at least one step per token of the longest request
    step_s = delta(after, before, "llm_engine_step_seconds_total")
    assert 0 < delta(after, before, "llm_engine_step_thread_cpu_seconds_total") <= step_s + 1e-3 * steps
    # 25 responses (one per streamed token, one for the non-streamed request); the senders run
    # beside the engine, so the last few may land after the idle publish.
    sent = delta(after, before, "llm_responses_sent_total")
    assert 0 < sent <= 25
    assert 0 < delta(after, before, "llm_response_send_thread_cpu_seconds_total") <= delta(
        after, before, "llm_response_send_seconds_total") + 1e-3 * sent

    for name, count in (
        ("llm_time_to_first_token_seconds", 6),
        ("llm_e2e_request_latency_seconds", 6),
        ("llm_inter_token_latency_seconds", generated - 6),  # every token but each request's first
    ):
        b_before, s_before, c_before = histogram(before, name)
        buckets, total, n = histogram(after, name)
        assert n - c_before == count, name
        assert buckets[-1] == (float("inf"), n), name
        assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), f"{name} buckets not cumulative"
        assert total > s_before, name


def test_n_samples_and_abort(server, client):
    rng = random.Random(11)
    before = scrape(server)
    tokens, reason = _run(client, _ids(rng, 11), 4, stream=False, n=2)
    assert len(tokens) == 8 and reason == "length"
    # A long stream left after 3 responses: the client cancel ends it as `abort`.
    stream = client.stream_generate("llm", {
        "input_ids": _ids(rng, 9), "max_tokens": 400, "stream": True, "sampling_parameters": json.dumps(GREEDY),
    })
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()

    after = wait_settled(server, before, finished=2)
    assert delta(after, before, "llm_request_finished_total", finish_reason="length") == 1
    assert delta(after, before, "llm_request_finished_total", finish_reason="abort") == 1
    assert delta(after, before, "llm_time_to_first_token_seconds_count") == 2
    assert delta(after, before, "llm_e2e_request_latency_seconds_count") == 2
    aborted_tokens = delta(after, before, "llm_generation_tokens_total") - 8
    assert aborted_tokens >= 3
    # n=2: 3 gaps per sample; the aborted stream: all its tokens but the first.
    assert delta(after, before, "llm_inter_token_latency_seconds_count") == 2 * 3 + aborted_tokens - 1
    assert value(after, "llm_kv_blocks_used") == 0


def test_a_busy_engine_never_shows_the_idle_numbers(server, client):
    """Busy numbers are published at most once a second, but the first step after idle always
    publishes: a stream a few tokens in never shows llm_kv_blocks_used == 0, so a scraper that
    waits for 0 after its requests end does wait for their finish reasons to be counted."""
    rng = random.Random(13)
    for _ in range(5):
        time.sleep(0.7)  # idle long enough for an idle publish (the loop wakes every 0.5 s)
        stream = client.stream_generate("llm", {
            "input_ids": _ids(rng, 20), "max_tokens": 400, "stream": True,
            "sampling_parameters": json.dumps(GREEDY),
        })
        for _, _chunk in zip(range(3), stream):
            pass
        busy = scrape(server)
        stream.close()
        assert value(busy, "llm_kv_blocks_used") > 0
        assert value(busy, "llm_num_requests_running") == 1
        wait_settled(server, busy, finished=1)


def test_rejected_requests_are_counted_apart(server, client):
    from tritonclient.utils import InferenceServerException

    before = scrape(server)
    for bad in ([5000000], []):  # out of the vocabulary; empty: refused in execute
        with pytest.raises(InferenceServerException):
            _run(client, bad, 4)
    # Refused by the engine after admission (the grammar compiles off the batch): QA s19_soak
    # saw these counted as finish_reason "error", the engine failing.
    with pytest.raises(InferenceServerException, match="invalid regex"):
        _run(client, [5, 6, 7], 4, regex="(unclosed")
    deadline = time.monotonic() + 10
    while delta(after := scrape(server), before, "llm_request_rejected_total", reason="invalid_argument") < 3:
        assert time.monotonic() < deadline, "rejections not published"
        time.sleep(0.2)
    assert delta(after, before, "llm_request_rejected_total", reason="invalid_argument") == 3
    assert delta(after, before, "llm_request_rejected_total", reason="overloaded") == 0
    for r in ("stop", "length", "abort", "error"):
        assert delta(after, before, "llm_request_finished_total", finish_reason=r) == 0
    assert delta(after, before, "llm_time_to_first_token_seconds_count") == 0


def test_only_counters_end_in_total(new_metrics):
    # Prometheus' naming rule (promtool lints it): `_total` marks a counter; a gauge named so
    # reads as one to OpenMetrics parsers (the pool's size was llm_kv_blocks_total). The
    # histograms are published as counter families of their own parts (_bucket, _sum, _count).
    new_metrics()
    assert _FakeFamily.registry
    for name, family in _FakeFamily.registry.items():
        if family.kind == _FakeFamily.COUNTER:
            assert name.endswith(("_total", "_bucket", "_sum", "_count")), name
        else:
            assert not name.endswith("_total"), name

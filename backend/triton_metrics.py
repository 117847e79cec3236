"""The `llm` model's Prometheus metrics, published through Triton's custom-metrics API.

No import of triton_python_backend_utils here: the model passes `pb_utils.MetricFamily` in, so
the counting (histograms kept in process, only changes sent, the order a scraper sees them in)
runs and is tested outside Triton with a stand-in.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from typing import Any, Optional

from backend.engine import EngineStats
from backend.outbox import OutboxStats
from backend.outputs import RequestOutput

__all__ = ["LLMMetrics", "RequestTiming", "FINISH_REASONS", "REJECT_REASONS"]

# Latency histogram bounds in seconds (vLLM's, so dashboards carry over), `+Inf` added.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECT_REASONS = ("invalid_argument", "overloaded", "stopping", "internal")


class _Histogram:
    """A histogram counted in this process and published as Prometheus histogram series.

    Triton 2.51's pb_utils has MetricFamily.HISTOGRAM, but every observe() is a round trip to
    the server process (about 40 us measured on CPU): once per generated token that would tax
    the engine thread in proportion to throughput. So observations only bump local counts (no
    IPC), and `flush` (run with the throttled gauge updates) sends the changes as counters
    `<name>_bucket{le=...}` (cumulative, `+Inf` = count), `<name>_sum`, `<name>_count`: the
    series of a Prometheus histogram, so `histogram_quantile()` works on them; only the
    `# TYPE` lines say counter.
    """

    def __init__(self, metrics: "LLMMetrics", name: str, description: str, bounds: tuple) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is > max bound
        self.sum = 0.0
        bucket = metrics._family(f"{name}_bucket", f"{description}: observations <= le (cumulative)", counter=True)
        self._buckets = [bucket.Metric(labels={"le": format(b, "g")}) for b in bounds]
        self._buckets.append(bucket.Metric(labels={"le": "+Inf"}))
        self._sum = metrics._family(f"{name}_sum", f"{description}: sum of observations", counter=True).Metric(labels={})
        self._count = metrics._family(f"{name}_count", f"{description}: number of observations", counter=True).Metric(
            labels={}
        )
        self._sent_cumulative = [0] * len(self._buckets)
        self._sent_count = 0
        self._sent_sum = 0.0

    def observe(self, value: float, weight: int = 1) -> None:
        """Count `weight` observations of `value` (caller holds the metrics lock)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += weight  # le: value <= bound
        self.sum += value * weight

    def snapshot(self) -> tuple[list[int], float]:
        return list(itertools.accumulate(self.counts)), self.sum

    def flush(self, cumulative: list[int], total: float) -> None:
        for i, value in enumerate(cumulative):
            if value != self._sent_cumulative[i]:
                self._buckets[i].increment(value - self._sent_cumulative[i])
                self._sent_cumulative[i] = value
        if cumulative[-1] != self._sent_count:
            self._count.increment(cumulative[-1] - self._sent_count)
            self._sent_count = cumulative[-1]
        if total != self._sent_sum:
            self._sum.increment(total - self._sent_sum)
            self._sent_sum = total


class RequestTiming:
    """One request's clock: arrival (in execute), first token, each later token, the end.

    Called by the StreamResponder with every engine output, before anything is sent, on the engine thread.
    TTFT is arrival to the first output carrying tokens; inter-token latency is the gap between
    a sample's outputs divided over the tokens the later one carries (observed once per token);
    end-to-end is arrival to the output that ends the request, whose finish reason is counted
    (`error` when the engine failed it, `abort` when any sample was aborted). A request the engine
    ended for an invalid argument counts as rejected (`invalid_argument`) instead.
    """

    __slots__ = ("metrics", "arrival", "first_token", "last_token", "remaining", "reason", "done")

    def __init__(self, metrics: "LLMMetrics", n: int) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: dict[int, float] = {}
        self.remaining = n
        self.reason: str | None = None
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        if self.done:
            return
        now = time.monotonic()
        m = self.metrics
        with m._lock:
            k = len(out.new_token_ids)
            if k:
                prev = self.last_token.get(out.index)
                if self.first_token is None:
                    self.first_token = now
                    m.ttft.observe(now - self.arrival)
                elif prev is not None:
                    m.itl.observe((now - prev) / k, k)
                self.last_token[out.index] = now
            if out.error is not None:
                # A request the engine refused for its own arguments (a grammar that does not
                # compile, a duplicate id, its logits processor failing) is the client's mistake:
                # counted with the refusals execute makes, not as the engine failing it.
                invalid = getattr(out, "error_code", "internal") == "invalid_arg"
                self.reason, self.remaining = ("invalid_argument" if invalid else "error"), 0
            elif out.finished:
                self.remaining -= 1
                if self.reason != "abort":
                    self.reason = out.finish_reason or "abort"
            if self.remaining <= 0:
                self.done = True
                if self.reason == "invalid_argument":
                    m._rejected["invalid_argument"] += 1
                    return
                m.e2e.observe(now - self.arrival)
                m.finished[self.reason] = m.finished.get(self.reason, 0) + 1


class LLMMetrics:
    """The llm model's Prometheus metrics, through Triton's custom-metrics API
    (`metric_family`: `pb_utils.MetricFamily`, or a stand-in with the same surface).

    Engine counters and gauges come from EngineStats (`update`, throttled by the caller);
    latencies and finish reasons from each request's RequestTiming. Every metric operation is
    an IPC to the server process, so `update` sends only what changed since the last call.
    """

    def __init__(self, metric_family: Any) -> None:
        self._metric_family = metric_family
        self._lock = threading.Lock()  # the local counts (responders and update)
        self._flush_lock = threading.Lock()  # one flusher at a time (what was sent)
        # The families must outlive their metrics: a collected MetricFamily unregisters itself.
        self._families: list = []
        self._gauges = {
            name: self._family(name, desc).Metric(labels={})
            for name, desc in {
                "num_requests_running": "Sequences in the running batch",
                "num_requests_waiting": "Sequences waiting to be scheduled",
                "kv_blocks_capacity": "KV cache blocks in the pool",
                "kv_blocks_used": "KV cache blocks held by sequences",
                "kv_blocks_cached": "KV cache blocks holding reusable prefix-cache content",
                "prefix_cache_hit_rate": "Prompt tokens found in the prefix cache / prompt tokens looked up (lifetime)",
            }.items()
        }
        self._counters = {
            name: self._family(name, desc, counter=True).Metric(labels={})
            for name, desc in {
                "num_preemptions_total": "Sequences preempted for lack of KV blocks",
                "prompt_tokens_total": "Prompt tokens prefilled",
                "generation_tokens_total": "Tokens generated",
                "jump_forward_tokens_total": "Generated tokens a grammar forced (jump-forward decoding), not sampled",
                "jump_forward_respelled_total": "Sampled tokens respelled together with the forced text after them "
                "(jump-forward decoding across a token boundary)",
                "spec_decode_num_drafts_total": "Drafts verified (speculative decoding); accepted tokens / drafts + 1 "
                "is the tokens a verifying step yields a sequence",
                "spec_decode_num_draft_tokens_total": "Draft tokens verified (speculative decoding)",
                "spec_decode_num_accepted_tokens_total": "Draft tokens accepted (speculative decoding): generated "
                "tokens no step of their own was run for",
                "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache",
                "prefix_cache_hits_total": "Prompt tokens found in the prefix cache",
                "engine_steps_total": "Engine steps (one batched forward pass each)",
                "engine_step_seconds_total": "Wall time spent in engine steps",
                "engine_step_thread_cpu_seconds_total": "CPU time of the engine loop's thread within its steps "
                "(torch's intra-op worker threads not included); well below the wall time means the loop "
                "waited for a core or the GIL",
                "responses_sent_total": "Responses sent by the llm model (streamed outputs, finals, errors)",
                "response_send_thread_cpu_seconds_total": "CPU time of the response sender threads, in the "
                "engine's process: per response, what streaming costs the engine's GIL",
                "response_send_seconds_total": "Wall time the response sender threads spent sending",
            }.items()
        }
        self._sent_gauges: dict[str, float] = {}
        self._sent_counters = {name: 0 for name in self._counters}
        self.ttft = _Histogram(self, "time_to_first_token_seconds", "Time from arrival to the first token", _TTFT_BUCKETS)
        self.itl = _Histogram(self, "inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = _Histogram(self, "e2e_request_latency_seconds", "Time from arrival to the last response", _E2E_BUCKETS)
        self._accepted_family = self._family(
            "spec_decode_num_accepted_tokens_per_pos_total",
            "Drafts whose token at this position (0 first) was kept (speculative decoding)", counter=True)
        self._accepted_metrics: dict[int, Any] = {}
        self._sent_accepted: list[int] = []
        self._finished_family = self._family(
            "request_finished_total", "Requests finished (an n > 1 request once), by finish reason", counter=True)
        self._finished_metrics = {r: self._finished_family.Metric(labels={"finish_reason": r}) for r in FINISH_REASONS}
        self.finished: dict[str, int] = {r: 0 for r in FINISH_REASONS}
        self._sent_finished: dict[str, int] = dict(self.finished)
        rejected = self._family("request_rejected_total", "Requests refused before running, by reason", counter=True)
        self._rejected_metrics = {r: rejected.Metric(labels={"reason": r}) for r in REJECT_REASONS}
        self._rejected = {r: 0 for r in REJECT_REASONS}
        self._sent_rejected = dict(self._rejected)

    def _family(self, name: str, description: str, counter: bool = False):
        mf = self._metric_family
        family = mf(name=f"llm_{name}", description=description, kind=mf.COUNTER if counter else mf.GAUGE)
        self._families.append(family)
        return family

    def request_timing(self, n: int) -> RequestTiming:
        return RequestTiming(self, n)

    def rejected(self, reason: str) -> None:
        """A request refused in execute (never reached the engine); published with the next update."""
        with self._lock:
            self._rejected[reason] += 1

    def update(self, s: EngineStats, outbox: Optional[OutboxStats] = None) -> None:
        queries = getattr(s, "prefix_cache_queries", 0)
        hits = getattr(s, "prefix_cache_hits", 0)
        gauges = {
            "num_requests_running": s.num_running,
            "num_requests_waiting": s.num_waiting,
            "kv_blocks_capacity": s.num_kv_blocks,
            "kv_blocks_used": s.num_kv_blocks - s.num_free_kv_blocks,
            "kv_blocks_cached": getattr(s, "num_cached_kv_blocks", 0),
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        }
        counters = {
            "num_preemptions_total": s.num_preemptions,
            "prompt_tokens_total": s.prompt_tokens_total,
            "generation_tokens_total": s.generation_tokens_total,
            "jump_forward_tokens_total": getattr(s, "jump_forward_tokens_total", 0),
            "jump_forward_respelled_total": getattr(s, "jump_forward_respelled_total", 0),
            "spec_decode_num_drafts_total": getattr(s, "spec_drafts_total", 0),
            "spec_decode_num_draft_tokens_total": getattr(s, "spec_draft_tokens_total", 0),
            "spec_decode_num_accepted_tokens_total": getattr(s, "spec_accepted_tokens_total", 0),
            "prefix_cache_queries_total": queries,
            "prefix_cache_hits_total": hits,
            "engine_steps_total": s.num_steps,
            "engine_step_seconds_total": getattr(s, "step_seconds_total", 0.0),
            "engine_step_thread_cpu_seconds_total": getattr(s, "step_thread_cpu_seconds_total", 0.0),
        }
        if outbox is not None:
            counters.update({"responses_sent_total": outbox.responses,
                             "response_send_thread_cpu_seconds_total": outbox.send_cpu_s,
                             "response_send_seconds_total": outbox.send_wall_s})
        with self._flush_lock:
            with self._lock:
                histograms = [(h, h.snapshot()) for h in (self.ttft, self.itl, self.e2e)]
                finished = dict(self.finished)
                rejected = dict(self._rejected)
            for name, value in counters.items():
                if value > self._sent_counters[name]:
                    self._counters[name].increment(value - self._sent_counters[name])
                    self._sent_counters[name] = value
            per_position = getattr(s, "spec_accepted_per_position", ())
            for position, value in enumerate(per_position):
                if position >= len(self._sent_accepted):
                    self._sent_accepted.append(0)
                    self._accepted_metrics[position] = self._accepted_family.Metric(labels={"position": str(position)})
                if value > self._sent_accepted[position]:
                    self._accepted_metrics[position].increment(value - self._sent_accepted[position])
                    self._sent_accepted[position] = value
            for reason, value in rejected.items():
                if value > self._sent_rejected[reason]:
                    self._rejected_metrics[reason].increment(value - self._sent_rejected[reason])
                    self._sent_rejected[reason] = value
            # Histograms before finish counts: a scraper that sees a request finished sees its latencies.
            for histogram, (cumulative, total) in histograms:
                histogram.flush(cumulative, total)
            for reason, value in finished.items():
                sent = self._sent_finished.get(reason, 0)
                if value > sent:
                    metric = self._finished_metrics.get(reason)
                    if metric is None:  # a finish reason this file does not know yet
                        metric = self._finished_metrics[reason] = self._finished_family.Metric(
                            labels={"finish_reason": reason}
                        )
                    metric.increment(value - sent)
                    self._sent_finished[reason] = value
            # Gauges last: a scraper that sees the engine drained (nothing running, no KV blocks
            # used) sees every request it finished counted.
            for name, value in gauges.items():
                if self._sent_gauges.get(name) != value:
                    self._gauges[name].set(value)
                    self._sent_gauges[name] = value

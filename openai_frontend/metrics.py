"""The frontend's own Prometheus metrics, served as text on GET /metrics.

No client library: a handful of counters kept in plain dicts (one event loop per process, no
locks needed) and rendered in the Prometheus text exposition format (version 0.0.4).

* `frontend_requests_total{endpoint,status}`: finished HTTP requests.
* `frontend_requests_in_flight{endpoint}`: requests being handled (streams included).
* `frontend_streams_in_flight`: SSE responses being streamed.
* `frontend_streams_total`: SSE responses started.
* `frontend_request_duration_seconds{endpoint}`: histogram, until the last byte was sent.
* `frontend_triton_out_of_order_responses_total`: stream responses that arrived after a later one
  of the same sample (should stay 0).
* With several tritonservers (--triton-url repeated), per server: `frontend_triton_server_requests_total`
  (generations sent), `frontend_triton_server_requests_in_flight`, `frontend_triton_server_up`
  (1 while routing takes it; 0 once it failed, until it answers again),
  `frontend_triton_server_prompt_chunks_total` and `..._prompt_chunks_matched_total` (the prompt
  chunks routed there, and those the router had sent it before: the routing's expected cache hits).

The engine's own metrics (KV blocks, queue, tokens, latencies) are on tritonserver's metrics
port; these are the HTTP side.

With --workers N, each worker process counts its own requests, and a scrape lands on any one of
them: `SharedMetrics` has every worker write its counts to a file in one directory (at most
every PUBLISH_INTERVAL_S, and at each scrape it answers), and answer with the sum over all of
them. Counters include workers that have exited, so they never go down; gauges count live
workers only.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional

from openai_frontend.processes import process_alive

# Paths reported under their own name; anything else is "other" (bounded label cardinality).
# Every route of server.py (tests/test_frontend_unit.py checks).
ENDPOINTS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/responses/input_tokens",
    "/v1/conversations", "/generate", "/parse_function_call", "/separate_reasoning",
    "/v1/models", "/health", "/ping", "/health_generate", "/get_model_info", "/get_server_info", "/server_info", "/metrics",
    "/openapi.json", "/tokenize", "/detokenize", "/abort_request", "/flush_cache", "/reset_prefix_cache",
    "/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
})

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def endpoint_label(path: str) -> str:
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        for tail in ("/input_items", "/cancel"):
            if path.endswith(tail):
                return "/v1/responses/{response_id}" + tail
        return "/v1/responses/{response_id}"
    if path.startswith("/v1/conversations/"):
        parts = path.split("/")  # "", "v1", "conversations", id[, "items"[, item_id]]
        if len(parts) == 4:
            return "/v1/conversations/{conversation_id}"
        if len(parts) in (5, 6) and parts[4] == "items":
            return "/v1/conversations/{conversation_id}/items" + ("/{item_id}" if len(parts) == 6 else "")
    return "other"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


_SERVER_GAUGES = ("in_flight", "up")  # per-server counts that are not summed over time


class FrontendMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight: dict[str, int] = {}
        self.streams_in_flight = 0
        self.streams_total = 0
        # endpoint -> [bucket counts..., +Inf count], sum
        self._hist: dict[str, list[int]] = {}
        self._hist_sum: dict[str, float] = {}
        # Per tritonserver (the client's server_counts): requests, in_flight, up.
        self.servers: dict[str, dict[str, int]] = {}

    # -- updates (called by the server middleware and SSEResponse) ----------------------------

    def request_started(self, endpoint: str) -> None:
        self.in_flight[endpoint] = self.in_flight.get(endpoint, 0) + 1

    def request_finished(self, endpoint: str, status: int, seconds: float) -> None:
        self.in_flight[endpoint] -= 1
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        counts = self._hist.get(endpoint)
        if counts is None:
            counts = self._hist[endpoint] = [0] * (len(BUCKETS) + 1)
            self._hist_sum[endpoint] = 0.0
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._hist_sum[endpoint] += seconds

    def stream_started(self) -> None:
        self.streams_in_flight += 1
        self.streams_total += 1

    def stream_finished(self) -> None:
        self.streams_in_flight -= 1

    @property
    def stream_hooks(self) -> tuple:
        return self.stream_started, self.stream_finished

    # -- one worker's counts, and their sum over workers ---------------------------------------

    def snapshot(self, out_of_order: Optional[int] = None,
                 servers: Optional[dict[str, dict[str, int]]] = None) -> dict[str, Any]:
        return {
            "servers": servers or {},
            "requests": [[e, s, v] for (e, s), v in self.requests.items()],
            "in_flight": dict(self.in_flight),
            "streams_in_flight": self.streams_in_flight,
            "streams_total": self.streams_total,
            "hist": {e: [counts, self._hist_sum[e]] for e, counts in self._hist.items()},
            "out_of_order": out_of_order,
        }

    def add(self, snap: dict[str, Any], live: bool) -> None:
        """Add a snapshot's counts to these; its gauges too when its process is `live`."""
        for e, status, v in snap["requests"]:
            self.requests[(e, status)] = self.requests.get((e, status), 0) + v
        if live:
            for e, v in snap["in_flight"].items():
                self.in_flight[e] = self.in_flight.get(e, 0) + v
            self.streams_in_flight += snap["streams_in_flight"]
        self.streams_total += snap["streams_total"]
        for e, (counts, total) in snap["hist"].items():
            mine = self._hist.setdefault(e, [0] * (len(BUCKETS) + 1))
            for i, c in enumerate(counts):
                mine[i] += c
            self._hist_sum[e] = self._hist_sum.get(e, 0.0) + total
        for url, counts in (snap.get("servers") or {}).items():
            mine = self.servers.setdefault(url, {"in_flight": 0, "up": 1})
            for key, value in counts.items():
                if key not in _SERVER_GAUGES:
                    mine[key] = mine.get(key, 0) + value
            if live:  # up while every live worker routes to it
                mine["in_flight"] += counts["in_flight"]
                mine["up"] = min(mine["up"], counts["up"])

    # -- exposition ---------------------------------------------------------------------------

    def render(self, out_of_order: Optional[int] = None, servers: Optional[dict[str, dict[str, int]]] = None) -> str:
        lines: list[str] = []
        servers = servers if servers is not None else self.servers

        def family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        family(
            "frontend_requests_total", "counter", "HTTP requests finished, by endpoint and status code.",
            (f'frontend_requests_total{{endpoint="{_escape(e)}",status="{s}"}} {v}'
             for (e, s), v in sorted(self.requests.items())),
        )
        family(
            "frontend_requests_in_flight", "gauge", "HTTP requests being handled, by endpoint.",
            (f'frontend_requests_in_flight{{endpoint="{_escape(e)}"}} {v}' for e, v in sorted(self.in_flight.items())),
        )
        family("frontend_streams_in_flight", "gauge", "Server-sent-event streams in progress.",
               [f"frontend_streams_in_flight {self.streams_in_flight}"])
        family("frontend_streams_total", "counter", "Server-sent-event streams started.",
               [f"frontend_streams_total {self.streams_total}"])
        if out_of_order is not None:
            family("frontend_triton_out_of_order_responses_total", "counter",
                   "Stream responses Triton delivered after a later one of the same sample (scrambled text).",
                   [f"frontend_triton_out_of_order_responses_total {out_of_order}"])
        for key, name, kind, help_text in (
                ("requests", "frontend_triton_server_requests_total", "counter", "Generations sent to each tritonserver."),
                ("in_flight", "frontend_triton_server_requests_in_flight", "gauge",
                 "Generations in flight on each tritonserver."),
                ("up", "frontend_triton_server_up", "gauge",
                 "1 while requests are routed to the tritonserver; 0 once it failed, until it answers again."),
                ("prompt_chunks", "frontend_triton_server_prompt_chunks_total", "counter",
                 "64-byte prompt chunks routed to each tritonserver (cache_aware, load_aware)."),
                ("prompt_chunks_matched", "frontend_triton_server_prompt_chunks_matched_total", "counter",
                 "Of those, chunks the router had sent it before: what its prefix cache should hold.")):
            if servers:
                family(name, kind, help_text,
                       (f'{name}{{server="{_escape(url)}"}} {counts.get(key, 0)}' for url, counts in sorted(servers.items())))
        samples = []
        for e, counts in sorted(self._hist.items()):
            label = _escape(e)
            acc = 0
            for bound, c in zip(BUCKETS, counts):
                acc += c
                samples.append(f'frontend_request_duration_seconds_bucket{{endpoint="{label}",le="{bound}"}} {acc}')
            acc += counts[-1]
            samples.append(f'frontend_request_duration_seconds_bucket{{endpoint="{label}",le="+Inf"}} {acc}')
            samples.append(f'frontend_request_duration_seconds_sum{{endpoint="{label}"}} {self._hist_sum[e]:.6f}')
            samples.append(f'frontend_request_duration_seconds_count{{endpoint="{label}"}} {acc}')
        family("frontend_request_duration_seconds", "histogram",
               "Time from the request's arrival to its last byte, by endpoint.", samples)
        return "\n".join(lines) + "\n"


PUBLISH_INTERVAL_S = 0.5


class SharedMetrics:
    """One worker's FrontendMetrics, written to `directory/<pid>.json`; `render` sums every
    worker's file. The directory is made by the launching process and shared by its workers."""

    def __init__(self, metrics: FrontendMetrics, directory: str) -> None:
        self.metrics = metrics
        self.directory = Path(directory)
        self.path = self.directory / f"{os.getpid()}.json"
        self._written: Optional[str] = None

    def publish(self, out_of_order: Optional[int] = None, servers: Optional[dict[str, dict[str, int]]] = None) -> None:
        text = json.dumps(self.metrics.snapshot(out_of_order, servers))
        if text == self._written:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)  # a reader sees the old file or the new one, never half of one
        self._written = text

    async def run(self, client_counts: Any) -> None:
        """Publish every PUBLISH_INTERVAL_S until cancelled; `client_counts()` gives the engine
        client's counts to add (publish's keyword arguments)."""
        while True:
            self.publish(**client_counts())
            await asyncio.sleep(PUBLISH_INTERVAL_S)

    def render(self, out_of_order: Optional[int] = None, servers: Optional[dict[str, dict[str, int]]] = None) -> str:
        self.publish(out_of_order, servers)
        total = FrontendMetrics()
        disordered: Optional[int] = None
        for path in sorted(self.directory.glob("*.json")):
            try:
                snap = json.loads(path.read_text())
            except (OSError, ValueError):  # a worker's file replaced or removed under us
                continue
            total.add(snap, live=process_alive(int(path.stem)))
            if snap.get("out_of_order") is not None:
                disordered = (disordered or 0) + snap["out_of_order"]
        return total.render(out_of_order=disordered)

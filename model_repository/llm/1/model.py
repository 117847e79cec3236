"""Triton adapter for the engine: tensors in, engine requests; engine outputs, responses out."""

import json
import os
import sys
import threading
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend.config import EngineConfig  # noqa: E402
from backend.engine import EngineOverloaded, EngineStats, LLMEngine, RequestError  # noqa: E402
from backend.outputs import RequestOutput  # noqa: E402
from backend.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from backend.triton_io import LLM_INPUTS, engine_config_overrides, llm_output_arrays, parse_llm_inputs  # noqa: E402
from backend.triton_utils import model_path_from_config  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Responder:
    """Sends one request's engine outputs as Triton responses.

    Streaming: one response per engine output. Not streaming: one response per sample (n of
    them), each when its sample finishes. The response that ends the last sample is final.
    """

    def __init__(self, sender, params: SamplingParams, stream: bool, on_final=None) -> None:
        self.sender = sender
        self.params = params
        self.stream = stream
        self.buffered: dict[int, RequestOutput] = {}
        self.on_final = on_final
        self.remaining = params.n
        self.failed = False

    def __call__(self, out: RequestOutput) -> None:
        if self.failed:
            return
        if out.error is not None:
            # One failed sample fails the request: the client gets the reason, once.
            self.failed = True
            if self.on_final is not None:
                self.on_final()
            code = pb_utils.TritonError.INVALID_ARG if out.error_code == "invalid_arg" else pb_utils.TritonError.INTERNAL
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(out.error, code)), flags=FINAL)
            return
        if not self.stream:
            prev = self.buffered.get(out.index)
            self.buffered[out.index] = out if prev is None else prev.merge(out)
            if not out.finished:
                return
            out = self.buffered.pop(out.index)
        last = False
        if out.finished:
            self.remaining -= 1
            last = self.remaining == 0
        if last and self.on_final is not None:
            self.on_final()
        tensors = [pb_utils.Tensor(k, v) for k, v in llm_output_arrays(out, self.params).items()]
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if last else 0)


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        overrides = engine_config_overrides(params, dict(os.environ))
        if overrides.get("device") is None:
            overrides.pop("device", None)
        self.engine = LLMEngine(EngineConfig(model_path=model_path_from_config(args), **overrides))
        self._metrics = _Metrics()
        self._last_publish = 0.0
        self.engine.on_step = self._publish
        # Triton request id -> engine request ids, for abort_request_id: cancelling an ensemble
        # stream does not reach this model's running request in Triton 2.51, so the frontend
        # sends an explicit abort naming the ensemble request's id (which Triton propagates).
        self._by_triton_id: dict[str, set[str]] = {}
        self._ids_lock = threading.Lock()
        self.engine.start()
        stats = self.engine.stats()
        self._publish(stats, force=True)
        pb_utils.Logger.log_info(
            f"llm engine ready: model={self.engine.config.model_path} device={self.engine.model.device} "
            f"kv_blocks={stats.num_kv_blocks}x{self.engine.config.block_size} max_model_len={self.engine.max_model_len}"
        )

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                arrays = {}
                for name in LLM_INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        arrays[name] = tensor.as_numpy()
                if "abort_request_id" in arrays:
                    self._abort(arrays["abort_request_id"])
                    sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                    continue
                prompt_ids, raw, stream = parse_llm_inputs(arrays)
                params = self.engine.parse_params(raw)
                triton_id = request.request_id() or ""
                responder = _Responder(sender, params, stream)
                engine_id = self.engine.add_request(
                    prompt_ids, params, responder, is_cancelled=sender.is_cancelled
                )
                if triton_id:
                    responder.on_final = lambda t=triton_id, e=engine_id: self._forget(t, e)
                    with self._ids_lock:
                        self._by_triton_id.setdefault(triton_id, set()).add(engine_id)
            except (RequestError, SamplingParamsError) as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            except EngineOverloaded as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            except Exception as exc:  # never let one request take the model down
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {exc}")), flags=FINAL)
        return None

    def _abort(self, arr) -> None:
        value = arr.reshape(-1)
        triton_id = value[0].decode() if value.size and isinstance(value[0], bytes) else str(value[0]) if value.size else ""
        with self._ids_lock:
            engine_ids = self._by_triton_id.pop(triton_id, set())
        for engine_id in engine_ids:
            self.engine.abort(engine_id)

    def _forget(self, triton_id: str, engine_id: str) -> None:
        with self._ids_lock:
            ids = self._by_triton_id.get(triton_id)
            if ids is not None:
                ids.discard(engine_id)
                if not ids:
                    del self._by_triton_id[triton_id]

    def _publish(self, stats: EngineStats, force: bool = False) -> None:
        # Metric updates cross into the server process: throttle them, but never leave an idle
        # engine showing stale numbers.
        now = time.monotonic()
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if force or idle or now - self._last_publish > 0.2:
            self._last_publish = now
            self._metrics.update(stats)

    def finalize(self):
        self.engine.shutdown()


class _Metrics:
    def __init__(self) -> None:
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self._lock = threading.Lock()
        # The families must outlive their metrics: a collected MetricFamily unregisters itself.
        self._families: list = []
        self._gauges = {
            name: self._metric(name, desc, gauge)
            for name, desc in {
                "num_requests_running": "Sequences in the running batch",
                "num_requests_waiting": "Sequences waiting to be scheduled",
                "kv_blocks_total": "KV cache blocks in the pool",
                "kv_blocks_used": "KV cache blocks held by sequences",
            }.items()
        }
        self._counters = {
            name: self._metric(name, desc, counter)
            for name, desc in {
                "num_preemptions_total": "Sequences preempted for lack of KV blocks",
                "prompt_tokens_total": "Prompt tokens prefilled",
                "generation_tokens_total": "Tokens generated",
            }.items()
        }
        self._seen = {name: 0 for name in self._counters}

    def _metric(self, name: str, description: str, kind):
        family = pb_utils.MetricFamily(name=f"llm_{name}", description=description, kind=kind)
        self._families.append(family)
        return family.Metric(labels={})

    def update(self, s: EngineStats) -> None:
        with self._lock:
            self._gauges["num_requests_running"].set(s.num_running)
            self._gauges["num_requests_waiting"].set(s.num_waiting)
            self._gauges["kv_blocks_total"].set(s.num_kv_blocks)
            self._gauges["kv_blocks_used"].set(s.num_kv_blocks - s.num_free_kv_blocks)
            for name, value in (
                ("num_preemptions_total", s.num_preemptions),
                ("prompt_tokens_total", s.prompt_tokens_total),
                ("generation_tokens_total", s.generation_tokens_total),
            ):
                if value > self._seen[name]:
                    self._counters[name].increment(value - self._seen[name])
                    self._seen[name] = value

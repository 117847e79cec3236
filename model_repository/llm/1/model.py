"""Triton adapter for the engine: tensors in, engine requests; engine outputs, responses out."""

import functools
import gc
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable, Optional

import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend.abort_acks import AbortAcks  # noqa: E402
from backend.config import EngineConfig  # noqa: E402
from backend.engine import EngineOverloaded, EngineStats, LLMEngine, RequestError  # noqa: E402
from backend.engine_process import EngineProxy  # noqa: E402
from backend.ensemble_check import check_ensemble_tokenizers  # noqa: E402
from backend.gc_freeze import freeze_startup_heap  # noqa: E402
from backend.outbox import Outbox, StreamResponder  # noqa: E402
from backend.outputs import RequestOutput  # noqa: E402
from backend.request_index import DuplicateRequestId, TritonRequestIndex  # noqa: E402
from backend.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402
from backend.server_stop import ServerStopWatch, exit_timeout_s, liveness_probe, server_args, stop_grace_s  # noqa: E402
from backend.triton_io import (  # noqa: E402
    LLM_INPUTS,
    control,
    control_input,
    engine_config_overrides,
    error_message,
    llm_output_arrays,
    llm_setting,
    meta_array,
    oversubscribed_threads,
    parse_abort_client,
    parse_abort_request_id,
    parse_llm_inputs,
    read_setting,
    refuse_lora_changes,
    request_name,
    server_torch_threads,
    setting_flag,
    unknown_llm_env,
    unknown_llm_params,
)  # noqa: E402
from backend.triton_metrics import LLMMetrics  # noqa: E402
from backend.triton_utils import (  # noqa: E402
    GuardedSender,
    OpenRequests,
    check_serving_config,
    exit_with_server,
    input_arrays,
    model_path_from_config,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_INTERVAL_S = 1.0


def _send_output(sender: GuardedSender, params: SamplingParams):
    def send(out: RequestOutput, last: bool) -> None:
        tensors = [pb_utils.Tensor(k, v) for k, v in llm_output_arrays(out, params).items()]
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), final=last)

    return send


def _send_error(sender: GuardedSender):
    def send(out: RequestOutput) -> None:
        code = pb_utils.TritonError.INVALID_ARG if out.error_code == "invalid_arg" else pb_utils.TritonError.INTERNAL
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(out.error, code)), final=True)

    return send


class TritonPythonModel:
    def initialize(self, args):
        self._watcher = exit_with_server("llm")
        check_serving_config(
            args, "llm",
            one_instance="the engine is one KV pool and one step loop, and aborts, `rid` checks and the prefix cache "
                         "find a request only in the engine that runs it; concurrency comes from continuous batching "
                         "(for more GPUs, one tritonserver each)",
            decoupled="a request's tokens stream as responses of their own, and n > 1 samples each end apart")
        check_ensemble_tokenizers(args)
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        env = dict(os.environ)
        if unknown := unknown_llm_params(params):
            raise ValueError(f"llm config.pbtxt: unknown parameter(s) {', '.join(unknown)} (README: Engine settings)")
        if unknown := unknown_llm_env(env):
            pb_utils.Logger.log_warn(f"llm: ignored environment variable(s) {', '.join(unknown)}: no such setting "
                                     "(README: Engine settings)")
        overrides = engine_config_overrides(params, env)
        if overrides.get("device") is None:
            overrides.pop("device", None)
        config = EngineConfig(model_path=model_path_from_config(args), **overrides)
        on_cpu = config.device.split(":")[0] == "cpu"  # "cpu:0" too (QA: it got the GPU defaults)
        if config.torch_threads is None and on_cpu:
            config = config.model_copy(update={"torch_threads": server_torch_threads()})
        elif on_cpu and (warning := oversubscribed_threads(config.torch_threads)):
            pb_utils.Logger.log_warn(f"llm: {warning}")
        # in_stub: the engine's step loop runs on a thread of this stub. separate: in a child
        # process with its own GIL, away from the response threads (backend/engine_process.py).
        # auto: separate on CUDA, where the stub's GIL bound the step loop (H200, c=64: through
        # the ensemble 0.73 of the engine against 0.30 in the stub); in_stub on the CPU, where the
        # cores are what is shared and a second process measured the same (2 cores: 0.52 / 0.48).
        engine_process = llm_setting(params, env, "engine_process") or (
            "separate" if config.device.startswith("cuda") else "in_stub")
        if engine_process not in ("in_stub", "separate"):
            raise ValueError(f'engine_process must be "in_stub" or "separate", not {engine_process!r}')
        # The serving settings are read before the engine exists: a bad one stops the load before
        # a KV pool is allocated or an engine process started.
        self.stream_interval = read_setting(params, env, "stream_interval", int, minimum=1) or 1
        self.runtime_lora = bool(read_setting(params, env, "allow_runtime_lora_updating", setting_flag))
        cap = read_setting(params, env, "max_responses_per_step", int, minimum=0)
        # A thread each, started at load (QA: nothing bounded it; 10^8 would be tried).
        senders = read_setting(params, env, "response_senders", int, minimum=1, maximum=256) or 4
        if engine_process == "separate":
            self.engine = EngineProxy(config)
            self.engine.on_gone = self._engine_gone
            self._control = self.engine.control
        else:
            self.engine = LLMEngine(config)
            self._control = functools.partial(control, self.engine)
        self._metrics = LLMMetrics(pb_utils.MetricFamily)
        # Responses go out on their own thread, merged when they pile up, at most
        # max_responses_per_step per engine step (backend/outbox.py). auto: 16 on CPU, where
        # each response's trip through the ensemble costs about as much CPU as a step of a
        # small model; no cap on GPU hosts.
        per_step = (16 if on_cpu else 0) if cap is None else cap
        # A send waits until the server has taken the response, so one sender thread has one
        # response in flight; several keep the server's side busy (backend/outbox.py).
        self._outbox = Outbox("llm-responses", responses_per_step=per_step, senders=senders)
        self._serving = {"stream_interval": self.stream_interval, "max_responses_per_step": per_step,
                         "response_senders": senders, "engine_process": engine_process}  # engine_info reports them
        self._last_publish = 0.0
        self._published_idle = True
        self.engine.on_step = self._on_step
        # Triton request id -> engine request ids, for abort_request_id (backend/request_index.py).
        self._requests = TritonRequestIndex()
        self._acks = AbortAcks()
        self._open = OpenRequests()  # engine_info's open_requests
        # A stopping tritonserver tells the model nothing and, past its exit timeout, crashed with
        # requests in flight: notice the stop, and end them in time (backend/server_stop.py).
        server = server_args(os.getppid())
        self._stop_watch = ServerStopWatch(
            liveness_probe(server), on_stop=self._abort_open, grace_s=stop_grace_s(exit_timeout_s(server)),
            idle=lambda: not self._acks.open_ids(), log=pb_utils.Logger)
        freeze_startup_heap()
        self.engine.start()
        stats = self.engine.stats()
        self._publish(stats, force=True)
        pb_utils.Logger.log_info(
            f"llm engine ready: model={self.engine.config.model_path} device={self.engine.device} "
            f"kv_blocks={stats.num_kv_blocks}x{self.engine.config.block_size} "
            f"kv_cache_dtype={self.engine.kv_dtype} max_model_len={self.engine.max_model_len} "
            f"engine_process={engine_process}" + (f" (pid {self.engine.pid})" if engine_process == "separate" else "")
        )

    def execute(self, requests):
        self._stop_watch.arm()
        for request in requests:
            guarded = GuardedSender(request.get_response_sender(), FINAL, self._open)
            arrays: dict = {}
            try:
                arrays = input_arrays(request, LLM_INPUTS)
                kind = control_input(arrays)
                if kind == "abort_request_id":
                    self._reply_after(guarded, self._abort(arrays["abort_request_id"]))
                    continue
                if kind == "abort_client":
                    count, engine_ids = self._abort_client(arrays["abort_client"])
                    self._reply_after(guarded, engine_ids, {"aborted": count})
                    continue
                if kind == "abort_all":
                    engine_ids = self._abort_open()
                    self._reply_after(guarded, engine_ids, {"aborted": len(engine_ids)})
                    continue
                if kind == "lora_update" and not self.runtime_lora:
                    refuse_lora_changes(arrays)
                if kind is not None:
                    extra = {"open_requests": self._open.count - 1}
                    meta = self._control(kind, arrays, self._serving, extra)
                    guarded.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("meta_info", meta)]),
                                 final=True)
                    continue
                if self._stop_watch.stopping:
                    self._metrics.rejected("stopping")
                    error = pb_utils.TritonError("the server is stopping", pb_utils.TritonError.UNAVAILABLE)
                    guarded.send(pb_utils.InferenceResponse(error=error), final=True)
                    continue
                parameters = request.parameters()
                prompt_ids, raw, stream = parse_llm_inputs(arrays, parameters)
                params = self.engine.parse_params(raw)
                triton_id, chosen = request_name(request.request_id() or "", parameters)
                responder = StreamResponder(
                    self._outbox,
                    params.n,
                    stream,
                    _send_output(guarded, params),
                    _send_error(guarded),
                    stream_interval=self.stream_interval,
                    on_output=self._metrics.request_timing(params.n).on_output,
                )
                # Indexed before the engine sees it, so a fast finish cannot precede the entry.
                engine_id = uuid.uuid4().hex
                aborted_first = bool(triton_id) and self._requests.add(triton_id, engine_id, params.n,
                                                                       chosen=chosen)  # may refuse
                self._acks.opened(engine_id)
                responder.on_sent = lambda e=engine_id: self._acks.sent(e)
                if triton_id:
                    responder.on_final = lambda t=triton_id, e=engine_id: self._requests.forget(t, e)
                try:
                    self.engine.add_request(prompt_ids, params, responder, request_id=engine_id,
                                            is_cancelled=guarded.is_cancelled, input_embeds=arrays.get("input_embeds"))
                except Exception:
                    self._requests.forget(triton_id, engine_id)
                    self._acks.sent(engine_id)
                    raise
                if aborted_first:
                    self.engine.abort(engine_id)
            except (RequestError, SamplingParamsError, DuplicateRequestId) as exc:
                self._metrics.rejected("invalid_argument")
                error = pb_utils.TritonError(error_message(exc, arrays), pb_utils.TritonError.INVALID_ARG)
                guarded.send(pb_utils.InferenceResponse(error=error), final=True)
            except EngineOverloaded as exc:
                self._metrics.rejected("overloaded")
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.UNAVAILABLE)
                guarded.send(pb_utils.InferenceResponse(error=error), final=True)
            except Exception as exc:  # never let one request take the model down
                self._metrics.rejected("internal")
                guarded.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {exc}")), final=True)
        return None

    def _abort(self, arr) -> set[str]:
        engine_ids = self._requests.abort(parse_abort_request_id(arr))
        self._end(engine_ids)
        return engine_ids

    def _abort_client(self, arr) -> tuple[int, set[str]]:
        count, engine_ids = self._requests.abort_client(*parse_abort_client(arr))
        self._end(engine_ids)
        return count, engine_ids

    def _abort_open(self) -> list[str]:
        """Abort every request whose last response has not gone out (abort_all, a server stop)."""
        engine_ids = self._acks.open_ids()
        self._end(engine_ids)
        if engine_ids and self._stop_watch.stopping:
            pb_utils.Logger.log_info(f"llm: the server is stopping: aborted {len(engine_ids)} request(s)")
        return engine_ids

    def _end(self, engine_ids: Iterable[str]) -> None:
        """Ask the engine to end these requests (at its next step)."""
        for engine_id in engine_ids:
            self.engine.abort(engine_id)

    def _reply_after(self, guarded: GuardedSender, engine_ids: Iterable[str], meta: Optional[dict] = None) -> None:
        """An abort's one response, once the requests it ended have sent their last ones."""
        tensors = [] if meta is None else [pb_utils.Tensor("meta_info", meta_array(meta))]
        response = pb_utils.InferenceResponse(output_tensors=tensors)
        self._acks.reply_after(engine_ids, lambda: guarded.send(response, final=True))

    def _on_step(self, stats: EngineStats) -> None:
        self._outbox.tick()
        self._publish(stats)

    def _publish(self, stats: EngineStats, force: bool = False) -> None:
        # Every metric update is an IPC round trip to the server that holds the GIL (the
        # histograms alone are ~60 series), on the engine thread: publish at most once per
        # METRICS_INTERVAL_S while busy (Triton's own metrics refresh every 2 s), but never
        # leave an idle engine showing stale numbers, nor a busy one showing idle ones: the first
        # step after idle publishes too. Responses go out on the outbox's threads, so a client
        # can see its request end before the next publish; without this, a scraper that waits
        # for llm_kv_blocks_used == 0 could read the idle value from before its requests ran,
        # and find their finish reasons not counted yet.
        now = time.monotonic()
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if force or idle or self._published_idle or now - self._last_publish > METRICS_INTERVAL_S:
            self._last_publish = now
            self._published_idle = idle
            self._metrics.update(stats, self._outbox.stats())

    def _engine_gone(self, reason: str) -> None:
        """The engine's child process died: nothing restarts it, so this stub goes too, once the
        requests' error responses had a moment to leave. The stub's watcher (exit_with_server)
        then stops tritonserver, and its supervisor starts a working one, as vLLM's server exits
        when its engine dies. Ready and serving nothing, it would pass every health check."""
        pb_utils.Logger.log_error(f"llm: {reason}; exiting, so that the server is restarted")
        threading.Timer(2.0, os._exit, args=(1,)).start()

    def finalize(self):
        self._stop_watch.close()
        self.engine.shutdown()
        self._outbox.close()
        # Collect reference cycles now, while the stub's shared memory is alive: an exception kept
        # in one holds its frames, and their InferenceRequests, and was seen freed by the
        # interpreter's last collection after the shared memory was gone (a segfault on the way out).
        gc.collect()

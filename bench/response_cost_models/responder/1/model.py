"""Streams synthetic llm-shaped responses from sender threads, like the llm model's outbox."""

import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _arrays(i: int, last: bool) -> list[tuple[str, np.ndarray]]:
    # The order puts completion_tokens first so that a one-tensor response still tells the
    # client where it belongs.
    return [
        ("completion_tokens", np.asarray([i + 1], dtype=np.int32)),
        ("output_ids", np.asarray([i % 4096], dtype=np.int32)),
        ("detok_ids", np.arange(i, i + 6, dtype=np.int32) % 4096),
        ("detok_prefix_len", np.asarray([5], dtype=np.int32)),
        ("finish_reason", np.asarray(["length" if last else ""], dtype=object)),
        ("meta_info", np.asarray([json.dumps({"index": 0, "stop_reason": None, "num_preemptions": 0,
                                              "cached_tokens": 0})], dtype=object)),
        ("prompt_tokens", np.asarray([128], dtype=np.int32)),
    ]


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"]).get("parameters", {}).items()}
        self._work: "queue.Queue" = queue.Queue()
        self._threads = [threading.Thread(target=self._send_loop, daemon=True, name=f"responder-{i}")
                         for i in range(int(params.get("senders", "4")))]
        for t in self._threads:
            t.start()

    def _send_loop(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            sender, n, k = job
            for i in range(n):
                last = i == n - 1
                tensors = [pb_utils.Tensor(name, arr) for name, arr in _arrays(i, last)[:k]]
                sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if last else 0)

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "responses").as_numpy().reshape(-1)[0])
            k = int(pb_utils.get_input_tensor_by_name(request, "tensors").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            if n < 1 or not 1 <= k <= 7:
                error = pb_utils.TritonError("responses must be >= 1 and tensors 1..7", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            self._work.put((sender, n, k))
        return None

    def finalize(self):
        for _ in self._threads:
            self._work.put(None)

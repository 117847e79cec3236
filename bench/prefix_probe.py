"""Where a request's time to first token goes with a shared prefix cached and not:

    python -m bench.prefix_probe [--device cuda] [--model-path models/demo] [--prefix-len 1024] [--json out.json]

serving_bench's `prefix` section measures TTFT p50 with prefix caching off and on through a
started engine (its loop thread, the callbacks into asyncio). This probe takes prompts of the
same shape apart (a shared random prefix and a 16-64 token suffix each, one request at a time;
the same prompts with caching off and on):

* hand-stepped (no loop thread, the device synchronized around each step and forward pass): the
  steps until the first token, their wall time and their forward passes;
* through the engine's step loop (on this thread; a client thread submits): add_request to the
  first output's callback, with nothing else in flight.

The gap between the two is what the loop and the callbacks add to a request; the hand-stepped
steps are the device work. For each of off and on, a single sequence's decode step beside it
sets the scale (with the prefix cached, TTFT was ~2.5 decode steps on an H200).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from bench.hand_stepped import HandStepped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-path", type=Path, default=Path("models/demo"))
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--kv-cache-memory-mb", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = random.Random(7)
    results: dict[str, Any] = {"device": a.device, "model": str(a.model_path), "prefix_len": a.prefix_len,
                               "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
                               "torch": torch.__version__}
    first = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    prompts: list[list[int]] = []  # the same for off and on: the warm-up's, the hand-stepped, the loop's
    for enabled in (False, True):
        engine = LLMEngine(EngineConfig(model_path=a.model_path, device=a.device, enable_prefix_caching=enabled,
                                        kv_cache_memory_mb=a.kv_cache_memory_mb))
        if not prompts:
            vocab = engine.vocab_size
            prefix = [rng.randrange(10, vocab - 10) for _ in range(a.prefix_len)]
            prompts = [prefix + [rng.randrange(10, vocab - 10) for _ in range(rng.randint(16, 64))]
                       for _ in range(1 + 2 * a.requests)]
        prompt = iter(prompts).__next__

        torch.set_num_threads(engine.torch_threads)  # the step loop's OpenMP threads, as start() sets on its thread
        stepped = HandStepped(engine)
        decode_ms: list[float] = []
        engine.add_request(prompt(), SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True), lambda out: None)
        while engine.has_unfinished():  # warms up and (with caching) puts the prefix in the cache
            decode_ms.append(stepped.step())
        decode_ms = decode_ms[-16:]  # the steps after the prefill: one sequence decoding
        hand_ttft, steps, step_ms, forward_ms, cached = [], [], [], [], []
        for _ in range(a.requests):
            got: list[Any] = []
            stepped.forward_ms.clear()
            stepped.sync()
            t = time.perf_counter()
            engine.add_request(prompt(), first, got.append)
            these = []
            while not got:
                these.append(stepped.step())
            hand_ttft.append(1e3 * (time.perf_counter() - t))
            steps.append(len(these))
            cached.append(got[0].cached_tokens)
            step_ms.extend(these)
            forward_ms.extend(stepped.forward_ms)
        # The step loop runs on this thread, whose OpenMP team the hand-stepped steps made: a
        # second team on a loop thread of its own would oversubscribe a CPU host's cores and
        # time that, not the loop (backend/engine._without_thread_team). A client thread submits.
        loop_ttft: list[float] = []
        finished = threading.Event()

        def client() -> None:
            try:
                for _ in range(a.requests):
                    done = threading.Event()
                    t = time.perf_counter()
                    engine.add_request(prompt(), first, lambda out: done.set())
                    done.wait(60)
                    loop_ttft.append(1e3 * (time.perf_counter() - t))
            finally:
                finished.set()
                engine.wake()

        submitter = threading.Thread(target=client)
        submitter.start()
        engine.run(until=finished)
        submitter.join()
        engine.shutdown()
        row = {"decode_step_ms_p50": statistics.median(decode_ms), "hand_ttft_ms": hand_ttft,
               "hand_ttft_ms_p50": statistics.median(hand_ttft), "steps_to_first_token": steps, "cached_tokens": cached,
               "step_ms_p50": statistics.median(step_ms), "forward_ms_p50": statistics.median(forward_ms),
               "loop_ttft_ms": loop_ttft, "loop_ttft_ms_p50": statistics.median(loop_ttft)}
        row["loop_and_callbacks_ms_p50"] = row["loop_ttft_ms_p50"] - row["hand_ttft_ms_p50"]
        results["on" if enabled else "off"] = row
        print(f"prefix caching {'on ' if enabled else 'off'}: TTFT p50 hand-stepped {row['hand_ttft_ms_p50']:6.2f} ms "
              f"({statistics.median(steps):.0f} steps, step p50 {row['step_ms_p50']:6.2f}, forward p50 "
              f"{row['forward_ms_p50']:6.2f}), through the loop {row['loop_ttft_ms_p50']:6.2f} ms; a decode step "
              f"{row['decode_step_ms_p50']:5.2f} ms", flush=True)
        del engine, stepped
        if a.device == "cuda":
            torch.cuda.empty_cache()
    for how in ("hand_ttft_ms_p50", "loop_ttft_ms_p50"):
        results[f"{how}_off_over_on"] = results["off"][how] / results["on"][how]
    print(f"TTFT p50 off / on: hand-stepped {results['hand_ttft_ms_p50_off_over_on']:.2f}, through the loop "
          f"{results['loop_ttft_ms_p50_off_over_on']:.2f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""One request's prefill time (max_new_tokens=1) at prompt lengths not seen before and seen
before, with SDPA's cuDNN backend off (the engine's setting on CUDA) and on, in one run:

    python -m bench.prefill_probe [--device cuda] [--model-path models/demo] [--json out.json]

A cost that comes with each new shape rather than with the prompt's length shows up as the gap
between the two columns. On an H200 with cuDNN's SDPA on, an unseen length took 45-60 ms against
3-5 ms seen (backend/model_runner.avoid_cudnn_attention). Each length is drawn fresh per mode,
so one mode's warm caches cannot serve the other. With --profile, the slowest unseen-length
prefill of each mode is profiled (cProfile, top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-path", type=Path, default=Path("models/demo"))
    ap.add_argument("--lengths", type=int, default=12, help="unseen lengths per mode")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    engine = LLMEngine(EngineConfig(model_path=a.model_path, device=a.device, enable_prefix_caching=False,
                                    kv_cache_memory_mb=2048))
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.vocab_size
    used: set[int] = set()

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    def once(n: int, prof: cProfile.Profile | None = None) -> float:
        ids = [rng.randrange(10, vocab - 10) for _ in range(n)]
        sync()
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        engine.generate([ids], params)
        sync()
        if prof is not None:
            prof.disable()
        return 1e3 * (time.perf_counter() - t)

    def fresh_length() -> int:
        while True:
            n = rng.randrange(16, 1024)
            if n not in used:
                used.add(n)
                return n

    for n in (64, 64, 300, 300):  # first-use costs (allocator, kernels' first compiles) go here
        once(n)
    results: dict[str, Any] = {"device": a.device, "model": str(a.model_path),
                               "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
                               "torch": torch.__version__}
    modes = [("cudnn_off", False), ("cudnn_on", True)] if a.device == "cuda" else [("cpu", None)]
    for name, cudnn in modes:
        if cudnn is not None:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        unseen, seen = [], []
        for _ in range(a.lengths):
            n = fresh_length()
            unseen.append(once(n))
            seen.append(once(n))
        row = {"unseen_ms": unseen, "seen_ms": seen, "unseen_p50_ms": statistics.median(unseen),
               "seen_p50_ms": statistics.median(seen)}
        if a.profile:
            prof = cProfile.Profile()
            row["profiled_ms"] = once(fresh_length(), prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
            row["profile"] = s.getvalue()
        results[name] = row
        print(f"{name:10s} prefill, unseen length p50 {row['unseen_p50_ms']:7.2f} ms, seen p50 "
              f"{row['seen_p50_ms']:7.2f} ms  (unseen: {', '.join(f'{x:.1f}' for x in unseen)})", flush=True)
        if a.profile:
            print(row["profile"][:2500], flush=True)
    if "cudnn_on" in results:
        results["unseen_p50_on_over_off"] = results["cudnn_on"]["unseen_p50_ms"] / results["cudnn_off"]["unseen_p50_ms"]
        print(f"unseen-length prefill p50, cuDNN SDPA on / off: {results['unseen_p50_on_over_off']:.2f}")
    # Through a started engine (its loop thread, callbacks): what serving's TTFT sees.
    import threading

    torch.backends.cuda.enable_cudnn_sdp(False)
    engine.start()
    ttft = []
    for _ in range(6):
        done = threading.Event()
        ids = [rng.randrange(10, vocab - 10) for _ in range(fresh_length())]
        t = time.perf_counter()
        engine.add_request(ids, params, lambda out: done.set() if out.finished else None)
        done.wait(30)
        ttft.append(1e3 * (time.perf_counter() - t))
    engine.shutdown()
    results["started_engine_ttft_ms"] = ttft
    print(f"started engine, unseen lengths: TTFT {', '.join(f'{x:.1f}' for x in ttft)} ms")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

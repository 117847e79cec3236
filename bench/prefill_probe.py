"""Time one request's prefill (max_new_tokens=1) at lengths seen and unseen, and profile an unseen
one: a fixed per-prefill cost that does not follow the prompt's length shows up here.

    python -m bench.prefill_probe [--device cuda] [--model-path models/demo]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-path", type=Path, default=Path("models/demo"))
    a = ap.parse_args()
    engine = LLMEngine(EngineConfig(model_path=a.model_path, device=a.device, enable_prefix_caching=False,
                                    kv_cache_memory_mb=2048))
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)

    def once(n: int) -> float:
        ids = [rng.randrange(10, 4000) for _ in range(n)]
        if a.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate([ids], params)
        if a.device == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)

    for n in (100, 100, 100, 237, 237, 411, 411, 100, 16, 16, 512, 512, 333, 334, 335):
        print(f"prefill {n:4d} tokens: {once(n):7.2f} ms", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    t = once(277)
    prof.disable()
    print(f"profiled prefill 277 tokens (unseen length): {t:.2f} ms")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    print(s.getvalue()[:6000])
    prof = cProfile.Profile()
    prof.enable()
    t = once(277)
    prof.disable()
    print(f"profiled prefill 277 tokens (seen length): {t:.2f} ms")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    print(s.getvalue()[:3000])
    # The same through a started engine (its loop thread, callbacks): what serving's TTFT sees.
    import threading

    engine.start()
    for n in (100, 100, 237, 237, 411):
        done = threading.Event()
        ids = [rng.randrange(10, 4000) for _ in range(n)]
        t = time.perf_counter()
        engine.add_request(ids, params, lambda out: done.set() if out.finished else None)
        done.wait(30)
        print(f"started engine, prefill {n:4d} tokens: TTFT {1e3 * (time.perf_counter() - t):7.2f} ms", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()

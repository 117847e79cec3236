"""Where a decode step's time goes: from its CUDA graph and eagerly, at several batch sizes.

    python -m bench.decode_probe [--device cuda] [--model-path /tmp/model-0.4b] [--batches 1 8 64]
                                 [--context 1024] [--json out.json]

The engine is stepped by hand (no loop thread). Per batch size, `--batches` sequences with
`--context`-token prompts are prefilled, then `--steps` decode steps are timed: the whole step
(scheduling, the forward pass, sampling, outputs) and the forward pass alone, with the device
synchronized around each. That runs once with the decode graphs (the CUDA default) and once
eagerly (`cuda_graphs=False`), for each `--splits` value (LLM_DECODE_SPLITS: the paged decode
kernel's programs per context, 1 or `auto`); the eager pass is also profiled (torch.profiler),
listing its kernels (or, on the CPU, its operators) by their own time over the profiled steps.

What it answers: on an H100 the 0.4B model (24 layers) decoded at ~9 ms a step at batch 1 and
64 alike, where reading its 0.8 GB of weights takes ~0.3 ms. If the graph's forward pass is
most of the step and the profile's kernel time matches it, the GPU work is slow (look at the
top kernel); if the forward pass is short, the time is the host's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from pathlib import Path
from typing import Any

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.sampling_params import SamplingParams
from bench.hand_stepped import HandStepped


def probe(a: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    cuda = a.device.startswith("cuda")
    engine = LLMEngine(EngineConfig(model_path=a.model_path, device=a.device, enable_prefix_caching=False,
                                    kv_cache_memory_mb=a.kv_cache_memory_mb, max_num_seqs=max(a.batches),
                                    cuda_graphs=graphs if cuda else None))
    rng = random.Random(0)
    vocab = engine.vocab_size

    stepped = HandStepped(engine)
    forward_ms, step = stepped.forward_ms, stepped.step

    rows: dict[str, Any] = {"cuda_graphs": engine.model.graphs is not None}
    try:
        for batch in a.batches:
            params = SamplingParams(max_new_tokens=a.steps + a.warmup + 8, temperature=0.0, ignore_eos=True)
            started: set[int] = set()

            def on_output(out: Any, i: int) -> None:
                if out.new_token_ids:
                    started.add(i)

            ids = [engine.add_request([rng.randrange(10, vocab - 10) for _ in range(a.context)], params,
                                      lambda out, i=i: on_output(out, i)) for i in range(batch)]
            # Prefill every prompt (each has its first token), then warm up: new shapes compile
            # Triton kernels or pick cuBLAS ones here, not in the timed steps.
            while len(started) < batch:
                step()
            for _ in range(a.warmup):
                step()
            forward_ms.clear()
            step_ms = [step() for _ in range(a.steps)]
            row: dict[str, Any] = {"step_ms_p50": statistics.median(step_ms),
                                   "forward_ms_p50": statistics.median(forward_ms)}
            row["host_ms_p50"] = row["step_ms_p50"] - row["forward_ms_p50"]
            if not graphs or not cuda:
                row["profile"] = profile_steps(step, cuda, a.profile_steps)
            rows[str(batch)] = row
            print(f"{'graphs' if graphs and cuda else 'eager':6s} batch {batch:3d}: step p50 {row['step_ms_p50']:7.2f} ms, "
                  f"forward {row['forward_ms_p50']:7.2f} ms, the rest {row['host_ms_p50']:6.2f} ms", flush=True)
            if "profile" in row:
                print(row["profile"]["table"], flush=True)
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
    finally:
        engine.shutdown()
    return rows


def profile_steps(step: Any, cuda: bool, n: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall = [step() for _ in range(n)]
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    # Kernels have device time and no CPU time of their own; on the CPU, operators by own time.
    total_us = sum(getattr(e, key) for e in events)
    return {"steps": n, "wall_ms_per_step": statistics.fmean(wall),
            "own_time_ms_per_step": total_us / 1e3 / n,
            "table": events.table(sort_by=key, row_limit=15, max_name_column_width=60)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model-path", type=Path, default=Path("models/demo"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=5, help="eager decode steps profiled per batch size")
    ap.add_argument("--kv-cache-memory-mb", type=int, default=4096)
    ap.add_argument("--splits", nargs="+", default=None,
                    help="LLM_DECODE_SPLITS values to compare (the Triton kernel's splits per context; default "
                         "1 and auto on CUDA, 1 elsewhere)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.splits = a.splits or (["1", "auto"] if a.device.startswith("cuda") else ["1"])
    cuda = a.device.startswith("cuda")
    results: dict[str, Any] = {"device": a.device, "model": str(a.model_path), "context": a.context,
                               "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                               "runs": {}}
    for splits in a.splits:
        # Read by the model runner when the engine is built (the decode graphs capture it).
        os.environ["LLM_DECODE_SPLITS"] = splits
        for graphs in ([True, False] if cuda else [False]):
            print(f"-- {'decode graphs' if graphs else 'eager'}, LLM_DECODE_SPLITS={splits}", flush=True)
            results["runs"][f"{'graphs' if graphs else 'eager'}_splits_{splits}"] = probe(a, graphs)
            if cuda:
                torch.cuda.empty_cache()
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

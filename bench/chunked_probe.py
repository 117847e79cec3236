"""Where a chunked-prefill step's time goes: running decodes with a long prompt arriving.

    python -m bench.chunked_probe [--device cuda] [--model-path models/demo] [--caps 128 256 512]
        [--context-units 0 4096] [--json out.json]

The engine is stepped by hand (no loop thread): `--streams` sequences decode, then a
`--long-prompt-len` prompt arrives and is prefilled in chunks of at most each cap
(max_prefill_tokens_while_decoding) while they keep decoding. Per cap: the decode-only step
before it arrives, every step that carried a chunk (wall time, with the device synchronized,
and the model's forward pass alone), and their ratio, which is what the decoding streams'
inter-token latency grows by (serving_bench's `chunked` section measures that ratio through the
engine's loop). With --context-units every cap runs once per prefill_context_unit (0: every
prefill token counts 1 against the cap; U: a token at context c counts 1 + c / U), and each
chunk step's tokens and context start are kept, so a fit of the step's time to them says what
a step, a prefill token and a key read cost on this device: what a unit buys in step time, and
costs in chunks, follows from those. With --profile, the chunk-carrying steps of the last run
are profiled (cProfile, top functions by own time): on a GPU the demo model's steps are host time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
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
    ap.add_argument("--caps", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-prompt-len", type=int, default=3072)
    ap.add_argument("--decode-steps", type=int, default=30, help="decode-only steps timed before the prompt")
    ap.add_argument("--flat-prefill-tokens", type=int, default=0,
                    help="EngineConfig.flat_prefill_tokens: steps of at most this many tokens run as decode steps "
                         "(on CUDA from the decode graphs); 0 off")
    ap.add_argument("--context-units", type=int, nargs="+", default=None,
                    help="EngineConfig.prefill_context_unit values to run each cap with (default: the device's)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    engine = LLMEngine(EngineConfig(model_path=a.model_path, device=a.device, enable_prefix_caching=False,
                                    kv_cache_memory_mb=2048, flat_prefill_tokens=a.flat_prefill_tokens))
    rng = random.Random(0)
    vocab = engine.vocab_size
    stepped = HandStepped(engine)
    cuda = stepped.cuda
    forward_ms = stepped.forward_ms
    step = stepped.step

    decode = SamplingParams(max_new_tokens=2048, temperature=0.0, ignore_eos=True)
    results: dict[str, Any] = {"device": a.device, "model": str(a.model_path), "streams": a.streams,
                               "flat_prefill_tokens": a.flat_prefill_tokens,
                               # LLM_QUERY_TILE: a flat chunk's rows scored in tiles of this many (1: per row)
                               "query_tile": engine.model.query_tile,
                               "long_prompt_len": a.long_prompt_len,
                               "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                               "caps": {}}
    profile_text = None
    units = a.context_units or [engine.scheduler.prefill_context_unit]
    runs = [(cap, unit) for cap in a.caps for unit in units]
    for round_, (cap, unit) in enumerate(runs[:1] + runs):  # the first round warms up and is dropped
        engine.scheduler.max_prefill_tokens_while_decoding = cap
        engine.scheduler.prefill_context_unit = unit
        ids = [engine.add_request([rng.randrange(10, vocab - 10) for _ in range(32)], decode, lambda out: None)
               for _ in range(a.streams)]
        for _ in range(10):
            step()
        decode_ms = [step() for _ in range(a.decode_steps)]
        done: list[bool] = []
        long_id = engine.add_request([rng.randrange(10, vocab - 10) for _ in range(a.long_prompt_len)],
                                     SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
                                     lambda out: done.append(True) if out.finished else None)

        def computed() -> int:  # the long prompt's tokens in the cache (all of it once it has left)
            queue = [*engine.scheduler.running, *engine.scheduler.waiting]
            return next((q.num_computed_tokens for q in queue if q.request_id == long_id), a.long_prompt_len if done else 0)

        prof = cProfile.Profile() if a.profile and (cap, unit) == runs[-1] and round_ > 0 else None
        mixed_ms, mixed_forward, chunks = [], [], []
        while not done:
            forward_ms.clear()
            start = computed()
            if prof is not None:
                prof.enable()
            mixed_ms.append(step())
            if prof is not None:
                prof.disable()
            mixed_forward.extend(forward_ms)
            chunks.append((start, computed() - start))
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        if round_ == 0:
            continue
        row = {"context_unit": unit, "decode_step_ms_p50": statistics.median(decode_ms), "mixed_steps": len(mixed_ms),
               "mixed_step_ms": mixed_ms, "mixed_forward_ms": mixed_forward,
               "chunk_start": [c[0] for c in chunks], "chunk_tokens": [c[1] for c in chunks],
               "mixed_step_ms_p50": statistics.median(mixed_ms), "mixed_step_ms_max": max(mixed_ms)}
        row["mixed_over_decode_p50"] = row["mixed_step_ms_p50"] / row["decode_step_ms_p50"]
        row["mixed_over_decode_max"] = row["mixed_step_ms_max"] / row["decode_step_ms_p50"]
        results["caps"][str(cap) if len(units) == 1 else f"{cap} unit {unit}"] = row
        print(f"cap {cap:5d} unit {unit:5d}: decode step p50 {row['decode_step_ms_p50']:6.2f} ms; {len(mixed_ms)} chunk steps "
              f"p50 {row['mixed_step_ms_p50']:6.2f} max {row['mixed_step_ms_max']:6.2f} ms (forward p50 "
              f"{statistics.median(mixed_forward):6.2f} ms); over decode p50 {row['mixed_over_decode_p50']:.2f} "
              f"max {row['mixed_over_decode_max']:.2f}", flush=True)
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            profile_text = s.getvalue()
    # Only across units: without them the chunks differ only in context, and a free per-token
    # term fits noise (a negative cost a prefill token).
    fit = chunk_cost_fit(results["caps"].values()) if a.context_units and len(units) > 1 else None
    if fit is not None:
        results["chunk_cost_fit"] = fit
        print(f"chunk step ms ~ {fit['fixed_ms']:.3f} + {fit['per_token_us']:.2f} us a prefill token + "
              f"{fit['per_row_key_ns']:.3f} ns a token's key read (r2 {fit['r2']:.3f}; {fit['steps']} steps)", flush=True)
    if profile_text is not None:
        results["profile_last_run"] = profile_text
        print(profile_text[:4000], flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


def chunk_cost_fit(rows: Any) -> dict[str, float] | None:
    """Least squares over every chunk step of every run: ms = fixed + per_token * T + per_row_key * K,
    T the chunk's tokens, K the keys they read (each token reads its context up to itself:
    T * start + T * (T + 1) / 2). None when the runs do not tell the two costs apart (every chunk
    the same size at the same contexts)."""
    import numpy as np

    x, y = [], []
    for row in rows:
        for ms, start, tokens in zip(row["mixed_step_ms"], row["chunk_start"], row["chunk_tokens"]):
            if tokens > 0:
                x.append([1.0, tokens, tokens * start + tokens * (tokens + 1) / 2])
                y.append(ms)
    if len(y) < 4:
        return None
    xs, ys = np.asarray(x), np.asarray(y)
    if np.linalg.matrix_rank(xs) < 3:
        return None
    coef, *_ = np.linalg.lstsq(xs, ys, rcond=None)
    residual = ys - xs @ coef
    r2 = 1 - float(residual @ residual) / max(float(((ys - ys.mean()) ** 2).sum()), 1e-12)
    return {"fixed_ms": float(coef[0]), "per_token_us": 1e3 * float(coef[1]), "per_row_key_ns": 1e6 * float(coef[2]),
            "r2": r2, "steps": len(y)}


if __name__ == "__main__":
    main()

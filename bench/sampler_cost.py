"""What sampling costs the engine on the CPU: the C++ sampling ops against the torch reference, in one run.

    python -m bench.sampler_cost [--model-path models/demo] [--requests 64] [--rounds 3] [--json out.json]

The engine alone serves the serving benchmark's workload (64 requests, prompts of 16-512 tokens,
16-256 new tokens, all at once) three ways, in alternating order, ``--rounds`` times:

* ``native``: the model's own sampling defaults (generation_config.json: for the demo model
  temperature 0.7, top-k 20, top-p 0.8, repetition penalty 1.05), one seed per request, with
  the C++ sampling ops (kernels/csrc/sampling_cpu.cpp);
* ``reference``: the same requests with ``LLM_CPU_SAMPLING=0``: the torch reference ops;
* ``greedy``: temperature 0 with the same penalty, for scale.

It prints each way's tokens/s, the median ratios native / reference and native / greedy, and
whether native and reference drew the same tokens for every request (they must: the ops are
bit-exact with the reference, the same seed draws the same token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
from pathlib import Path
from typing import Any

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.tokenizer import load_tokenizer
from bench.serving_bench import closed_loop, engine_requester
from client.perf.make_inputs import mixed_workload, usable_vocab

REPO_ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, default=REPO_ROOT / "models" / "demo")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    tokenizer = load_tokenizer(args.model_path)
    prompts, news = mixed_workload(args.requests, usable_vocab(tokenizer), seed=args.seed)
    # Prefix caching off: every way must prefill the same prompts.
    engine = LLMEngine(EngineConfig(model_path=args.model_path, device="cpu", enable_prefix_caching=False))
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()

    def sampling(greedy: bool):
        def params(i: int) -> dict[str, Any]:
            p: dict[str, Any] = {"max_new_tokens": news[i], "ignore_eos": True, "seed": 1000 + i}
            if greedy:
                p["temperature"] = 0.0
            return p

        return params

    async def run(way: str) -> tuple[float, list[list[int]]]:
        os.environ["LLM_CPU_SAMPLING"] = "0" if way == "reference" else "1"
        request = engine_requester(engine, prompts, sampling(way == "greedy"))
        recs, wall = await closed_loop(request, list(range(len(prompts))), len(prompts))
        bad = [r.error for r in recs if r.error]
        if bad:
            raise SystemExit(f"{way}: {len(bad)} requests failed: {bad[0]}")
        return sum(r.tokens for r in recs) / wall, [r.ids for r in recs]

    ways = ["native", "reference", "greedy"]
    tput: dict[str, list[float]] = {w: [] for w in ways}
    ids: dict[str, list[list[int]]] = {}
    try:
        asyncio.run(run("native"))  # warm-up
        for r in range(args.rounds):
            order = ways if r % 2 == 0 else ways[::-1]
            for way in order:
                t, out = asyncio.run(run(way))
                tput[way].append(t)
                ids.setdefault(way, out)
            print(f"round {r + 1}: " + ", ".join(f"{w} {tput[w][-1]:.0f}" for w in ways) + " tok/s", flush=True)
    finally:
        os.environ.pop("LLM_CPU_SAMPLING", None)
        engine.shutdown()

    ratio = lambda a, b: statistics.median(x / y for x, y in zip(tput[a], tput[b]))  # noqa: E731
    same = ids["native"] == ids["reference"]
    result = {
        "model": str(args.model_path), "requests": args.requests, "rounds": args.rounds,
        "tok_per_s": tput, "native_vs_reference": ratio("native", "reference"),
        "native_vs_greedy": ratio("native", "greedy"), "native_equals_reference": same,
    }
    print(f"native / reference: {result['native_vs_reference']:.2f}   native / greedy: {result['native_vs_greedy']:.2f}   "
          f"same tokens as the reference: {same}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not same:
        raise SystemExit("the C++ sampler drew different tokens from the reference")


if __name__ == "__main__":
    main()

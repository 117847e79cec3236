"""What a narrower KV cache buys (kv_cache_dtype), in one run: the engine alone, float32 cache vs
bfloat16 and fp8 (or any of float16, fp8_e5m2), on the serving benchmark's workload, at the same
cache memory.

    python -m bench.kv_cache_dtype [--model-path models/demo] [--memory-mb 8 1024] [--rounds 3]
        [--dtypes float32 bfloat16 fp8 float16 fp8_e5m2] [--attention] [--json out.json]

For each memory budget, every dtype serves the 64 mixed requests (prompts of 16-512 tokens,
16-256 new tokens, greedy, all at once) in alternating order, ``--rounds`` times. Printed per
dtype: the pool's size in tokens, tokens/s, preemptions and the prompt tokens computed (more
than the prompts' total when preempted sequences are computed again); then each dtype's median
throughput ratio to float32 and the share of requests whose tokens equal float32's (the
rounded cache may move a greedy choice). A tight budget is where the narrow cache pays: two or
four times the tokens fit, so fewer sequences are preempted and recomputed. With room to spare it only
changes what decode attention reads (``--attention`` times that kernel alone).
"""

from __future__ import annotations

import argparse
import asyncio
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
from backend.tokenizer import load_tokenizer
from bench.serving_bench import closed_loop, engine_requester
from client.perf.make_inputs import mixed_workload, usable_vocab

REPO_ROOT = Path(__file__).resolve().parents[1]


def serve(args, dtype: str, memory_mb: int, prompts, news) -> list[dict[str, Any]]:
    engine = LLMEngine(EngineConfig(model_path=args.model_path, device=args.device, enable_prefix_caching=False,
                                    kv_cache_dtype=dtype, kv_cache_memory_mb=memory_mb,
                                    max_model_len=args.max_model_len))
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()

    def sampling(i: int) -> dict[str, Any]:
        return {"max_new_tokens": news[i], "ignore_eos": True, "temperature": 0.0}

    async def once():
        recs, wall = await closed_loop(engine_requester(engine, prompts, sampling), list(range(len(prompts))),
                                       len(prompts))
        return recs, wall

    runs = []
    try:
        asyncio.run(once())  # warm-up
        for _ in range(args.repeats):
            before = engine.stats()
            recs, wall = asyncio.run(once())
            after = engine.stats()
            bad = [r.error for r in recs if r.error]
            if bad:
                raise SystemExit(f"{dtype}: {len(bad)} requests failed: {bad[0]}")
            runs.append({
                "tok_per_s": sum(r.tokens for r in recs) / wall,
                "preemptions": after.num_preemptions - before.num_preemptions,
                "prompt_tokens_computed": after.prompt_tokens_total - before.prompt_tokens_total,
                "pool_tokens": after.num_kv_blocks * engine.config.block_size,
                "ids": [r.ids for r in recs],
            })
    finally:
        engine.shutdown()
    return runs


def attention_times(dtypes: list[str], threads: int, seed: int = 0) -> dict[str, float]:
    """ms per call of the C++ decode-attention kernel: 64 sequences of 16-768 tokens, the demo
    model's heads (4 query, 2 KV, 32 dims), four layers' caches in turn as in a step."""
    from kernels import cpu_attention

    if cpu_attention.load() is None:
        return {}
    torch.set_num_threads(threads)
    rng = random.Random(seed)
    B, H, kvh, D, bs, layers = 64, 4, 2, 32, 16, 4
    lens = [rng.randint(16, 768) for _ in range(B)]
    blocks = sum(-(-n // bs) for n in lens)
    perm = torch.randperm(blocks * layers, generator=torch.Generator().manual_seed(seed))
    tables = torch.zeros(B, -(-max(lens) // bs), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        k = -(-n // bs)
        tables[b, :k] = perm[used : used + k].to(torch.int32)
        used += k
    lens_t = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(B, H, D)
    times: dict[str, list[float]] = {d: [] for d in dtypes}
    torch_dtype = {d: EngineConfig(model_path=REPO_ROOT, kv_cache_dtype=d).kv_torch_dtype() for d in dtypes}
    caches = {d: [(torch.randn(kvh, blocks * layers * bs, D).to(torch_dtype[d]),
                   torch.randn(kvh, blocks * layers * bs, D).to(torch_dtype[d])) for _ in range(layers)]
              for d in dtypes}
    for _ in range(3):
        for d in dtypes:
            for k, v in caches[d]:
                cpu_attention.paged_decode_attention(q, k, v, tables, lens_t, bs, 0.17)
            n = 50
            t0 = time.perf_counter()
            for _ in range(n):
                for k, v in caches[d]:
                    cpu_attention.paged_decode_attention(q, k, v, tables, lens_t, bs, 0.17)
            times[d].append((time.perf_counter() - t0) / (n * layers) * 1e3)
    return {d: statistics.median(t) for d, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, default=REPO_ROOT / "models" / "demo")
    ap.add_argument("--memory-mb", type=int, nargs="+", default=[8, 1024])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "fp8"])
    ap.add_argument("--baseline", default="float32", help="the dtype the others are compared with (bfloat16 for "
                    "a bf16 model on a GPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-model-len", type=int, default=None, help="needed where a tight pool cannot hold the "
                    "model's whole context (the workload's sequences stay under 800 tokens)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per engine (after one warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention", action="store_true", help="also time the decode-attention kernel alone")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    base = args.baseline
    if base in args.dtypes:
        args.dtypes.remove(base)
    args.dtypes.insert(0, base)

    tokenizer = load_tokenizer(args.model_path)
    prompts, news = mixed_workload(args.requests, usable_vocab(tokenizer), seed=args.seed)
    result: dict[str, Any] = {"model": str(args.model_path), "device": args.device, "requests": args.requests,
                              "rounds": args.rounds, "baseline": base,
                              "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(news), "budgets": {}}
    for mb in args.memory_mb:
        runs: dict[str, list[dict[str, Any]]] = {d: [] for d in args.dtypes}
        for r in range(args.rounds):
            order = args.dtypes if r % 2 == 0 else args.dtypes[::-1]
            for d in order:
                runs[d].extend(serve(args, d, mb, prompts, news))
            print(f"{mb} MB, round {r + 1}: " + ", ".join(f"{d} {runs[d][-1]['tok_per_s']:.0f}" for d in args.dtypes)
                  + " tok/s", flush=True)
        base_ids = runs[base][0]["ids"]
        summary = {}
        for d in args.dtypes:
            ratios = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(runs[d], runs[base])]
            same = sum(a == b for a, b in zip(runs[d][0]["ids"], base_ids)) / len(base_ids)
            summary[d] = {
                "pool_tokens": runs[d][0]["pool_tokens"],
                "tok_per_s": [round(x["tok_per_s"], 1) for x in runs[d]],
                "preemptions": [x["preemptions"] for x in runs[d]],
                "prompt_tokens_computed": [x["prompt_tokens_computed"] for x in runs[d]],
                f"vs_{base}": statistics.median(ratios),
                f"same_tokens_as_{base}": same,
            }
            print(f"  {d:9s} pool {summary[d]['pool_tokens']:7d} tokens  tok/s {summary[d]['tok_per_s']}  "
                  f"preemptions {summary[d]['preemptions']}  prompt tokens computed {summary[d]['prompt_tokens_computed']}"
                  f" (prompts: {result['prompt_tokens']})  vs {base} {summary[d][f'vs_{base}']:.2f}  "
                  f"requests with {base}'s tokens {same:.0%}", flush=True)
        result["budgets"][str(mb)] = summary
        if args.json:  # after each budget, so a run cut short keeps what it measured
            args.json.write_text(json.dumps(result, indent=2))
    if args.attention and args.device == "cpu":
        result["attention_ms"] = {}
        for threads in (1, 2):
            ms = attention_times(args.dtypes, threads)
            result["attention_ms"][threads] = ms
            print(f"decode attention, {threads} thread(s): " + "  ".join(f"{d} {v:.3f} ms" for d, v in ms.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

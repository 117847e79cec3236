"""What serving LoRA adapters costs: the same requests on the base model and under adapters, in one run.

    python -m bench.lora_overhead [--model-path models/demo] [--requests 64] [--adapters 1 4]
                                  [--rank 16] [--repeats 3] [--device cpu] [--json out.json]

One engine loads ``max(--adapters)`` random PEFT adapters (every projection, rank ``--rank``).
The same greedy requests (random prompts of 16-256 tokens, 64 new tokens each) then run three
ways, in alternating order, ``--repeats`` times:

* ``base``: no adapter;
* ``one``: every request under the same adapter;
* ``mixed``: requests spread round-robin over the adapters, plus base requests (a multi-LoRA
  batch, what a shared server sees).

It prints each way's tokens/s and the median ratio against ``base``. The adapters' deltas are
added to their rows after each base matmul (backend/lora.py), so the overhead is two thin
matmuls per targeted projection and adapter in the batch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from backend.config import EngineConfig
from backend.engine import LLMEngine

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(model_path: Path, out: Path, rank: int, seed: int) -> None:
    cfg = json.loads((model_path / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * hd, hidden), "k_proj": (kv * hd, hidden), "v_proj": (kv * hd, hidden),
              "o_proj": (hidden, heads * hd), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (o, i) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(MODULES)}))


def run(engine: LLMEngine, prompts: list[list[int]], loras: list) -> float:
    params = [engine.parse_params({"temperature": 0, "max_new_tokens": 64, "ignore_eos": True,
                                   **({"lora_path": name} if name else {})}) for name in loras]
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    bad = [o.error for o in outs if o.error]
    if bad:
        raise SystemExit(f"a request failed: {bad[0]}")
    return sum(len(o.new_token_ids) for o in outs) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="models/demo")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4], help="adapters in the mixed runs")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model_path = Path(args.model_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(rng.randint(16, 256))] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(max(args.adapters))]
        for i, name in enumerate(names):
            write_adapter(model_path, Path(tmp) / name, args.rank, seed=i)
        engine = LLMEngine(EngineConfig(model_path=model_path, device=args.device, enable_prefix_caching=False,
                                        lora_modules={n: str(Path(tmp) / n) for n in names}))
        try:
            ways = {"base": [None] * len(prompts), "one": [names[0]] * len(prompts)}
            for k in args.adapters:
                # k adapters and base requests, round-robin (a shared server's mix)
                ways[f"mixed{k}"] = [([None] + names[:k])[i % (k + 1)] for i in range(len(prompts))]
            run(engine, prompts[:8], ways["one"][:8])  # warm-up
            rates: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(args.repeats):
                order = list(ways) if r % 2 == 0 else list(reversed(ways))
                for w in order:
                    rates[w].append(run(engine, prompts, ways[w]))
                    print(f"round {r}: {w:>8} {rates[w][-1]:8.1f} tok/s", flush=True)
        finally:
            engine.shutdown()
    result = {"device": args.device, "rank": args.rank, "requests": args.requests,
              "tok_per_s": {w: statistics.median(v) for w, v in rates.items()},
              "vs_base": {w: statistics.median(a / b for a, b in zip(v, rates["base"])) for w, v in rates.items()
                          if w != "base"}}
    for w, ratio in result["vs_base"].items():
        print(f"{w:>8} / base: {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Speculative decoding (n-gram, draft model) against decoding one token a step, on the same
requests, in one run.

    python -m bench.spec_decode [--model-path models/demo] [--batch 1 8] [--repeats 3]
                                [--workloads demo repeating json layerskip] [--device cpu] [--json out.json]

Two engines on the same model, one with `speculative_config`, serve the same requests (greedy,
`ignore_eos`, no penalties, so every request speculates) in alternating order, `--repeats` times,
at each `--batch` (requests served together; 1 is one at a time). The outputs must be equal token
for token. Reported per setting: output tok/s of each, the median over the repeats of (time
without) / (time with), the draft tokens accepted, the tokens each verifying step yields, and a
step's mean time without and with drafts and how much of the latter went on drafting.

What speculation gains depends on how often a sequence repeats itself, so two models run:

* `demo` — the demo model on random-token prompts. Its random weights rarely repeat a phrase,
  so few drafts exist and fewer hold: this is what speculation costs when it does not help.
* `repeating` — the demo model with its final norm zeroed (every logit 0, so greedy repeats one
  token): every draft holds. Same shapes, same cost per step: the ceiling, where a step yields
  num_speculative_tokens + 1 tokens.
* `json` — the demo model writing a JSON array of six objects under a schema (structured
  output, one space at most between tokens): the keys and punctuation the grammar forces repeat
  from object to object, whatever the weights, so drafts of them hold.

Real workloads that quote their input (code edits, RAG answers, summaries) land between the two,
by their acceptance rate.

* `layerskip` — the draft-model method: a random 38M-parameter Qwen2 target (hidden 512, 12
  layers, `bench.make_random_model`) drafted by its own first layer (the same embeddings, final
  norm and head: LayerSkip's self-speculation, built as a model directory of its own). How often
  such an early exit agrees with the whole stack is a property of the weights; on this random
  model it is about 70%.
* `layerskip_sampled` — the same, sampling at temperature 0.8 with top-k 40 and a seed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from backend.config import EngineConfig
from backend.engine import LLMEngine

CONFIGS = {
    # vLLM's defaults for the method: 5-grams only.
    "ngram_k5_n5": {"method": "ngram", "num_speculative_tokens": 5},
    # Shorter n-grams match more often (and more wrongly).
    "ngram_k4_n3-1": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    # 4- to 2-grams: JSON keys and punctuation repeat in runs of a few tokens.
    "ngram_k5_n4-2": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}
SAMPLING = {"temperature": 0.0, "repetition_penalty": 1.0, "ignore_eos": True}
ITEMS = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "label": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"}},
         "required": ["id", "label", "ok"], "additionalProperties": False}
# Sampled (the same seed for every request): draft tokens are drawn as the target draws them,
# with the same noise, so they hold as often as the two models' distributions agree.
SAMPLED = {"temperature": 0.8, "top_k": 40, "seed": 1, "repetition_penalty": 1.0, "ignore_eos": True}
JSON_SAMPLING = {"temperature": 0.0, "repetition_penalty": 1.0, "whitespace_pattern": "[ ]?",
                 "json_schema": json.dumps({"type": "array", "minItems": 6, "maxItems": 6, "items": ITEMS})}


def repeating_model(src: Path, out: Path) -> Path:
    """A copy of `src` with its final norm zeroed: every logit 0, greedy repeats token 0."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    weights = out / "model.safetensors"
    raw = load_file(str(weights))
    raw["model.norm.weight"] = torch.zeros_like(raw["model.norm.weight"])
    save_file(raw, str(weights))
    return out


def first_layers(src: Path, out: Path, layers: int) -> Path:
    """`src` with only its first `layers` decoder layers: a draft model of the same vocabulary
    (the embeddings, final norm and head are `src`'s)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    raw = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in raw.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers},
              str(out / "model.safetensors"))
    return out


def layerskip_pair(tokenizer_from: Path, out: Path) -> tuple[Path, dict]:
    """The `layerskip` workload's target and its speculative_config."""
    target = out / "target"
    subprocess.run([sys.executable, "-m", "bench.make_random_model", "--out", str(target), "--tokenizer-from",
                    str(tokenizer_from), "--hidden", "512", "--layers", "12", "--heads", "8", "--kv-heads", "2",
                    "--intermediate", "1536", "--max-position", "4096"], check=True, capture_output=True)
    draft = first_layers(target, out / "draft", layers=1)
    return target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}


def serve(engine: LLMEngine, prompts: list[list[int]], batch: int, max_new: int,
          sampling: Optional[dict] = None) -> dict[str, Any]:
    params = engine.parse_params({**(sampling or SAMPLING), "max_new_tokens": max_new})
    before = engine.stats()
    outs = []
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i : i + batch], params)
    elapsed = time.perf_counter() - t
    after = engine.stats()
    steps = after.num_steps - before.num_steps
    tokens = sum(len(o.new_token_ids) for o in outs)
    drafts = after.spec_draft_tokens_total - before.spec_draft_tokens_total
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    return {"seconds": elapsed, "tokens": tokens, "tok_s": tokens / elapsed, "steps": steps, "draft_tokens": drafts,
            "accepted_tokens": accepted, "ids": [o.new_token_ids for o in outs]}


def compare(model: Path, spec: dict, prompts: list[list[int]], batch: int, max_new: int, repeats: int,
            device: str, sampling: Optional[dict] = None) -> dict[str, Any]:
    def engine(speculative: Optional[dict]) -> LLMEngine:
        return LLMEngine(EngineConfig(model_path=model, device=device, num_kv_blocks=1024, max_model_len=2048,
                                      enable_prefix_caching=False, speculative_config=speculative))

    plain, spec_engine = engine(None), engine(spec)
    # Time spent drafting (the proposer's passes and draws; on a GPU each ends in a host sync, so
    # this is its wall time), apart from the verifying steps around it.
    drafting = [0.0]
    propose = spec_engine._propose

    def timed_propose() -> None:
        t = time.perf_counter()
        propose()
        drafting[0] += time.perf_counter() - t

    spec_engine._propose = timed_propose
    try:
        # Warm-up (allocator, grammar compile, and on a GPU the Triton kernels' compiles for this
        # batch's shapes, verifying steps included): a batch of the prompts, 24 tokens each.
        serve(plain, prompts[:batch], batch, 24, sampling)
        serve(spec_engine, prompts[:batch], batch, 24, sampling)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(repeats):
            order = [("off", plain), ("on", spec_engine)] if r % 2 == 0 else [("on", spec_engine), ("off", plain)]
            for name, eng in order:
                drafting[0] = 0.0
                runs[name].append(serve(eng, prompts, batch, max_new, sampling))
                runs[name][-1]["drafting_s"] = drafting[0] if name == "on" else 0.0
    finally:
        plain.shutdown()
        spec_engine.shutdown()
    equal = all(a["ids"] == runs["off"][0]["ids"] for a in runs["off"] + runs["on"])
    on = runs["on"][-1]
    verify_steps = on["steps"]
    return {
        "batch": batch,
        "outputs_equal": equal,
        "tok_s_off": [round(x["tok_s"]) for x in runs["off"]],
        "tok_s_on": [round(x["tok_s"]) for x in runs["on"]],
        "speedup": statistics.median(off["seconds"] / on["seconds"] for off, on in zip(runs["off"], runs["on"])),
        "steps_off": runs["off"][-1]["steps"],
        "steps_on": verify_steps,
        "draft_tokens": on["draft_tokens"],
        "accepted_tokens": on["accepted_tokens"],
        "acceptance_rate": on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else 0.0,
        # Of the last run with drafts: its steps' mean time, and the part of it spent drafting.
        "step_ms_on": 1e3 * on["seconds"] / on["steps"],
        "drafting_ms_per_step": 1e3 * on["drafting_s"] / on["steps"],
        "step_ms_off": 1e3 * runs["off"][-1]["seconds"] / runs["off"][-1]["steps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, default=Path("models/demo"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                    help="the n-gram configurations the demo, repeating and json workloads run")
    ap.add_argument("--workloads", nargs="+", default=["demo", "repeating", "json", "layerskip", "layerskip_sampled"],
                    choices=["demo", "repeating", "json", "layerskip", "layerskip_sampled"])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(16, 256))] for _ in range(a.num_prompts)]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        from backend.tokenizer import load_tokenizer

        tok = load_tokenizer(a.model_path)
        json_prompts = [tok(f"Record {i}: list the items as JSON.").input_ids for i in range(a.num_prompts)]
        ngram = [(name, CONFIGS[name]) for name in a.configs]
        pair: list = []  # the layerskip target and its speculative_config, made once

        def workload(name: str) -> tuple[Path, list[list[int]], Optional[dict], int, list[tuple[str, dict]]]:
            if name == "repeating":
                return repeating_model(a.model_path, Path(tmp) / "repeating"), prompts, None, a.max_new, ngram
            if name == "json":
                return a.model_path, json_prompts, JSON_SAMPLING, 400, ngram
            if name in ("layerskip", "layerskip_sampled"):
                if not pair:
                    pair.extend(layerskip_pair(a.model_path, Path(tmp) / "layerskip"))
                sampling = SAMPLED if name == "layerskip_sampled" else None
                return pair[0], prompts, sampling, a.max_new, [("draft_first_layer_k4", pair[1])]
            return a.model_path, prompts, None, a.max_new, ngram

        for model_name in a.workloads:
            path, workload_prompts, sampling, max_new, configs = workload(model_name)
            for config, spec in configs:
                for batch in a.batch:
                    res = {"model": model_name, "config": config, **compare(path, spec, workload_prompts,
                                                                             batch, max_new, a.repeats, a.device,
                                                                             sampling)}
                    results.append(res)
                    print(f"{model_name:9s} {config:14s} batch {batch:3d}: speculation {res['speedup']:.2f}x "
                          f"(tok/s off {res['tok_s_off']} on {res['tok_s_on']}), steps {res['steps_off']} -> "
                          f"{res['steps_on']}, drafts accepted {res['accepted_tokens']}/{res['draft_tokens']} "
                          f"({100 * res['acceptance_rate']:.0f}%), step {res['step_ms_off']:.2f} -> {res['step_ms_on']:.2f} ms "
                          f"({res['drafting_ms_per_step']:.2f} drafting), outputs equal: {res['outputs_equal']}", flush=True)
    if a.json:  # written before the verdict: a changed output is the evidence to keep
        a.json.write_text(json.dumps({"device": a.device, "max_new": a.max_new, "prompts": a.num_prompts,
                                      "results": results}, indent=1))
    if not all(r["outputs_equal"] for r in results):
        raise SystemExit("speculation changed an output")


if __name__ == "__main__":
    main()

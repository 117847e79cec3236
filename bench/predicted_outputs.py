"""Predicted Outputs (OpenAI's `prediction`) against decoding without one, on the same requests,
in one run.

    python -m bench.predicted_outputs [--model-path models/demo] [--batch 1 8] [--repeats 3]
                                      [--draft-tokens 8] [--device cpu] [--json out.json]

One engine serves the same requests (greedy, `ignore_eos`) without a prediction and with each
kind of prediction, in alternating order, `--repeats` times, at each `--batch` (requests served
together; 1 is one at a time). The outputs must be equal token for token. The predictions are
made from the outputs of a first run, as a client that knows most of the answer makes them:

* `exact` — the output itself: the ceiling, where every draft holds;
* `edited` — the output with an edit every 32 tokens on average (3-6 tokens substituted,
  deleted or inserted), as a file returned with changes;
* `half` — the output's first half, then unrelated tokens: a rewrite of the second half;
* `unrelated` — random tokens: what a useless prediction costs.

They go as token ids: the demo model's random outputs are rarely the tokenizer's own spelling
of their text, which a trained model's are (`prediction` as text is tokenized by the engine).
Reported per kind: tok/s without and with, the median over the repeats of (time without) /
(time with), steps, and the prediction tokens accepted and rejected (OpenAI's usage counts).
`--draft-tokens` sets the drafts' length (the engine's default is
backend/predicted_outputs.DEFAULT_DRAFT_TOKENS, or the server's num_speculative_tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine

SAMPLING = {"temperature": 0.0, "repetition_penalty": 1.0, "ignore_eos": True}


def edited(ids: list[int], rng: random.Random, every: int = 32) -> list[int]:
    out = list(ids)
    for _ in range(max(1, len(ids) // every)):
        i, size, kind = rng.randrange(len(out)), rng.randint(3, 6), rng.randrange(3)
        if kind == 0:
            out[i : i + size] = [rng.randrange(100, 4000) for _ in range(size)]
        elif kind == 1:
            del out[i : i + size]
        else:
            out[i:i] = [rng.randrange(100, 4000) for _ in range(size)]
    return out


def predictions(outputs: list[list[int]], seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    return {
        "exact": outputs,
        "edited": [edited(ids, rng) for ids in outputs],
        "half": [ids[: len(ids) // 2] + [rng.randrange(100, 4000) for _ in range(len(ids) - len(ids) // 2)]
                 for ids in outputs],
        "unrelated": [[rng.randrange(100, 4000) for _ in ids] for ids in outputs],
    }


def serve(engine: LLMEngine, prompts: list[list[int]], batch: int, max_new: int,
          preds: Optional[list[list[int]]]) -> dict[str, Any]:
    raw = {**SAMPLING, "max_new_tokens": max_new}
    params = [engine.parse_params(raw if preds is None else {**raw, "prediction": p})
              for p in (preds or [None] * len(prompts))]
    before = engine.stats()
    outs = []
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i : i + batch], params[i : i + batch])
    elapsed = time.perf_counter() - t
    tokens = sum(len(o.new_token_ids) for o in outs)
    return {"seconds": elapsed, "tok_s": tokens / elapsed, "steps": engine.stats().num_steps - before.num_steps,
            "accepted": sum(o.accepted_prediction_tokens or 0 for o in outs),
            "rejected": sum(o.rejected_prediction_tokens or 0 for o in outs),
            # the drafts' own counts (SGLang's spec_* meta): tokens verified, and kept
            "drafted": sum((o.spec or {}).get("spec_draft_token_num", 0) for o in outs),
            "kept": sum((o.spec or {}).get("spec_accept_token_num", 0) for o in outs),
            "ids": [o.new_token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, default=Path("models/demo"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, nargs="+", default=[8])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randint(16, 256))] for _ in range(a.num_prompts)]
    engine = LLMEngine(EngineConfig(model_path=a.model_path, device=a.device, num_kv_blocks=1024, max_model_len=2048,
                                    enable_prefix_caching=False))
    results: list[dict[str, Any]] = []
    try:
        # Warm-up, verifying steps included (a prediction of the output's start): on a GPU the
        # Triton kernels compile for each batch's shapes on first use.
        for batch in a.batch:
            start = serve(engine, prompts[:batch], batch, 24, None)["ids"]
            serve(engine, prompts[:batch], batch, 24, start)
        reference = serve(engine, prompts, max(a.batch), a.max_new, None)["ids"]
        kinds = predictions(reference, seed=1)
        for k in a.draft_tokens:
            engine.predictions.k = k
            for batch in a.batch:
                for kind, preds in kinds.items():
                    runs: dict[str, list[dict]] = {"off": [], "on": []}
                    for r in range(a.repeats):
                        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):
                            runs[name].append(serve(engine, prompts, batch, a.max_new, preds if name == "on" else None))
                    on = runs["on"][-1]
                    res = {
                        "kind": kind, "draft_tokens": k, "batch": batch,
                        "outputs_equal": all(x["ids"] == reference for x in runs["off"] + runs["on"]),
                        "tok_s_off": [round(x["tok_s"]) for x in runs["off"]],
                        "tok_s_on": [round(x["tok_s"]) for x in runs["on"]],
                        "speedup": statistics.median(x["seconds"] / y["seconds"] for x, y in zip(runs["off"], runs["on"])),
                        "steps_off": runs["off"][-1]["steps"], "steps_on": on["steps"],
                        "accepted_prediction_tokens": on["accepted"], "rejected_prediction_tokens": on["rejected"],
                        "draft_tokens_kept": on["kept"], "draft_tokens_thrown_away": on["drafted"] - on["kept"],
                    }
                    results.append(res)
                    print(f"{kind:9s} k={k:2d} batch {batch:3d}: {res['speedup']:.2f}x (tok/s without "
                          f"{res['tok_s_off']} with {res['tok_s_on']}), steps {res['steps_off']} -> {res['steps_on']}, "
                          f"prediction tokens accepted {on['accepted']} rejected {on['rejected']}, "
                          f"draft tokens kept {on['kept']} thrown away {on['drafted'] - on['kept']}, "
                          f"outputs equal: {res['outputs_equal']}", flush=True)
    finally:
        engine.shutdown()
    if a.json:  # written before the verdict: a changed output is the evidence to keep
        a.json.write_text(json.dumps({"device": a.device, "max_new": a.max_new, "prompts": a.num_prompts,
                                      "results": results}, indent=1))
    if not all(r["outputs_equal"] for r in results):
        raise SystemExit("a prediction changed an output")


if __name__ == "__main__":
    main()

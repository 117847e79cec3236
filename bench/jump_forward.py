"""Jump-forward decoding against token-by-token decoding, on the same constrained requests, in one run.

    python -m bench.jump_forward [--model-path models/demo] [--kind json_schema regex]
                                 [--batch 1 16] [--repeats 3] [--device cpu] [--json out.json]

Two engines on the same model, one with ``enable_jump_forward``, serve the same requests (same
prompts, seeds and sampling) in alternating order, ``--repeats`` times. The outputs are not the
same token for token (a forced span is tokenized by the tokenizer, not chosen by the model, and
what follows depends on it), so the figure is the time to finish every document of a batch, the
engine steps that took, and how many of the output tokens the grammar forced. Every output is
checked against its constraint. The reported ratio is the median over the repeats of
(time without) / (time with).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import jsonschema
import torch

from backend.config import EngineConfig
from backend.engine import LLMEngine
from bench.grammar_overhead import SAMPLING, SCHEMA

# A form with literal text between free fields (a regex), and the record schema of
# grammar_overhead (nested object, enums, patterns): keys, enum endings and the punctuation
# between them are forced, the values are the model's.
FORM = r"Name: [A-Z][a-z]{2,9}\. Role: (admin|user|guest)\. Score: [0-9]{1,3}/100\. Verdict: (pass|fail)\."
KINDS = {"regex": FORM, "json_schema": json.dumps(SCHEMA)}


def valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(FORM, text) is not None
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(engine: LLMEngine, kind: str, batch: int, max_new: int, seed0: int) -> dict:
    prompts = [engine.tokenizer(f"Record {i}: fill in the form.").input_ids for i in range(batch)]
    params = [engine.parse_params({**SAMPLING, "max_new_tokens": max_new, "seed": seed0 + i, kind: KINDS[kind]})
              for i in range(batch)]
    before = engine.stats()
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    after = engine.stats()
    for o in outs:
        if o.error or o.finish_reason != "stop":  # "length": the constrained text did not end in max_new tokens
            raise SystemExit(f"{kind}: an output ended with {o.error or o.finish_reason!r}, not at its grammar's "
                             f"end (raise --max-new): {o.text!r}")
        if not valid(kind, o.text):
            raise SystemExit(f"{kind}: an output does not satisfy its constraint: {o.text!r}")
    return {
        "seconds": elapsed,
        "steps": after.num_steps - before.num_steps,
        "tokens": sum(o.completion_tokens for o in outs),
        "forced_tokens": after.jump_forward_tokens_total - before.jump_forward_tokens_total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="models/demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kind", choices=sorted(KINDS), nargs="+", default=["regex", "json_schema"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()

    engines = {jf: LLMEngine(EngineConfig(model_path=args.model_path, device=args.device, enable_jump_forward=jf))
               for jf in (False, True)}
    for engine in engines.values():  # compile the grammars (cached from here on), warm every path
        for kind in args.kind:
            run(engine, kind, 2, args.max_new, 0)

    print(f"device={args.device} repeats={args.repeats} (medians; tokens and steps summed over the batch)")
    print(f"{'kind':>11} {'batch':>5} {'s off':>7} {'s on':>7} {'steps off':>9} {'steps on':>8} "
          f"{'tok off':>7} {'tok on':>7} {'forced':>6} {'off/on':>6}")
    figures = []
    for kind in args.kind:
        for batch in args.batch:
            runs: dict[bool, list[dict]] = {False: [], True: []}
            for r in range(args.repeats):
                order = (False, True) if r % 2 == 0 else (True, False)
                for jf in order:
                    runs[jf].append(run(engines[jf], kind, batch, args.max_new, 1000 * r))
            med = {jf: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for jf, rs in runs.items()}
            ratio = statistics.median(a["seconds"] / b["seconds"] for a, b in zip(runs[False], runs[True]))
            off, on = med[False], med[True]
            print(f"{kind:>11} {batch:>5} {off['seconds']:7.2f} {on['seconds']:7.2f} {off['steps']:9.0f} "
                  f"{on['steps']:8.0f} {off['tokens']:7.0f} {on['tokens']:7.0f} {on['forced_tokens']:6.0f} {ratio:6.2f}")
            figures.append({"kind": kind, "batch": batch, "off": runs[False], "on": runs[True],
                            "time_ratio_off_over_on": ratio})
    for engine in engines.values():
        engine.shutdown()
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "repeats": args.repeats, "figures": figures}, indent=2))


if __name__ == "__main__":
    main()

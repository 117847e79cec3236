"""Per-token cost of grammar-constrained decoding against unconstrained decoding, in one run.

    python -m bench.grammar_overhead [--model-path models/demo] [--batch 1 16] [--kind json_schema]
                                     [--repeats 3] [--device cpu] [--json out.json]

For each batch size: the constrained run first (temperature 1.0, a seed per request) records how
many tokens each request generated; the unconstrained run then generates exactly as many tokens
per request (same prompts, same sampling, EOS ignored), so both runs do the same model work and
differ only by the grammar: bitmask fill + apply before the draw, accept after it. The pair runs
``--repeats`` times (in alternating order); the best (minimum) per-token time of each side is
reported, the robust figure on a shared machine, with the median ratio beside it. Grammars are compiled (and cached) in a
warm-up, so compile time is not in the figures. The grammar's own CPU time (GrammarState
fill_bitmask and accept, timed around the calls) is reported too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from backend import grammar as grammar_mod
from backend.config import EngineConfig
from backend.engine import LLMEngine

# A schema with nested objects, arrays, enums, required fields and string patterns (as the tests).
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                "role": {"enum": ["admin", "user", "guest"]},
            },
            "required": ["name", "role"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
        "note": {"type": "string", "maxLength": 24},
    },
    "required": ["id", "status", "owner", "tags"],
    "additionalProperties": False,
}

SPECS = {
    "json_schema": json.dumps(SCHEMA),
    "regex": r"[A-Z]{2}-\d{3}( [a-z]{1,8}){1,12}",
    "ebnf": 'root ::= item ("," item){0,15}\nitem ::= "(" [a-z]{1,6} ":" [0-9]{1,4} ")"',
}

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}


class GrammarTimer:
    """Wraps GrammarState.fill_bitmask / accept to add up their wall time."""

    def __init__(self) -> None:
        self.fill_s = self.accept_s = 0.0
        self.fills = self.accepts = 0
        self._orig = (grammar_mod.GrammarState.fill_bitmask, grammar_mod.GrammarState.accept)

    def __enter__(self) -> "GrammarTimer":
        fill, accept = self._orig
        timer = self

        def timed_fill(state, bitmask, row):
            t = time.perf_counter()
            try:
                return fill(state, bitmask, row)
            finally:
                timer.fill_s += time.perf_counter() - t
                timer.fills += 1

        def timed_accept(state, token_id):
            t = time.perf_counter()
            try:
                return accept(state, token_id)
            finally:
                timer.accept_s += time.perf_counter() - t
                timer.accepts += 1

        grammar_mod.GrammarState.fill_bitmask, grammar_mod.GrammarState.accept = timed_fill, timed_accept
        return self

    def __exit__(self, *exc) -> None:
        grammar_mod.GrammarState.fill_bitmask, grammar_mod.GrammarState.accept = self._orig


def prompts_for(engine: LLMEngine, batch: int) -> list[list[int]]:
    return [engine.tokenizer(f"Request {i}: answer in the requested format.").input_ids for i in range(batch)]


def run_constrained(engine: LLMEngine, prompts, kind: str, spec: str, max_new: int, seed0: int):
    params = [engine.parse_params({**SAMPLING, "max_new_tokens": max_new, "seed": seed0 + i, kind: spec})
              for i in range(len(prompts))]
    with GrammarTimer() as timer:
        t = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t
    errors = [o.error for o in outs if o.error]
    if errors:
        raise SystemExit(f"constrained run failed: {errors[0]}")
    return elapsed, [o.completion_tokens for o in outs], [o.finish_reason for o in outs], timer


def run_unconstrained(engine: LLMEngine, prompts, lengths: list[int], seed0: int) -> float:
    params = [engine.parse_params({**SAMPLING, "max_new_tokens": n, "ignore_eos": True, "seed": seed0 + i})
              for i, n in enumerate(lengths)]
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t
    assert [o.completion_tokens for o in outs] == lengths
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="models/demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kind", choices=sorted(SPECS), default="json_schema")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model_path=args.model_path, device=args.device, max_num_seqs=256))
    spec = SPECS[args.kind]
    # Warm-up: compile the grammar (cached from here on), touch every code path once.
    run_constrained(engine, prompts_for(engine, 2), args.kind, spec, 16, 0)
    run_unconstrained(engine, prompts_for(engine, 2), [8, 8], 0)

    print(f"device={args.device} kind={args.kind} repeats={args.repeats} (best of the repeats)")
    header = (f"{'batch':>5} {'tokens':>7} {'unconstr ms/tok':>15} {'constr ms/tok':>13} {'overhead us/tok':>15} "
              f"{'ratio':>6} {'med.ratio':>9} {'fill us':>8} {'accept us':>9} {'grammar us/tok':>14}")
    print(header)
    figures = []
    for batch in args.batch:
        prompts = prompts_for(engine, batch)
        t_c, t_u, grammar_tok = [], [], []
        fills, accepts = [], []
        tokens = 0
        ratios = []
        lengths: list[int] = []
        for r in range(args.repeats):
            seed0 = 1000 * (r // 2)
            if r % 2 == 0:  # constrained first; it fixes the lengths for these seeds
                elapsed_c, c_lengths, reasons, timer = run_constrained(engine, prompts, args.kind, spec, args.max_new, seed0)
                lengths = c_lengths
                elapsed_u = run_unconstrained(engine, prompts, lengths, seed0)
            else:  # the same seeds again, unconstrained first
                elapsed_u = run_unconstrained(engine, prompts, lengths, seed0)
                elapsed_c, c_lengths, reasons, timer = run_constrained(engine, prompts, args.kind, spec, args.max_new, seed0)
            tokens = sum(lengths)
            t_c.append(elapsed_c / sum(c_lengths))
            t_u.append(elapsed_u / tokens)
            ratios.append(t_c[-1] / t_u[-1])
            grammar_tok.append((timer.fill_s + timer.accept_s) / sum(c_lengths))
            fills.append(1e6 * timer.fill_s / max(timer.fills, 1))
            accepts.append(1e6 * timer.accept_s / max(timer.accepts, 1))
        c, u, g = min(t_c), min(t_u), min(grammar_tok)
        fill_us, accept_us = min(fills), min(accepts)
        row = {
            "batch": batch,
            "tokens": tokens,
            "unconstrained_ms_per_token": 1e3 * u,
            "constrained_ms_per_token": 1e3 * c,
            "overhead_us_per_token": 1e6 * (c - u),
            "ratio": c / u,
            "median_pair_ratio": statistics.median(ratios),
            "fill_bitmask_us_per_call": fill_us,
            "accept_us_per_call": accept_us,
            "grammar_cpu_us_per_token": 1e6 * g,
            "finish_reasons": sorted(set(reasons)),
        }
        figures.append(row)
        print(f"{batch:>5} {tokens:>7} {row['unconstrained_ms_per_token']:>15.3f} {row['constrained_ms_per_token']:>13.3f} "
              f"{row['overhead_us_per_token']:>15.1f} {row['ratio']:>6.3f} {row['median_pair_ratio']:>9.3f} "
              f"{fill_us:>8.1f} {accept_us:>9.1f} "
              f"{row['grammar_cpu_us_per_token']:>14.1f}")
    print("ms/tok: engine wall time per generated token (all rows of the batch together), best of the repeats; "
          "overhead = constrained - unconstrained; ratio = constrained / unconstrained (med.ratio: median over "
          "the pairs); fill/accept us: per call; grammar us/tok: fill_bitmask + accept time per token, part of "
          "the overhead")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "kind": args.kind, "figures": figures}, indent=2))


if __name__ == "__main__":
    main()

"""Write perf_analyzer `--input-data` JSON files for the `ensemble` and `llm` models.

    python -m client.perf.make_inputs [--out client/perf] [--num 16] [--min-prompt 16] [--max-prompt 512]
        [--min-new 16] [--max-new 256] [--seed 0] [--model-path models/demo]

Writes
  ensemble_text.json  text prompts (text_input) cut from the demo corpus to about the wanted
                      token lengths, + max_tokens, stream, sampling_parameters
  ensemble_ids.json   the same workload as exact token ids (input_ids) through the ensemble
  llm_ids.json        the same token ids straight to the llm model (engine alone)

Every request is greedy with `ignore_eos`, so it generates exactly `max_tokens` tokens and the
throughput perf_analyzer reports in responses/s is output tokens/s (one token per response while
streaming on a request of its own; several sequences share a step but each gets its own response).
perf_analyzer takes the entries in turn, one per request.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
PERF_DIR = Path(__file__).resolve().parent
CORPUS = REPO_ROOT / "backend" / "demo_model" / "corpus.txt"


def mixed_workload(
    n: int,
    vocab_size: int,
    *,
    seed: int = 0,
    min_prompt: int = 16,
    max_prompt: int = 512,
    min_new: int = 16,
    max_new: int = 256,
    low_id: int = 100,
) -> tuple[list[list[int]], list[int]]:
    """n random-token prompts with lengths in [min_prompt, max_prompt] and max_new_tokens in
    [min_new, max_new]; the same seed gives the same workload everywhere (bench, perf_analyzer)."""
    rng = random.Random(seed)
    hi = max(low_id + 1, vocab_size)
    prompts = [[rng.randrange(low_id, hi) for _ in range(rng.randint(min_prompt, max_prompt))] for _ in range(n)]
    new_tokens = [rng.randint(min_new, max_new) for _ in range(n)]
    return prompts, new_tokens


def usable_vocab(tokenizer: Any) -> int:
    """Ids below this are ordinary tokens (special tokens sit at the end of the demo vocabulary)."""
    specials = [i for i in getattr(tokenizer, "all_special_ids", []) if i is not None]
    return min([len(tokenizer), *specials])


def sampling_json(max_new: int, temperature: float = 0.0, seed: Optional[int] = None) -> str:
    params: dict[str, Any] = {"temperature": temperature, "ignore_eos": True, "max_new_tokens": max_new}
    if seed is not None:
        params["seed"] = seed
    return json.dumps(params)


def ids_entries(prompts: Sequence[Sequence[int]], new_tokens: Sequence[int], *, stream: bool = True,
                temperature: float = 0.0, seeds: Optional[Sequence[int]] = None) -> list[dict[str, Any]]:
    return [
        {
            "input_ids": {"content": list(map(int, p)), "shape": [len(p)]},
            "max_tokens": [int(n)],
            "stream": [stream],
            "sampling_parameters": [sampling_json(int(n), temperature, seeds[i] if seeds else None)],
        }
        for i, (p, n) in enumerate(zip(prompts, new_tokens))
    ]


def text_entries(tokenizer: Any, n: int, *, seed: int = 0, min_prompt: int = 16, max_prompt: int = 512,
                 min_new: int = 16, max_new: int = 256, stream: bool = True) -> list[dict[str, Any]]:
    """Text prompts: windows of the demo corpus whose token counts span [min_prompt, max_prompt]."""
    rng = random.Random(seed)
    corpus_ids = tokenizer(CORPUS.read_text(), verbose=False).input_ids  # longer than a context on purpose
    while len(corpus_ids) < max_prompt + 1:
        corpus_ids = corpus_ids + corpus_ids
    entries = []
    for _ in range(n):
        length = rng.randint(min_prompt, max_prompt)
        start = rng.randrange(0, len(corpus_ids) - length)
        text = tokenizer.decode(corpus_ids[start : start + length], skip_special_tokens=True)
        new = rng.randint(min_new, max_new)
        entries.append({
            "text_input": [text],
            "max_tokens": [new],
            "stream": [stream],
            "sampling_parameters": [sampling_json(new)],
        })
    return entries


def write(path: Path, entries: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": entries}, ensure_ascii=False, separators=(",", ":")) + "\n")
    return path


def _context_length(model_path: Path) -> Optional[int]:
    """config.json's max_position_embeddings (the server's default max_model_len), if known."""
    try:
        value = json.loads((model_path / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=PERF_DIR)
    ap.add_argument("--model-path", type=Path, default=REPO_ROOT / "models" / "demo")
    ap.add_argument("--num", type=int, default=16, help="entries per file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    args = ap.parse_args(argv)
    # Refused here, not found out from perf_analyzer (which dies on an empty data set with its
    # banner alone) or from the server refusing every request (QA).
    if args.num < 1:
        ap.error(f"--num must be at least 1, got {args.num}")
    for low, high, name in ((args.min_prompt, args.max_prompt, "prompt"), (args.min_new, args.max_new, "new")):
        if not 1 <= low <= high:
            ap.error(f"need 1 <= --min-{name} <= --max-{name}, got {low} and {high}")
    context = _context_length(args.model_path)
    if context is not None and args.max_prompt + args.max_new > context:
        ap.error(f"--max-prompt {args.max_prompt} + --max-new {args.max_new} is past the model's context of "
                 f"{context} tokens: the server would refuse those requests")

    from backend.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model_path)
    shape = dict(min_prompt=args.min_prompt, max_prompt=args.max_prompt, min_new=args.min_new, max_new=args.max_new)
    prompts, new_tokens = mixed_workload(args.num, usable_vocab(tok), seed=args.seed, **shape)
    for name, entries in (
        ("ensemble_text.json", text_entries(tok, args.num, seed=args.seed, **shape)),
        ("ensemble_ids.json", ids_entries(prompts, new_tokens)),
        ("llm_ids.json", ids_entries(prompts, new_tokens)),
    ):
        print(write(args.out / name, entries))


if __name__ == "__main__":
    main()

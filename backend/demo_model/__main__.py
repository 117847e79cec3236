"""CLI: python -m backend.demo_model --out models/demo [--seed 0]"""

from __future__ import annotations

import argparse
import os
import sys

# Before anything imports `tokenizers`: single-threaded training keeps merges deterministic.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.demo_model", description=__doc__)
    parser.add_argument("--out", default="models/demo", help="output directory (default: models/demo)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    args = parser.parse_args(argv)

    from backend.demo_model.builder import build_demo_model

    build_demo_model(args.out, seed=args.seed, log=lambda msg: print(msg, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

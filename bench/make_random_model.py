"""A random-weight Qwen2 model of a chosen size, with the demo model's tokenizer, for benchmarks.

    python -m bench.make_random_model --out models/bench-0.5b --hidden 896 --layers 24 \
        --heads 14 --kv-heads 2 --intermediate 4864

With --experts N it is a Qwen3-MoE model instead (N experts of --moe-intermediate, --experts-per-tok
of them a token, renormalised, as Qwen3-30B-A3B's 128 / 8 / 768):

    python -m bench.make_random_model --out models/bench-moe --hidden 512 --layers 8 \
        --heads 8 --kv-heads 2 --experts 32 --experts-per-tok 4 --moe-intermediate 256

The demo model is sized for CPU tests (about a million parameters); GPU throughput needs a model
whose matmuls are big enough to matter. The vocabulary stays the demo tokenizer's unless
--vocab asks for more rows (the extra ids are never produced by the tokenizer but are sampled
like any other).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer-from", type=Path, default=Path("models/demo"))
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--vocab", type=int, default=None, help="default: the tokenizer's model vocab size")
    ap.add_argument("--max-position", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", type=int, default=0, help="> 0: a Qwen3-MoE model with this many experts")
    ap.add_argument("--experts-per-tok", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    args = ap.parse_args()

    from transformers import AutoConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = AutoConfig.from_pretrained(args.tokenizer_from)
    common = dict(
        vocab_size=args.vocab or base.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_position,
        tie_word_embeddings=True,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
    )
    torch.manual_seed(args.seed)
    print(f"[make_random_model] building {args.layers} layers x {args.hidden} hidden"
          + (f", {args.experts} experts ({args.experts_per_tok} a token)" if args.experts else ""), flush=True)
    if args.experts:
        cfg = Qwen3MoeConfig(**common, head_dim=args.hidden // args.heads, num_experts=args.experts,
                             num_experts_per_tok=args.experts_per_tok, moe_intermediate_size=args.moe_intermediate,
                             norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common)).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for f in args.tokenizer_from.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy2(f, args.out / f.name)
    print(f"[make_random_model] wrote {args.out} ({n / 1e6:.1f}M parameters)", flush=True)


if __name__ == "__main__":
    main()

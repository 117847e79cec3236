"""The paged decode-attention kernel at each tile size, against SDPA over gathered blocks (the
engine's `gather` path, LLM_PAGED_DECODE=0), timed in the same run on the same cache.

    python -m bench.paged_decode_bench [--tiles 16 32 64 128] [--query-tiles 2 4 8 16] [--heads 14 --kv-heads 2 --head-dim 64] [--json OUT]

Shapes are by default the random 0.4B Qwen2's (14 query heads, 2 KV heads, head dim 64; a
Llama-3-8B layer is --heads 32 --kv-heads 8 --head-dim 128), 16-key blocks, bf16 cache: decode
batches of 1, 8 and 64 over 1k contexts, and 128 rows over 3k contexts (a flat chunked-prefill
step: each of a 3072-token prompt's chunk rows sees its own prefix, through the prompt's one
block table, as the engine lays it out; the fourteenth session's figures gave each row blocks
of its own). Each case runs with one split and with auto_splits, float32 dots at each tile
size and bf16 dots (tensor cores; `low_precision_dots`) at the head dim's default tile, and each
result is checked against the gathered SDPA. The flat case then runs with query tiles
(LLM_QUERY_TILE: a tile's rows read each K/V tile once together, on bf16 dots) of each
--query-tiles size, the default tile, with one split and with auto_splits counted over the tiles.
Prints microseconds per call (one layer) and SDPA's time over the kernel's. CUDA only:
the Triton interpreter's timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.nn.functional as F


def _gathered_sdpa(q, k_cache, v_cache, tables, lens, block_size, scale):
    """The `gather` path: each context's blocks copied into a padded batch, then SDPA with GQA."""
    B, H, D = q.shape
    kvh = k_cache.shape[0]
    width = tables.shape[1] * block_size
    slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size, device=q.device)).reshape(B, width)
    k = k_cache[:, slots].permute(1, 0, 2, 3)  # [B, kvh, width, D]
    v = v_cache[:, slots].permute(1, 0, 2, 3)
    mask = torch.arange(width, device=q.device)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=kvh != H)
    return out[:, :, 0, :]


def _time_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, nargs="+", default=[16, 32, 64, 128], help="tile_keys values")
    ap.add_argument("--query-tiles", type=int, nargs="*", default=[2, 4, 8, 16],
                    help="query tokens per tile for the flat case (the kernel's tile_tokens)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("paged_decode_bench: CUDA only")
    from kernels import paged_attention

    dev = torch.device("cuda")
    H, kvh, D, bs = args.heads, args.kv_heads, args.head_dim, 16
    scale = D ** -0.5
    cases = [(1, 1024), (8, 1024), (64, 1024), (128, 3072)]
    results = []
    for rows, ctx in cases:
        g = torch.Generator(device="cpu").manual_seed(rows * 7 + ctx)
        width = -(-ctx // bs)
        num_blocks = rows * width + 8
        k_cache = torch.randn(kvh, num_blocks * bs, D, generator=g).to(dev, torch.bfloat16)
        v_cache = torch.randn(kvh, num_blocks * bs, D, generator=g).to(dev, torch.bfloat16)
        flat = rows == 128
        tables = torch.randperm(num_blocks, generator=g)[: rows * width].reshape(rows, width).to(dev, torch.int32)
        if flat:  # one prompt's rows: one table
            tables = tables[:1].expand(rows, width).contiguous()
        # Flat-step rows see growing prefixes of one prompt; decode rows see full contexts.
        lens = (torch.arange(ctx - rows + 1, ctx + 1) if flat else torch.full((rows,), ctx)).to(dev, torch.int32)
        q = torch.randn(rows, H, D, generator=g).to(dev, torch.bfloat16)
        want = _gathered_sdpa(q, k_cache, v_cache, tables, lens, bs, scale).float()
        sdpa_us = _time_us(lambda: _gathered_sdpa(q, k_cache, v_cache, tables, lens, bs, scale), args.iters)
        auto = paged_attention.auto_splits(rows, kvh, width, dev)
        default_tile = paged_attention.default_tile_keys(D)
        for splits in sorted({1, auto}):
            # float32 dots (the default for one row a program) at every tile size; bf16 dots
            # (tensor cores) at the default tile, to see whether they pay for one row too
            for tile, lowp in [(t, False) for t in args.tiles] + [(default_tile, True)]:
                def call():
                    return paged_attention.paged_decode_attention(
                        q, k_cache, v_cache, tables, lens, bs, scale, splits=splits, tile_keys=tile,
                        low_precision_dots=lowp)
                err = (call().float() - want).abs().max().item()
                us = _time_us(call, args.iters)
                row = {"rows": rows, "context": ctx, "splits": splits, "tile_keys": tile,
                       "dots": "bf16" if lowp else "fp32", "kernel_us": round(us, 2),
                       "sdpa_gathered_us": round(sdpa_us, 2), "sdpa_over_kernel": round(sdpa_us / us, 2),
                       "max_abs_err_vs_sdpa": err}
                results.append(row)
                print(f"rows {rows:4d} ctx {ctx:5d} splits {splits:3d} tile {tile:4d} dots {row['dots']}: kernel "
                      f"{us:8.1f} us, gathered SDPA {sdpa_us:8.1f} us, ratio {sdpa_us / us:6.2f}, max |err| {err:.2e}",
                      flush=True)
        for tokens in args.query_tiles if flat else []:
            tiles = torch.tensor(paged_attention.query_tiles([rows], tokens), dtype=torch.int32, device=dev)
            tiled_auto = paged_attention.auto_splits(-(-rows // tokens), kvh, width, dev)
            for splits in sorted({1, tiled_auto}):
                def call():
                    return paged_attention.paged_decode_attention(
                        q, k_cache, v_cache, tables, lens, bs, scale, splits=splits, query_tiles=tiles,
                        tile_tokens=tokens)
                err = (call().float() - want).abs().max().item()
                us = _time_us(call, args.iters)
                results.append({"rows": rows, "context": ctx, "splits": splits, "tile_keys": default_tile,
                                "query_tile_tokens": tokens, "dots": "bf16", "kernel_us": round(us, 2),
                                "sdpa_gathered_us": round(sdpa_us, 2), "sdpa_over_kernel": round(sdpa_us / us, 2),
                                "max_abs_err_vs_sdpa": err})
                print(f"rows {rows:4d} ctx {ctx:5d} splits {splits:3d} query tile {tokens:3d}: kernel {us:8.1f} us, "
                      f"gathered SDPA {sdpa_us:8.1f} us, ratio {sdpa_us / us:6.2f}, max |err| {err:.2e}", flush=True)
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
                "shape": {"heads": H, "kv_heads": kvh, "head_dim": D, "block_size": bs, "dtype": "bfloat16"}}
        with open(args.json, "w") as f:
            json.dump({**meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

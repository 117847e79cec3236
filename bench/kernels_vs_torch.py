"""Sampling kernels vs their torch references, timed in the same run.

    python -m bench.kernels_vs_torch [--batch 256] [--vocab 128000] [--iters 20]

On CUDA both run on the GPU (the Triton kernels compiled); on CPU the Triton kernels need
TRITON_INTERPRET=1 and the figure only shows interpreter overhead, so by default the CPU run
times the references against the C++ CPU kernels (kernels/csrc/sampling_cpu.cpp: penalties,
bitmask, the top-k/top-p/min-p filter and the draw). Prints ms per call and the torch/kernel ratio for each op.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _time(fn, iters: int, cuda: bool) -> float:
    fn()  # warm-up / compile
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128_000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    triton_ok = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    import kernels

    dev = torch.device("cuda" if cuda else "cpu")
    B, V = args.batch, args.vocab
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(B, V, generator=g) * 3).to(dev)
    temp = (torch.rand(B, generator=g) + 0.3).to(dev)
    top_k = torch.randint(1, 200, (B,), generator=g).to(dev)
    top_p = (torch.rand(B, generator=g) * 0.5 + 0.5).to(dev)
    min_p = (torch.rand(B, generator=g) * 0.1).to(dev)
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32).to(dev)
    prompt = (torch.rand(B, V, generator=g) < 0.01).to(dev)
    pen = (torch.rand(B, generator=g) * 0.5).to(dev)
    rep = (torch.rand(B, generator=g) * 0.5 + 1.0).to(dev)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (B, (V + 31) // 32), generator=g, dtype=torch.int32).to(dev)
    rows = torch.ones(B, dtype=torch.bool, device=dev)
    seeds = torch.arange(B, dtype=torch.int64, device=dev)
    offsets = torch.full((B,), 7, dtype=torch.int64, device=dev)
    greedy = torch.zeros(B, dtype=torch.bool, device=dev)

    from kernels import cpu_sampling, reference

    # name -> (torch reference, the kernels' own path: use_triton -> result)
    ops = {
        "temperature": (lambda: reference.apply_temperature(logits, temp),
                        lambda t: kernels.apply_temperature(logits, temp, use_triton=t)),
        "penalties": (lambda: reference.apply_penalties(logits, counts, prompt, pen, pen, rep),
                      lambda t: kernels.apply_penalties(logits, counts, prompt, pen, pen, rep, use_triton=t)),
        "token_bitmask": (lambda: reference.apply_token_bitmask(logits, bitmask, rows),
                          lambda t: kernels.apply_token_bitmask(logits, bitmask, rows, use_triton=t)),
        "top_k_top_p_min_p": (lambda: reference.top_k_top_p_min_p(logits, top_k, top_p, min_p),
                              lambda t: kernels.top_k_top_p_min_p(logits, top_k, top_p, min_p, use_triton=t)),
        "sample": (lambda: reference.sample(logits, seeds, offsets, greedy),
                   lambda t: kernels.sample(logits, seeds, offsets, greedy, use_triton=t)),
        "log_softmax": (lambda: reference.log_softmax(logits), lambda t: kernels.log_softmax(logits, use_triton=t)),
    }
    native = () if cuda or cpu_sampling.load() is None else ("penalties", "token_bitmask", "top_k_top_p_min_p", "sample")
    kind = "triton" if triton_ok else "cpu_cpp"
    results = {"device": torch.cuda.get_device_name() if cuda else "cpu", "batch": B, "vocab": V, "kernel": kind, "ops": {}}
    print(f"device {results['device']}  batch {B}  vocab {V}")
    print(f"{'op':20s} {'torch ms':>10s} {kind + ' ms':>12s} {'torch/kernel':>13s}")
    for name, (ref_fn, fn) in ops.items():
        ref_ms = _time(ref_fn, args.iters, cuda)
        if triton_ok:
            k_ms = _time(lambda: fn(True), max(1, args.iters if cuda else 1), cuda)
        elif name in native:
            k_ms = _time(lambda: fn(False), args.iters, cuda)
        else:
            k_ms = float("nan")  # the reference is the CPU path
        ratio = ref_ms / k_ms if k_ms == k_ms else None
        # null, not NaN, where no kernel ran: NaN is not JSON (strict parsers refuse the file)
        results["ops"][name] = {"torch_ms": ref_ms, f"{kind}_ms": k_ms if ratio is not None else None, "ratio": ratio}
        print(f"{name:20s} {ref_ms:10.3f} {k_ms:12.3f} {ratio if ratio is not None else float('nan'):13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

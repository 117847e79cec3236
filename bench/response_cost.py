"""What one streamed response costs tritonserver's Python backend on this machine, engine aside.

    python -m bench.response_cost [--concurrency 64] [--responses 200] [--streams 128] [--rounds 3]

The serving path's loss against the engine alone is paid per streamed response (docs/BENCHMARKS.md):
every token the llm model streams crosses the Python backend's shared-memory IPC to tritonserver,
the ensemble, the postprocessing stub and back, and gRPC. This measures that toll with the engine
replaced by `responder` (bench/response_cost_models/), a decoupled model that sends responses as
fast as it can from four threads, shaped like the llm model's (same names, types and sizes):

  direct_1    responder, gRPC stream, 1 tensor per response (the floor of a decoupled response)
  direct_7    responder, 7 tensors per response (the llm model's streamed response)
  ensemble_7  responder_ensemble: responder -> a tokenizer-free postprocessing step, like
              model_repository/ensemble (what a streamed token costs end to end)

Cases alternate for --rounds rounds. For each: responses/s, and CPU milliseconds per response
spent by the tritonserver tree (server, both stubs) and by this client (tritonclient aio). The
ratios are per-response CPU against direct_1 and direct_7 in the same run. Divide an engine's
step budget by these figures to size `max_responses_per_step` / `stream_interval` for a host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.serving_bench import CpuMeter, Rec, closed_loop  # noqa: E402
from client.local_server import LocalTritonServer  # noqa: E402

MODELS = Path(__file__).resolve().parent / "response_cost_models"
CASES = {"direct_1": ("responder", 1), "direct_7": ("responder", 7), "ensemble_7": ("responder_ensemble", 7)}


async def stream_all(url: str, model: str, tensors: int, responses: int, streams: int, concurrency: int) -> dict[str, Any]:
    """`streams` requests of `responses` responses each, `concurrency` at a time (closed loop).
    Every response is checked: it arrives, in order, with `tensors` outputs (ensemble: its six)."""
    import tritonclient.grpc.aio as grpc_aio
    from tritonclient.grpc import InferInput

    client = grpc_aio.InferenceServerClient(url)
    problems: list[str] = []

    async def one(_: int) -> Rec:
        rec = Rec(start=time.perf_counter())
        n_in = InferInput("responses", [1], "INT32")
        n_in.set_data_from_numpy(np.array([responses], dtype=np.int32))
        k_in = InferInput("tensors", [1], "INT32")
        k_in.set_data_from_numpy(np.array([tensors], dtype=np.int32))
        done = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": [n_in, k_in], "parameters": {"triton_enable_empty_final_response": True}}
            await done.wait()

        count = 0
        try:
            async for result, error in client.stream_infer(requests()):
                if error is not None:
                    problems.append(str(error))
                    break
                resp = result.get_response()
                if resp.outputs:
                    names = [o.name for o in resp.outputs]
                    position = struct.unpack("<i", resp.raw_output_contents[names.index("completion_tokens")][:4])[0]
                    if position != count + 1:
                        problems.append(f"response {position} arrived as number {count + 1}")
                    count += 1
                final = resp.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
        finally:
            done.set()
        if count != responses:
            problems.append(f"a stream got {count} of {responses} responses")
        rec.tokens, rec.end = count, time.perf_counter()
        return rec

    try:
        recs, wall = await closed_loop(one, range(streams), concurrency)
    finally:
        await client.close()
    problems.extend(r.error for r in recs if r.error)
    return {"responses": sum(r.tokens for r in recs), "wall_s": wall, "problems": problems[:5]}


def measure(srv: LocalTritonServer, case: str, args) -> dict[str, Any]:
    model, tensors = CASES[case]
    meter = CpuMeter({"tritonserver": srv.process.pid if srv.process else None})
    before = meter.snapshot()
    out = asyncio.run(stream_all(srv.grpc_url, model, tensors, args.responses, args.streams, args.concurrency))
    cores = CpuMeter.cores(before, meter.snapshot())
    per_s = max(out["responses"], 1) / out["wall_s"]
    return {
        "responses": out["responses"], "responses_per_s": round(per_s, 1), "cores": cores,
        "server_ms_per_response": round(cores["tritonserver"] / per_s * 1e3, 4),
        "client_ms_per_response": round(cores["bench_process"] / per_s * 1e3, 4),
        "problems": out["problems"],
    }


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for case in CASES:
        runs = [r[case] for r in rounds]
        cases[case] = {
            key: round(statistics.median(run[key] for run in runs), 4)
            for key in ("responses_per_s", "server_ms_per_response", "client_ms_per_response")
        }
        cases[case]["total_ms_per_response"] = round(
            cases[case]["server_ms_per_response"] + cases[case]["client_ms_per_response"], 4)

    def ratio(a: str, b: str) -> float:
        return round(cases[a]["total_ms_per_response"] / max(cases[b]["total_ms_per_response"], 1e-9), 2)

    return {"cases": cases, "ratios": {"direct_7_vs_direct_1": ratio("direct_7", "direct_1"),
                                       "ensemble_7_vs_direct_7": ratio("ensemble_7", "direct_7")}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=64, help="streams open at once")
    ap.add_argument("--responses", type=int, default=200, help="responses per stream")
    ap.add_argument("--streams", type=int, default=128, help="streams per case and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of all cases, in turns")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    rounds: list[dict[str, dict[str, Any]]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_file = args.out / f"response_cost-{stamp}.tritonserver.log"
    with LocalTritonServer(model_repository=MODELS, log_file=log_file) as srv:
        for case in CASES:  # warm-up: first-call costs out of the figures
            asyncio.run(stream_all(srv.grpc_url, CASES[case][0], CASES[case][1], 2, 2, 2))
        for r in range(args.rounds):
            rounds.append({})
            for case in CASES:
                m = rounds[-1][case] = measure(srv, case, args)
                print(f"round {r + 1} {case:11s} {m['responses_per_s']:8.0f} responses/s   CPU per response: "
                      f"server {m['server_ms_per_response']:.3f} ms, client {m['client_ms_per_response']:.3f} ms"
                      f"{'   PROBLEMS: ' + '; '.join(m['problems']) if m['problems'] else ''}", flush=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds, **summarize(rounds)}
    print("=== medians ===")
    for case, m in result["cases"].items():
        print(f"  {case:11s} {m['responses_per_s']:8.0f} responses/s   {m['total_ms_per_response']:.3f} ms CPU per "
              f"response ({m['server_ms_per_response']:.3f} server + {m['client_ms_per_response']:.3f} client)")
    for name, value in result["ratios"].items():
        print(f"  {name:24s} {value:.2f}")
    cost = result["cases"]["ensemble_7"]["total_ms_per_response"]
    print(f"  at 1000 streamed tokens/s, one token per response, the ensemble path uses {cost:.2f} cores")
    path = args.out / f"response_cost-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"results: {path}")
    result["path"] = str(path)
    return result


if __name__ == "__main__":
    main()

"""Routing across several tritonservers: the routing policies against each other, in one run.

Starts N tritonservers (one per GPU on a GPU host; here all on the CPU) and, for each routing
policy in turn, one frontend in front of them; then runs the same multi-turn chats through the
OpenAI SDK: C conversations at once, each with a system prompt of its own, T turns each, every
turn sent with the whole history so far. Before each policy the servers' prefix caches are
flushed. Reports per policy the share of later turns' prompt tokens served from the prefix cache,
their TTFT p50/p99 and the turns per second, and the first policy's ratios to each other one.

    .venv/bin/python -m bench.router_bench [--servers 2] [--conversations 16] [--turns 4]
        [--policies cache_aware,round_robin] [--shared-system-prompt] [--pin-servers]
        [--frontend-workers 1] [--router-placement auto] [--model-path models/demo]
        [--out bench/results/router_bench.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

from bench.serving_bench import Frontend, div
from client.local_server import LocalTritonServer

REPO_ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["ledgers and audits", "train timetables", "vegetable gardens", "tax forms", "bicycle repair",
          "sourdough baking", "chess openings", "home networking", "bird watching", "jazz harmony",
          "marathon training", "roof insulation", "beekeeping", "watch repair", "sailing knots", "cheese making"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.router_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=REPO_ROOT / "models" / "demo")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-chars", type=int, default=2000, help="length of each conversation's system prompt")
    p.add_argument("--shared-system-prompt", action="store_true",
                   help="one system prompt for every conversation (each asks its own first question): the case "
                        "where a frontend process that never saw a chat sends its next turn where only the system "
                        "prompt is cached")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--frontend-workers", type=int, default=1, help="the frontend's --workers")
    p.add_argument("--router-placement", default="auto", help="the frontend's --router-placement")
    p.add_argument("--connection-per-turn", action="store_true",
                   help="each turn on a new HTTP connection (as behind a proxy that pools them): with several "
                        "frontend workers, a chat's turns then reach any of them")
    p.add_argument("--pin-servers", action="store_true",
                   help="server i on CPU i (mod the CPUs; taskset), its engine on one thread: each server with "
                        "compute of its own, as each GPU of a multi-GPU host, so that how the load is spread shows "
                        "in throughput (the frontend and the clients share every CPU)")
    p.add_argument("--num-kv-blocks", type=int, default=0, help="LLM_NUM_KV_BLOCKS per server (0: the engine's default)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "router_bench.json")
    args = p.parse_args(argv)
    if args.servers < 2:
        p.error("--servers: at least 2 (routing needs a choice)")
    return args


class PinnedServer(LocalTritonServer):
    """A tritonserver (its stubs and engine too) on one CPU: the engine takes one thread there
    (backend/triton_io.py server_torch_threads reads the affinity)."""

    def __init__(self, cpu: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cpu = cpu

    def command(self) -> list[str]:
        return ["taskset", "-c", str(self.cpu), *super().command()]


def system_prompt(i: int, chars: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    sentence = f"You are assistant {i}, an expert on {topic}; answer briefly and precisely. "
    return (sentence * (chars // len(sentence) + 1))[:chars]


async def conversation(sdk: Any, model: str, i: int, args: argparse.Namespace) -> list[dict[str, float]]:
    messages = [{"role": "system", "content": system_prompt(0 if args.shared_system_prompt else i, args.system_chars)}]
    who = f"Conversation {i}. " if args.shared_system_prompt else ""
    turns = []
    for turn in range(args.turns):
        if args.connection_per_turn:
            sdk = sdk.with_options(http_client=_fresh_http_client())
        messages.append({"role": "user", "content": f"{who}Question {turn} about it: what comes first?"})
        start = time.perf_counter()
        ttft, text, usage = None, [], None
        stream = await sdk.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        details = usage.prompt_tokens_details
        turns.append({"turn": turn, "ttft_s": ttft or time.perf_counter() - start,
                      "latency_s": time.perf_counter() - start, "prompt_tokens": usage.prompt_tokens,
                      "cached_tokens": (details.cached_tokens or 0) if details else 0})
        messages.append({"role": "assistant", "content": "".join(text) or "ok"})
    return turns


def _fresh_http_client() -> Any:
    import httpx

    return httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=600)


async def run_chats(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    sdk = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    start = time.perf_counter()
    per_chat = await asyncio.gather(*(conversation(sdk, model, i, args) for i in range(args.conversations)))
    wall = time.perf_counter() - start
    await sdk.close()
    later = [t for chat in per_chat for t in chat if t["turn"] > 0]
    ttfts = sorted(t["ttft_s"] for t in later)
    return {
        "wall_s": wall,
        "turns_per_s": sum(len(c) for c in per_chat) / wall,
        "later_turns_cached_share": sum(t["cached_tokens"] for t in later) / max(1, sum(t["prompt_tokens"] for t in later)),
        "later_turns_ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else None,
        "later_turns_ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
        "turns": per_chat,
    }


def post(url: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=60) as r:
        r.read()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    env = {"LLM_MODEL_PATH": str(args.model_path.resolve())}
    if args.num_kv_blocks:
        env["LLM_NUM_KV_BLOCKS"] = str(args.num_kv_blocks)
    logs = Path(tempfile.mkdtemp(prefix="router-bench-"))
    cpus = sorted(os.sched_getaffinity(0))
    servers = [PinnedServer(cpus[i % len(cpus)], env=env, log_file=logs / f"triton{i}.log") if args.pin_servers
               else LocalTritonServer(env=env, log_file=logs / f"triton{i}.log") for i in range(args.servers)]
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "policies": {}}
    try:
        for server in servers:
            server.start(timeout=600)
        urls = ",".join(s.grpc_url for s in servers)
        for policy in policies:
            frontend = Frontend(urls, args.model_path, logs / f"frontend-{policy}.log", workers=args.frontend_workers)
            frontend.cmd += ["--router-policy", policy, "--router-placement", args.router_placement]
            frontend.start()
            try:
                url = f"http://127.0.0.1:{frontend.port}"
                post(f"{url}/flush_cache")  # every policy starts with cold caches
                before = [_ensemble_requests(s) for s in servers]
                run = results["policies"][policy] = asyncio.run(run_chats(url, frontend.name, args))
                run["requests_per_server"] = [_ensemble_requests(s) - b for s, b in zip(servers, before)]
            finally:
                frontend.stop()
            print(f"{policy:12s} later turns: {run['later_turns_cached_share']:.0%} of prompt tokens cached, "
                  f"TTFT p50 {run['later_turns_ttft_p50_ms']:.1f} ms p99 {run['later_turns_ttft_p99_ms']:.1f} ms; "
                  f"{run['turns_per_s']:.2f} turns/s", flush=True)
    finally:
        for server in servers:
            server.stop()
    runs = results["policies"]
    first = policies[0] if policies and policies[0] in runs else None
    results["ratios"] = {}
    for other in [p for p in policies if first and p != first and p in runs]:
        a, b = runs[first], runs[other]
        r = results["ratios"][f"{first}_vs_{other}"] = {
            "ttft_p50_lower": div(b["later_turns_ttft_p50_ms"], a["later_turns_ttft_p50_ms"]),
            "throughput": div(a["turns_per_s"], b["turns_per_s"]),
            "cached_share": [a["later_turns_cached_share"], b["later_turns_cached_share"]],
        }
        print(f"{first} vs {other}: TTFT p50 {r['ttft_p50_lower']:.2f}x lower, throughput {r['throughput']:.2f}x, "
              f"cached share {r['cached_share'][0]:.0%} vs {r['cached_share'][1]:.0%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


def _ensemble_requests(server: LocalTritonServer) -> float:
    from openai_frontend.testing import scrape_metric

    return scrape_metric(server.metrics_url, "nv_inference_request_success", 'model="ensemble",version="1"') or 0.0


if __name__ == "__main__":
    sys.exit(main())

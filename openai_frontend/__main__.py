"""CLI: python -m openai_frontend --triton-url localhost:8001 --model-name NAME --port 9000 ..."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from backend.host_limits import usable_cpus
from openai_frontend.processes import process_alive
from openai_frontend.router import PLACEMENTS, POLICIES
from openai_frontend.settings import Settings


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__)
    p.add_argument("--triton-url", type=grpc_targets, action="extend", default=None, metavar="HOST:PORT",
                   help="Triton gRPC endpoint (default localhost:8001). Several (repeated, or comma-separated): "
                        "tritonservers serving the same model, one per GPU; each generation goes to one of them "
                        "(--router-policy)")
    p.add_argument("--router-policy", default="cache_aware", choices=POLICIES,
                   help="with several --triton-url: cache_aware (default; SGLang router's: the server that has seen "
                        "the longest start of the prompt, for its prefix cache, unless loads drift apart), "
                        "load_aware (vLLM production-stack's: the best of the share of the prompt seen less "
                        "--router-load-beta times the load above the mean), round_robin, power_of_two (the less "
                        "loaded of two at random), random")
    p.add_argument("--router-cache-threshold", type=float, default=0.5,
                   help="cache_aware: a server takes a request for its cache when it has seen more than this share")
    p.add_argument("--router-balance-abs-threshold", type=int, default=32,
                   help="cache_aware: loads have drifted apart (least loaded takes the request) when the busiest "
                        "server has more than this many requests in flight above the idlest ...")
    p.add_argument("--router-balance-rel-threshold", type=float, default=1.0001,
                   help="... and more than this many times its count")
    p.add_argument("--router-load-beta", type=float, default=1.0,
                   help="load_aware: how much a server's in-flight load, relative to the mean, counts against the "
                        "share of the prompt it has cached (1: twice the mean costs a whole prompt's worth)")
    p.add_argument("--router-placement", default="auto", choices=("auto",) + PLACEMENTS,
                   help="cache_aware, a prompt no server has seen enough of (load_aware: a tie): least_seen "
                        "(SGLang's: the server that has seen the least), hash (a hash of the chat's opening, the same "
                        "in every --workers process, within 1.25x the average load); auto (default): hash with "
                        "several --workers")
    p.add_argument("--triton-model", default="ensemble", help="the Triton model to call (default: ensemble)")
    p.add_argument("--model-name", "--served-model-name", dest="model_name", default=None,
                   help="model name clients use (default: the --tokenizer-path directory name, else the Triton model)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_FRONTEND_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (env OPENAI_FRONTEND_API_KEY)")
    p.add_argument("--tool-call-parser", default=None,
                   help="tool-call format of the model: qwen25/hermes, llama3, pythonic, mistral, deepseekv3, qwen3_coder")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="leave the tools out of the prompt when tool_choice is none (vLLM's flag; SGLang always "
                        "does); by default the model sees them and does not call them, as OpenAI's none means")
    p.add_argument("--reasoning-parser", default=None,
                   help="split thinking models' output into reasoning_content and content: deepseek_r1, "
                        "qwen3, qwen3_thinking, glm45, kimi, granite (SGLang's dashed names work too)")
    p.add_argument("--enable-reasoning", action="store_true",
                   help="vLLM's older switch for the same; needs --reasoning-parser")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME[=PATH]",
                   help="the LoRA adapters the engine serves (its lora_modules): requests may name them as "
                        "`model`; /v1/models lists them (vLLM's flag; paths are the engine's business)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve /load_lora_adapter, /unload_lora_adapter and their /v1/ forms (the engine loads "
                        "adapters from server paths named in the request)")
    p.add_argument("--tokenizer-path", default=None,
                   help="local HF model directory: token texts for logprobs, EOS ids for beam search")
    p.add_argument("--max-n", type=int, default=64, help="largest n accepted")
    p.add_argument("--stream-timeout", type=float, default=None, help="seconds one generation may take")
    p.add_argument("--abort-model", default="llm",
                   help="after a client disconnect, send `abort_request_id` to this Triton model (default llm; "
                        "'none' disables): Triton 2.51 does not cancel an ensemble's in-flight decoupled step")
    p.add_argument("--frontend-id", default=None,
                   help="names this frontend in its Triton request ids: frontends given the same id (replicas "
                        "behind one load balancer) abort each other's requests on /abort_request; default: "
                        "one random id per launch, shared by its --workers")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (else 413)")
    p.add_argument("--max-stop-strings", type=int, default=64, help="most stop strings per request")
    p.add_argument("--enable-custom-logit-processor", action="store_true",
                   help="accept SGLang custom_logit_processor (client code run by the engine; the engine "
                        "must allow it too: LLM_ENABLE_CUSTOM_LOGIT_PROCESSOR=1). Off: such requests get 400")
    p.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 503 responses")
    p.add_argument("--responses-store-size", type=int, default=4096,
                   help="/v1/responses kept for GET and previous_response_id (the N used last; 0: none)")
    p.add_argument("--responses-store-max-mb", type=int, default=256,
                   help="at most this many MiB of stored responses (the least recently used go first)")
    p.add_argument("--embeddings-pooling", choices=("off", "last", "mean"), default="off",
                   help="serve /v1/embeddings from the model's final-norm hidden states, pooled over the prompt: "
                        "last (its last token, as decoder embedders like Qwen3-Embedding are trained) or mean; "
                        "off (default): a 400, as a chat model is no embedder")
    p.add_argument("--conversations-store-size", type=int, default=4096,
                   help="/v1/conversations kept (the N used last; 0: none). Their own store: responses "
                        "never evict a conversation")
    p.add_argument("--conversations-store-max-mb", type=int, default=256,
                   help="at most this many MiB of conversations (the least recently used go first)")
    p.add_argument("--graceful-shutdown-timeout", type=shutdown_timeout_arg, default=DEFAULT_GRACEFUL_SHUTDOWN_S,
                   help="on SIGTERM/SIGINT, stop accepting and let in-flight requests and streams finish for at "
                        f"most this many seconds (default {DEFAULT_GRACEFUL_SHUTDOWN_S:g}); then the rest are "
                        "cancelled: their streams are aborted on --abort-model (KV freed) and their connections "
                        "closed. 'none': no limit (a stream that never ends then keeps the frontend, and a "
                        "tritonserver waiting on its gRPC stream, from exiting). A second SIGINT cancels at once, "
                        "still aborting each stream on --abort-model (up to 2 s each)")
    p.add_argument("--workers", type=workers_arg, default="auto",
                   help="server processes (each with its own event loop and gRPC channel) sharing the port; "
                        "auto (default): one per four usable CPUs (the affinity mask, capped by a container's CPU quota), "
                        "from one to four")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request (costs throughput)")
    return p.parse_args(argv)


# Long enough for most streams to end, short enough to stop well within tritonserver's default
# 30 s exit timeout (scripts/serve.sh stops the frontend first, then tritonserver).
DEFAULT_GRACEFUL_SHUTDOWN_S = 10.0


def shutdown_timeout_arg(value: str) -> Optional[float]:
    """--graceful-shutdown-timeout: seconds (0 or more), or none (no limit)."""
    if value.lower() == "none":
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds or none, not {value!r}") from None
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError("must be 0 or more (none: no limit)")
    return seconds


def grpc_targets(value: str) -> list[str]:
    """--triton-url: Triton gRPC endpoints, host:port (or gRPC targets such as dns:///h:p),
    comma-separated. An HTTP URL there failed every call with gRPC's "Misformatted domain name" (QA)."""
    targets = [v.strip() for v in value.split(",") if v.strip()]
    if not targets:
        raise argparse.ArgumentTypeError("expected host:port")
    for target in targets:
        if target.startswith(("http://", "https://", "grpc://")):
            raise argparse.ArgumentTypeError(
                f"Triton's gRPC endpoint as host:port (8001 by default), not a URL: {target!r}")
    return targets


def workers_arg(value: str) -> int:
    """--workers: a count, or auto. One event loop spends ~1.3 ms of CPU a request; on an H100
    host (16 cores) four workers took the frontend's streaming from 0.70 to 0.82 of its
    non-streaming throughput at concurrency 64. On a small host the cores belong to the engine.
    A container's CPU quota counts, not the host's cores its affinity mask shows."""
    if value == "auto":
        return max(1, min(4, usable_cpus() // 4))
    try:
        workers = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or auto, not {value!r}") from None
    if workers < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return workers


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings(
        triton_url=",".join(args.triton_url or ["localhost:8001"]),
        router_policy=args.router_policy,
        router_cache_threshold=args.router_cache_threshold,
        router_balance_abs_threshold=args.router_balance_abs_threshold,
        router_balance_rel_threshold=args.router_balance_rel_threshold,
        router_load_beta=args.router_load_beta,
        router_placement=(args.router_placement if args.router_placement != "auto"
                          else "hash" if args.workers > 1 else "least_seen"),
        triton_model=args.triton_model,
        model_name=args.model_name,
        api_key=args.api_key,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=args.reasoning_parser,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_modules=tuple(m.partition("=")[0] for arg in args.lora_modules for m in arg.replace(",", " ").split()),
        tokenizer_path=args.tokenizer_path,
        max_n=args.max_n,
        stream_timeout=args.stream_timeout,
        abort_model=None if (args.abort_model or "none").lower() == "none" else args.abort_model,
        **({"frontend_id": args.frontend_id} if args.frontend_id is not None else {}),
        max_body_bytes=args.max_body_bytes,
        max_stop_strings=args.max_stop_strings,
        enable_custom_logit_processor=args.enable_custom_logit_processor,
        retry_after_s=args.retry_after,
        responses_store_size=max(0, args.responses_store_size),
        responses_store_max_mb=max(1, args.responses_store_max_mb),
        conversations_store_size=max(0, args.conversations_store_size),
        embeddings_pooling=args.embeddings_pooling,
        conversations_store_max_mb=max(1, args.conversations_store_max_mb),
    )


class CancelledAtShutdown(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" traceback for each request it cancels when
    --graceful-shutdown-timeout runs out (uvicorn cancels tasks at no other time); it has already
    said "Cancel N running task(s), timeout graceful shutdown exceeded" once. Also the traceback
    of the app's lifespan cancelled at a forced exit (a second Ctrl-C: no lifespan shutdown then),
    which Starlette reports as text."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        message = record.getMessage().strip()
        if exc is not None and issubclass(exc, asyncio.CancelledError) and message == "Exception in ASGI application":
            return False
        return not (message.startswith("Traceback") and message.endswith("asyncio.exceptions.CancelledError")
                    and "in lifespan" in message)


def log_config() -> dict:
    """uvicorn's logging configuration with CancelledAtShutdown on its error log (a configuration,
    not a filter added here: --workers processes configure their logging from it)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["cancelled_at_shutdown"] = {"()": "openai_frontend.__main__.CancelledAtShutdown"}
    config["loggers"]["uvicorn.error"].setdefault("filters", []).append("cancelled_at_shutdown")
    return config


FRONTEND_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # no '@' or '.': Triton ids are parsed on them


def main(argv: Optional[Sequence[str]] = None) -> None:
    import uvicorn

    from openai_frontend.server import create_app, freeze_startup_heap

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    if not FRONTEND_ID.fullmatch(settings.frontend_id):
        raise SystemExit("--frontend-id: letters, digits, '_' and '-' only")
    if args.enable_reasoning and not args.reasoning_parser:
        raise SystemExit("--enable-reasoning needs --reasoning-parser")
    urls = settings.triton_urls
    if len(set(urls)) != len(urls):
        raise SystemExit(f"--triton-url: a server is named twice ({settings.triton_url})")
    try:
        settings.router_config()
    except ValueError as exc:
        raise SystemExit(f"--router-*: {exc}") from None
    try:
        settings.check_lora_modules()
    except ValueError as exc:
        raise SystemExit(f"--lora-modules: {exc}") from None
    if settings.reasoning_parser:
        from openai_frontend.reasoning import get_reasoning_format

        try:
            get_reasoning_format(settings.reasoning_parser)
        except ValueError as exc:
            raise SystemExit(f"--reasoning-parser: {exc}") from None
    if settings.tool_call_parser:
        from openai_frontend.errors import APIError
        from openai_frontend.tools import get_parser

        try:
            get_parser(settings.tool_call_parser)  # fail at startup on an unknown parser name
        except APIError as exc:
            raise SystemExit(f"--tool-call-parser: {exc.message}") from None
    options = dict(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.graceful_shutdown_timeout,
        log_config=log_config(),
        # uvicorn's C HTTP parser and event loop, when installed, cut the per-chunk cost of
        # streaming by about a quarter
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
    )
    if args.workers > 1:
        import dataclasses
        import json

        from openai_frontend.server import SETTINGS_ENV, SUPERVISOR_ENV

        sweep_metrics_dirs()
        settings.metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
        share_router_memory(settings)
        os.environ[SETTINGS_ENV] = json.dumps(dataclasses.asdict(settings))
        os.environ[SUPERVISOR_ENV] = str(os.getpid())
        try:
            uvicorn.run("openai_frontend.server:app_from_env", factory=True, workers=args.workers, **options)
        finally:
            shutil.rmtree(settings.metrics_dir, ignore_errors=True)
    else:
        from openai_frontend import forced_exit

        app = create_app(settings)
        forced_exit.install()
        freeze_startup_heap()  # this process serves until it exits
        uvicorn.run(app, **options)


METRICS_DIR_PREFIX = "openai-frontend-metrics-"


def share_router_memory(settings: Settings) -> None:
    """Several tritonservers under several --workers: one memory of what each server was sent,
    in a file of the workers' shared directory, so that a chat's next turn finds its server
    whichever process takes it (openai_frontend/router_memory.py)."""
    from openai_frontend.router import CACHE_POLICIES
    from openai_frontend.router_memory import RouterMemory, shared_path

    servers = len(settings.triton_urls)
    if servers < 2 or settings.router_policy not in CACHE_POLICIES:
        return
    path = shared_path(settings.metrics_dir)
    RouterMemory.create_file(path, servers, settings.router_config().max_chunks * servers)
    settings.router_memory_path = path


def sweep_metrics_dirs(root: Optional[str] = None) -> None:
    """Remove the metrics directories of multi-worker frontends that are gone: one killed
    (SIGKILL, OOM) never reached its `finally` (QA: 66 such directories in /tmp). Each is named
    after its supervisor's pid; one whose process lives, or that names none, is left alone."""
    base = Path(root or tempfile.gettempdir())
    for d in base.glob(f"{METRICS_DIR_PREFIX}*-*"):
        pid = d.name[len(METRICS_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and d.is_dir() and not process_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()

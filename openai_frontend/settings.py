"""The frontend's configuration (filled from the CLI, or directly by tests / embedders)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Optional

from openai_frontend.router import RouterConfig


@dataclass
class Settings:
    # Triton's gRPC endpoint; several, comma-separated, are tritonservers serving the same model
    # (one per GPU), among which each generation is routed (openai_frontend/router.py).
    triton_url: str = "localhost:8001"
    router_policy: str = "cache_aware"
    router_cache_threshold: float = 0.5
    router_balance_abs_threshold: int = 32
    router_balance_rel_threshold: float = 1.0001
    router_load_beta: float = 1.0
    router_placement: str = "least_seen"  # the CLI's auto: hash with several --workers (router.py)
    triton_model: str = "ensemble"  # the Triton model requests go to
    model_name: Optional[str] = None  # the served name clients use; default: see served_model_name
    api_key: Optional[str] = None
    tool_call_parser: Optional[str] = None
    # vLLM's flag: tool_choice "none" keeps the tools in the prompt unless set (OpenAI's meaning:
    # the model sees them and does not call them; the prompt, and its cached prefix, stay those
    # of the turns before, which an agent's closing turn of tool_choice "none" reuses).
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: Optional[str] = None  # openai_frontend/reasoning.py; None: no separation
    # Names of the LoRA adapters the engine serves (its lora_modules): a request's `model` may be
    # one of them (vLLM's --lora-modules); /v1/models lists them.
    lora_modules: tuple[str, ...] = ()
    # SGLang's /load_lora_adapter and vLLM's /v1/load_lora_adapter (vLLM gates them with
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING): the engine loads server-side paths, so off by default.
    allow_runtime_lora_updating: bool = False
    tokenizer_path: Optional[str] = None
    max_n: int = 64
    stream_timeout: Optional[float] = None  # seconds for one whole generation; None: no limit
    # Model that accepts `abort_request_id` to stop a request whose stream was cancelled (Triton
    # 2.51 does not cancel an ensemble's in-flight decoupled step). None: rely on gRPC cancellation.
    abort_model: Optional[str] = "llm"
    # Part of every Triton request id this frontend makes, so that any process sharing it (the
    # --workers of one launch, replicas given the same --frontend-id) can abort the others'
    # requests by rid or all at once (SGLang's /abort_request) through abort_model.
    frontend_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # --workers N: the directory where each worker writes its metrics, so that /metrics answers
    # with all of theirs (openai_frontend/metrics.py SharedMetrics). None: one process.
    metrics_dir: Optional[str] = None
    # --workers N with several tritonservers: the file of the router's memory that they share
    # (openai_frontend/router_memory.py), in metrics_dir. None: each process keeps its own.
    router_memory_path: Optional[str] = None
    # Input safety (issue 7): request body size, stop strings per request.
    max_body_bytes: int = 8 * 1024 * 1024
    max_stop_strings: int = 64
    # SGLang's custom_logit_processor runs client-supplied code in the engine: refused (400)
    # unless enabled here (and in the engine: LLM_ENABLE_CUSTOM_LOGIT_PROCESSOR).
    enable_custom_logit_processor: bool = False
    retry_after_s: int = 1  # Retry-After on 503s (overload, Triton down)
    health_generate_timeout: float = 20.0  # seconds /health_generate waits for its one token
    # /v1/responses with store (OpenAI's default): this many responses, those read or written last,
    # are kept for GET /v1/responses/{id} and previous_response_id (in metrics_dir with
    # --workers, shared).
    # 0: none kept, and responses say "store": false.
    responses_store_size: int = 4096
    responses_store_max_mb: int = 256  # ... and at most this much of their JSON
    # /v1/conversations: a store of their own, so that no number of responses evicts a
    # conversation; the least recently used go first past this many or this much JSON.
    conversations_store_size: int = 4096
    # /v1/embeddings: how the prompt's final-norm hidden rows are pooled ("last", "mean"); "off"
    # refuses the route (openai_frontend/embeddings.py).
    embeddings_pooling: str = "off"
    conversations_store_max_mb: int = 256

    @property
    def triton_urls(self) -> list[str]:
        return [u.strip() for u in self.triton_url.split(",") if u.strip()]

    def router_config(self) -> RouterConfig:
        """Raises ValueError on a setting out of range."""
        return RouterConfig(policy=self.router_policy, cache_threshold=self.router_cache_threshold,
                            balance_abs_threshold=self.router_balance_abs_threshold,
                            balance_rel_threshold=self.router_balance_rel_threshold, load_beta=self.router_load_beta,
                            placement=self.router_placement)

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.tokenizer_path:
            return self.tokenizer_path.rstrip("/").rsplit("/", 1)[-1]
        return self.triton_model

    @property
    def model_aliases(self) -> frozenset[str]:
        """The names a request's `model` may give the base model (Context.check_model). Without
        --model-name, also --tokenizer-path as the frontend was given it (scripts/serve.sh gives
        the absolute path): vLLM and SGLang name a model by its path (`--model /models/X`) unless
        told otherwise, and their clients send that."""
        names = {self.served_model_name, self.triton_model}
        if not self.model_name and self.tokenizer_path:
            names |= {self.tokenizer_path, self.tokenizer_path.rstrip("/")}
        return frozenset(names)

    def lora_name_error(self, name: str, adapters: tuple[str, ...] = ()) -> Optional[str]:
        """Why `name` cannot name a new LoRA adapter (None when it can): a request's `model` has
        to tell the base model and every adapter apart."""
        if name in self.model_aliases:
            which = ("the served model's name" if name == self.served_model_name
                     else "the Triton model's name, which requests may give for the served model"
                     if name == self.triton_model else "the served model's path, which requests may give for it")
            return f"'{name}' is {which}; a LoRA adapter needs a name of its own"
        if name in adapters:
            return f"LoRA adapter '{name}' is already loaded"
        return None

    def check_lora_modules(self) -> None:
        """Raise ValueError when a --lora-modules name is the served model's or repeats."""
        for i, name in enumerate(self.lora_modules):
            if not name:
                raise ValueError("a LoRA adapter needs a name (NAME=PATH)")
            if name in self.lora_modules[:i]:
                raise ValueError(f"LoRA adapter '{name}' is named twice")
            error = self.lora_name_error(name)
            if error:
                raise ValueError(error)

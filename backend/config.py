"""Engine configuration: what the llm model's config.pbtxt parameters and the CLI can set."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backend.speculative import SpeculativeConfig


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: Path
    device: str = Field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None
    block_size: int = Field(default=16, ge=1)
    # Pool size: num_kv_blocks wins; otherwise kv_cache_memory_mb; otherwise (CUDA) a fraction
    # of the free device memory.
    num_kv_blocks: Optional[int] = Field(default=None, ge=1)
    kv_cache_memory_mb: Optional[int] = Field(default=None, ge=1)
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    # vLLM's / SGLang's --kv-cache-dtype: what the KV cache stores. "auto" is the model's dtype;
    # a narrower one holds more tokens in the same memory (bfloat16 or float16 twice as many as
    # float32, fp8 four times) and decode attention reads less. Attention still computes in
    # float32 (kernels widen the cached rows); the new K/V are rounded once, when written. fp8
    # is e4m3 ("fp8" as in vLLM) or e5m2 with a scale of 1.0 (vLLM's default without scales in
    # the checkpoint): values past the format's range saturate at +-448 / +-57344.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    # vLLM's --calculate-kv-scales: an fp8 cache's per-layer K/V scales measured at start-up, from a
    # prefill of a fixed text, as max|K| / 200 and max|V| / 100 (vLLM's K_SCALE_CONSTANT and
    # V_SCALE_CONSTANT, headroom for inputs larger than the calibration's), instead of the
    # checkpoint's scales or 1.0. vLLM measures on the first forward pass; here it is before any
    # request, so the scales do not depend on which request came first, and CUDA graphs capture them.
    calculate_kv_scales: bool = False
    max_num_seqs: int = Field(default=128, ge=1)  # 0 would admit nothing: every request would wait
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # Prefill tokens per step while other sequences decode (chunked prefill keeps their
    # inter-token latency bounded). None: 96 on CPU, 512 on CUDA.
    max_prefill_tokens_while_decoding: Optional[int] = Field(default=None, ge=1)
    # While others decode, a prefill token at context c counts 1 + c / this against that cap:
    # a chunk's attention grows with its context, and on CPU a 128-token chunk at 3k context
    # took 3x the time of one at the start. None: 640 on CPU (a prefill token there cost ~17 us at
    # context 0 and ~95 us at context 3k on 2 cores, mostly attention), 0 (off) on CUDA.
    prefill_context_unit: Optional[int] = Field(default=None, ge=0)
    # While others decode, the cap above grows to this many prefill tokens per decoding sequence
    # when that is more: a step's decode work sets its duration, so a prefill share proportional
    # to it inflates inter-token latency by about the same factor at any batch size, while a
    # fixed cap makes a large batch take hundreds of steps to admit its prompts. None: 6 on CPU,
    # 0 (off) on CUDA.
    prefill_tokens_per_decode: Optional[int] = Field(default=None, ge=0)
    # The caps above are lifted while more than this many requests per running one wait: in a
    # burst the step admits with its whole token budget (vLLM's policy) until the batch has
    # caught up with the queue (or every seat is taken). Users waiting for a first token then
    # outnumber the streams the caps protect. 64 requests at once on 2 CPU cores: TTFT p50 ~500 ->
    # ~250 ms, ITL p99 +10-40%. A long prompt arriving beside running streams (one waits) is still
    # capped. 0: never.
    prefill_cap_queue_ratio: float = Field(default=1.0, ge=0)
    # A step whose prefill chunks and decodes come to at most this many tokens runs as a decode
    # step does: every token one query of the paged kernel, reading the cache in place up to its
    # own position (ModelRunner._prepare_flat); on CUDA that step replays a decode graph when its
    # token count fits one, instead of the eager mixed step. While streams decode, chunks are cut
    # to fit beside them. 0: never. None: on CUDA with graphs, 128 (at most max_num_seqs, the
    # largest graph): on an H100, 8 streams' ITL p99 while a 3072-token prompt arrived went from
    # 3.5x to 1.5x its value without it, that prompt's TTFT from 49 to 78 ms (docs/BENCHMARKS.md).
    # 0 on the CPU, where it measured slower (each query reads its whole context).
    flat_prefill_tokens: Optional[int] = Field(default=None, ge=0)
    max_model_len: Optional[int] = Field(default=None, ge=1)
    # vLLM's --speculative-config (a JSON object or its text): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": .., "prompt_lookup_min": ..,
    # "disable_by_batch_size": ..} drafts up to k tokens a step from each sequence's own history
    # and verifies them in that step (backend/speculative.py). None: off.
    speculative_config: Optional[SpeculativeConfig] = None
    # vLLM's --scheduling-policy: "fcfs" (arrival order), or "priority": a request's `priority`
    # (lower first, arrival breaks ties) orders the waiting queue, the running batch's share of
    # the step budget and which sequence is preempted first (the last in that order).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    seed: int = 0
    # Requests the next step cannot start (past max_num_seqs) wait; past this many waiting ones they
    # are refused as overloaded (bounded memory under load). At least 1: a request is counted as
    # waiting until a step starts it, so 0 refused every request, an idle server's too (QA).
    max_waiting_requests: int = Field(default=1024, ge=1)
    # Content-addressed sharing of full KV blocks between requests with a common prefix.
    enable_prefix_caching: bool = True
    # Loading a serialized CustomLogitProcessor runs code from the request: off unless enabled.
    enable_custom_logit_processor: bool = False
    # vLLM's --logits-processor-pattern: requests' logits_processors may name only server code
    # whose qualified name this regex matches (re.match). None: no processors at all.
    logits_processor_pattern: Optional[str] = None
    sampling_defaults: Literal["model", "openai"] = "model"
    # Which distribution output logprobs describe: "processed" (SGLang's: after logit_bias,
    # penalties, grammar and temperature, before top-k/top-p/min-p) or "raw_logprobs" (vLLM's
    # default --logprobs-mode: the model's own). Prompt logprobs are the model's either way.
    logprobs_mode: Literal["processed", "raw_logprobs"] = "processed"
    # CPU threads for the step loop's torch ops. None: one on CUDA, torch's default on the CPU
    # (engine.default_torch_threads).
    torch_threads: Optional[int] = Field(default=None, ge=1)
    # Decode steps replayed from CUDA graphs (backend/decode_graphs.py). None: on for CUDA
    # (vLLM's default; its --enforce-eager is cuda_graphs=false). CPU: always eager.
    cuda_graphs: Optional[bool] = None
    # Jump-forward decoding for structured output: text the grammar forces (a JSON key, the
    # literal part of a regex) is appended without sampling and computed in the next step as
    # one chunk (backend/grammar.py). Off by default: the forced text's token boundaries are
    # the tokenizer's, not the model's choice, so outputs differ from token-by-token decoding.
    enable_jump_forward: bool = False
    # LoRA adapters served next to the base model, name -> PEFT directory (vLLM's --lora-modules,
    # SGLang's --lora-paths); "name=path,name2=path2" is accepted too. Requests pick one by name.
    lora_modules: dict[str, str] = Field(default_factory=dict)

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        # Checked here, not where torch first meets it: its message named no setting.
        try:
            kind = torch.device(v).type
        except RuntimeError:
            kind = None
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {v!r}")
        return v

    @field_validator("logits_processor_pattern")
    @classmethod
    def _compiles(cls, v: Optional[str]) -> Optional[str]:
        # A bad pattern must stop the server at start-up: matched per request, it made every
        # request with logits_processors a 500 (QA).
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"logits_processor_pattern {v!r} is not a valid regular expression: {exc}") from None
        return v

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, v: Any) -> Any:
        from backend.lora import parse_lora_modules

        return parse_lora_modules(v)

    @model_validator(mode="after")
    def _kv_scales_need_fp8(self) -> "EngineConfig":
        if self.calculate_kv_scales and self.kv_cache_dtype not in _FP8:
            raise ValueError(f"calculate_kv_scales needs an fp8 kv_cache_dtype (fp8, fp8_e4m3, fp8_e5m2), "
                             f"not '{self.kv_cache_dtype}': only an fp8 cache is scaled")
        return self

    def prefill_cap(self) -> int:
        if self.max_prefill_tokens_while_decoding is not None:
            return self.max_prefill_tokens_while_decoding
        return 512 if self.device.startswith("cuda") else 96

    def prefill_unit(self) -> int:
        if self.prefill_context_unit is not None:
            return self.prefill_context_unit
        return 0 if self.device.startswith("cuda") else 640

    def prefill_per_decode(self) -> int:
        if self.prefill_tokens_per_decode is not None:
            return self.prefill_tokens_per_decode
        return 0 if self.device.startswith("cuda") else 6

    def flat_tokens(self) -> int:
        if self.flat_prefill_tokens is not None:
            return self.flat_prefill_tokens
        # A flat step pays by replaying a decode graph: up to what the largest one holds.
        return min(128, self.max_num_seqs) if self.use_cuda_graphs() else 0

    def use_cuda_graphs(self) -> bool:
        return self.device.startswith("cuda") and self.cuda_graphs is not False

    def model_dtype(self) -> torch.dtype:
        """The weights' dtype once "auto" is resolved: bf16 on CUDA, float32 on the CPU."""
        if self.dtype:
            return getattr(torch, self.dtype)
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    def kv_torch_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "auto":
            return self.model_dtype()
        if self.kv_cache_dtype in _FP8:
            return _FP8[self.kv_cache_dtype]
        return getattr(torch, self.kv_cache_dtype)


_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

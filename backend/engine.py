"""The engine: one background loop that schedules, runs the model, samples and reports.

Callers (the Triton llm model, tests, benchmarks) talk to it through `add_request` and `abort`,
from any thread; both only enqueue. Everything else happens on the loop's thread at step
boundaries, so the scheduler and KV bookkeeping need no locks.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from backend.block_manager import BlockManager
from backend.config import EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.model_runner import ModelRunner
from backend.outputs import OutputState, RequestOutput
from backend.sampler import Sampler, SamplingRow
from backend.sampling_params import SamplingParams, load_model_defaults, parse_sampling_params
from backend.scheduler import Scheduler
from backend.sequence import FinishReason, Sequence
from backend.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

OutputCallback = Callable[[RequestOutput], None]


class RequestError(ValueError):
    """A request the engine refuses; the message says why."""


@dataclass
class _Tracked:
    seq: Sequence
    on_output: OutputCallback
    state: OutputState


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    num_preemptions: int
    num_steps: int
    prompt_tokens_total: int
    generation_tokens_total: int


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = Path(config.model_path)
        self.tokenizer = load_tokenizer(model_path)
        device = torch.device(config.device)
        probe = ModelRunnerSizing(model_path, config)
        self.max_model_len = probe.max_model_len
        self.model = ModelRunner(
            model_path, probe.num_blocks, config.block_size, device=device, dtype=config.torch_dtype()
        )
        self.block_manager = BlockManager(probe.num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(device, seed=config.seed)
        self.defaults = load_model_defaults(model_path) if config.sampling_defaults == "model" else {}
        self.eos_ids = frozenset(_eos_token_ids(model_path, self.tokenizer))
        self.vocab_size = self.model.config.vocab_size

        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._num_steps = 0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self.on_step: Optional[Callable[[EngineStats], None]] = None

    # ------------------------------------------------------------------ API
    def parse_params(self, raw: dict[str, Any]) -> SamplingParams:
        return parse_sampling_params(raw, self.defaults)

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: OutputCallback,
        request_id: Optional[str] = None,
        is_cancelled: Optional[Callable[[], bool]] = None,
    ) -> str:
        """Validate and enqueue. Raises RequestError for a request that can never run."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, but the context is {self.max_model_len} tokens "
                "(at least one must be left to generate)"
            )
        request_id = request_id or uuid.uuid4().hex
        max_new = min(params.max_new_tokens, self.max_model_len - len(prompt_ids))
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt_ids),
            params=params,
            max_new_tokens=max_new,
            is_cancelled=is_cancelled,
            arrival_time=time.monotonic(),
        )
        detok = IncrementalDetokenizer(
            self.tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        state = OutputState(detok=detok, stops=list(params.stop), eos_ids=self.eos_ids)
        self._inbox.put(("add", _Tracked(seq, on_output, state)))
        self._wakeup.set()
        return request_id

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.block_manager.num_blocks,
            num_free_kv_blocks=self.block_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
        )

    def has_unfinished(self) -> bool:
        return bool(self._tracked) or not self._inbox.empty()

    # ------------------------------------------------------------------ loop
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self._drain_inbox()
        for request_id in list(self._tracked):
            self._end(request_id, FinishReason.ABORT, error="the server is shutting down")

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.step():
                if self.on_step is not None:
                    self.on_step(self.stats())  # idle: publish the settled numbers
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()

    def step(self) -> bool:
        """One engine iteration. Returns False when there was nothing to do."""
        self._drain_inbox()
        self._check_cancelled()
        if not self.scheduler.has_work():
            return False
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return False
        try:
            self._run(scheduled)
        except Exception as exc:  # a failed step must not kill the loop or leak blocks
            log.exception("engine step failed")
            for item in scheduled:
                self._end(item.seq.request_id, FinishReason.ABORT, error=f"engine step failed: {exc}")
        self._num_steps += 1
        if self.on_step is not None:
            self.on_step(self.stats())
        return True

    def _run(self, scheduled: list) -> None:
        chunks = []
        for item in scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            ids = seq.token_ids[start : start + item.num_new_tokens]
            chunks.append((ids, start, seq.block_table, item.samples))
            if start < seq.num_prompt_tokens:
                self._prompt_tokens_total += min(item.num_new_tokens, seq.num_prompt_tokens - start)
        batch = self.model.prepare(chunks)
        logits = self.model.forward(batch)
        sampling = [item for item in scheduled if item.samples]
        rows = [SamplingRow(item.seq.params, item.seq.num_output_tokens) for item in sampling]
        next_tokens = self.sampler(logits, rows) if rows else []
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        for item, token in zip(sampling, next_tokens):
            seq = item.seq
            seq.token_ids.append(int(token))
            self._generation_tokens_total += 1
            tracked = self._tracked[seq.request_id]
            out = tracked.state.on_tokens(seq, [int(token)])
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
                del self._tracked[seq.request_id]
            if out is not None:
                self._emit(tracked, out)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                tracked: _Tracked = payload
                rid = tracked.seq.request_id
                if rid in self._tracked:
                    tracked.seq.finish_reason = FinishReason.ABORT
                    self._emit(tracked, tracked.state.close(tracked.seq, error=f"duplicate request id '{rid}'"))
                    continue
                self._tracked[rid] = tracked
                if tracked.seq.max_new_tokens == 0:
                    self._end(rid, FinishReason.LENGTH)
                else:
                    self.scheduler.add(tracked.seq)
            elif kind == "abort":
                self._end(payload, FinishReason.ABORT)

    def _check_cancelled(self) -> None:
        for rid, tracked in list(self._tracked.items()):
            check = tracked.seq.is_cancelled
            if check is not None and check():
                self._end(rid, FinishReason.ABORT)

    def _end(self, request_id: str, reason: FinishReason, error: Optional[str] = None) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        seq = tracked.seq
        self.scheduler.finish(seq, reason)
        self._emit(tracked, tracked.state.close(seq, error=error))

    @staticmethod
    def _emit(tracked: _Tracked, out: RequestOutput) -> None:
        try:
            tracked.on_output(out)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("output callback failed for %s", out.request_id)

    # ------------------------------------------------------------------ sync helper
    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[RequestOutput]:
        """Run prompts to completion on the calling thread (tests, benchmarks). Engine must not be started."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        results: dict[str, RequestOutput] = {}
        order = []

        def collect(out: RequestOutput) -> None:
            prev = results.get(out.request_id)
            results[out.request_id] = out if prev is None else prev.merge(out)

        for ids, p in zip(prompts, params):
            order.append(self.add_request(ids, p, collect))
        while self.has_unfinished():
            self.step()
        return [results[rid] for rid in order]


class ModelRunnerSizing:
    """Pool size and context length, decided before the model is built."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        cfg = json.loads((model_path / "config.json").read_text())
        ctx = cfg.get("max_position_embeddings", 4096)
        self.max_model_len = min(config.max_model_len or ctx, ctx)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        dtype = config.torch_dtype() or (torch.bfloat16 if config.device.startswith("cuda") else torch.float32)
        elem = torch.empty((), dtype=dtype).element_size()
        bytes_per_block = 2 * cfg["num_hidden_layers"] * config.block_size * kv_heads * head_dim * elem
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory_mb is not None:
            num_blocks = config.kv_cache_memory_mb * 2**20 // bytes_per_block
        elif config.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            weights = sum(f.stat().st_size for f in model_path.glob("*.safetensors"))
            num_blocks = int(max(free - weights * 1.2, 0) * config.gpu_memory_utilization) // bytes_per_block
        else:
            num_blocks = 2**30 // bytes_per_block  # 1 GiB on CPU
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV pool ({num_blocks} blocks of {config.block_size}) cannot hold one sequence of the "
                f"context length {self.max_model_len}; raise num_kv_blocks or lower max_model_len"
            )
        self.num_blocks = int(num_blocks)


def _eos_token_ids(model_path: Path, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))

"""The engine: one background loop that schedules, runs the model, samples and reports.

Callers (the Triton llm model, tests, benchmarks) talk to it through `add_request` and `abort`,
from any thread; both only enqueue. Everything else happens on the loop's thread at step
boundaries, so the scheduler and KV bookkeeping need no locks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import regex
import torch

from backend.block_manager import BlockManager
from backend.cancel_watch import CancelWatch
from backend.config import EngineConfig
from backend.detokenizer import IncrementalDetokenizer
from backend.draft_model import DraftModelProposer
from backend.grammar import MATCH_TIME_LIMIT_S, DraftMask
from backend.host_limits import available_memory_bytes
from backend.lora import LoraAdapter
from backend.model_files import read_json
from backend.model_runner import ModelConfig, ModelRunner, weight_files
from backend.outputs import OutputState, RequestOutput, StopRegexTimeout
from backend.predicted_outputs import DEFAULT_DRAFT_TOKENS, Prediction, PredictionProposer
from backend.quantized_checkpoint import CALIBRATION_TEXT
from backend.sampler import Sampler, SamplerOutput, SamplingRow, TokenLogprobs, logprobs_at
from backend.sampling_params import SamplingParams, load_default_max_tokens, load_model_defaults, parse_sampling_params
from backend.scheduler import ScheduledSeq, Scheduler
from backend.sequence import FinishReason, Sequence, sample_request_id
from backend.speculative import NgramProposer, speculates
from backend.tokenizer import bad_word_token_ids, load_tokenizer
from kernels import cpu_sampling

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1
CANCEL_CHECKS_PER_S = 100  # is_cancelled round trips per second at most (backend/cancel_watch.py)

OutputCallback = Callable[[RequestOutput], None]


class RequestError(ValueError):
    """A request the engine refuses; the message says why."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


@dataclass
class _Tracked:
    seq: Sequence
    on_output: OutputCallback
    state: OutputState
    grammar_future: Any = None  # concurrent.futures.Future of a compiled grammar
    grammar: Any = None  # GrammarState once compiled
    custom_processor: Any = None
    group: str = ""  # the request id shared by the n samples of one request
    logits_processors: list = field(default_factory=list)  # this sample's own instances


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
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found cached
    num_cached_kv_blocks: int = 0
    # Wall time of steps, and the loop thread's CPU time within them. Their ratio is how much of
    # a step the loop actually ran: with one torch thread, the rest is waiting for a core or the
    # GIL (on a small host, the server's response handling competes with the model).
    step_seconds_total: float = 0.0
    step_thread_cpu_seconds_total: float = 0.0
    # Of generation_tokens_total, the tokens a grammar forced (jump-forward decoding), and how
    # many sampled tokens were respelled with the forced text that followed them.
    jump_forward_tokens_total: int = 0
    jump_forward_respelled_total: int = 0
    # Speculative decoding: draft tokens verified, and of them accepted (each accepted one is a
    # generation token a step did not have to be run for).
    spec_drafts_total: int = 0  # drafts verified (accepted / drafts + 1: tokens a verifying step yields)
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    # Per draft position (0 first): how many drafts reached it and kept its token, for tuning
    # num_speculative_tokens (vLLM's num_accepted_tokens_per_pos).
    spec_accepted_per_position: tuple[int, ...] = ()


@contextlib.contextmanager
def _without_thread_team() -> Iterator[None]:
    """Run the block's torch ops on the calling thread alone (no OpenMP worker threads).

    libgomp lets its idle workers spin for the next parallel region only while all the worker
    threads it manages fit the CPUs. Loading the weights on the caller's thread with N threads
    leaves that thread a team of N - 1 workers; the step loop's own team then oversubscribes the
    CPUs, and every team's workers sleep and are woken per parallel region (a step has dozens).
    Measured on 2 cores, demo model, 64 requests: 2100-2700 tok/s with the caller's team alive,
    3800-4100 without it, 3000 with one thread.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def default_torch_threads(device: str) -> int:
    """The step loop's OpenMP threads when the config leaves them unset. On CUDA, one: the host
    side of a step is small tensors, and each parallel region leaves torch's idle workers
    spinning for the next. On an H100 host (16 cores) the engine process's 15 workers took 2.5
    cores doing nothing, the cores that tritonserver's response path needed: through the
    ensemble, 4711 -> 7927 tok/s at concurrency 64 with one thread (vLLM sets its workers'
    OMP_NUM_THREADS to 1 for the same reason). On the CPU the threads are the model's compute."""
    return 1 if device.startswith("cuda") else torch.get_num_threads()


def _cache_salt(adapter: Optional[LoraAdapter], salt: Optional[str]) -> Optional[int]:
    """Where the prompt's prefix-cache hash chain starts: an adapter's blocks hold other values,
    and a client's salt isolates its prompts from everyone without the same salt."""
    base = adapter.cache_salt if adapter is not None else None
    return base if salt is None else hash(("cache_salt", base, salt))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The step loop's thread sets this for itself (start()): the OpenMP thread count is kept
        # per thread.
        self.torch_threads = config.torch_threads or default_torch_threads(config.device)
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        with _without_thread_team():
            self._build(config)

    def _build(self, config: EngineConfig) -> None:
        model_path = Path(config.model_path)
        self.tokenizer = load_tokenizer(model_path)
        device = torch.device(config.device)
        probe = ModelRunnerSizing(model_path, config)
        self.max_model_len = probe.max_model_len
        graph_batch = config.max_num_seqs if config.use_cuda_graphs() else 0
        self.model = ModelRunner(
            model_path, probe.num_blocks, config.block_size, device=device, dtype=config.model_dtype(),
            kv_dtype=config.kv_torch_dtype(), graph_batch=graph_batch,
        )
        self.model.flat_tokens = config.flat_tokens()
        if config.calculate_kv_scales:
            ids = self.tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=True)[: self.max_model_len]
            scales = self.model.calibrate_kv_scales(ids)
            log.info("fp8 KV cache scales measured on %d tokens: %s", len(ids),
                     ", ".join(f"{k:.4g}/{v:.4g}" for k, v in scales))
        for name, path in config.lora_modules.items():
            self.load_lora(name, path)
        if graph_batch:
            t0 = time.perf_counter()
            problem = self.model.enable_decode_graphs()
            if problem:
                log.warning("CUDA graphs off, decode runs eagerly: %s", problem)
            else:
                log.info("CUDA graphs for decode batches up to %d captured in %.1f s",
                         self.model.graphs.max_batch, time.perf_counter() - t0)
        # Every layer's window (ModelConfig.uniform_window), 0 when any layer attends to the whole context.
        self.block_manager = BlockManager(probe.num_blocks, config.block_size, config.enable_prefix_caching,
                                          sliding_window=self.model.window)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.prefill_cap(),
            prefill_context_unit=config.prefill_unit(), prefill_tokens_per_decode=config.prefill_per_decode(),
            policy=config.scheduling_policy, flat_step_tokens=config.flat_tokens(),
            prefill_cap_queue_ratio=config.prefill_cap_queue_ratio,
        )
        self.sampler = Sampler(self.model.config.vocab_size, config.logprobs_mode)
        spec = config.speculative_config
        self.proposer: Any = None
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(spec)
        elif spec is not None:
            self.proposer = DraftModelProposer(
                spec.model, spec.num_speculative_tokens, probe.num_blocks, config.block_size,
                self.model.config.vocab_size, self.max_model_len, self.model.device, self.model.dtype, self.model.kv_dtype,
                graph_batch=graph_batch,
            )
        self.predictions = PredictionProposer(spec.num_speculative_tokens if spec is not None else DEFAULT_DRAFT_TOKENS)
        self._num_predicting = 0  # tracked sequences whose request carries a prediction
        if self.model.device.type == "cpu":
            # Built (or loaded from torch's extension cache) now, during model load, rather than
            # by the first sampled request: a first build takes ~20 s.
            cpu_sampling.load()
        self._seed_rng = random.Random(config.seed)
        self._grammar_compiler: Any = None
        self._compiling: list[_Tracked] = []
        self._groups: dict[str, list[str]] = {}
        self.defaults = load_model_defaults(model_path) if config.sampling_defaults == "model" else {}
        self.default_max_tokens = load_default_max_tokens(model_path) if config.sampling_defaults == "model" else None
        self.eos_ids = frozenset(_eos_token_ids(model_path, self.tokenizer))
        self.vocab_size = self.model.config.vocab_size
        self._embeds_placeholder = _placeholder_id(self.tokenizer, self.eos_ids)

        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        # Sequences (a request's n samples each) added and not yet taken from the inbox: waiting
        # is counted in sequences in the inbox and the scheduler alike.
        self._inbox_seqs = 0
        self._inbox_lock = threading.Lock()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._stop = threading.Event()
        self._running = threading.Event()  # run() is looping (on start()'s thread or a caller's)
        self._thread: Optional[threading.Thread] = None
        self._num_steps = 0
        self._cancel_watch = CancelWatch(CANCEL_POLL_S, CANCEL_CHECKS_PER_S)
        self._next_cancel_poll = 0.0
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._jump_forward_tokens_total = 0
        self._jump_forward_respelled_total = 0
        self._spec_drafts_total = 0
        self._spec_draft_tokens_total = 0
        # Kept draft tokens per draft position; their sum is every kept draft token.
        self._spec_accepted_per_position: list[int] = []
        self._step_seconds = 0.0
        self._step_cpu_seconds = 0.0
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
        input_embeds: Any = None,
    ) -> str:
        """Validate and enqueue. Raises RequestError for a request that can never run.

        `input_embeds` (SGLang's): the prompt as rows of the model's embedding space, [L, hidden]
        (a tensor, an array or nested lists), instead of `prompt_ids`, which must then be empty.
        """
        embeds = None
        if input_embeds is not None:
            if prompt_ids:
                raise RequestError("give either prompt token ids or input_embeds, not both")
            embeds = self._prompt_embeds(input_embeds, params)
            # Placeholders keep the sequence's positions, block accounting and detokenization
            # windows as for any prompt; a special token, so a window that reaches back into
            # the prompt decodes it to nothing. The model reads the embeddings instead.
            prompt_ids = [self._embeds_placeholder] * embeds.shape[0]
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise RequestError(
                f"priority {params.priority} needs priority scheduling, and this server schedules first come, "
                "first served (start it with scheduling_policy=priority)"
            )
        if params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-params.truncate_prompt_tokens :]  # vLLM: keep the last k
            if embeds is not None:
                embeds = embeds[-params.truncate_prompt_tokens :]
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size] if embeds is None else []
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of range [0, {self.vocab_size})")
        # A whole context is only scored (max_new_tokens 0, vLLM's echo with max_tokens 0).
        if len(prompt_ids) > self.max_model_len or (len(prompt_ids) == self.max_model_len and params.max_new_tokens != 0):
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens, but the context is {self.max_model_len} tokens "
                "(at least one must be left to generate)"
            )
        # Queued requests that the next step can start (free running slots) are not waiting:
        # otherwise a burst arriving between two steps is refused before max_num_seqs fill up,
        # and how many get in depends on how the arrivals fall between steps.
        queued = len(self.scheduler.waiting) + self._inbox_seqs + len(self._compiling)
        waiting = max(0, queued - max(0, self.scheduler.max_num_seqs - len(self.scheduler.running)))
        if waiting >= self.config.max_waiting_requests:
            raise EngineOverloaded(
                f"the server is overloaded: {waiting} sequences are already waiting (max_waiting_requests="
                f"{self.config.max_waiting_requests}); retry later"
            )
        request_id = request_id or uuid.uuid4().hex
        if params.logprob_start_len >= len(prompt_ids):
            raise RequestError(
                f"logprob_start_len {params.logprob_start_len} must be less than the prompt length {len(prompt_ids)}"
            )
        # An id past the vocabulary can never be scored or sampled: a stop id there would never
        # stop anything, a bias never apply.
        for name, ids in (("token_ids_logprob", params.token_ids_logprob), ("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids), ("stop_token_ids", params.stop_token_ids)):
            if ids and max(ids) >= self.vocab_size:
                raise RequestError(f"{name} token ids must be < the vocabulary size {self.vocab_size}")
        if params.min_output_tokens > 0 and params.allowed_token_ids:
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
            if set(params.allowed_token_ids) <= ends:
                name = "min_tokens" if params.min_tokens else "min_new_tokens"
                raise RequestError(
                    f"allowed_token_ids holds only stop/EOS tokens, which {name} "
                    f"{params.min_output_tokens} forbids for the first tokens: nothing could be drawn"
                )
        adapter = self._adapter(params.lora_path)
        salt = _cache_salt(adapter, params.cache_salt)
        if params.bad_words:
            params.set_bad_word_ids(bad_word_token_ids(self.tokenizer, params.bad_words))
        processor = self._custom_processor(params)
        compiled = self._submit_grammar(params)
        room = self.max_model_len - len(prompt_ids)
        if params.max_new_tokens is None:
            default = self.default_max_tokens if params.max_new_tokens_from_model else None
            max_new = room if default is None else min(default, room)
        elif params.max_new_tokens > room and "max_new_tokens" in params.model_fields_set:
            # Asked for, not defaulted: refused, as SGLang and vLLM do, rather than cut short.
            raise RequestError(
                f"max_new_tokens must be at most {room}: the context is {self.max_model_len} tokens and the "
                f"prompt has {len(prompt_ids)}; got {params.max_new_tokens}"
            )
        else:
            max_new = min(params.max_new_tokens, room)
        if params.min_output_tokens > max_new:
            # As vLLM: an absent limit is the context's room, and a minimum past it is refused,
            # not silently cut to the room.
            name = "min_tokens" if params.min_tokens else "min_new_tokens"
            raise RequestError(
                f"{name} must be at most {max_new}: the context is {self.max_model_len} tokens and the prompt "
                f"has {len(prompt_ids)}; got {params.min_output_tokens}"
            )
        prediction = self._prediction(params)
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        stop_regexes = [regex.compile(p) for p in params.stop_regex]
        special_stops = self._special_stops(params)
        cacheable = params.logprob_start_len < 0 and not params.return_hidden_states and embeds is None
        children: list[_Tracked] = []
        for index in range(params.n):
            child_id = sample_request_id(request_id, index, params.n)
            seq = Sequence(
                request_id=child_id,
                token_ids=list(prompt_ids),
                params=params,
                max_new_tokens=max_new,
                is_cancelled=is_cancelled,
                arrival_time=time.monotonic(),
                # Prompt logprobs and hidden states need every prompt position run, none cached;
                # an embedded prompt's placeholder ids must never match another prompt's blocks.
                prefix_cacheable=cacheable,
                prompt_embeds=embeds,
                index=index,
                # As vLLM: sample i of seed s draws as a request with seed s + i (int64, wrapping).
                seed=(base_seed + index + 2**63) % 2**64 - 2**63,
                # Siblings wait for the first one's prefill only to find its blocks cached.
                wait_for=children[0].seq if children and cacheable and self.config.enable_prefix_caching else None,
                lora=adapter,
                cache_salt=salt,
                prediction=prediction,
                # None of it taken yet: an output that ends before its first token (max_new_tokens
                # 0) still reports the whole prediction rejected, as OpenAI counts it.
                prediction_rejected=prediction.length if prediction is not None else 0,
                speculates=self.proposer is not None or prediction is not None,
            )
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
            state = OutputState(detok=detok, stops=list(params.stop), eos_ids=self.eos_ids, stop_regexes=stop_regexes,
                                special_stops=special_stops, model_eos=getattr(self.tokenizer, "eos_token_id", None))
            children.append(_Tracked(seq, on_output, state, compiled, None, processor, request_id,
                                     self._logits_processors(params)))
        with self._inbox_lock:
            self._inbox_seqs += len(children)
        self._inbox.put(("add", children))
        self._wakeup.set()
        return request_id

    def _special_stops(self, params: SamplingParams) -> dict[int, str]:
        """Stop strings that are one special token, by its id, where the text skips it: the
        text never shows them, so they are matched on the token (vLLM never matches them there,
        vllm#2123; SGLang matches its stop strings against text that keeps special tokens)."""
        if not params.skip_special_tokens or not params.stop:
            return {}
        found: dict[int, str] = {}
        for stop in params.stop:
            ids = self.tokenizer.encode(stop, add_special_tokens=False)
            if (len(ids) == 1 and ids[0] < self.vocab_size and ids[0] not in found
                    and self.tokenizer.decode(ids, skip_special_tokens=True) == ""
                    and self.tokenizer.decode(ids, skip_special_tokens=False) == stop):
                found[ids[0]] = stop
        return found

    def _prediction(self, params: SamplingParams) -> Optional[Prediction]:
        """The request's predicted output as tokens, no longer than a context (no output is)."""
        if not params.prediction:
            return None
        if isinstance(params.prediction, str):
            ids = self.tokenizer.encode(params.prediction, add_special_tokens=False)
            length = len(ids)
            # A tokenizer may know tokens the model has no row for: never drafted.
            ids = ids[: next((i for i, t in enumerate(ids) if t >= self.vocab_size), len(ids))]
        else:
            ids = params.prediction
            length = len(ids)
            if max(ids) >= self.vocab_size:
                raise RequestError(f"prediction token ids must be < the vocabulary size {self.vocab_size}")
        # The part past a context is never drafted, yet counts as rejected (QA: a 26k-token
        # prediction reported max_model_len tokens in all).
        return Prediction(ids[: self.max_model_len], length) if ids else None

    def _prompt_embeds(self, value: Any, params: SamplingParams) -> torch.Tensor:
        hidden = self.model.config.hidden_size
        if params.wants_prompt_logprobs:
            raise RequestError(
                "prompt logprobs (logprob_start_len >= 0) need the prompt's token ids; with input_embeds only the "
                "output's logprobs are available (logprob_start_len -1)"
            )
        if params.return_prompt_token_ids:
            raise RequestError("return_prompt_token_ids: an input_embeds prompt has no token ids")
        try:
            rows = torch.as_tensor(value, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise RequestError(f"input_embeds must be rows of {hidden} numbers: {exc}") from None
        if rows.dim() != 2 or rows.shape[0] == 0 or rows.shape[1] != hidden:
            raise RequestError(
                f"input_embeds must have the shape [num_tokens, {hidden}] (this model's hidden size), "
                f"got {list(rows.shape)}"
            )
        if not bool(torch.isfinite(rows).all()):
            raise RequestError("input_embeds holds a value that is not a finite number")
        # A copy: a numpy input may be a view of the request's tensor, which its server frees.
        return rows.to(device=self.model.device, dtype=self.model.dtype, copy=True)

    def _custom_processor(self, params: SamplingParams) -> Any:
        if params.custom_logit_processor is None:
            return None
        if not self.config.enable_custom_logit_processor:
            raise RequestError(
                "custom_logit_processor is disabled on this server (start it with enable_custom_logit_processor=true)"
            )
        from backend.custom_logit_processor import CustomLogitProcessorError, load_processor

        try:
            return load_processor(params.custom_logit_processor)
        except CustomLogitProcessorError as exc:
            raise RequestError(str(exc)) from None

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> None:
        """Serve another adapter (SGLang's /load_lora_adapter). Requests may name it at once."""
        from backend.lora import LoraError

        if not name or name in self.model.adapters:
            raise RequestError(f"LoRA adapter '{name}' is already loaded" if name else "a LoRA adapter needs a name")
        try:
            with _without_thread_team():  # called from a server thread: no OpenMP team there either
                adapter = self.model.load_lora(name, path)
        except LoraError as exc:
            raise RequestError(str(exc)) from None
        log.info("LoRA adapter '%s' (rank %d) from %s", name, adapter.rank, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving an adapter: new requests may not name it; running ones finish with it
        (each sequence holds its adapter)."""
        if self.model.adapters.pop(name, None) is None:
            raise RequestError(f"LoRA adapter '{name}' is not loaded")
        log.info("LoRA adapter '%s' unloaded", name)

    def lora_adapters(self) -> dict[str, str]:
        # list() copies in one step: another thread may load or unload meanwhile.
        return {name: a.path for name, a in list(self.model.adapters.items())}

    def _adapter(self, name: Optional[str]) -> Any:
        if name is None:
            return None
        adapters = self.model.adapters
        found = adapters.get(name) or next((a for a in list(adapters.values()) if a.path == name), None)
        if found is None:
            loaded = ", ".join(sorted(adapters)) or "none (start the engine with lora_modules)"
            raise RequestError(f"LoRA adapter '{name}' is not loaded; loaded adapters: {loaded}")
        return found

    def _logits_processors(self, params: SamplingParams) -> list:
        if params.thinking_budget is not None:
            from backend.thinking_budget import ThinkingBudgetProcessor

            budget = [ThinkingBudgetProcessor(params.thinking_budget, self._encode_forced)]
        else:
            budget = []
        if not params.logits_processors:
            return budget
        from backend.logits_processors import LogitsProcessorError, build_processors

        try:
            return budget + build_processors(params.logits_processors, self.config.logits_processor_pattern)
        except (LogitsProcessorError, ValueError) as exc:  # ValueError: pydantic's, on a bad object
            raise RequestError(f"invalid parameter 'logits_processors': {exc}") from None

    def _submit_grammar(self, params: SamplingParams) -> Any:
        constraint = params.constraint
        if constraint is None:
            return None
        if self._grammar_compiler is None:
            try:
                from backend.grammar import GrammarCompiler
            except ImportError as exc:
                raise RequestError(f"structured output is not available: {exc}") from None
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammar_compiler.submit(*constraint)

    def wake(self) -> None:
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """End a request (all of its n samples); its blocks are freed at the next step boundary."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            # A sequence waiting for its grammar to compile waits too (vLLM v1 queues it as
            # WAITING_FOR_FSM): otherwise a monitor saw an idle engine while it waited.
            num_waiting=len(self.scheduler.waiting) + len(self._compiling),
            num_kv_blocks=self.block_manager.num_blocks,
            num_free_kv_blocks=self.block_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self._num_steps,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            prefix_cache_queries=self.block_manager.num_queried_tokens,
            prefix_cache_hits=self.block_manager.num_hit_tokens,
            num_cached_kv_blocks=self.block_manager.num_cached_blocks,
            step_seconds_total=self._step_seconds,
            step_thread_cpu_seconds_total=self._step_cpu_seconds,
            jump_forward_tokens_total=self._jump_forward_tokens_total,
            jump_forward_respelled_total=self._jump_forward_respelled_total,
            spec_drafts_total=self._spec_drafts_total,
            spec_draft_tokens_total=self._spec_draft_tokens_total,
            spec_accepted_tokens_total=sum(self._spec_accepted_per_position),
            spec_accepted_per_position=tuple(self._spec_accepted_per_position),
        )

    @property
    def device(self) -> str:
        return str(self.model.device)

    @property
    def kv_dtype(self) -> str:
        """What the KV cache stores ("bfloat16", "float8_e4m3fn", ...)."""
        return str(self.model.kv_dtype).removeprefix("torch.")

    def info(self) -> dict[str, Any]:
        """The effective configuration ("auto" resolved) and counters, for SGLang's /get_server_info."""
        config = self.config.model_dump(mode="json")
        config.update(
            device=self.device,
            dtype=str(self.model.dtype).removeprefix("torch."),
            kv_cache_dtype=self.kv_dtype,
            # The scales an fp8 cache divides K / V by: the checkpoint's, or 1.0 for every layer.
            kv_cache_scales=("calculated" if self.config.calculate_kv_scales
                             else "checkpoint" if self.model.kv_scales is self.model.checkpoint_kv_scales else "1.0"),
            num_kv_blocks=self.block_manager.num_blocks,
            max_model_len=self.max_model_len,
            max_prefill_tokens_while_decoding=self.config.prefill_cap(),
            prefill_context_unit=self.config.prefill_unit(),
            prefill_tokens_per_decode=self.config.prefill_per_decode(),
            flat_prefill_tokens=self.config.flat_tokens(),
            cuda_graphs=self.model.graphs is not None,
            torch_threads=self.torch_threads,
        )
        return {"config": config, "vocab_size": self.vocab_size, "eos_token_ids": sorted(self.eos_ids),
                "default_max_tokens": self.default_max_tokens,
                "lora_adapters": self.lora_adapters(), "stats": dataclasses.asdict(self.stats())}

    def has_unfinished(self) -> bool:
        return bool(self._tracked) or not self._inbox.empty()

    def reset_prefix_cache(self) -> "concurrent.futures.Future[int]":
        """Forget the cached blocks no request holds (benchmarks: measure with a cold cache;
        SGLang's /flush_cache, vLLM's /reset_prefix_cache). Done by the step loop between steps;
        the future gets the number of blocks forgotten."""
        done: "concurrent.futures.Future[int]" = concurrent.futures.Future()
        self._inbox.put(("reset_prefix_cache", done))
        self._wakeup.set()
        return done

    # ------------------------------------------------------------------ loop
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self.run, name="llm-engine", daemon=True)
            self._thread.start()
            self._cancel_watch.start(self.abort)

    def shutdown(self) -> None:
        self._cancel_watch.stop()
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        deadline = time.monotonic() + 30
        while self._running.is_set() and time.monotonic() < deadline:  # run() on a caller's thread
            time.sleep(0.01)
        self._drain_inbox()
        for request_id in list(self._tracked):
            self._end(request_id, FinishReason.ABORT, error="the server is shutting down")
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown()

    def run(self, until: Optional[threading.Event] = None) -> None:
        """The step loop, on the calling thread, until shutdown() or `until` is set (then call
        wake()). start() runs it on a thread of its own; a caller that runs other torch work too
        (a benchmark's baselines) can run it on that work's thread instead, so the process keeps
        one OpenMP team (see _without_thread_team)."""
        torch.set_num_threads(self.torch_threads)
        self._running.set()
        try:
            self._run_steps(until)
        finally:
            self._running.clear()

    def _run_steps(self, until: Optional[threading.Event]) -> None:
        while not self._stop.is_set() and not (until is not None and until.is_set()):
            if not self.step():
                if self.on_step is not None:
                    self.on_step(self.stats())  # idle: publish the settled numbers
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()

    def step(self) -> bool:
        """One engine iteration. Returns False when there was nothing to do."""
        self._drain_inbox()
        self._check_cancelled()
        self._admit_compiled()
        if not self.scheduler.has_work():
            return False
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        if self.proposer is not None or self._num_predicting:
            try:
                self._propose()
            except Exception:  # drafts are an optimization: without them the step runs as usual
                log.exception("speculative drafts failed; this step decodes one token a sequence")
                for seq in self.scheduler.running:
                    seq.draft_tokens = []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return False
        try:
            self._run(scheduled)
        except Exception as exc:  # a failed step must not kill the loop or leak blocks
            log.exception("engine step failed")
            for item in scheduled:
                self._end(item.seq.request_id, FinishReason.ABORT, error=f"internal error: engine step failed: {exc}")
        self._step_seconds += time.perf_counter() - wall0
        self._step_cpu_seconds += time.thread_time() - cpu0
        self._num_steps += 1
        if self.on_step is not None:
            self.on_step(self.stats())
        return True

    def _run(self, scheduled: list) -> None:
        chunks = []
        embeds: Optional[list[Optional[torch.Tensor]]] = None
        for c, item in enumerate(scheduled):
            seq = item.seq
            start = seq.num_computed_tokens
            if item.draft:  # the newest token and the draft after it, every position sampled
                chunks.append((seq.token_ids[start:] + item.draft, start, seq.block_table, list(range(item.num_new_tokens))))
            else:
                ids = seq.token_ids[start : start + item.num_new_tokens]
                chunks.append((ids, start, seq.block_table, self._logit_rows(seq, start, len(ids), item.samples)))
            # A draft can follow a prompt's last token too (its last chunk one token long): that
            # token is still the prompt's (QA: its embedded row was left out there, and the
            # placeholder id's embedding computed instead).
            if start < seq.num_prompt_tokens:
                self._prompt_tokens_total += min(item.num_new_tokens, seq.num_prompt_tokens - start)
                if seq.prompt_embeds is not None:  # the chunk's prompt part reads the given rows
                    embeds = embeds or [None] * len(scheduled)
                    embeds[c] = seq.prompt_embeds[start : min(start + item.num_new_tokens, seq.num_prompt_tokens)]
        wants_hidden = [item.seq.params.return_hidden_states for item in scheduled]
        # Each sequence carries its adapter: an adapter unloaded meanwhile still serves it.
        # Drafts to verify beside plain decodes: a few tokens per sequence, laid out as a decode
        # step (on CUDA a decode graph's replay) rather than as prefill chunks.
        flat = any(item.draft for item in scheduled) and all(item.draft or len(c[0]) == 1 for item, c in zip(scheduled, chunks))
        batch = self.model.prepare(chunks, [item.seq.lora for item in scheduled], embeds, wants_hidden, flat=flat)
        hidden = None
        if batch.hidden_index is not None:
            logits, hidden = self.model.forward_with_hidden(batch)
            # Rows in chunk order, every position of each chunk that asked.
            hidden_rows = iter(hidden.float().cpu().split([len(c[0]) for c, w in zip(chunks, wants_hidden) if w]))
        else:
            logits = self.model.forward(batch)

        # Split the logits rows (see _logit_rows). A chunk's rows start at position `first`: its
        # prompt-logprob rows are consecutive from there, and the sampling row, if it samples,
        # is last.
        sampling, sample_logits = [], []
        row = 0
        for item, chunk in zip(scheduled, chunks):
            seq, rows, start = item.seq, chunk[3], chunk[1]
            count = 1 if rows is True else len(rows) if rows else 0
            first = start + (len(chunk[0]) - 1 if rows is True else rows[0] if rows else 0)
            if seq.params.wants_prompt_logprobs:
                # Logits at position p score prompt token p + 1: p in [lo, P - 2].
                lo = max(first, seq.params.logprob_start_len)
                hi = min(first + count, seq.num_prompt_tokens - 1)
                if hi > lo:
                    self._prompt_logprobs(seq, lo, logits[row + lo - first : row + hi - first])
            if hidden is not None and seq.params.return_hidden_states:
                rows_hidden = next(hidden_rows)
                tracked = self._tracked.get(seq.request_id)
                if tracked is not None:
                    tracked.state.add_hidden_states(start, rows_hidden.tolist(), seq.num_prompt_tokens)
            if item.samples:
                sampling.append(item)
                # A draft's rows: one per position, each drawn as its own decode step would be.
                sample_logits.extend(range(row, row + count) if item.draft else (row + count - 1,))
            row += count

        result = None
        if sampling:
            rows = [r for item in sampling for r in self._sampling_rows(item)]
            result = self.sampler(logits[sample_logits], rows)
        for item in scheduled:
            seq = item.seq
            # A draft's K/V stand only once its tokens are accepted (below).
            seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
            self.block_manager.register_full_blocks(seq)
            self.block_manager.free_behind_window(seq)
            if seq.max_new_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                self._end(seq.request_id, FinishReason.LENGTH)  # scored only: its prompt logprobs go out
        if result is None:
            return
        row = 0
        for item in sampling:
            item.seq.num_token_steps += 1
            if item.draft:
                self._take_verified(item, result, row)
                row += 1 + len(item.draft)
            else:
                self._take_token(item.seq, int(result.token_ids[row]), result.logprobs[row], result.errors.get(row))
                row += 1

    def _take_verified(self, item: ScheduledSeq, result: SamplerOutput, row: int) -> None:
        """A sequence's draft and the draw at each of its positions (result rows from `row`):
        position j's draw is the token after draft[:j], so it counts only while every draft token
        before it was the one drawn. The first draw that differs ends the run."""
        seq, draft = item.seq, item.draft
        if self._tracked.get(seq.request_id) is None:
            return
        tokens = [int(t) for t in result.token_ids[row : row + 1 + len(draft)]]
        accepted = 0
        while accepted < len(draft) and tokens[accepted] == draft[accepted]:
            accepted += 1
        self._spec_drafts_total += 1
        self._spec_draft_tokens_total += len(draft)
        per_position = self._spec_accepted_per_position
        per_position.extend([0] * (accepted - len(per_position)))
        for position in range(accepted):
            per_position[position] += 1
        predicted = seq.draft_predicted
        (self.predictions if predicted else self.proposer).verified(seq.seq_id, seq.num_tokens + accepted + 1, accepted)
        kept_before = seq.spec_accepted_tokens
        seq.spec_verify_ct += 1
        seq.spec_draft_tokens += len(draft)
        for j, token in enumerate(tokens[: accepted + 1]):
            if j:  # the draft token before this one was drawn: its K/V stand
                seq.num_computed_tokens += 1
            # The counts as they stand should the sequence end with this token.
            seq.spec_accepted_tokens = kept_before + min(accepted, j + 1)
            if not self._take_token(seq, token, result.logprobs[row + j], result.errors.get(row + j)):
                return
        self.block_manager.register_full_blocks(seq)
        self.block_manager.free_behind_window(seq)

    def _take_token(self, seq: Sequence, token: int, lp: Optional[TokenLogprobs], error: Optional[str]) -> bool:
        """Append a drawn token to its sequence and emit what it releases. False when the
        sequence ended (or is gone): no later token of this step is for it."""
        tracked = self._tracked.get(seq.request_id)
        if tracked is None:
            return False
        if error is not None:  # the request's own processor failed (its siblings end too)
            self._end(seq.request_id, FinishReason.ABORT, error=error, code="invalid_arg")
            return False
        seq.token_ids.append(token)
        self._generation_tokens_total += 1
        grammar_done = False
        new_tokens = [token]
        if tracked.grammar is not None:
            if not tracked.grammar.accept(token):
                # The request's own processors run after the grammar's mask: one that raised a
                # masked token chose it, the request's fault and not the server's (QA: a 500).
                if tracked.custom_processor is not None or tracked.logits_processors:
                    which = ("custom_logit_processor" if tracked.custom_processor is not None else "logits_processors"
                             if seq.params.logits_processors else "thinking_token_budget")
                    self._end(seq.request_id, FinishReason.ABORT, code="invalid_arg",
                              error=f"{which}: token {token} was drawn after it raised that token's logit, which "
                                    "the request's grammar had masked; a processor must leave masked logits at -inf")
                else:
                    self._end(seq.request_id, FinishReason.ABORT,
                              error=f"internal error: the grammar rejected token {token}")
                return False
            if tracked.grammar.slowest > MATCH_TIME_LIMIT_S:
                self._end(seq.request_id, FinishReason.ABORT, code="invalid_arg", error=(
                    f"the request's grammar took {tracked.grammar.slowest:.1f} s to match one token (the limit is "
                    f"{MATCH_TIME_LIMIT_S:g} s, as each step waits for it): it is too ambiguous, typically a "
                    "repetition of something that can match nothing (`( *)*`); simplify it"))
                return False
            grammar_done = tracked.grammar.is_terminated
            if self.config.enable_jump_forward and not grammar_done:
                new_tokens = self._jump_forward(tracked)
        if lp is not None:
            tracked.state.add_logprobs(self._logprob_entries("output", [lp], seq.params))
        if seq.prediction is not None:  # OpenAI's counts, as they stand should the output end here
            seq.prediction_accepted = self.predictions.taken(seq.seq_id, seq.prediction, seq.token_ids,
                                                             seq.num_prompt_tokens)
            seq.prediction_rejected = seq.prediction.length - seq.prediction_accepted
        try:
            out = tracked.state.on_tokens(seq, new_tokens, grammar_done=grammar_done)
        except StopRegexTimeout as exc:
            self._end(seq.request_id, FinishReason.ABORT, error=str(exc), code="invalid_arg")
            return False
        if seq.finish_reason is not None:
            self.scheduler.finish(seq, seq.finish_reason)
            self._forget(tracked)
        if out is not None:
            self._emit(tracked, out)
        return seq.finish_reason is None

    def _propose(self) -> None:
        """Draft tokens for the decoding sequences that speculate: from the request's prediction
        (backend/predicted_outputs.py) where it has one and the output stands in it, else from
        the sequence's own history when the server speculates (backend/speculative.py)."""
        running = self.scheduler.running
        spec = self.config.speculative_config
        # disable_by_batch_size turns the server's own drafts off in a large batch, where
        # verifying steps cost more than they save; a request's prediction drafts regardless.
        speculating = self.proposer is not None and (spec.disable_by_batch_size is None
                                                     or len(running) <= spec.disable_by_batch_size)
        batched = isinstance(self.proposer, DraftModelProposer)
        wanted: list[tuple[Sequence, int]] = []
        for seq in running:
            seq.draft_tokens = []
            seq.draft_predicted = False
            if (seq.num_tokens - seq.num_computed_tokens != 1
                    or not speculates(seq.params, self.config.enable_jump_forward)):
                continue
            # The step adds the draft's accepted tokens and one more: within max_new_tokens.
            limit = seq.max_new_tokens - seq.num_output_tokens - 1
            if seq.prediction is not None:
                seq.draft_tokens = self.predictions.propose(seq.seq_id, seq.prediction, seq.token_ids,
                                                            seq.num_prompt_tokens, limit)
                seq.draft_predicted = bool(seq.draft_tokens)
            if not speculating or seq.draft_tokens:
                continue
            if not batched:
                seq.draft_tokens = self.proposer.propose(seq.seq_id, seq.token_ids, limit)
            elif seq.prompt_embeds is None:  # the draft model reads token ids, not the embedded prompt
                wanted.append((seq, limit))
        if wanted:
            seqs = [seq for seq, _ in wanted]
            drafts = self.proposer.propose_batch([(seq.seq_id, seq.token_ids, limit) for seq, limit in wanted],
                                                 {seq.seq_id for seq in running},
                                                 lambda logits, rows: self._draw_drafts(seqs, logits, rows))
            for seq in seqs:
                seq.draft_tokens = drafts.get(seq.seq_id, [])

    def _draw_drafts(self, seqs: list[Sequence], logits: torch.Tensor, rows: list[tuple[int, list[int]]]) -> list[int]:
        """Draft-model tokens drawn as the target draws its own (backend/draft_model.py): each row
        is the one the verifying step will give that position (a grammar's mask as it stands
        after the draft before it), so where the models agree, so do the draws. Without logprobs:
        no one reads them."""
        sampling_rows = []
        for i, draft in rows:
            row = self._sampling_row(seqs[i], len(draft), draft)
            if draft and row.grammar is not None:
                row.grammar = DraftMask(row.grammar.draft_masks(draft)[-1])
            if row.params.return_logprob:
                row.params = row.params.model_copy(update={"return_logprob": False, "top_logprobs_num": 0,
                                                           "token_ids_logprob": None})
            sampling_rows.append(row)
        return self.sampler(logits, sampling_rows).token_ids

    def _jump_forward(self, tracked: _Tracked) -> list[int]:
        """The step's tokens for a sequence whose grammar accepted its newest (sampled) token:
        that token, or its respelling where the tokenizer merges it with the forced text, then
        the tokens the grammar forces after it (see EngineConfig.enable_jump_forward). The
        sampled token has no K/V yet, so respelling it costs nothing; all of them are computed
        with the next step's chunk."""
        seq = tracked.seq
        params = seq.params
        sampled = seq.token_ids[-1]
        # Not after a stop token (the sequence ends with it), nor with logprobs (forced tokens
        # have none), stop strings (checked per token, so no output token follows a match) or
        # logit_bias / allowed_token_ids (they would have to hold for forced tokens too).
        if (params.return_logprob or params.stop or params.stop_regex or params.restricts_tokens
                or params.processes_rows or sampled in params.stop_token_ids):
            return [sampled]
        # A stop token ends a sequence only as its newest token: the jump stops before one, and
        # the model, which may then only sample it, ends the sequence as usual.
        tokens = tracked.grammar.jump_forward_from(
            sampled, self._encode_forced, self.tokenizer.decode,
            seq.max_new_tokens - seq.num_output_tokens, stop_before=params.stop_token_ids,
        )
        seq.token_ids[-1:] = tokens
        forced = len(tokens) - 1
        self._generation_tokens_total += forced
        self._jump_forward_tokens_total += forced
        if tokens[0] != sampled:
            self._jump_forward_respelled_total += 1
        return tokens

    def _encode_forced(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _logit_rows(self, seq: Sequence, start: int, n: int, samples: bool) -> Any:
        """Which rows of this chunk need logits: the sampling row, plus prompt positions
        whose next-token logprobs were asked for (logprob_start_len) (True: the last row only)."""
        lsl = seq.params.logprob_start_len
        if not seq.params.wants_prompt_logprobs or start >= seq.num_prompt_tokens - 1:
            return samples
        # Logits at position p give the logprob of prompt token p + 1, for tokens (lsl, P): token
        # lsl itself is reported without one, as SGLang does (_unscored_prompt_logprob).
        lo = lsl
        hi = min(start + n, seq.num_prompt_tokens - 1)  # exclusive; P - 1 is the sampling row
        rows = [p - start for p in range(max(start, lo), hi)]
        if samples:
            rows.append(n - 1)
        return rows or samples

    def _prompt_logprobs(self, seq: Sequence, first_pos: int, logits: torch.Tensor) -> None:
        tracked = self._tracked.get(seq.request_id)
        if tracked is None:
            return
        skip = max(0, seq.prompt_logprobs_done - first_pos)  # recomputed after a preemption
        if skip >= logits.shape[0]:
            return
        first_pos, logits = first_pos + skip, logits[skip:]
        seq.prompt_logprobs_done = first_pos + logits.shape[0]
        params = seq.params
        targets = seq.token_ids[first_pos + 1 : first_pos + 1 + logits.shape[0]]
        lps = torch.log_softmax(logits.float(), dim=-1)
        items = logprobs_at(lps, targets, params.top_logprobs_num, params.token_ids_logprob, ranks=True)
        entries = self._logprob_entries("input", items, params)
        # Beyond SGLang's format: each prompt token's rank in its distribution (1 = the most
        # likely), for vLLM's prompt_logprobs.
        entries["input_token_ranks"] = [i.rank for i in items]
        tracked.state.add_logprobs(entries)

    def _unscored_prompt_logprob(self, tracked: _Tracked) -> None:
        """SGLang's prompt logprobs start at token logprob_start_len (the last prompt token when
        it is -1, the default) with None, logprob or not: only the tokens after it are scored
        (token 0 has no logprob in any case). So its clients skip or drop that first entry, and
        a loglikelihood summed over the entries counts the same tokens here as there. Added once,
        on admission, so a one-token prompt (no logits rows at all) and a prompt recomputed
        after a preemption report it exactly once. An embedded prompt has no token ids to name."""
        seq, params = tracked.seq, tracked.seq.params
        if seq.prompt_embeds is not None:
            return
        pos = params.logprob_start_len if params.logprob_start_len >= 0 else seq.num_prompt_tokens - 1
        token = seq.token_ids[pos]
        entries: dict[str, list] = {
            "input_token_logprobs": [[None, token, self._token_text(token, params)]],
            "input_token_ranks": [None],
        }
        if params.top_logprobs_num:
            entries["input_top_logprobs"] = [None]
        if params.token_ids_logprob:
            entries["input_token_ids_logprobs"] = [None]
        tracked.state.add_logprobs(entries)

    def _logprob_entries(self, kind: str, items: list[TokenLogprobs], params: SamplingParams) -> dict[str, list]:
        """SGLang's meta_info format: [logprob, token_id, text or None] triples."""
        text = lambda t: self._token_text(t, params)  # noqa: E731
        out: dict[str, list] = {f"{kind}_token_logprobs": [[i.logprob, i.token_id, text(i.token_id)] for i in items]}
        if params.top_logprobs_num:
            out[f"{kind}_top_logprobs"] = [[[lp, t, text(t)] for t, lp in i.top] for i in items]
        if params.token_ids_logprob:
            out[f"{kind}_token_ids_logprobs"] = [[[lp, t, text(t)] for t, lp in i.requested] for i in items]
        return out

    def _token_text(self, token_id: int, params: SamplingParams) -> Optional[str]:
        if not params.return_text_in_logprobs:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _sampling_rows(self, item: ScheduledSeq) -> list[SamplingRow]:
        """The sampling row of a scheduled sequence, or with a draft one per position: the row
        its own decode step would have, that position being the next output token."""
        if not item.draft:
            return [self._sampling_row(item.seq)]
        rows = [self._sampling_row(item.seq, ahead, item.draft[:ahead]) for ahead in range(1 + len(item.draft))]
        grammar = self._tracked[item.seq.request_id].grammar
        if grammar is not None:  # each position masked as the grammar stands after the draft before it
            for row, mask in zip(rows, grammar.draft_masks(item.draft)):
                row.grammar = DraftMask(mask)
        return rows

    def _sampling_row(self, seq: Sequence, ahead: int = 0, pending: tuple | list = ()) -> SamplingRow:
        params = seq.params
        tracked = self._tracked[seq.request_id]
        suppress: tuple[int, ...] = ()
        if seq.num_output_tokens + ahead < params.min_output_tokens:
            suppress = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(self.eos_ids))
        return SamplingRow(
            params=params,
            seed=seq.seed,
            step=seq.num_output_tokens + ahead,
            seq_id=seq.seq_id,
            token_ids=(seq.token_ids if params.has_penalties or params.processes_rows or tracked.custom_processor
                       or params.bad_words else ()),
            num_prompt_tokens=seq.num_prompt_tokens,
            prompt_is_placeholder=seq.prompt_embeds is not None,
            suppress_ids=suppress,
            grammar=tracked.grammar,
            custom_processor=tracked.custom_processor,
            logits_processors=tracked.logits_processors,
            pending=pending,
        )

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                children: list[_Tracked] = payload
                with self._inbox_lock:
                    self._inbox_seqs -= len(children)
                group = children[0].group
                if group in self._groups or any(c.seq.request_id in self._tracked for c in children):
                    for c in children:
                        c.seq.finish_reason = FinishReason.ABORT
                        out = c.state.close(c.seq, error=f"duplicate request id '{group}'")
                        out.error_code = "invalid_arg"
                        self._emit(c, out)
                    continue
                self._groups[group] = [c.seq.request_id for c in children]
                if children[0].seq.is_cancelled is not None:  # the n samples share their caller's
                    self._cancel_watch.watch(group, children[0].seq.is_cancelled)
                for tracked in children:
                    rid = tracked.seq.request_id
                    self._tracked[rid] = tracked
                    self._num_predicting += tracked.seq.prediction is not None
                    if tracked.seq.params.return_logprob:
                        self._unscored_prompt_logprob(tracked)
                    # A grammar is compiled first even for no tokens: an invalid one fails the
                    # request whatever max_new_tokens is (fuzz QA: with 0 it succeeded).
                    if tracked.grammar_future is None and self._nothing_to_compute(tracked.seq):
                        self._end(rid, FinishReason.LENGTH)
                    elif tracked.grammar_future is not None:
                        self._compiling.append(tracked)  # waits off the batch until compiled
                        # An idle loop sleeps until woken (up to half a second): the compile's
                        # end wakes it, or every new grammar would add that sleep to its TTFT.
                        tracked.grammar_future.add_done_callback(lambda _: self._wakeup.set())
                    else:
                        self.scheduler.add(tracked.seq)
            elif kind == "abort":
                for rid in self._groups.get(payload, [payload]):
                    self._end(rid, FinishReason.ABORT)
            elif kind == "reset_prefix_cache":
                payload.set_result(self.block_manager.reset_prefix_cache())

    def _admit_compiled(self) -> None:
        if not self._compiling:
            return
        still = []
        # One look per future: the n samples of a request share theirs, and a compile that ended
        # between two samples' looks queued the later sample ahead of the one it waits for (fuzz QA).
        done: dict[int, bool] = {}
        for tracked in self._compiling:
            rid = tracked.seq.request_id
            if rid not in self._tracked:
                continue  # aborted while compiling
            future = tracked.grammar_future
            if not done.setdefault(id(future), future.done()):
                still.append(tracked)
                continue
            try:
                tracked.grammar = self._grammar_compiler.matcher(future.result())
            except Exception as exc:
                self._end(rid, FinishReason.ABORT, error=str(exc), code="invalid_arg")
                continue
            if self._nothing_to_compute(tracked.seq):
                self._end(rid, FinishReason.LENGTH)
            else:
                self.scheduler.add(tracked.seq)
        self._compiling = still

    @staticmethod
    def _nothing_to_compute(seq: Sequence) -> bool:
        """No tokens to generate and no prompt rows asked for: the request ends as it arrives."""
        return seq.max_new_tokens == 0 and not seq.params.needs_prompt_rows

    def _check_cancelled(self) -> None:
        # A started engine has the cancel watch's thread polling (backend/cancel_watch.py); an
        # engine stepped by hand polls here, as rarely (is_cancelled may be an IPC round trip).
        if self._cancel_watch.running or not self._cancel_watch:
            return
        now = time.monotonic()
        if now < self._next_cancel_poll:
            return
        self._next_cancel_poll = now + self._cancel_watch.next_interval()
        for group in self._cancel_watch.poll():
            for rid in self._groups.get(group, []):
                self._end(rid, FinishReason.ABORT)

    def _end(self, request_id: str, reason: FinishReason, error: Optional[str] = None, code: str = "internal") -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        seq = tracked.seq
        self.scheduler.finish(seq, reason)
        self._forget(tracked)
        out = tracked.state.close(seq, error=error)
        out.error_code = code
        self._emit(tracked, out)
        if error is not None:  # a failed sample fails its request: stop the siblings too
            for sibling in self._groups.get(tracked.group, []):
                self._end(sibling, FinishReason.ABORT)

    def _forget(self, tracked: _Tracked) -> None:
        rid = tracked.seq.request_id
        if self._tracked.pop(rid, None) is not None and tracked.seq.prediction is not None:
            self._num_predicting -= 1
            self.predictions.forget(tracked.seq.seq_id)
        self.sampler.release(tracked.seq.seq_id)
        if self.proposer is not None:
            self.proposer.forget(tracked.seq.seq_id)
        members = self._groups.get(tracked.group)
        if members is not None and all(m not in self._tracked for m in members):
            del self._groups[tracked.group]
            self._cancel_watch.unwatch(tracked.group)

    @staticmethod
    def _emit(tracked: _Tracked, out: RequestOutput) -> None:
        try:
            tracked.on_output(out)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("output callback failed for %s", out.request_id)

    # ------------------------------------------------------------------ sync helper
    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 input_embeds: Optional[list[Any]] = None) -> list[RequestOutput]:
        """Run prompts to completion on the calling thread (tests, benchmarks). Engine must not be started.
        `input_embeds`: per prompt, its embeddings (the prompt's ids then empty) or None."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        embeds = input_embeds or [None] * len(prompts)
        results: dict[str, RequestOutput] = {}
        order = []

        def collect(out: RequestOutput) -> None:
            prev = results.get(out.request_id)
            results[out.request_id] = out if prev is None else prev.merge(out)

        for ids, p, e in zip(prompts, params, embeds):
            rid = self.add_request(ids, p, collect, input_embeds=e)
            order.extend(sample_request_id(rid, i, p.n) for i in range(p.n))
        while self.has_unfinished():
            self.step()
        return [results[rid] for rid in order]


class ModelRunnerSizing:
    """Pool size and context length, decided before the model is built."""

    def __init__(self, model_path: Path, config: EngineConfig) -> None:
        model = ModelConfig.from_model_dir(model_path)
        ctx = model.context_limit
        if config.max_model_len is not None and config.max_model_len > ctx:
            # As vLLM refuses it: positions past what the model was trained on give output that
            # looks fine and is not, so a longer context is never granted quietly (or at all here).
            where = (f"max_position_embeddings {ctx}" if ctx == model.max_position_embeddings
                     else f"{ctx} (max_position_embeddings {model.max_position_embeddings} with its rope_scaling)")
            raise ValueError(f"max_model_len {config.max_model_len} is more than the model's context, "
                             f"{where} in {model_path / 'config.json'}")
        self.max_model_len = config.max_model_len or ctx
        elem = torch.empty((), dtype=config.kv_torch_dtype()).element_size()
        bytes_per_block = 2 * model.num_layers * config.block_size * model.num_kv_heads * model.head_dim * elem
        weights_dirs = [model_path]
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            # The draft model's pool has as many blocks as the target's (backend/draft_model.py):
            # a block of the budget holds both.
            draft = ModelConfig.from_model_dir(spec.model)
            bytes_per_block += 2 * draft.num_layers * config.block_size * draft.num_kv_heads * draft.head_dim * elem
            weights_dirs.append(Path(spec.model))
        # Not loaded yet: the files' size (what they take once loaded, or more where a narrower
        # model dtype halves them on the CPU).
        weights = sum(f.stat().st_size for d in weights_dirs for f in weight_files(d))
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory_mb is not None:
            num_blocks = config.kv_cache_memory_mb * 2**20 // bytes_per_block
        elif config.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            loaded = weights
            if model.quantization:  # FP8 weights are dequantized at load: up to model-dtype bytes each
                loaded *= torch.empty((), dtype=config.model_dtype()).element_size()
            num_blocks = int(max(free - loaded * 1.2, 0) * config.gpu_memory_utilization) // bytes_per_block
        else:
            num_blocks = 2**30 // bytes_per_block  # 1 GiB on CPU
        if config.device.split(":")[0] == "cpu":
            _check_host_memory(int(num_blocks) * bytes_per_block, weights)
        bs = config.block_size
        need, what = -(-self.max_model_len // bs), f"one sequence of the context length {self.max_model_len}"
        window = model.uniform_window
        # Every layer slides: a sequence holds its window and the step's new tokens, from any
        # offset in a block (the rest is released behind it), as vLLM sizes it.
        if window and -(-(window - 1 + config.max_num_batched_tokens) // bs) + 1 < need:
            need = -(-(window - 1 + config.max_num_batched_tokens) // bs) + 1
            what = f"the sliding window of {window} and a step's {config.max_num_batched_tokens} tokens"
        if num_blocks < need:
            raise ValueError(
                f"the KV pool ({num_blocks} blocks of {bs}) cannot hold {what}; "
                f"raise num_kv_blocks or lower max_model_len"
            )
        self.num_blocks = int(num_blocks)


def _check_host_memory(pool_bytes: int, weights_bytes: int = 0) -> None:
    """On the CPU the pool is zeroed host memory: a pool and weights larger than what the host
    has available would be allocated page by page until the kernel's OOM killer ends the process
    (the Triton stub dies with no reason given), so they are refused here with one (settings QA)."""
    available = available_memory_bytes()
    if available is not None and pool_bytes + weights_bytes > available:
        raise ValueError(
            f"the KV pool needs {pool_bytes / 2**20:.0f} MiB and the weights at least "
            f"{weights_bytes / 2**20:.0f} MiB, and this host has {available / 2**20:.0f} MiB available; "
            "lower kv_cache_memory_mb or num_kv_blocks"
        )


def _eos_token_ids(model_path: Path, tokenizer: Any) -> list[int]:
    """generation_config.json's EOS ids, else config.json's (as transformers falls back), and the
    tokenizer's own."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = model_path / name
        eos = read_json(file).get("eos_token_id") if file.exists() else None
        if eos is not None:
            ids.extend(eos if isinstance(eos, list) else [eos])
            break
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


def _placeholder_id(tokenizer: Any, eos_ids: frozenset[int]) -> int:
    """The token id that stands for each row of an input_embeds prompt: a special token (it
    decodes to nothing in a detokenization window), never fed to the model."""
    for name in ("pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return min(eos_ids, default=0)

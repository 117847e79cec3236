"""A torch forward pass for Llama/Qwen2/Qwen3-family decoders over a paged KV cache: Mistral,
Phi-3, Granite and OLMo 2 among them, the mixture-of-experts variants (Qwen2-MoE, Qwen3-MoE, Mixtral) and
Gemma 3's text models.

One step runs a ragged batch: each sequence contributes a chunk of new tokens (a prefill chunk
or one decode token) on top of the context already in the cache. Projections and MLPs run on
the packed tokens; attention gathers each sequence's blocks through its block table and runs
one batched SDPA per layer, so there is no Python loop over sequences.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

import kernels
from backend import moe
from backend.decode_graphs import Capture, DecodeGraphs, capture_cuda_graph, graph_buckets
from backend.host_tensors import host_tensor, on_device, page_aligned_zeros
from backend.lora import LoraAdapter, apply_lora, apply_lora_embedding, apply_lora_logits, load_adapter
from backend.model_config import ACTIVATIONS, FUSED_CHECKPOINTS, ModelConfig
from backend.model_files import read_json
from backend.quantized_checkpoint import dequantize_weights, measured_scales, take_kv_scales
from kernels import cpu_attention

log = logging.getLogger(__name__)

def weight_files(path: Path) -> list[Path]:
    """The model's safetensors files: the shards its index names, else model*.safetensors, else
    any. Mistral's repos carry consolidated.safetensors (the same weights under its own names)
    beside the shards. Without safetensors, PyTorch's pytorch_model*.bin (older checkpoints,
    which vLLM loads too), the same way."""
    for index_name, pattern in (("model.safetensors.index.json", "model*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = path / index_name
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no weight_map object")
            return [path / f for f in sorted(set(weight_map.values()))]
        files = sorted(path.glob(pattern)) or (sorted(path.glob("*.safetensors")) if pattern.endswith("safetensors") else [])
        if files:
            return files
    return []


def load_weight_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".bin":
        # weights_only: a pickle may run code on load; tensors (and the containers around them) only.
        return torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    try:
        return load_file(str(file))
    except SafetensorError as exc:
        raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None


def _rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies [head_dim / 2], and the factor cos and sin are scaled by
    (YaRN's attention factor; 1 otherwise)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling, kind = cfg.rope_scaling or {}, cfg.rope_type
    if kind == "yarn":
        return _yarn_inv_freq(cfg, scaling)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling type '{kind}' (supported: linear, llama3, yarn)")
    return inv_freq.float(), 1.0


def _yarn_inv_freq(cfg: ModelConfig, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers computes it, in float32 as it does: dimensions
    that rotate fast keep their frequency, slow ones are interpolated by `factor`, a linear ramp
    between (beta_fast / beta_slow rotations over the pretraining length), and cos/sin are scaled
    by the attention factor (0.1 ln(factor) + 1 unless the config gives it)."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = scaling.get("factor") or cfg.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide it by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and x.is_cpu and weight.dtype == torch.float32:
        # torch's fused op: for float32 on the CPU it is bit for bit the arithmetic below
        # (tests/test_engine.py), 1.4x faster on a decode row and 3x on a prefill's rows. Other
        # dtypes round where Hugging Face does not, so they keep the three ops.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _float_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's and OLMo 2's RMSNorm, `weight` in float32 (Gemma's already 1 + the checkpoint's):
    scaled before the rounding to x's dtype, where Llama's rounds first."""
    if x.dtype == torch.float32 and x.is_cpu:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # the same arithmetic, fused (see _rms_norm)
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class AttentionGroup:
    """Sequences of a step whose attention runs as one padded batch.

    A step mixes one-token decodes with long prefill chunks, and contexts of 16 and 4000
    tokens: padding all of them to the largest query and the longest context would multiply
    the attention work. Sequences are grouped by query length class and context length, and
    each group pads only to its own maxima.
    """

    token_index: torch.Tensor  # [Tg] packed indices of the group's new tokens
    query_slots: torch.Tensor  # [Tg] flat index row * max_q + i into the group's padded queries
    # [n * max_blocks] each sequence's block table, padded with block 0 (masked). Gathering whole
    # blocks (rows of block_size * head_dim) is ~3x faster than gathering single slots.
    gather_blocks: Optional[torch.Tensor]
    # [1, n, g * max_q, max_k] key visible to query, with the g query heads that share a KV head
    # folded into the query rows (see ModelRunner._attention). Built once per step, not per
    # layer; for the explicit matmul-softmax path (SDPA groups carry attn_bias instead).
    mask: Optional[torch.Tensor]
    num_seqs: int
    max_q: int
    # Decode groups read the paged cache in place when a kernel is available (Triton on CUDA,
    # C++ on CPU: kernels.paged_decode_attention); these replace gather_blocks and the masks.
    block_tables: Optional[torch.Tensor] = None  # [n, max_blocks] int32
    context_lens: Optional[torch.Tensor] = None  # [n] int32
    # The mask as SDPA's additive float bias (0 / -inf); SDPA would otherwise convert the
    # boolean mask again in every layer (at a 3k context that was a fifth of a prefill step).
    attn_bias: Optional[torch.Tensor] = None
    # CPU prefill chunks, attended one sequence at a time instead (gather_blocks and the masks
    # are then unused): see SeqChunk.
    seqs: Optional[list["SeqChunk"]] = None
    # A stack mixing full and sliding-window layers: mask / attn_bias as the sliding layers
    # see them (ModelRunner.mixed_window).
    window_mask: Optional[torch.Tensor] = None
    window_attn_bias: Optional[torch.Tensor] = None
    # A flat step's query tiles for the Triton kernel (kernels/paged_attention.query_tiles): a
    # prefill chunk's consecutive rows scored together; num_tiles programs do the work.
    query_tiles: Optional[torch.Tensor] = None  # [n] int32
    num_tiles: int = 0


@dataclass
class SeqChunk:
    """One sequence's prefill chunk, attended on its own (CPU).

    On the CPU, SDPA over a padded group with the GQA heads folded into the query rows and a
    [rows, keys] bias was 3-4x slower than one unpadded call per sequence with enable_gqa, and
    a chunk that starts the prompt needs no bias at all: SDPA's causal path skips the masked
    half (4 prompts of 250-400 tokens: 6.2 ms against 1.6 ms a layer)."""

    base: int  # the chunk's first token in the packed batch (its tokens are consecutive)
    num_tokens: int
    blocks: torch.Tensor  # [ceil((start + num_tokens) / block_size)] the sequence's block ids
    # [num_tokens, start + num_tokens] 0 / -inf, key visible to query (causal, aligned at the
    # bottom right); None when the chunk starts at position 0 (is_causal).
    bias: Optional[torch.Tensor]
    # The same for the sliding layers of a stack that mixes them with full ones.
    window_bias: Optional[torch.Tensor] = None


@dataclass
class BatchInput:
    """A step's ragged batch, already laid out as tensors."""

    input_ids: torch.Tensor  # [T] packed new tokens
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token
    groups: list[AttentionGroup]
    logits_index: torch.Tensor  # [S] packed index of each token whose logits are needed
    max_position: int = 0
    decode_only: bool = False  # every sequence decodes one token: groups is one paged group, in order
    # LoRA: each adapter in the step with the packed indexes of its tokens (None: base model only).
    lora: Optional[list[tuple[LoraAdapter, Optional[torch.Tensor]]]] = None
    # Set with `lora`, one entry per adapter: its rows of the logits (None: every row), for lm_head LoRA.
    lora_logit_rows: Optional[list[Optional[torch.Tensor]]] = None
    # input_embeds: packed indexes [E] of tokens whose embedding is given, and the rows [E, hidden].
    embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    # return_hidden_states: packed indexes [N] of tokens whose final-norm hidden states are
    # wanted. Kept apart from logits_index: a prompt's rows need no [rows, vocab] logits.
    hidden_index: Optional[torch.Tensor] = None


def _split_groups(q_lens: list[int], num_blocks: list[int], fine: bool = True, paged_decode: bool = False) -> list[list[int]]:
    """Sequence indices grouped so that padding stays within about 2x of the real work.

    `fine=False` (GPUs, where launches cost more than padded FLOPs) only separates decodes
    from prefill chunks. `paged_decode`: decodes read the cache in place, unpadded, so they
    are one group whatever their lengths.
    """
    order = sorted(range(len(q_lens)), key=lambda i: (q_lens[i] > 1, num_blocks[i], q_lens[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            first = g[0]
            same_kind = (q_lens[first] > 1) == (q_lens[i] > 1)
            coarse = not fine or (paged_decode and q_lens[i] == 1)
            if same_kind and (coarse or (num_blocks[i] <= 2 * num_blocks[first] and q_lens[i] <= 2 * max(q_lens[first], 1))):
                g.append(i)
                continue
        groups.append([i])
    return groups


def avoid_cudnn_attention() -> None:
    """Keep SDPA off its cuDNN backend (process-wide; SDPA then picks flash, memory-efficient or
    math). torch prefers cuDNN's SDPA on sm90/sm100 once its bundled cuDNN is past 9.15 (2.11's
    is). cuDNN builds an execution graph for every new query/key shape and caches it per
    shape. Prefill chunks and padded attention groups take a new shape nearly every step. On an
    H200 (torch 2.11), a prompt of a length not seen before took 45-60 ms to prefill on the demo
    model, 40 ms of it inside SDPA, against 3-5 ms for a length seen before
    (bench/prefill_probe.py). That cost hid the prefix cache's TTFT gain, and it stretched the
    decode gaps of streams running beside a chunked prefill."""
    torch.backends.cuda.enable_cudnn_sdp(False)


class ModelRunner:
    """Owns the weights and the KV cache tensors; runs one forward step."""

    def __init__(
        self,
        model_path: str | Path,
        num_blocks: int,
        block_size: int,
        device: str | torch.device = "cpu",
        dtype: Optional[torch.dtype] = None,
        graph_batch: int = 0,
        kv_dtype: Optional[torch.dtype] = None,
    ) -> None:
        """`graph_batch` > 0 reserves scratch blocks for decode graphs of up to that many
        sequences (see enable_decode_graphs). `kv_dtype`: what the KV cache stores (None: the
        model's dtype); a narrower one is rounded to once, when K/V are written, and widened
        back to the model's dtype (or float32, in the decode kernels) when read."""
        self.config = ModelConfig.from_model_dir(model_path)
        # Per layer: 0 full causal attention, else its sliding window. The step's masks are built
        # for `window` (every layer's, or 0), and when the stack mixes the two, also for
        # `mixed_window` (the sliding layers'): SeqChunk.window_bias, AttentionGroup.window_*.
        self.windows = self.config.layer_windows
        self.window = self.config.uniform_window
        self.mixed_window = max(self.windows) if len(set(self.windows)) > 1 else 0
        self._act = ACTIVATIONS[self.config.hidden_act]
        self.device = torch.device(device)
        if self.device.type == "cuda":
            avoid_cudnn_attention()
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.kv_dtype = kv_dtype or self.dtype
        self.block_size = block_size
        self.graph_batch = graph_batch
        # Steps of at most this many tokens that carry prefill chunks are laid out flat: every
        # token one paged-kernel query (_prepare_flat; EngineConfig.flat_prefill_tokens). 0: never.
        self.flat_tokens = 0
        self.graphs: Optional[DecodeGraphs] = None
        self.adapters: dict[str, LoraAdapter] = {}
        self._load_weights(Path(model_path))
        c = self.config
        # An MoE layer's experts run as one grouped matmul where torch has one for this device
        # and dtype (no host sync, so decode graphs can hold them), else one matmul pair each.
        self.grouped_experts = c.is_moe and moe.grouped_mm_works(self.device, self.dtype)
        # Blocks past the pool that no sequence owns: padding rows of a graph replay write
        # their K/V there. Enough of them for one block per block_size rows of the largest
        # bucket, which the capture check needs.
        scratch = -(-graph_buckets(graph_batch)[-1] // block_size) if graph_batch > 0 else 0
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        # Head-major: gathering a sequence's slots yields [kvh, n, max_k, d], which batched
        # matmuls read without a transposing copy.
        cache_shape = (c.num_layers, c.num_kv_heads, (num_blocks + scratch) * block_size, c.head_dim)
        if self.device.type == "cpu":
            self.k_cache = page_aligned_zeros(cache_shape, self.kv_dtype)
            self.v_cache = page_aligned_zeros(cache_shape, self.kv_dtype)
        else:
            self.k_cache = torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device)
            self.v_cache = torch.zeros(cache_shape, dtype=self.kv_dtype, device=self.device)
        # torch has no index_copy_/index_select for fp8: an fp8 cache is written and gathered
        # through byte views of the same storage.
        fp8 = self.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self._kv_bytes = (self.k_cache.view(torch.uint8), self.v_cache.view(torch.uint8)) if fp8 else None
        # Saturate rather than overflow: e4m3fn's cast already stops at 448, e5m2's goes to inf.
        self._kv_max = torch.finfo(self.kv_dtype).max if fp8 else None
        inv_freq, self._rope_scale = _rope_inv_freq(c)
        self.inv_freq = inv_freq.to(self.device)
        # Gemma 3's sliding layers rotate by a default rope of their own base: a second table.
        self._local_inv_freq = None if c.local_rope_theta is None else _rope_inv_freq(
            dataclasses.replace(c, rope_theta=c.local_rope_theta, rope_scaling=None))[0].to(self.device)
        self._local_rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._uses_local_rope = [self._local_inv_freq is not None and w > 0 for w in self.windows]
        # cos/sin per position, computed once: evaluating them every step cost more than the
        # step's attention on CPU (large arguments take the slow range reduction).
        self._rope_cos = self._rope_sin = torch.empty(0, device=self.device)
        self._extend_rope(c.context_limit)
        self.attn_scale = c.attention_multiplier or (c.query_pre_attn_scalar or c.head_dim) ** -0.5
        self._norm = _float_rms_norm if c.norms_in_float else _rms_norm
        # Gemma 3 scales the embeddings by sqrt(hidden_size), rounded to the model's dtype;
        # Granite by its embedding_multiplier.
        self._embed_scale: Optional[torch.Tensor | float] = (
            torch.tensor(c.hidden_size**0.5, dtype=self.dtype, device=self.device) if c.embed_sqrt_hidden
            else c.embedding_multiplier if c.embedding_multiplier != 1.0 else None)
        # Layers that are only norm, attention, norm, MLP and plain residual adds take the
        # shortest path in _eager.
        self._plain_layers = c.pre_norms and not c.post_norms and c.residual_multiplier == 1.0
        # An fp8 cache stores K / k_scale and V / v_scale: the checkpoint's calibrated scales
        # (backend/quantized_checkpoint.py), else 1.0. Every attention path reads the stored
        # rows as they are: k_scale is folded into the layer's softmax scale (q.(k8 s) =
        # (q.k8) s) and v_scale multiplies its output (sum p (v8 s) = s sum p v8), so the
        # kernels and the decode graphs need nothing of their own.
        self.kv_scales = [(1.0, 1.0)] * c.num_layers
        if fp8 and self.checkpoint_kv_scales:
            self.kv_scales = self.checkpoint_kv_scales
        elif self.checkpoint_kv_scales:
            log.info("the checkpoint's KV cache scales are not used: the cache is %s, not fp8", self.kv_dtype)
        self.layer_attn_scales = [self.attn_scale * k for k, _ in self.kv_scales]
        self._kv_maxima: Optional[list[list[float]]] = None  # max |K|, |V| per layer while calibrating
        # Decode attention: "triton" (the Triton kernel reading the paged cache in place, CUDA),
        # "cpu" (the C++ kernel doing the same, when it builds) or "gather" (each sequence's
        # blocks gathered into a padded batch for SDPA / matmul-softmax). LLM_PAGED_DECODE=0
        # forces "gather".
        if os.environ.get("LLM_PAGED_DECODE", "1") == "0":
            self.decode_attention = "gather"
        elif self.device.type == "cuda":
            # Triton's e4m3 conversion needs compute capability 8.9 (Ada, Hopper); on older GPUs
            # an fp8 cache is gathered and widened with torch instead.
            old_gpu = torch.cuda.get_device_capability(self.device) < (8, 9)
            self.decode_attention = "gather" if fp8 and old_gpu else "triton"
        else:
            self.decode_attention = "cpu" if cpu_attention.load() is not None else "gather"
        # The Triton kernel's splits per context (kernels/paged_attention.py, flash-decoding):
        # LLM_DECODE_SPLITS "auto" (enough programs for the GPU's SMs) or a number; 1 is one
        # program per (sequence, KV head). auto is the default since an H200 measured it
        # (bench/decode_probe.py, 0.4B model, 1k contexts): a graph-replayed decode step at
        # batch 1-64 went from 9.6-9.9 ms to 4.0 ms, the kernel from 307 to 23 us a layer.
        self.decode_splits = os.environ.get("LLM_DECODE_SPLITS", "auto")
        if self.decode_splits != "auto" and not (self.decode_splits.isdigit() and int(self.decode_splits) >= 1):
            raise ValueError(f"LLM_DECODE_SPLITS must be 'auto' or a number of at least 1, not {self.decode_splits!r}")
        # Query tokens per tile in a flat step (the Triton kernel): a chunk's rows read each K/V
        # tile once together instead of once each. LLM_QUERY_TILE "auto" (about 64 score rows:
        # query_tile_tokens) or a number; 1, the default, reads per row: on an H200 tiles made
        # the graph-replayed chunk steps of a 3k-token prompt slower (p50 7.7 -> 11.1 ms, the
        # kernel's float32 dots; docs/BENCHMARKS.md), though eager steps of 512 got faster.
        self.query_tile = 1
        tile = os.environ.get("LLM_QUERY_TILE", "1")
        if tile != "auto" and not (tile.isdigit() and int(tile) >= 1):
            raise ValueError(f"LLM_QUERY_TILE must be 'auto' or a number of at least 1, not {tile!r}")
        if self.decode_attention == "triton":
            from kernels import paged_attention

            gqa = self.config.num_heads // self.config.num_kv_heads
            self.query_tile = paged_attention.query_tile_tokens(gqa, self.config.head_dim) if tile == "auto" else int(tile)

    def _splits(self, num_seqs: int, table_blocks: int) -> int:
        """Decode attention's splits per context for a group (static under a CUDA graph: the
        graph's tables have a fixed width)."""
        if self.decode_attention != "triton" or self.decode_splits == "1":
            return 1
        if self.decode_splits == "auto":
            from kernels import paged_attention

            return paged_attention.auto_splits(num_seqs, self.config.num_kv_heads, table_blocks, self.device)
        return int(self.decode_splits)

    @property
    def rope_positions(self) -> int:
        return self._rope_cos.shape[0]

    def enable_decode_graphs(self, capture: Optional[Capture] = None) -> Optional[str]:
        """Capture decode graphs for up to `graph_batch` sequences and check them against the
        eager pass. Returns None when they are in use, else why not (the runner stays eager)."""
        if self.config.is_moe and not self.grouped_experts:
            return "mixture-of-experts layers group their tokens by expert on the host (no grouped_mm here)"
        if self.graph_batch <= 0:
            return "no scratch blocks reserved (graph_batch=0)"
        try:
            graphs = DecodeGraphs(self, self.graph_batch, capture or capture_cuda_graph)
            problem = graphs.self_check()
        except Exception as exc:  # a capture failure leaves the eager path intact
            problem = f"capture failed: {type(exc).__name__}: {exc}"
        self.graphs = None if problem else graphs
        if not problem and graphs.tiled_problem:
            # The tiles failed on this device: flat steps read per row, eager ones too.
            log.warning("query tiles off (LLM_QUERY_TILE): %s", graphs.tiled_problem)
            self.query_tile = 1
        return problem

    def _extend_rope(self, length: int) -> None:
        # Same arithmetic as computing them per step (and as HF): position * inv_freq in float32.
        freqs = torch.arange(length, device=self.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self._rope_scale != 1.0:  # YaRN's attention factor, on both (as transformers applies it)
            cos, sin = cos * self._rope_scale, sin * self._rope_scale
        self._rope_cos = cos.to(self.dtype)
        self._rope_sin = sin.to(self.dtype)
        if self._local_inv_freq is not None:
            local = torch.arange(length, device=self.device, dtype=torch.float32)[:, None] * self._local_inv_freq[None, :]
            emb = torch.cat((local, local), dim=-1)
            self._local_rope = (emb.cos().to(self.dtype), emb.sin().to(self.dtype))

    # ---------------------------------------------------------------- weights
    def _load_weights(self, path: Path) -> None:
        files = weight_files(path)
        if not files:
            raise FileNotFoundError(f"no weights in {path}: neither *.safetensors nor pytorch_model*.bin")
        raw: dict[str, torch.Tensor] = {}
        for f in files:
            raw.update(load_weight_file(f))
        c = self.config
        dequantize_weights(raw, c.quantization)
        self.checkpoint_kv_scales = take_kv_scales(raw, c.num_layers)

        # Every tensor's shape is checked against what config.json implies, before any fusing: a
        # config that says something else than the checkpoint (or leaves out a key whose
        # transformers default does not fit it) is refused here, naming the weight and the
        # fields, rather than failing every request once the server is up.
        d = c.describe
        hidden, q_rows, kv_rows = d("hidden_size"), d("num_attention_heads", "head_dim"), d("num_key_value_heads", "head_dim")
        shapes: dict[str, tuple[tuple[int, ...], str]] = {
            "embed": ((c.vocab_size, c.hidden_size), f"{d('vocab_size')}, {hidden}"),
            "norm": ((c.hidden_size,), hidden),
            "q_proj": ((c.num_heads * c.head_dim, c.hidden_size), f"{q_rows}, {hidden}"),
            "kv_proj": ((c.num_kv_heads * c.head_dim, c.hidden_size), f"{kv_rows}, {hidden}"),
            "o_proj": ((c.hidden_size, c.num_heads * c.head_dim), f"{hidden}, {q_rows}"),
            "q_bias": ((c.num_heads * c.head_dim,), q_rows),
            "kv_bias": ((c.num_kv_heads * c.head_dim,), kv_rows),
            "gate_up": ((c.intermediate_size, c.hidden_size), f"{d('intermediate_size')}, {hidden}"),
            "down": ((c.hidden_size, c.intermediate_size), f"{hidden}, {d('intermediate_size')}"),
            "inter_bias": ((c.intermediate_size,), d("intermediate_size")),
            "head_norm": ((c.head_dim,), d("head_dim")),
            "qkv_fused": (((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
                          f"{q_rows} + 2 x {kv_rows}, {hidden}"),
            "gate_up_fused": ((2 * c.intermediate_size, c.hidden_size), f"2 x {d('intermediate_size')}, {hidden}"),
        }
        if c.is_moe:
            wide = "intermediate_size" if c.model_type == "mixtral" else "moe_intermediate_size"
            shapes.update({
                "router": ((c.num_experts, c.hidden_size), f"the number of experts {c.num_experts}, {hidden}"),
                "expert_gate_up": ((c.moe_intermediate_size, c.hidden_size), f"{wide} {c.moe_intermediate_size}, {hidden}"),
                "expert_down": ((c.hidden_size, c.moe_intermediate_size), f"{hidden}, {wide} {c.moe_intermediate_size}"),
                "shared_gate_up": ((c.shared_expert_intermediate_size, c.hidden_size),
                                   f"shared_expert_intermediate_size {c.shared_expert_intermediate_size}, {hidden}"),
                "shared_down": ((c.hidden_size, c.shared_expert_intermediate_size),
                                f"{hidden}, shared_expert_intermediate_size {c.shared_expert_intermediate_size}"),
                "shared_gate": ((1, c.hidden_size), f"1, {hidden}"),
            })

        def take(name: str, kind: str) -> torch.Tensor:
            try:
                t = raw.pop(name)
            except KeyError:
                raise ValueError(f"weight '{name}' missing from {path}") from None
            shape, why = shapes[kind]
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {list(t.shape)} in the checkpoint, but {path / 'config.json'} "
                                 f"implies {list(shape)} ({why})")
            return t.to(device=self.device, dtype=self.dtype)

        def norm(name: str, kind: str = "norm") -> torch.Tensor:
            # Gemma's and OLMo 2's norms scale in float32 (_float_rms_norm), Gemma's by 1 + weight.
            return c.norm_offset + take(name, kind).float() if c.norms_in_float else take(name, kind)

        self.embed = take("model.embed_tokens.weight", "embed")
        self.final_norm = norm("model.norm.weight")
        head = raw.get("lm_head.weight")
        if c.tie_word_embeddings and head is not None:
            # vLLM ties the head to the embeddings whenever the config says so; transformers 5
            # loads the checkpoint's lm_head.weight over the tie. Say which one runs.
            if tuple(head.shape) != tuple(self.embed.shape) or not torch.equal(
                    head.to(device=self.device, dtype=self.dtype), self.embed):
                log.warning("%s: config.json has tie_word_embeddings true, but the checkpoint's lm_head.weight differs "
                            "from model.embed_tokens.weight; the embeddings are used as the output head (as vLLM "
                            "does; transformers 5 uses lm_head.weight)", path)
        if not c.tie_word_embeddings and head is None:
            # Not the embeddings in its place: that runs, and says nothing while every token is
            # wrong (QA). transformers warns "lm_head.weight MISSING", vLLM refuses.
            raise ValueError(f"weight 'lm_head.weight' missing from {path}, and {path / 'config.json'} has "
                             "tie_word_embeddings false (the output head is a weight of its own)")
        self.lm_head = self.embed if c.tie_word_embeddings else take("lm_head.weight", "embed")
        self.layers: list[dict[str, torch.Tensor]] = []
        fused = c.model_type in FUSED_CHECKPOINTS
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            # q, k, v and gate, up are fused so each becomes one matmul.
            layer = {
                "qkv": (take(p + "self_attn.qkv_proj.weight", "qkv_fused") if fused else
                        torch.cat([take(p + f"self_attn.{n}_proj.weight", "q_proj" if n == "q" else "kv_proj")
                                   for n in "qkv"])),
                "o": take(p + "self_attn.o_proj.weight", "o_proj"),
            }
            if c.pre_norms:
                layer["in_norm"] = norm(p + "input_layernorm.weight")
                # The norm before the MLP: Gemma's pre_feedforward_layernorm, as its
                # post_attention_layernorm norms the attention's output (attn_out_norm).
                layer["post_norm"] = norm(p + ("pre_feedforward_layernorm.weight" if c.post_norms
                                               else "post_attention_layernorm.weight"))
            if c.moe_layers and c.moe_layers[i]:
                layer.update(moe.take_experts(c, p, take))
            else:
                layer["gate_up"] = (take(p + "mlp.gate_up_proj.weight", "gate_up_fused") if fused else
                                    torch.cat([take(p + "mlp.gate_proj.weight", "gate_up"),
                                               take(p + "mlp.up_proj.weight", "gate_up")]))
                layer["down"] = take(p + "mlp.down_proj.weight", "down")
            if c.attention_bias:
                layer["qkv_bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias", "q_bias" if n == "q" else "kv_bias")
                                               for n in "qkv"])
            if c.o_bias:
                layer["o_bias"] = take(p + "self_attn.o_proj.bias", "norm")
            if c.mlp_bias:
                layer["gate_up_bias"] = torch.cat([take(p + "mlp.gate_proj.bias", "inter_bias"),
                                                   take(p + "mlp.up_proj.bias", "inter_bias")])
                layer["down_bias"] = take(p + "mlp.down_proj.bias", "norm")
            if c.qk_norm:
                layer["q_norm"] = norm(p + "self_attn.q_norm.weight", "q_bias" if c.qk_norm_whole else "head_norm")
                layer["k_norm"] = norm(p + "self_attn.k_norm.weight", "kv_bias" if c.qk_norm_whole else "head_norm")
            if c.post_norms:
                layer["attn_out_norm"] = norm(p + "post_attention_layernorm.weight")
                layer["mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight")
            self.layers.append(layer)
        raw.pop("lm_head.weight", None)
        # AutoGPTQ saves a bias for every linear, zeros where the model has none (vLLM skips them).
        leftovers = [k for k in raw if "rotary_emb" not in k and not (k.endswith(".bias") and not raw[k].any())]
        if leftovers:
            raise ValueError(f"unexpected weights in {path}: {leftovers[:5]}")

    def load_lora(self, name: str, path: str | Path) -> LoraAdapter:
        """Load a PEFT adapter that requests may then name (backend/lora.py). The dict is only
        ever replaced or has keys added/removed (atomic in CPython): the step loop never reads
        it, sequences hold their adapter."""
        adapter = load_adapter(name, path, self.config, self.device, self.dtype)
        self.adapters[name] = adapter
        return adapter

    def calibrate_kv_scales(self, token_ids: list[int]) -> list[tuple[float, float]]:
        """Measure an fp8 cache's per-layer K/V scales on a prefill of `token_ids` and use them
        (EngineConfig.calculate_kv_scales). The prefill writes the pool's first blocks, free at
        start-up: every block is written before it is read. Call before capturing decode graphs,
        which keep the scales they saw."""
        if self._kv_bytes is None:
            raise ValueError(f"only an fp8 cache is scaled; this one is {self.kv_dtype}")
        if self.graphs is not None:
            raise RuntimeError("calibrate the KV scales before capturing decode graphs")
        ids = token_ids[: self.scratch_block * self.block_size]
        blocks = list(range(-(-len(ids) // self.block_size)))
        self._kv_maxima = [[0.0, 0.0] for _ in self.layers]
        try:
            self.forward(self.prepare([(ids, 0, blocks, False)]))
            maxima = [(k, v) for k, v in self._kv_maxima]
        finally:
            self._kv_maxima = None
        self.kv_scales = measured_scales(maxima)
        self.layer_attn_scales = [self.attn_scale * k for k, _ in self.kv_scales]
        return self.kv_scales

    # ---------------------------------------------------------------- inputs
    def prepare(self, chunks: list[tuple[list[int], int, list[int], Any]],
                adapters: Optional[list[Optional[LoraAdapter]]] = None,
                embeds: Optional[list[Optional[torch.Tensor]]] = None,
                hidden: Optional[list[bool]] = None, flat: bool = False) -> BatchInput:
        """Lay out a step. Each chunk is (new token ids, start position, block table, logit rows).

        Logit rows: True for the chunk's last token (it samples), False for none, or a list of
        offsets into the chunk (prompt logprobs need logits at prompt positions too). The
        forward pass returns logits for these rows, in chunk order. ``adapters``: the LoRA
        adapter of each chunk's sequence (None: the base model). ``embeds``: per chunk, rows
        [k, hidden] that replace the embeddings of its first k tokens (input_embeds), or None.
        ``hidden``: per chunk, whether the hidden states of all its tokens are wanted
        (forward_with_hidden returns them in chunk order). ``flat``: lay the step out flat
        (_prepare_flat) where the paged kernels can take it, whatever its size: a step of
        decodes and speculative drafts to verify, a few tokens per sequence.
        """
        if (self.decode_attention != "gather" and chunks and not (adapters and any(adapters)) and embeds is None
                and not (hidden and any(hidden))):
            if all(len(c[0]) == 1 and c[3] is True for c in chunks):
                return self._prepare_decode(chunks)
            if flat or sum(len(c[0]) for c in chunks) <= self.flat_tokens:
                return self._prepare_flat(chunks)
        return self._prepare_general(chunks, adapters, embeds, hidden)

    def _prepare_flat(self, chunks: list[tuple[list[int], int, list[int], Any]]) -> BatchInput:
        """`prepare` for a step whose prefill chunks are small: every token is one query of the
        paged decode kernel, reading its sequence's blocks in place up to its own position (the
        chunk's K/V are written before attention runs, so each query sees the tokens before it
        and itself: causal). The step is then laid out as a decode step is, one paged group in
        packed order, with no gathered K/V, no masks and no per-sequence attention call; on a
        GPU it replays a decode graph."""
        bs = self.block_size
        width = max(len(c[2]) for c in chunks)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        table_rows: list[list[int]] = []
        logits_index: list[int] = []
        for ids, start, table, rows in chunks:
            base = len(input_ids)
            n = len(ids)
            row = table if len(table) == width else list(table) + [0] * (width - len(table))
            pos = range(start, start + n)
            input_ids.extend(ids)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            table_rows.extend([row] * n)
            if rows is True:
                logits_index.append(base + n - 1)
            elif rows:
                logits_index.extend(base + r for r in rows)
        tiles = None
        if self.query_tile > 1 and self.decode_attention == "triton":
            from kernels import paged_attention

            tiles = paged_attention.query_tiles([len(c[0]) for c in chunks], self.query_tile)
        return self._paged_batch(input_ids, positions, slots, table_rows, logits_index, tiles)

    def _prepare_general(self, chunks: list[tuple[list[int], int, list[int], Any]],
                         adapters: Optional[list[Optional[LoraAdapter]]] = None,
                         embeds: Optional[list[Optional[torch.Tensor]]] = None,
                         hidden: Optional[list[bool]] = None) -> BatchInput:
        bs = self.block_size
        dev = self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_index: list[int] = []
        bases: list[int] = []
        logit_spans: list[tuple[int, int]] = []  # each chunk's rows of the logits
        for ids, start, table, rows in chunks:
            n = len(ids)
            base = len(input_ids)
            bases.append(base)
            first_logit = len(logits_index)
            pos = range(start, start + n)
            input_ids.extend(ids)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if rows is True:
                logits_index.append(base + n - 1)
            elif rows:
                logits_index.extend(base + r for r in rows)
            logit_spans.append((first_logit, len(logits_index)))

        groups = []
        q_lens = [len(c[0]) for c in chunks]
        paged_decode = self.decode_attention != "gather"
        # A decode-only step is one paged group in packed order: the forward pass then hands
        # the kernel every query as is, without gathering them or scattering the result.
        decode_only = paged_decode and bool(q_lens) and all(n == 1 for n in q_lens)
        split = (
            [list(range(len(chunks)))]
            if decode_only
            else _split_groups(q_lens, [len(c[2]) for c in chunks], fine=self.device.type != "cuda", paged_decode=paged_decode)
        )
        for members in split:
            max_q = max(q_lens[i] for i in members)
            max_blocks = max(len(chunks[i][2]) for i in members)
            max_k = max_blocks * bs
            # Plain lists first, one tensor each: a tensor op per sequence cost more than the step's attention.
            table_rows: list[list[int]] = []
            qpos_rows: list[list[int]] = []
            token_index: list[int] = []
            query_slots: list[int] = []
            for row, i in enumerate(members):
                ids, start, table, _ = chunks[i]
                n = len(ids)
                table_rows.append(list(table) + [0] * (max_blocks - len(table)))
                # Padding queries see key 0 only, so their (discarded) rows stay finite.
                qpos_rows.append(list(range(start, start + n)) + [0] * (max_q - n))
                token_index.extend(range(bases[i], bases[i] + n))
                query_slots.extend(range(row * max_q, row * max_q + n))
            token_index_t = host_tensor(token_index, torch.long, dev)
            query_slots_t = host_tensor(query_slots, torch.long, dev)
            if paged_decode and max_q == 1:
                groups.append(
                    AttentionGroup(token_index_t, query_slots_t, None, None, len(members), 1,
                                   block_tables=host_tensor(table_rows, torch.int32, dev),
                                   context_lens=host_tensor([r[0] + 1 for r in qpos_rows], torch.int32, dev))
                )
                continue
            if self.device.type == "cpu" and max_q > 1:
                groups.append(AttentionGroup(token_index_t, query_slots_t, None, None, len(members), max_q,
                                             seqs=[self._seq_chunk(bases[i], chunks[i]) for i in members]))
                continue
            tables = host_tensor(table_rows, torch.long, "cpu")
            qpos = host_tensor(qpos_rows, torch.long, "cpu")
            n = len(members)
            mask, attn_bias = self._group_masks(qpos, max_k, self.window)
            window_mask, window_attn_bias = (self._group_masks(qpos, max_k, self.mixed_window) if self.mixed_window
                                             else (None, None))
            groups.append(
                AttentionGroup(
                    token_index=token_index_t,
                    query_slots=query_slots_t,
                    gather_blocks=on_device(tables.reshape(-1), dev),
                    mask=mask,
                    num_seqs=n,
                    max_q=max_q,
                    attn_bias=attn_bias,
                    window_mask=window_mask,
                    window_attn_bias=window_attn_bias,
                )
            )
        lora = lora_logit_rows = None
        if adapters is not None and any(a is not None for a in adapters):
            # By load, not by name: an adapter unloaded and loaded again under its name keeps
            # serving its running requests with the old weights beside new ones with the new.
            rows_of: dict[int, tuple[LoraAdapter, list[int], list[int]]] = {}
            for i, adapter in enumerate(adapters):
                if adapter is not None:
                    _, token_rows, logit_rows = rows_of.setdefault(adapter.load_id, (adapter, [], []))
                    token_rows.extend(range(bases[i], bases[i] + q_lens[i]))
                    logit_rows.extend(range(*logit_spans[i]))
            if len(rows_of) == 1 and all(a is not None for a in adapters):
                lora = [(next(iter(rows_of.values()))[0], None)]  # one adapter for every token
                lora_logit_rows = [None]
            else:
                lora = [(a, host_tensor(rows, torch.long, dev)) for a, rows, _ in rows_of.values()]
                lora_logit_rows = [host_tensor(rows, torch.long, dev) for _, _, rows in rows_of.values()]
        hidden_index = None
        if hidden is not None and any(hidden):
            rows = [bases[i] + j for i, wanted in enumerate(hidden) if wanted for j in range(q_lens[i])]
            hidden_index = host_tensor(rows, torch.long, dev)
        given = None
        if embeds is not None and any(e is not None for e in embeds):
            at = [bases[i] + j for i, e in enumerate(embeds) if e is not None for j in range(e.shape[0])]
            given = (host_tensor(at, torch.long, dev), torch.cat([e for e in embeds if e is not None]))
        return BatchInput(
            embeds=given,
            hidden_index=hidden_index,
            lora=lora,
            lora_logit_rows=lora_logit_rows,
            input_ids=host_tensor(input_ids, torch.long, dev),
            positions=host_tensor(positions, torch.long, dev),
            slot_mapping=host_tensor(slots, torch.long, dev),
            groups=groups,
            logits_index=host_tensor(logits_index, torch.long, dev),
            max_position=max(positions, default=0),
            decode_only=decode_only,
        )

    def _prepare_decode(self, chunks: list[tuple[list[int], int, list[int], Any]]) -> BatchInput:
        """`prepare` for a step where every sequence decodes one token and samples it (most
        steps under load): the same BatchInput, laid out in one pass over the sequences. On a
        GPU the step's host time is mostly such per-sequence Python."""
        bs = self.block_size
        input_ids = [c[0][0] for c in chunks]
        positions = [c[1] for c in chunks]
        tables = [c[2] for c in chunks]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        max_blocks = max(len(t) for t in tables)
        table_rows = [t if len(t) == max_blocks else list(t) + [0] * (max_blocks - len(t)) for t in tables]
        return self._paged_batch(input_ids, positions, slots, table_rows)

    def _paged_batch(self, input_ids: list[int], positions: list[int], slots: list[int], table_rows: list[list[int]],
                     logits_index: Optional[list[int]] = None, tiles: Optional[list[int]] = None) -> BatchInput:
        """A step as one paged group in packed order: every token one query of the paged kernel,
        seeing its sequence's blocks up to its own position (decode steps and flat steps).
        `logits_index` None: every row's logits. `tiles`: the query tiles of a flat step."""
        dev = self.device
        index = host_tensor(range(len(input_ids)), torch.long, dev)
        group = AttentionGroup(index, index, None, None, len(input_ids), 1,
                               block_tables=host_tensor(table_rows, torch.int32, dev),
                               context_lens=host_tensor([p + 1 for p in positions], torch.int32, dev))
        num_tiles = sum(1 for t in tiles if t) if tiles is not None else 0
        if num_tiles and num_tiles < len(tiles):  # some tile holds more than one row
            group.query_tiles = host_tensor(tiles, torch.int32, dev)
            group.num_tiles = num_tiles
        return BatchInput(
            input_ids=host_tensor(input_ids, torch.long, dev),
            positions=host_tensor(positions, torch.long, dev),
            slot_mapping=host_tensor(slots, torch.long, dev),
            groups=[group],
            logits_index=index if logits_index is None else host_tensor(logits_index, torch.long, dev),
            max_position=max(positions),
            decode_only=True,
        )

    def _group_masks(self, qpos: torch.Tensor, max_k: int, window: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """A padded group's (mask, attn_bias), one of them set: key visible to query, the GQA
        heads folded into the query rows. qpos [n, max_q] is each query's position; `window`
        > 0 hides keys at or before position - window."""
        n, max_q = qpos.shape
        gqa = self.config.num_heads // self.config.num_kv_heads
        key = torch.arange(max_k)[None, None, :]
        visible = key <= qpos[:, :, None]  # [n, max_q, max_k]
        if window:
            visible &= key > qpos[:, :, None] - window
        mask = on_device(visible[:, None].expand(n, gqa, max_q, max_k).reshape(1, n, gqa * max_q, max_k), self.device)
        # SDPA (CUDA) takes the additive bias; the CPU's padded groups are decodes without the C++
        # kernel, on the explicit matmul-softmax path, which takes the boolean mask (its prefill
        # chunks go one sequence at a time: SeqChunk).
        if self.device.type != "cuda":
            return mask, None
        return None, torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))

    def _seq_chunk(self, base: int, chunk: tuple[list[int], int, list[int], Any]) -> SeqChunk:
        ids, start, table, _ = chunk
        n, bs = len(ids), self.block_size
        total = start + n
        window_bias = self._chunk_bias(start, n, self.mixed_window) if self.mixed_window else None
        return SeqChunk(base, n, host_tensor(table[: (total + bs - 1) // bs], torch.long, self.device),
                        self._chunk_bias(start, n, self.window), window_bias)

    def _chunk_bias(self, start: int, n: int, window: int) -> Optional[torch.Tensor]:
        """A prefill chunk's [n, start + n] 0 / -inf bias; None where SDPA's causal mask is it."""
        total = start + n
        if start == 0 and not (window and total > window):
            return None
        visible = torch.ones(n, total, dtype=torch.bool).tril_(start)
        if window:  # key j seen by the query at position p when p - window < j
            visible.triu_(start - window + 1)
        return torch.zeros(n, total, dtype=self.dtype).masked_fill_(~visible, float("-inf"))

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, batch: BatchInput) -> torch.Tensor:
        """Runs the step, writes the new K/V into the cache, returns float32 logits [S, vocab]."""
        # Graphs are captured without adapters and embed token ids only.
        if self.graphs is not None and batch.lora is None and batch.embeds is None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
        return self.eager_forward(batch)

    @torch.inference_mode()
    def forward_with_hidden(self, batch: BatchInput) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, also returning the final-norm hidden states of the `hidden_index` rows
        [N, hidden] (return_hidden_states). Always eager: the decode graphs keep only logits."""
        return self._eager(batch)

    def eager_forward(self, batch: BatchInput) -> torch.Tensor:
        return self._eager(batch)[0]

    @torch.inference_mode()
    def _eager(self, batch: BatchInput) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        c = self.config
        if batch.max_position >= self._rope_cos.shape[0]:
            # Captured graphs read the old tables: they go (only past max_position_embeddings).
            self.graphs = None
            self._extend_rope(2 * (batch.max_position + 1))
        cos = self._rope_cos[batch.positions][:, None, :]
        sin = self._rope_sin[batch.positions][:, None, :]
        ropes = {False: (cos, sin)}
        if self._local_rope is not None:
            ropes[True] = (self._local_rope[0][batch.positions][:, None, :], self._local_rope[1][batch.positions][:, None, :])
        norm, pre, sandwich, residual = self._norm, c.pre_norms, c.post_norms, c.residual_multiplier

        h = self.embed[batch.input_ids]
        if self._embed_scale is not None:
            h = h * self._embed_scale
        if batch.lora:
            apply_lora_embedding(h, batch.input_ids, batch.lora)
        if batch.embeds is not None:
            h.index_copy_(0, *batch.embeds)
        q_size = c.num_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        # Each paged group's splits are the same in every layer: chosen once a step.
        splits = [self._splits(g.num_tiles or g.num_seqs, g.block_tables.shape[1]) if g.block_tables is not None else 1
                  for g in batch.groups]
        for li, layer in enumerate(self.layers):
            x = norm(h, layer["in_norm"], c.rms_norm_eps) if pre else h
            qkv = F.linear(x, layer["qkv"], layer.get("qkv_bias"))
            if batch.lora:
                apply_lora(qkv, x, li, "qkv", batch.lora)
            v = qkv[:, q_size + kv_size :].view(-1, c.num_kv_heads, c.head_dim)
            if c.qk_norm:
                q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
                if c.qk_norm_whole:  # OLMo 2: each token's q (and k) normed across all its heads
                    q, k = norm(q, layer["q_norm"], c.rms_norm_eps), norm(k, layer["k_norm"], c.rms_norm_eps)
                q = q.reshape(-1, c.num_heads, c.head_dim)
                k = k.reshape(-1, c.num_kv_heads, c.head_dim)
                if not c.qk_norm_whole:
                    q, k = norm(q, layer["q_norm"], c.rms_norm_eps), norm(k, layer["k_norm"], c.rms_norm_eps)
                lcos, lsin = ropes[self._uses_local_rope[li]]
                q, k = _rotate(q, lcos, lsin), _rotate(k, lcos, lsin)
            else:
                # Query and key heads rotate as one tensor: half the ops of rotating each (every
                # op is a dispatch the small-model CPU step pays for), the same arithmetic.
                qk = _rotate(qkv[:, : q_size + kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
                q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            self._store(li, batch.slot_mapping, k, v)
            scale = self.layer_attn_scales[li]
            # A decode-only step is one paged group holding every token in order: its queries
            # go to the kernel as they are and its output is the attention, no gather/scatter.
            attn = None if batch.decode_only else q.new_empty((q.shape[0], q_size))
            for g, g_splits in zip(batch.groups, splits):
                if g.seqs is not None:
                    self._attend_each(q, li, g.seqs, attn)
                    continue
                if g.block_tables is not None:
                    out = kernels.paged_decode_attention(
                        q.contiguous() if attn is None else q[g.token_index], self.k_cache[li], self.v_cache[li],
                        g.block_tables, g.context_lens, self.block_size, scale, window=self.windows[li],
                        splits=g_splits, query_tiles=g.query_tiles,
                        tile_tokens=self.query_tile if g.query_tiles is not None else 1,
                        use_triton=self.decode_attention == "triton",
                    ).reshape(g.num_seqs, q_size)
                    if attn is None:
                        attn = out
                    else:
                        attn[g.token_index] = out
                    continue
                keys = self._gather(self.k_cache[li], g)  # [kvh, n, max_k, d]
                values = self._gather(self.v_cache[li], g)
                qp = q.new_zeros((g.num_seqs * g.max_q, c.num_heads, c.head_dim))
                qp.index_copy_(0, g.query_slots, q[g.token_index])
                out = self._attention(qp.view(g.num_seqs, g.max_q, c.num_heads, c.head_dim), keys, values, g, scale,
                                      sliding=bool(self.mixed_window and self.windows[li]))
                attn[g.token_index] = out.reshape(g.num_seqs * g.max_q, q_size)[g.query_slots]
            if self.kv_scales[li][1] != 1.0:
                attn = attn * self.kv_scales[li][1]
            if not batch.lora and self._plain_layers:
                h = h + F.linear(attn, layer["o"], layer.get("o_bias"))
                x = _rms_norm(h, layer["post_norm"], c.rms_norm_eps)
                if "router" in layer:
                    h = h + moe.forward(c, x, layer, self._act, self.grouped_experts)
                    continue
                gate, up = F.linear(x, layer["gate_up"], layer.get("gate_up_bias")).chunk(2, dim=-1)
                h = h + F.linear(self._act(gate) * up, layer["down"], layer.get("down_bias"))
                continue
            o = F.linear(attn, layer["o"], layer.get("o_bias"))
            if batch.lora:
                apply_lora(o, attn, li, "o", batch.lora)
            if sandwich:
                o = norm(o, layer["attn_out_norm"], c.rms_norm_eps)
            h = h + (o * residual if residual != 1.0 else o)
            x = norm(h, layer["post_norm"], c.rms_norm_eps) if pre else h
            if "router" in layer:  # adapters on experts are refused when loaded (backend/lora.py)
                out = moe.forward(c, x, layer, self._act, self.grouped_experts)
                h = h + (out * residual if residual != 1.0 else out)
                continue
            gate_up = F.linear(x, layer["gate_up"], layer.get("gate_up_bias"))
            if batch.lora:
                apply_lora(gate_up, x, li, "gate_up", batch.lora)
            gate, up = gate_up.chunk(2, dim=-1)
            act = self._act(gate) * up
            down = F.linear(act, layer["down"], layer.get("down_bias"))
            if batch.lora:
                apply_lora(down, act, li, "down", batch.lora)
            if sandwich:
                down = norm(down, layer["mlp_out_norm"], c.rms_norm_eps)
            h = h + (down * residual if residual != 1.0 else down)
        hidden = None if batch.hidden_index is None else norm(h[batch.hidden_index], self.final_norm, c.rms_norm_eps)
        h = norm(h[batch.logits_index], self.final_norm, c.rms_norm_eps)
        logits = F.linear(h, self.lm_head)
        if batch.lora:
            apply_lora_logits(logits, h, batch.lora, batch.lora_logit_rows)
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        return logits.float(), hidden

    def _attend_each(self, q: torch.Tensor, li: int, seqs: list[SeqChunk], attn: torch.Tensor) -> None:
        """Prefill attention one sequence at a time (see SeqChunk), into attn's rows."""
        c = self.config
        kvh, d, bs = c.num_kv_heads, c.head_dim, self.block_size
        k_cache, v_cache = self._kv_bytes or (self.k_cache, self.v_cache)
        k_blocks = k_cache[li].view(kvh, -1, bs * d)
        v_blocks = v_cache[li].view(kvh, -1, bs * d)
        sliding = bool(self.mixed_window and self.windows[li])
        for s in seqs:
            bias = s.window_bias if sliding else s.bias
            total = s.num_tokens if bias is None else bias.shape[1]  # keys: the context so far
            keys = self._widen(k_blocks.index_select(1, s.blocks)).view(1, kvh, -1, d)[:, :, :total]
            values = self._widen(v_blocks.index_select(1, s.blocks)).view(1, kvh, -1, d)[:, :, :total]
            qs = q[s.base : s.base + s.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=bias, is_causal=bias is None,
                                                 scale=self.layer_attn_scales[li], enable_gqa=True)
            attn[s.base : s.base + s.num_tokens] = out[0].transpose(0, 1).reshape(s.num_tokens, -1)

    def _store(self, li: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write a step's new K/V ([n, kvh, d], the model's dtype) into layer li's cache slots,
        rounded to the cache dtype (an fp8 cache's after division by the layer's scales)."""
        if self._kv_bytes is None:
            self.k_cache[li].index_copy_(1, slots, k.transpose(0, 1).to(self.kv_dtype))
            self.v_cache[li].index_copy_(1, slots, v.transpose(0, 1).to(self.kv_dtype))
            return
        if self._kv_maxima is not None:
            self._kv_maxima[li] = [max(self._kv_maxima[li][0], k.abs().max().item()),
                                   max(self._kv_maxima[li][1], v.abs().max().item())]
        for cache, x, x_scale in zip(self._kv_bytes, (k, v), self.kv_scales[li]):
            if x_scale != 1.0:
                x = x / x_scale
            x8 = x.transpose(0, 1).clamp(-self._kv_max, self._kv_max).to(self.kv_dtype)
            cache[li].index_copy_(1, slots, x8.view(torch.uint8))

    def _widen(self, rows: torch.Tensor) -> torch.Tensor:
        """Cached rows (gathered, possibly as fp8 bytes) in the model's dtype."""
        if self._kv_bytes is not None:
            rows = rows.view(self.kv_dtype)
            if rows.device.type == "cpu" and cpu_attention.load() is not None:
                rows = cpu_attention.widen_fp8(rows)  # the decode kernel's widening: ~30x torch's for e4m3
        return rows.to(self.dtype)

    def _gather(self, cache: torch.Tensor, g: AttentionGroup) -> torch.Tensor:
        if self._kv_bytes is not None:
            cache = cache.view(torch.uint8)
        kvh, _, d = cache.shape
        blocks = cache.view(kvh, -1, self.block_size * d)
        return self._widen(torch.index_select(blocks, 1, g.gather_blocks)).view(kvh, g.num_seqs, -1, d)

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: AttentionGroup,
                   scale: float, sliding: bool = False) -> torch.Tensor:
        """q [B, max_q, H, d], keys/values [kvh, B, max_k, d], the softmax scale, the group's masks
        (its window_* ones for a sliding layer of a mixed stack) -> [B, max_q, H, d].

        GQA without repeating K/V: the g query heads sharing a KV head are folded into the
        query length, so each KV head is read once, and the KV head is the leading batch dim
        so the gathered K/V are used in place. SDPA's fused kernels win on CUDA; on the CPU this
        serves only decodes without the C++ kernel (prefill chunks go one sequence at a time,
        see SeqChunk), where the explicit form is as fast and was several times faster than
        SDPA's masked fallback on some shapes.
        """
        c = self.config
        B, max_q = q.shape[0], q.shape[1]
        g = c.num_heads // c.num_kv_heads
        kvh = c.num_kv_heads
        qg = q.view(B, max_q, kvh, g, c.head_dim).permute(2, 0, 3, 1, 4).reshape(kvh, B, g * max_q, c.head_dim)
        attn_bias, mask = (group.window_attn_bias, group.window_mask) if sliding else (group.attn_bias, group.mask)
        if attn_bias is not None:
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=attn_bias, scale=scale)
        else:
            scores = torch.matmul(qg * scale, keys.transpose(-1, -2))
            scores = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1)
            out = torch.matmul(scores.to(values.dtype), values)
        return out.view(kvh, B, g, max_q, c.head_dim).permute(1, 3, 0, 2, 4).reshape(B, max_q, c.num_heads, c.head_dim)

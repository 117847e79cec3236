"""Decode steps replayed from captured CUDA graphs.

Why: a decode step issues ~15 kernel launches per layer from Python. For the demo model, and
for any model at small batch sizes, a GPU step is launch-bound: the GPU waits on the host. A
captured graph replays all of a step's kernels with one launch (vLLM and SGLang do the same).

How: the decode-only forward pass (every sequence adds one token) is captured once per batch
size bucket (1, 2, 4, 8, then steps of 16 up to max_num_seqs) over static input buffers. A
step of n sequences copies its inputs into the buffers of the smallest bucket b >= n and
replays that bucket's graph; rows n..b are padding. Padding rows write their K/V only into
the runner's scratch blocks, which no sequence owns, and their logits are dropped, so they
never touch a real sequence's cache. Steps with prefill chunks, or more sequences than the
largest bucket, run eagerly.

With query tiles on (ModelRunner.query_tile > 1), buckets of at least TILED_MIN_BATCH rows are
captured a second time with the tiled kernel, for flat steps: there a prefill chunk's rows read
each K/V tile once together. Decode steps keep the untiled graphs, whose score tiles are a
single row's heads.

Capture is checked before use: the largest bucket replays a batch of distinct tokens whose
attention runs over the scratch blocks (positions 0..block_size-1 per block, like a short
prefill done token by token) and must match the eager forward pass on the same inputs. On a
mismatch or any capture error the graphs are dropped and the runner stays eager.

`capture` is pluggable so the buffer and padding logic runs on the CPU too (tests replay by
calling the forward pass again); `capture_cuda_graph` is the real one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from backend.model_runner import BatchInput, ModelRunner

Forward = Callable[[], torch.Tensor]
# (forward, memory pool) -> (replay(), the tensor replay() refreshes)
Capture = Callable[[Forward, Any], tuple[Callable[[], None], torch.Tensor]]

# Flat steps carrying a prefill chunk have at least this many rows; smaller buckets keep one set.
TILED_MIN_BATCH = 16


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 16 (padding stays under 16 rows)."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch + 16, 16)) if max_batch > 8 else small + [max_batch]


def capture_cuda_graph(forward: Forward, pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    # Two eager runs first, on a side stream as PyTorch's capture notes advise: they compile the
    # Triton kernels and create cuBLAS handles, neither of which may happen during capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
        forward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph.replay, out


def eager_replay(forward: Forward, pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """A stand-in for capture that runs the forward pass again on every replay (CPU tests)."""
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return replay, out


class DecodeGraphs:
    """Per-bucket graphs of the decode-only forward pass of one ModelRunner."""

    def __init__(self, runner: "ModelRunner", max_batch: int, capture: Capture = capture_cuda_graph) -> None:
        from backend.model_runner import AttentionGroup, BatchInput

        self.runner = runner
        dev = runner.device
        self.buckets = graph_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        # Wide enough for the longest sequence the rope table covers; the kernel reads only
        # the first ceil(context_len / block_size) entries of a row.
        self.max_blocks = -(-runner.rope_positions // runner.block_size)
        top = self.max_batch
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((top,), runner.scratch_slot, dtype=torch.long, device=dev)
        self.block_tables = torch.full((top, self.max_blocks), runner.scratch_block, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(top, dtype=torch.int32, device=dev)
        self.query_tiles = torch.ones(top, dtype=torch.int32, device=dev)
        arange = torch.arange(top, dtype=torch.long, device=dev)
        self.replays = 0  # steps served from a graph
        self.tiled_replays = 0  # of which flat steps with query tiles
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._tiled: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self._batches: dict[int, BatchInput] = {}
        self._tiled_batches: dict[int, BatchInput] = {}
        tile = runner.query_tile
        for b in self.buckets:
            group = AttentionGroup(arange[:b], arange[:b], None, None, b, 1,
                                   block_tables=self.block_tables[:b], context_lens=self.context_lens[:b])
            self._batches[b] = BatchInput(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], [group],
                                          arange[:b], max_position=0, decode_only=True)
            if tile > 1 and b >= TILED_MIN_BATCH:
                # Splits as for one chunk filling the bucket: its tiles are the programs.
                tiled = AttentionGroup(arange[:b], arange[:b], None, None, b, 1, block_tables=self.block_tables[:b],
                                       context_lens=self.context_lens[:b], query_tiles=self.query_tiles[:b],
                                       num_tiles=-(-b // tile))
                self._tiled_batches[b] = BatchInput(self.input_ids[:b], self.positions[:b], self.slot_mapping[:b],
                                                    [tiled], arange[:b], max_position=0, decode_only=True)
        pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None
        # Why the tiled graphs are not in use (their capture failed, or self_check found them or
        # the tiled kernel wrong); the decode graphs stay either way.
        self.tiled_problem: Optional[str] = None
        # Inference mode as in forward(): the captured outputs are inference tensors, which only
        # inference mode may update in place.
        with torch.inference_mode():
            self._capture(self._graphs, self._batches, capture, pool)
            try:
                self._capture(self._tiled, self._tiled_batches, capture, pool)
            except Exception as exc:
                self._tiled.clear()
                self.tiled_problem = f"capture failed: {type(exc).__name__}: {exc}"
        self._reset_padding(0, top)

    def _capture(self, graphs: dict, batches: dict, capture: Capture, pool: Any) -> None:
        for b in sorted(batches, reverse=True):  # largest first: the smaller ones reuse its memory
            self._reset_padding(0, b)
            batch = batches[b]
            graphs[b] = capture(lambda batch=batch: self.runner.eager_forward(batch), pool)

    def _reset_padding(self, start: int, end: int) -> None:
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.runner.scratch_slot
        self.block_tables[start:end, 0] = self.runner.scratch_block
        self.context_lens[start:end] = 1
        self.query_tiles[start:end] = 1

    def bucket(self, n: int) -> Optional[int]:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, batch: "BatchInput") -> Optional[torch.Tensor]:
        """The step's logits from a graph, or None when it must run eagerly."""
        if not batch.decode_only or batch.max_position >= self.runner.rope_positions:
            return None
        n = batch.input_ids.shape[0]
        b = self.bucket(n)
        if b is None:
            return None
        group = batch.groups[0]
        width = group.block_tables.shape[1]
        if width > self.max_blocks:
            return None
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.block_tables[:n, :width].copy_(group.block_tables)
        self.context_lens[:n].copy_(group.context_lens)
        if b > n:
            self._reset_padding(n, b)
        # A flat step's tiles where a tiled graph holds it; else its rows go one by one, which
        # the decode graph does as well.
        tiled = group.query_tiles is not None and b in self._tiled
        if tiled:
            self.query_tiles[:n].copy_(group.query_tiles)
            self.tiled_replays += 1
        replay, logits = (self._tiled if tiled else self._graphs)[b]
        replay()
        self.replays += 1
        # The graph computes every row's logits. A decode step wants them all, in order; a flat
        # step (prefill chunks as decode rows, ModelRunner._prepare_flat) only its logits_index.
        if batch.logits_index.shape[0] == n:
            return logits[:n].clone()
        return logits[:n].index_select(0, batch.logits_index)

    @torch.inference_mode()
    def self_check(self, atol: float = 1e-2) -> Optional[str]:
        """Replay the largest bucket on distinct tokens and compare with the eager pass; None if
        they agree, else what differed. Uses only the scratch blocks. The largest tiled graph
        replays the same rows as chunks (a scratch block's rows each) against the eager tiled
        pass, and the tiled kernel is checked against the untiled one (_check_tiles); on a
        mismatch only the tiled graphs go (tiled_problem)."""
        b = self.max_batch
        problem = self._check(self._graphs[b], self._batches[b], atol)
        if problem is None and b in self._tiled:
            # The tiled graph against the eager tiled pass (the same kernel, the same splits),
            # then the tiled kernel against the untiled one at one layer. Not the tiled graph
            # against the untiled pass: in bf16 their reduction orders differ, an output moves by
            # an ulp, and over a deep model's layers that grows past any fixed tolerance on the
            # logits (0.047 of 2.9 on a 24-layer 0.4B model, an H200).
            tiled_problem = (self._check(self._tiled[b], self._tiled_batches[b], atol, tiled=True)
                             or self._check_tiles(atol))
            if tiled_problem:
                self._tiled.clear()
                self.tiled_problem = tiled_problem
        return problem

    def _check(self, graph: tuple[Callable[[], None], torch.Tensor], eager: "BatchInput", atol: float,
               tiled: bool = False) -> Optional[str]:
        runner = self.runner
        b = self.max_batch
        bs = runner.block_size
        rows = torch.arange(b, device=self.input_ids.device)
        blocks = runner.scratch_block + rows // bs
        self.input_ids[:b] = (rows * 7919 + 13) % runner.config.vocab_size
        self.positions[:b] = rows % bs
        self.slot_mapping[:b] = blocks * bs + rows % bs
        self.block_tables[:b, 0] = blocks.to(torch.int32)
        self.context_lens[:b] = (rows % bs + 1).to(torch.int32)
        if tiled:
            from kernels import paged_attention

            chunks = [bs] * (b // bs) + ([b % bs] if b % bs else [])
            tiles = paged_attention.query_tiles(chunks, runner.query_tile)
            self.query_tiles[:b].copy_(torch.tensor(tiles, dtype=torch.int32))
        try:
            replay, logits = graph
            replay()
            got = logits.float().clone()
            want = runner.eager_forward(eager).float()
        finally:
            self._reset_padding(0, b)
        return _compare(got, want, atol, "logits")

    def _check_tiles(self, atol: float) -> Optional[str]:
        """The tiled kernel against the untiled one on the first layer's scratch blocks (their
        K/V as _check left them), read as one sequence of max_batch tokens: query tiles that
        cross blocks, each row masked at its own position, the splits the engine would use."""
        import kernels
        from kernels import paged_attention

        runner = self.runner
        c = runner.config
        b = self.max_batch
        dev = self.input_ids.device
        width = -(-b // runner.block_size)
        tables = (runner.scratch_block + torch.arange(width, dtype=torch.int32, device=dev)).expand(b, width)
        lens = torch.arange(1, b + 1, dtype=torch.int32, device=dev)
        tiles = paged_attention.query_tiles([b], runner.query_tile)
        num_tiles = sum(1 for t in tiles if t)
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn((b, c.num_heads, c.head_dim), generator=gen, device=dev).to(runner.dtype)

        def attend(query_tiles: Optional[torch.Tensor], programs: int) -> torch.Tensor:
            return kernels.paged_decode_attention(
                q, runner.k_cache[0], runner.v_cache[0], tables, lens, runner.block_size, runner.layer_attn_scales[0],
                window=runner.windows[0], splits=runner._splits(programs, width), query_tiles=query_tiles,
                tile_tokens=runner.query_tile if query_tiles is not None else 1, use_triton=True).float()

        got = attend(torch.tensor(tiles, dtype=torch.int32, device=dev), num_tiles)
        want = attend(None, b)
        return _compare(got, want, atol, "tiled attention")


def _compare(got: torch.Tensor, want: torch.Tensor, atol: float, what: str) -> Optional[str]:
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)} against {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1.0)
    return None if err <= atol * scale else f"max abs difference {err:.4g} ({what} up to {scale:.4g})"

"""The paged KV cache's bookkeeping: one pool of fixed-size blocks and per-sequence block tables.

The tensors themselves live in the model runner; this module only decides which block ids a
sequence owns. Block 0.. num_blocks-1 are all interchangeable.
"""

from __future__ import annotations

from collections import deque

from backend.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, int] = {}  # block id -> seq id, to catch double frees early

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs so its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.num_blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"KV cache out of blocks: need {needed}, have {len(self._free)}")
        for _ in range(needed):
            block = self._free.popleft()
            self._owner[block] = seq.seq_id
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            if self._owner.pop(block, None) != seq.seq_id:
                raise RuntimeError(f"block {block} freed by a sequence that does not own it")
            self._free.append(block)
        seq.block_table = []

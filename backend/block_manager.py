"""The paged KV cache's bookkeeping: one pool of fixed-size blocks and per-sequence block tables.

The tensors themselves live in the model runner; this module only decides which block ids a
sequence owns. With prefix caching, a *full* block is content-addressed by a hash chained over
every token up to and including it, so two sequences with a common prefix (system prompt, chat
history, the n samples of one prompt) share the blocks of that prefix, reference-counted. A
block whose last owner finishes keeps its contents and its hash: it sits in the free list, in
least-recently-freed order, and is either found again by a later prefix or reused (evicted)
when fresh blocks are needed.

With sliding-window attention in every layer (Mistral's), a block wholly behind the window is
never read again: it is released as the sequence moves on (vLLM's sliding-window manager), so a
long sequence holds about window / block_size blocks, not its whole length. Its table entry
stays, pointing at block 0, so positions keep their index: attention never reads it (the
decode kernels start at the window; where a path gathers every block, the window's mask hides it,
as it hides the tables' block-0 padding). A prompt found in the cache takes only the cached blocks
its window sees, for the same reason: the pool is sized for a window, not for a whole prefix. And
only those need be found: the head blocks, released first, are the first evicted.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence as Seq

from backend.sequence import Sequence


@dataclass
class _Block:
    ref_count: int = 0
    hash: Optional[int] = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent: Optional[int], token_ids: Seq[int]) -> int:
    return hash((parent, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 sliding_window: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if sliding_window < 0:
            raise ValueError("sliding_window must be 0 (off) or positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Every layer's window (0: full attention somewhere, nothing is released early).
        self.sliding_window = sliding_window
        self._blocks = [_Block() for _ in range(num_blocks)]
        # Free blocks, oldest-freed first: allocation takes from the front, so a cached block
        # survives as long as possible. Values unused (an ordered set).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[int, int] = {}
        # Every hash chain starts from this process's random root (vLLM's random NONE_HASH, after
        # CVE-2025-25183): Python's hash of a tuple of ints is the same in every process, so
        # without it a client could compute which prompts collide with another's cached blocks.
        self._root = secrets.randbits(61)
        # Prompt tokens looked up in / found in the cache (prefix-cache hit rate).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._blocks[block].ref_count

    # ------------------------------------------------------------- prefix cache
    def match_prefix(self, seq: Sequence) -> list[Optional[int]]:
        """Cached blocks holding a prefix of `seq`'s tokens (not taken yet), one entry per block
        of the prefix.

        With full attention that is the leading run of cached blocks. With a sliding window only
        the blocks the first computed token's window sees must be cached (vLLM's sliding-window
        lookup): the longest prefix whose window blocks are all found is taken, and the entries
        behind its window may be None (evicted, and never read again). The hash chain is over
        tokens, so a block is found whatever became of those before it.
        At least one token is always left to compute: its logits are what the next step samples.
        """
        if not self.enable_prefix_caching or seq.block_table or not seq.prefix_cacheable:
            return []
        bs = self.block_size
        full = (seq.num_tokens - 1) // bs
        found: list[Optional[int]] = []
        best = 0  # longest prefix (in blocks) whose visible blocks are all cached
        run_start = 0  # first block of the run of cached blocks that ends at the current one
        parent: Optional[int] = self._chain_start(seq)
        for i in range(full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block = self._by_hash.get(parent)
            if block is None or self._blocks[block].token_ids != tokens:
                if not self.sliding_window:
                    break
                found.append(None)
                run_start = i + 1
                continue
            found.append(block)
            if run_start <= self._behind_window(i + 1):
                best = i + 1
        return found[:best]

    def _blocks_behind(self, position: int) -> int:
        """Leading blocks wholly behind the window of the query at `position` (it sees keys from
        position - window + 1 on): never read again. 0 without a sliding window."""
        if not self.sliding_window:
            return 0
        return max(0, (position - self.sliding_window + 1) // self.block_size)

    def _behind_window(self, num_hits: int) -> int:
        """How many of `num_hits` leading hits the first token computed after them cannot see:
        not taken."""
        return min(num_hits, self._blocks_behind(num_hits * self.block_size))

    def can_admit(self, seq: Sequence, hits: list[Optional[int]], num_tokens: int) -> bool:
        """Whether `seq` can take `hits` and grow its table to cover `num_tokens` tokens."""
        # With a sliding window the pool is sized for a window, not a whole prefix: counting the
        # hits behind it could exceed the pool for good, and the request waited forever.
        reclaimed = sum(1 for b in hits[self._behind_window(len(hits)):] if self._blocks[b].ref_count == 0)
        fresh = max(0, self.blocks_for(num_tokens) - len(hits))
        return fresh + reclaimed <= len(self._free)

    def take_prefix(self, seq: Sequence, hits: list[Optional[int]]) -> int:
        """Give `seq` the cached blocks; returns the number of tokens they cover."""
        self.num_queried_tokens += seq.num_tokens
        behind = self._behind_window(len(hits))
        # Their table entries point at block 0, as free_behind_window leaves them.
        seq.block_table.extend([0] * behind)
        seq.num_window_freed = behind
        for block in hits[behind:]:
            b = self._blocks[block]
            if b.ref_count == 0:
                del self._free[block]
            b.ref_count += 1
            seq.block_table.append(block)
        cached = len(hits) * self.block_size
        self.num_hit_tokens += cached
        seq.num_hashed_blocks = len(hits)
        seq.block_hash = chain_hash_of(seq.token_ids, len(hits), self.block_size, self._chain_start(seq))
        return cached

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks `seq` has just filled, so later prefixes can find them."""
        if not self.enable_prefix_caching or not seq.prefix_cacheable:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if seq.num_hashed_blocks == 0:
            seq.block_hash = self._chain_start(seq)
        for i in range(seq.num_hashed_blocks, full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(seq.block_hash, tokens)
            block = seq.block_table[i]
            b = self._blocks[block]
            if h not in self._by_hash and b.hash is None:
                b.hash, b.token_ids = h, tokens
                self._by_hash[h] = block
            seq.block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def _chain_start(self, seq: Sequence) -> int:
        """The hash a sequence's chain starts from: the root, and its salt (a LoRA adapter's
        load, a client's cache_salt), so only sequences with the same salt share blocks."""
        return hash((self._root, seq.cache_salt))

    # ------------------------------------------------------------- allocation
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
            block, _ = self._free.popitem(last=False)
            b = self._blocks[block]
            if b.hash is not None:  # evict the cached contents
                if self._by_hash.get(b.hash) == block:
                    del self._by_hash[b.hash]
                b.hash, b.token_ids = None, ()
            b.ref_count = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        for block in reversed(seq.block_table[seq.num_window_freed:]):
            self._release(block)
        seq.block_table = []
        seq.num_window_freed = 0
        seq.num_hashed_blocks = 0
        seq.block_hash = None

    def free_behind_window(self, seq: Sequence) -> int:
        """Release the blocks `seq`'s next tokens can no longer see; returns how many. Call it
        once the step's K/V are stored (and its full blocks registered): the next query, at
        position num_computed_tokens, sees keys from num_computed_tokens - window + 1 on."""
        if not self.sliding_window:
            return 0
        dead = min(len(seq.block_table), self._blocks_behind(seq.num_computed_tokens))
        released = 0
        for i in range(seq.num_window_freed, dead):
            self._release(seq.block_table[i])
            seq.block_table[i] = 0
            released += 1
        seq.num_window_freed = max(seq.num_window_freed, dead)
        return released

    def _release(self, block: int) -> None:
        b = self._blocks[block]
        if b.ref_count <= 0:
            raise RuntimeError(f"block {block} freed more often than it was taken")
        b.ref_count -= 1
        if b.ref_count == 0:
            self._free[block] = None
            if b.hash is None:
                self._free.move_to_end(block, last=False)  # uncached: reuse first

    def reset_prefix_cache(self) -> int:
        """Forget the cached contents of every block nobody holds; returns how many."""
        forgotten = 0
        for h, block in list(self._by_hash.items()):
            b = self._blocks[block]
            if b.ref_count == 0:
                b.hash, b.token_ids = None, ()
                del self._by_hash[h]
                forgotten += 1
        return forgotten


def chain_hash_of(token_ids: Seq[int], num_blocks: int, block_size: int, salt: Optional[int] = None) -> Optional[int]:
    h: Optional[int] = salt
    for i in range(num_blocks):
        h = chain_hash(h, token_ids[i * block_size : (i + 1) * block_size])
    return h

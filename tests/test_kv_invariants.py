"""Randomized runs of the scheduler and block manager against a simulated KV cache.

Each run drives `Scheduler` + `BlockManager` the way the engine does (schedule, compute the
scheduled chunks, publish full blocks, append a sampled token, finish) under random traffic:
prompts built from a few shared prefixes over a tiny vocabulary (so prefix hits are common,
also on generated tokens), n > 1 siblings that wait for each other's prefill, LoRA-like cache
salts, requests that may not use the cache, both scheduling policies, random aborts of waiting
and running sequences, prefix-cache resets, and a pool small enough that preemption is routine.

The simulated cache stores, in every slot a sequence writes, the identity of what it computed
there (its salt and every token up to that position). After every step these must hold:

* every position a running sequence has computed reads back its own identity from its block
  table: sharing, eviction and preemption never hand a sequence someone else's K/V;
* a sequence only writes into blocks it owns alone;
* reference counts equal the number of block tables holding each block, a block is in the free
  list exactly when nobody holds it, and the hash index names only blocks that carry that hash;
* the system makes progress: once arrivals stop, everything finishes within a bound.

At the end, after everything finished or was aborted, every block is free.
"""

from __future__ import annotations

import random
from typing import Optional

import pytest

from backend.block_manager import BlockManager
from backend.sampling_params import SamplingParams
from backend.scheduler import Scheduler
from backend.sequence import FinishReason, Sequence, SequenceStatus

BLOCK_SIZE = 4


class Simulation:
    def __init__(self, rng: random.Random, policy: str, caching: bool) -> None:
        self.rng = rng
        self.num_blocks = rng.randint(12, 40)
        self.max_model_len = self.num_blocks * BLOCK_SIZE  # the engine's guarantee
        self.bm = BlockManager(self.num_blocks, BLOCK_SIZE, enable_prefix_caching=caching)
        self.sched = Scheduler(
            self.bm,
            max_num_seqs=rng.randint(2, 12),
            max_num_batched_tokens=rng.choice([8, 16, 32, 64]),
            max_prefill_tokens_while_decoding=rng.choice([None, 4, 12]),
            policy=policy,
        )
        self.policy = policy
        self.live: list[Sequence] = []
        self.slots: dict[int, tuple] = {}  # slot -> identity of the K/V written there
        self.prefixes = [[rng.randrange(3) for _ in range(rng.randint(1, 24))] for _ in range(3)]
        self.counter = 0
        self.steps = 0

    # -- traffic ------------------------------------------------------------------------------
    def arrive(self) -> None:
        rng = self.rng
        prompt = list(rng.choice(self.prefixes)) if rng.random() < 0.7 else []
        prompt += [rng.randrange(3) for _ in range(rng.randint(1 if prompt else 2, 20))]
        prompt = prompt[: self.max_model_len - 1]
        max_new = rng.randint(0 if rng.random() < 0.05 else 1, max(1, min(24, self.max_model_len - len(prompt))))
        salt = rng.choice([None, None, 11, 12])
        cacheable = rng.random() < 0.9
        priority = rng.randint(-2, 2) if self.policy == "priority" else 0
        n = rng.choice([1, 1, 1, 2, 3])
        first: Optional[Sequence] = None
        for i in range(n):
            self.counter += 1
            seq = Sequence(request_id=f"r{self.counter}", token_ids=list(prompt),
                           params=SamplingParams(priority=priority), max_new_tokens=max_new)
            seq.cache_salt, seq.prefix_cacheable, seq.index = salt, cacheable, i
            if first is None:
                first = seq
            elif cacheable and self.bm.enable_prefix_caching:
                seq.wait_for = first  # as the engine does for the n samples of one prompt
            self.sched.add(seq)
            self.live.append(seq)

    def abort_one(self) -> None:
        if self.live:
            seq = self.rng.choice(self.live)
            self.sched.finish(seq, FinishReason.ABORT)
            self.live.remove(seq)

    # -- one engine step ----------------------------------------------------------------------
    def identity(self, seq: Sequence, pos: int) -> tuple:
        return seq.cache_salt, tuple(seq.token_ids[: pos + 1])

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    def step(self) -> None:
        self.steps += 1
        scheduled = self.sched.schedule()
        seen = set()
        for item in scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            assert seq.request_id not in seen, "a sequence scheduled twice in one step"
            seen.add(seq.request_id)
            assert seq.status is SequenceStatus.RUNNING and seq in self.sched.running
            assert n >= 1 and start + n <= seq.num_tokens
            assert len(seq.block_table) * BLOCK_SIZE >= start + n, "chunk beyond the allocated blocks"
            # Attention reads [0, start): every one of those slots must hold this sequence's K/V.
            for pos in range(start):
                assert self.slots.get(self.slot(seq, pos)) == self.identity(seq, pos), (
                    f"{seq.request_id} reads foreign K/V at position {pos}")
        for item in scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            for pos in range(start, start + n):
                block = seq.block_table[pos // BLOCK_SIZE]
                assert self.bm.ref_count(block) == 1, f"{seq.request_id} writes into shared block {block}"
                self.slots[self.slot(seq, pos)] = self.identity(seq, pos)
        for item in scheduled:
            seq = item.seq
            samples = item.samples  # before the chunk counts as computed, as in the engine
            seq.num_computed_tokens += item.num_new_tokens
            self.bm.register_full_blocks(seq)
            if seq.max_new_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                self.finish(seq, FinishReason.LENGTH)
            elif samples:
                seq.token_ids.append(self.rng.randrange(3))
                if seq.num_output_tokens >= seq.max_new_tokens:
                    self.finish(seq, FinishReason.LENGTH)
                elif self.rng.random() < 0.03:
                    self.finish(seq, FinishReason.STOP)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.sched.finish(seq, reason)
        self.live.remove(seq)

    # -- invariants ---------------------------------------------------------------------------
    def check(self) -> None:
        bm, sched = self.bm, self.sched
        holders = [0] * self.num_blocks
        for seq in self.live:
            assert not seq.is_finished
            assert (seq in sched.running) == (seq.status is SequenceStatus.RUNNING)
            if seq.status is SequenceStatus.WAITING:
                assert seq in sched.waiting and not seq.block_table and seq.num_computed_tokens == 0
            else:
                assert len(seq.block_table) == len(set(seq.block_table))
                # Covers what it computed, and no more than its tokens need.
                assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
                assert len(seq.block_table) <= bm.blocks_for(seq.num_tokens)
                for pos in range(seq.num_computed_tokens):
                    assert self.slots.get(self.slot(seq, pos)) == self.identity(seq, pos)
            for block in seq.block_table:
                holders[block] += 1
        assert len(sched.running) + len(sched.waiting) == len(self.live)
        assert len(sched.running) <= sched.max_num_seqs
        free = set(bm._free)
        for block in range(self.num_blocks):
            assert bm.ref_count(block) == holders[block], f"block {block}: refcount vs tables"
            assert (block in free) == (holders[block] == 0), f"block {block}: free list vs holders"
        for h, block in bm._by_hash.items():
            assert bm._blocks[block].hash == h
        for block, b in enumerate(bm._blocks):
            if b.hash is not None:
                assert bm._by_hash.get(b.hash) == block
                assert len(b.token_ids) == BLOCK_SIZE

    def run(self, arrival_steps: int) -> None:
        rng = self.rng
        for _ in range(arrival_steps):
            # Bursts, but a bounded backlog: the queue must stay small enough to drain.
            if len(self.live) < 24 and rng.random() < 0.3:
                for _ in range(rng.choice([1, 1, 2, 4])):
                    self.arrive()
            if rng.random() < 0.08:
                self.abort_one()
            if rng.random() < 0.02:
                self.bm.reset_prefix_cache()
            self.step()
            self.check()
        # No more arrivals: everything must drain, without livelock.
        bound = 40 * (len(self.live) + 1) * (self.max_model_len // 8 + 1)
        drain = 0
        while self.sched.has_work():
            drain += 1
            assert drain <= bound, f"no progress: {len(self.live)} sequences left after {drain} steps"
            self.step()
            self.check()
        assert not self.live
        assert self.bm.num_free_blocks == self.num_blocks and self.bm.num_used_blocks == 0
        assert all(self.bm.ref_count(b) == 0 for b in range(self.num_blocks))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_keeps_kv_invariants(seed: int, policy: str, caching: bool) -> None:
    sim = Simulation(random.Random(f"{seed}-{policy}-{caching}"), policy, caching)
    sim.run(arrival_steps=150)
    if caching:
        assert sim.bm.num_hit_tokens > 0 or sim.counter < 3  # the traffic does exercise sharing


def test_random_traffic_preempts_and_shares() -> None:
    """The randomized runs reach the hard cases, not only the easy ones."""
    preemptions = hits = 0
    for seed in range(12):
        sim = Simulation(random.Random(f"{seed}-fcfs-True"), "fcfs", True)
        sim.run(arrival_steps=150)
        preemptions += sim.sched.num_preemptions
        hits += sim.bm.num_hit_tokens
    assert preemptions > 20 and hits > 1000, (preemptions, hits)


def test_aborting_everything_mid_flight_frees_every_block() -> None:
    for seed in range(6):
        sim = Simulation(random.Random(seed), "fcfs", True)
        for _ in range(40):
            sim.arrive()
            sim.step()
            sim.check()
        while sim.live:
            sim.abort_one()
            sim.check()
        assert not sim.sched.has_work()
        assert sim.bm.num_free_blocks == sim.num_blocks

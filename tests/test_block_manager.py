import pytest

from backend.block_manager import BlockManager
from backend.sampling_params import SamplingParams
from backend.scheduler import Scheduler
from backend.sequence import FinishReason, Sequence, SequenceStatus


def _seq(n_prompt: int, max_new: int = 8, priority: int = 0) -> Sequence:
    return Sequence(request_id=f"r{n_prompt}-{id(object())}", token_ids=list(range(1, n_prompt + 1)),
                    params=SamplingParams(priority=priority), max_new_tokens=max_new)


def test_allocate_grows_by_blocks_and_frees_all():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _seq(5)
    bm.allocate(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    bm.allocate(s, 8)  # still fits in 2 blocks
    assert len(s.block_table) == 2
    bm.allocate(s, 9)
    assert len(s.block_table) == 3
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8


def test_allocation_failure_and_double_free_are_errors():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = _seq(4)
    assert not bm.can_allocate(s, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(s, 9)
    bm.allocate(s, 4)
    other = _seq(3)
    other.block_table = list(s.block_table)  # a table the pool never handed out twice
    bm.free(other)
    with pytest.raises(RuntimeError):
        bm.free(s)


def test_priority_policy_orders_admission_budget_and_preemption():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, policy="priority")
    late_low, urgent, mid_a, mid_b = _seq(4, priority=5), _seq(4, priority=-1), _seq(4, priority=1), _seq(4, priority=1)
    for s in (late_low, mid_a, urgent, mid_b):
        sched.add(s)
    assert list(sched.waiting) == [urgent, mid_a, mid_b, late_low]  # priority, then arrival
    assert [s.seq for s in sched.schedule()] == [urgent, mid_a]  # max_num_seqs 2
    for s in (urgent, mid_a):
        s.num_computed_tokens = 4
        s.token_ids += [7] * 8  # both grow: 12 tokens need 3 blocks each, the pool has 6
    sched.max_num_seqs = 3
    sched.running.reverse()  # whatever order they ran in, the budget goes by priority
    step = sched.schedule()
    assert [s.seq for s in step] == [urgent, mid_a] and bm.num_free_blocks == 0

    # The pool is full: growing urgent preempts the last in priority order (mid_a), which waits
    # ahead of mid_b (same priority, earlier arrival).
    urgent.num_computed_tokens = mid_a.num_computed_tokens = 12
    urgent.token_ids += [7] * 4
    step = sched.schedule()
    assert [s.seq for s in step] == [urgent] and mid_a.num_preemptions == 1
    assert list(sched.waiting) == [mid_a, mid_b, late_low]

    fcfs = Scheduler(BlockManager(num_blocks=6, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [_seq(4, priority=p) for p in (5, -1, 1)]
    for s in seqs:
        fcfs.add(s)
    assert list(fcfs.waiting) == seqs  # arrival order only


def test_scheduler_respects_token_budget_with_chunked_prefill():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    long, short = _seq(25), _seq(3)
    sched.add(long)
    sched.add(short)
    step = sched.schedule()
    assert [(s.seq is long, s.num_new_tokens) for s in step] == [(True, 10)]
    assert not step[0].samples  # a partial prefill draws no token
    long.num_computed_tokens += 10
    step = sched.schedule()
    assert [s.num_new_tokens for s in step] == [10]
    long.num_computed_tokens += 10
    step = sched.schedule()
    # The rest of the long prompt (5) and the whole short prompt (3) share the step.
    assert sorted(s.num_new_tokens for s in step) == [3, 5]
    assert all(s.samples for s in step)


def test_prefill_cap_while_decoding_weighs_tokens_by_context():
    """While others decode, a chunk deep into a long prompt gets fewer tokens (its attention
    costs more), never fewer than MIN_PREFILL_CHUNK; an idle batch prefills at full budget."""
    from backend.scheduler import MIN_PREFILL_CHUNK

    bm = BlockManager(num_blocks=2048, block_size=16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=128,
                      prefill_context_unit=1024)
    long = _seq(21000)
    sched.add(long)
    assert [s.num_new_tokens for s in sched.schedule()] == [2048]  # nothing decodes: whole budget
    long.num_computed_tokens = 0
    decoder = _seq(4)
    decoder.num_computed_tokens = 4
    decoder.token_ids.append(9)  # one token to decode
    sched.running.insert(0, decoder)
    bm.allocate(decoder, 5)
    sizes = {}
    for start in (0, 1024, 3072, 7000, 20000):
        long.num_computed_tokens = start
        step = {item.seq is long: item.num_new_tokens for item in sched.schedule()}
        assert step[False] == 1  # the decode always goes
        sizes[start] = step[True]
    assert sizes == {0: 128, 1024: 64, 3072: 32, 7000: 16, 20000: MIN_PREFILL_CHUNK}
    plain = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=128)
    plain.running = [decoder, long]
    long.num_computed_tokens = 3072
    assert [s.num_new_tokens for s in plain.schedule()] == [1, 128]


def _add_decoders(sched: Scheduler, num_decoders: int) -> None:
    """`num_decoders` running sequences, each with one token to decode."""
    for _ in range(num_decoders):
        d = _seq(4)
        d.num_computed_tokens = 4
        d.token_ids.append(9)
        sched.block_manager.allocate(d, 5)
        sched.running.append(d)


def _step_beside_decoders(sched: Scheduler, num_decoders: int) -> tuple[int, int]:
    """One step of `sched` with `num_decoders` sequences decoding and a 3000-token prompt
    waiting: (the prompt's chunk, the step's tokens). Every block is freed afterwards."""
    bm = sched.block_manager
    _add_decoders(sched, num_decoders)
    long = _seq(3000)
    sched.add(long)
    step = sched.schedule()
    (chunk,) = [item.num_new_tokens for item in step if item.seq is long]
    total = sum(item.num_new_tokens for item in step)
    for item in step:
        bm.free(item.seq)
    return chunk, total


def test_prefill_cap_while_decoding_grows_with_the_decode_batch():
    """With prefill_tokens_per_decode, the cap is the larger of the fixed cap and that many
    tokens per decoding sequence: a few decoders keep the fixed cap, a large batch admits more."""
    bm = BlockManager(num_blocks=4096, block_size=16)

    def prefill_tokens(num_decoders: int) -> int:
        sched = Scheduler(bm, max_num_seqs=128, max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=128,
                          prefill_tokens_per_decode=6)
        chunk, total = _step_beside_decoders(sched, num_decoders)
        assert total == chunk + num_decoders  # every decode goes
        return chunk

    assert prefill_tokens(0) == 2048  # nothing decodes: the whole budget
    assert prefill_tokens(4) == 128  # 4 x 6 < 128: the fixed cap
    assert prefill_tokens(40) == 240
    assert prefill_tokens(64) == 384
    assert bm.num_free_blocks == bm.num_blocks


def test_prefill_cap_is_lifted_while_more_requests_wait_than_run():
    """A burst (more waiting than running) admits with the whole budget; a long prompt arriving
    beside running streams, or a queue no deeper than the batch, stays capped; ratio 0: always."""
    def first_step(ratio: float, num_decoders: int, num_waiting: int, max_num_seqs: int = 128) -> tuple[int, int]:
        bm = BlockManager(num_blocks=4096, block_size=16)
        sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=96,
                          prefill_context_unit=640, prefill_tokens_per_decode=6, prefill_cap_queue_ratio=ratio)
        _add_decoders(sched, num_decoders)
        for _ in range(num_waiting):
            sched.add(_seq(300))
        step = sched.schedule()
        assert sum(1 for item in step if item.num_new_tokens == 1) == num_decoders  # every decode goes
        prefill = sum(item.num_new_tokens for item in step if item.num_new_tokens > 1)
        for item in step:
            bm.free(item.seq)
        assert bm.num_free_blocks == bm.num_blocks
        return prefill, len(sched.waiting)

    # 8 streams, 9 waiting: the whole budget (6 prompts of 300, a chunk of the 7th); 2 still wait.
    assert first_step(1.0, 8, 9) == (2048 - 8, 2)
    assert first_step(1.0, 8, 8) == (96, 7)  # no deeper than the batch: capped, one chunk
    assert first_step(1.0, 8, 1) == (96, 0)  # a prompt arriving beside the streams: capped
    assert first_step(2.0, 8, 16) == (96, 15)  # the ratio sets the depth
    assert first_step(2.0, 8, 17)[0] == 2048 - 8
    assert first_step(0.0, 8, 60) == (96, 59)  # 0: never lifted
    assert first_step(1.0, 8, 60, max_num_seqs=9) == (300, 59)  # a seat left: lifted, one comes in
    # Every seat taken: no one waiting can come in, so a running prompt's chunk stays capped.
    bm = BlockManager(num_blocks=4096, block_size=16)
    sched = Scheduler(bm, max_num_seqs=9, max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=96,
                      prefill_tokens_per_decode=6, prefill_cap_queue_ratio=1.0)
    _add_decoders(sched, 8)
    long = _seq(3000)
    long.num_computed_tokens = 16
    bm.allocate(long, 16)
    sched.running.append(long)
    for _ in range(60):
        sched.add(_seq(300))
    assert [item.num_new_tokens for item in sched.schedule() if item.seq is long] == [96]


def test_scheduler_preempts_newest_when_pool_runs_dry():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _seq(4), _seq(4)
    sched.add(a)
    sched.add(b)
    for item in sched.schedule():
        item.seq.num_computed_tokens += item.num_new_tokens
    assert bm.num_free_blocks == 2
    # Both grow past their first block, then past their second: b must give way to a.
    for s in (a, b):
        s.token_ids += [7] * 5
    step = sched.schedule()
    assert [s.seq for s in step] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.num_preemptions == 1 and sched.waiting[0] is b
    sched.finish(a, FinishReason.STOP)
    assert bm.num_free_blocks == 4
    sched.finish(b, FinishReason.ABORT)
    assert bm.num_free_blocks == 4 and not sched.has_work()


# ---------------------------------------------------------------- prefix caching


def _tokens_seq(tokens: list[int]) -> Sequence:
    return Sequence(request_id=f"t-{id(object())}", token_ids=list(tokens), params=SamplingParams(), max_new_tokens=8)


def _admit_and_compute(sched: Scheduler, seq: Sequence) -> None:
    sched.add(seq)
    for item in sched.schedule():
        item.seq.num_computed_tokens += item.num_new_tokens
        sched.block_manager.register_full_blocks(item.seq)


def test_common_prefix_shares_full_blocks_refcounted():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prefix = list(range(100, 112))  # 3 full blocks
    a = _tokens_seq(prefix + [1, 2])
    _admit_and_compute(sched, a)
    assert bm.num_cached_blocks == 3
    b = _tokens_seq(prefix + [3, 4, 5])
    sched.add(b)
    step = sched.schedule()
    assert [(i.seq is b, i.num_new_tokens) for i in step if i.seq is b] == [(True, 3)]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert all(bm.ref_count(blk) == 2 for blk in a.block_table[:3])
    assert bm.num_hit_tokens == 12
    sched.finish(a, FinishReason.STOP)
    assert all(bm.ref_count(blk) == 1 for blk in b.block_table[:3])
    sched.finish(b, FinishReason.STOP)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks >= 3


def test_whole_prompt_hit_still_computes_one_token():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    tokens = list(range(50, 58))  # exactly 2 blocks
    a = _tokens_seq(tokens)
    _admit_and_compute(sched, a)
    sched.finish(a, FinishReason.STOP)
    b = _tokens_seq(tokens)
    sched.add(b)
    (item,) = sched.schedule()
    assert b.num_cached_tokens == 4 and item.num_new_tokens == 4 and item.samples


def test_cached_free_blocks_are_evicted_lru_when_pool_is_needed():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = _tokens_seq(list(range(10, 19)))  # 2 full blocks cached + 1 partial
    _admit_and_compute(sched, a)
    sched.finish(a, FinishReason.STOP)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    big = _tokens_seq(list(range(200, 216)))  # needs the whole pool: evicts the cache
    _admit_and_compute(sched, big)
    assert len(big.block_table) == 4 and bm.num_free_blocks == 0
    sched.finish(big, FinishReason.STOP)
    again = _tokens_seq(list(range(10, 19)))
    assert bm.match_prefix(again) == []


def test_reset_prefix_cache_forgets_only_blocks_nobody_holds():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    done = _tokens_seq(list(range(10, 19)))  # 2 full blocks
    _admit_and_compute(sched, done)
    sched.finish(done, FinishReason.STOP)
    running = _tokens_seq(list(range(30, 39)))  # 2 full blocks, held
    _admit_and_compute(sched, running)
    assert bm.num_cached_blocks == 4
    assert bm.reset_prefix_cache() == 2
    assert bm.match_prefix(_tokens_seq(list(range(10, 19)))) == []
    assert len(bm.match_prefix(_tokens_seq(list(range(30, 39))))) == 2  # still shareable
    assert bm.reset_prefix_cache() == 0


def test_different_content_never_hits_and_disabled_cache_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a = _tokens_seq(list(range(1, 10)))
    _admit_and_compute(sched, a)
    b = _tokens_seq(list(range(1, 10)))
    assert bm.match_prefix(b) == []
    bm2 = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    sched2 = Scheduler(bm2, max_num_seqs=8, max_num_batched_tokens=64)
    _admit_and_compute(sched2, _tokens_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm2.match_prefix(_tokens_seq([1, 2, 3, 5, 5, 6, 7, 8, 9])) == []
    assert len(bm2.match_prefix(_tokens_seq([1, 2, 3, 4, 0, 0, 0, 0, 9]))) == 1


def test_prefill_is_capped_while_others_decode():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=8)
    short = _seq(3)
    _admit_and_compute(sched, short)
    short.token_ids.append(9)  # now decoding
    long = _seq(40)
    sched.add(long)
    step = sched.schedule()
    assert sorted((i.seq is long, i.num_new_tokens) for i in step) == [(False, 1), (True, 8)]
    # Alone, a prompt gets the whole budget.
    bm2 = BlockManager(num_blocks=64, block_size=4)
    sched2 = Scheduler(bm2, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=8)
    sched2.add(_seq(40))
    assert [i.num_new_tokens for i in sched2.schedule()] == [40]


def test_sliding_window_releases_the_blocks_behind_it():
    # window 8, blocks of 4: the next query at position p sees keys p-7..p, so the blocks
    # wholly below p-7 go back to the pool; their entries stay (block 0) to keep positions.
    bm = BlockManager(num_blocks=8, block_size=4, sliding_window=8)
    s = _seq(20)
    bm.allocate(s, 20)
    held = list(s.block_table)
    assert bm.free_behind_window(s) == 0  # nothing computed yet
    s.num_computed_tokens = 11  # next query at 11 sees 4..11: block 0 (0..3) is behind
    assert bm.free_behind_window(s) == 1
    assert s.block_table == [0] + held[1:] and bm.num_free_blocks == 4 and bm.ref_count(held[0]) == 0
    s.num_computed_tokens = 20  # sees 13..20: blocks 1 and 2 (4..11) are behind, block 3 (12..15) is not
    assert bm.free_behind_window(s) == 2 and bm.free_behind_window(s) == 0
    assert s.block_table[:3] == [0, 0, 0] and s.block_table[3:] == held[3:] and s.num_window_freed == 3
    bm.allocate(s, 21)  # grows by position: the released entries still count as the table's length
    assert len(s.block_table) == 6
    bm.free(s)  # only what it still holds
    assert bm.num_free_blocks == 8 and s.num_window_freed == 0 and s.block_table == []
    # Off without a window: full attention reads every block.
    full = BlockManager(num_blocks=8, block_size=4)
    t = _seq(20)
    full.allocate(t, 20)
    t.num_computed_tokens = 20
    assert full.free_behind_window(t) == 0 and full.num_free_blocks == 3


def test_sliding_window_release_keeps_shared_and_cached_blocks():
    # A block shared through the prefix cache stays with its other holder; released by its
    # last holder it keeps its contents (cached, free, found by a later prompt). A prompt takes
    # only the cached blocks its window sees: the pool is sized for a window, not a prefix.
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True, sliding_window=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    prefix = list(range(100, 112))  # 3 full blocks
    a = _tokens_seq(prefix + [1, 2, 3, 4, 5, 6])
    _admit_and_compute(sched, a)
    shared = a.block_table[:3]
    b = _tokens_seq(prefix + [3, 4, 5])
    sched.add(b)
    sched.schedule()
    # b's first computed token, at 12, sees 9..12: of the three hits it holds only the last
    assert b.num_cached_tokens == 12 and b.block_table[:3] == [0, 0, shared[2]] and b.num_window_freed == 2
    assert [bm.ref_count(x) for x in shared] == [1, 1, 2]
    assert bm.free_behind_window(a) == 3  # a's next query at 18 sees 15..18: blocks 0-2 behind
    assert [bm.ref_count(x) for x in shared] == [0, 0, 1] and bm.num_cached_blocks == 4
    sched.finish(b, FinishReason.STOP)
    sched.finish(a, FinishReason.STOP)
    assert bm.num_free_blocks == 16 and all(bm.ref_count(x) == 0 for x in shared)
    assert bm.match_prefix(_tokens_seq(prefix + [9])) == shared


def test_sliding_window_prefix_is_found_when_blocks_behind_its_window_were_evicted():
    # Window 8, blocks of 4. A long sequence releases its head blocks as it moves on, so they are
    # the first evicted. A prompt sharing its prefix needs only the blocks its first computed
    # token sees: the hash chain is over tokens, so those are found without the evicted head.
    # The lookup stopped at the first miss, block 0, and recomputed the whole prefix.
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=True, sliding_window=8)
    prefix = list(range(100, 124))  # 6 full blocks
    a = _tokens_seq(prefix + [1])
    bm.allocate(a, 25)
    a.num_computed_tokens = 24
    bm.register_full_blocks(a)
    held = list(a.block_table)
    assert bm.free_behind_window(a) == 4  # the query at 24 sees 17..24: blocks 0-3 released
    c = _seq(12)
    bm.allocate(c, 12)  # two never-used blocks, then the oldest released: prefix block 0
    assert held[0] in c.block_table and bm.num_cached_blocks == 5
    b = _tokens_seq(prefix + [7, 8, 9])
    hits = bm.match_prefix(b)
    assert hits == [None] + held[1:6]
    # b's first computed token, at 24, sees 17..24: blocks 4 and 5, both held by a
    assert bm.can_admit(b, hits, 27)
    assert bm.take_prefix(b, hits) == 24 and b.block_table == [0, 0, 0, 0] + held[4:6] and b.num_window_freed == 4
    assert [bm.ref_count(x) for x in held[4:6]] == [2, 2]
    # A miss inside the window shortens the match to the longest prefix whose window is whole:
    # with block 4 gone, 4 blocks (the query at 16 sees 9..16: blocks 2 and 3).
    bm.free(b)
    bm.free(a)
    bm.free(c)
    bm._by_hash.pop(next(h for h, blk in bm._by_hash.items() if blk == held[4]))
    assert bm.match_prefix(_tokens_seq(prefix + [7])) == [None] + held[1:4]
    # Full attention reads every block: the match still ends at the first miss.
    full = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=True)
    d = _tokens_seq(prefix + [1])
    full.allocate(d, 25)
    d.num_computed_tokens = 24
    full.register_full_blocks(d)
    head = d.block_table[0]
    full.free(d)
    assert len(full.match_prefix(_tokens_seq(prefix + [7]))) == 6
    full._by_hash.pop(next(h for h, blk in full._by_hash.items() if blk == head))
    assert full.match_prefix(_tokens_seq(prefix + [7])) == []


def test_flat_steps_cut_chunks_to_fit_while_others_decode():
    """flat_step_tokens (EngineConfig.flat_prefill_tokens): while streams decode, a chunk takes at
    most what the flat size leaves beside the decodes, so the whole step stays flat (on CUDA a
    decode graph). With too many decodes for a chunk of MIN_PREFILL_CHUNK, the usual cap holds
    (the step runs in the general layout); an idle batch keeps the whole budget."""
    bm = BlockManager(num_blocks=4096, block_size=16)

    def step_sizes(num_decoders: int, flat: int) -> tuple[int, int]:
        sched = Scheduler(bm, max_num_seqs=128, max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=512,
                          flat_step_tokens=flat)
        return _step_beside_decoders(sched, num_decoders)

    assert step_sizes(8, 128) == (120, 128)  # decodes + chunk = the flat size
    assert step_sizes(8, 0) == (512, 520)  # off: the usual cap
    assert step_sizes(120, 128) == (512, 632)  # 8 left < MIN_PREFILL_CHUNK: the usual cap
    assert step_sizes(0, 128) == (2048, 2048)  # nothing decodes: the whole budget
    assert bm.num_free_blocks == bm.num_blocks


def test_block_hashes_start_from_a_random_root_per_pool():
    # CVE-2025-25183 (vLLM): Python hashes a tuple of ints alike in every process, so a client
    # could compute block hashes and craft prompts that collide with another's cached blocks.
    from backend.block_manager import chain_hash

    hashes = []
    for _ in range(2):
        bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
        seq = _tokens_seq(list(range(10, 19)))
        _admit_and_compute(sched, seq)
        hashes.append(seq.block_hash)
        assert len(bm.match_prefix(_tokens_seq(list(range(10, 19))))) == 2  # still found in its own pool
    unrooted = chain_hash(chain_hash(None, range(10, 14)), range(14, 18))
    assert hashes[0] != hashes[1] and unrooted not in hashes

"""bench/load_clients.py: the closed loop shared out among client processes (ClientPool)."""

import asyncio
import os
import sys
import time

import pytest

from bench.load_clients import ClientPool, Rec, closed_loop, split_loop


def fake_requester(delay: float):
    """A requester for the pool's processes (imported there by name): each request sleeps
    `delay` and names the process that served it."""
    in_flight = [0, 0]  # now, most at once

    async def request(i: int) -> Rec:
        rec = Rec(start=time.perf_counter(), tokens=i)
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await asyncio.sleep(delay)
        in_flight[0] -= 1
        rec.text = f"{os.getpid()} {in_flight[1]}"
        rec.end = time.perf_counter()
        return rec

    async def close() -> None:
        pass

    return request, close


@pytest.fixture
def pool():
    p = ClientPool(f"{__name__}:fake_requester", (0.05,), 2)
    yield p
    p.close()


def _served(recs: list[Rec]) -> tuple[set[int], int]:
    """(the processes that served the records, the most requests one had in flight at once)"""
    pairs = [tuple(map(int, r.text.split())) for r in recs]
    return {pid for pid, _ in pairs}, max(n for _, n in pairs)


def test_pool_shares_the_loop_and_keeps_the_order(pool):
    recs, wall = asyncio.run(closed_loop(pool, list(range(16)), 4))
    assert [r.tokens for r in recs] == list(range(16)) and all(r.error is None for r in recs)
    pids, most = _served(recs)
    assert pids == set(pool.pids) and os.getpid() not in pids
    assert most == 2  # concurrency 4 over 2 processes
    # 4 rounds of 4 at once (no upper bound: under a loaded CI the 0.2 s took 2.9 s; `most` above
    # shows they ran at once).
    assert wall >= 16 / 4 * 0.05
    # The processes (and their requesters) live on: the next loop runs on the same ones.
    again, _ = asyncio.run(closed_loop(pool, [5, 3, 9], 3))
    assert [r.tokens for r in again] == [5, 3, 9] and _served(again)[0] <= set(pool.pids)


def test_pool_below_its_size_uses_fewer_processes(pool):
    recs, wall = asyncio.run(closed_loop(pool, list(range(4)), 1))
    pids, most = _served(recs)
    assert len(pids) == 1 and most == 1 and [r.tokens for r in recs] == [0, 1, 2, 3]
    assert wall >= 4 * 0.05  # one at a time


def test_pool_processes_leave_the_main_module_alone():
    main = sys.modules["__main__"]
    before = (main.__dict__.get("__spec__"), main.__dict__.get("__file__"))
    p = ClientPool(f"{__name__}:fake_requester", (0.0,), 2)
    try:
        assert (main.__dict__.get("__spec__"), main.__dict__.get("__file__")) == before
        assert len(set(p.pids)) == 2
    finally:
        p.close()
    with pytest.raises(ValueError):
        ClientPool(f"{__name__}:fake_requester", (0.0,), 1)  # one process: the requester itself


def test_requests_are_shared_in_proportion_to_each_processs_clients(pool):
    # QA: 12 requests at concurrency 3 over 2 processes were split 6/6 with 2/1 clients, so the
    # one-client process ran on alone and the level's tail ran below its concurrency.
    shares, clients = split_loop(list(range(12)), 3, 2)
    assert clients == [2, 1] and [len(s) for s in shares] == [8, 4]
    assert sorted(shares[0] + shares[1]) == list(range(12))
    shares, clients = split_loop([7, 1, 4, 2, 9], 4, 2)  # even split, any indices, in order
    assert clients == [2, 2] and shares == [[7, 4, 9], [1, 2]]
    recs, _ = asyncio.run(closed_loop(pool, list(range(12)), 3))
    by_pid: dict[int, int] = {}
    for r in recs:
        pid = int(r.text.split()[0])
        by_pid[pid] = by_pid.get(pid, 0) + 1
    assert sorted(by_pid.values()) == [4, 8]

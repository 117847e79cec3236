"""bench/chunked_probe.py's fit of a chunk step's time to its tokens and the keys they read."""

import pytest

from bench.chunked_probe import chunk_cost_fit


def _row(starts, tokens, fixed_ms, token_us, key_ns):
    keys = [t * s + t * (t + 1) / 2 for s, t in zip(starts, tokens)]
    ms = [fixed_ms + 1e-3 * token_us * t + 1e-6 * key_ns * k for t, k in zip(tokens, keys)]
    return {"mixed_step_ms": ms, "chunk_start": starts, "chunk_tokens": tokens}


def test_the_fit_recovers_the_costs_from_chunks_of_varied_sizes():
    level = _row([0, 120, 240, 360], [120, 120, 120, 120], 3.5, 2.0, 25.0)
    weighted = _row([0, 120, 200, 260, 310], [120, 80, 60, 50, 0], 3.5, 2.0, 25.0)  # a step without a chunk: left out
    fit = chunk_cost_fit([level, weighted])
    assert fit["fixed_ms"] == pytest.approx(3.5) and fit["per_token_us"] == pytest.approx(2.0)
    assert fit["per_row_key_ns"] == pytest.approx(25.0) and fit["r2"] == pytest.approx(1.0) and fit["steps"] == 8


def test_no_fit_where_every_chunk_is_alike():
    # One size at one context per step: the fixed and the per-token cost cannot be told apart.
    same = _row([0, 0, 0, 0], [64, 64, 64, 64], 3.5, 2.0, 25.0)
    assert chunk_cost_fit([same]) is None
    assert chunk_cost_fit([_row([0, 64], [64, 64], 1.0, 1.0, 1.0)]) is None  # too few steps

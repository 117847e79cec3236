"""bench/kv_cache_dtype.py's --attention timing goes through the CPU kernel's own wrapper, so a
kernel argument added later (the sliding window's) cannot break it unseen."""

import pytest

from kernels import cpu_attention


@pytest.mark.skipif(cpu_attention.load() is None, reason="the C++ CPU attention kernel did not build")
def test_attention_times_runs_the_cpu_kernel_per_cache_dtype():
    from bench.kv_cache_dtype import attention_times

    got = attention_times(["float32", "fp8"], threads=1)
    assert set(got) == {"float32", "fp8"} and all(ms > 0 for ms in got.values()), got

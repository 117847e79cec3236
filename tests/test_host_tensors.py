"""backend.host_tensors: the same tensors torch.tensor would build, on the CPU without a copy."""

from __future__ import annotations

import pytest
import torch

from backend.host_tensors import HUGE_PAGE, host_tensor, on_device, page_aligned_zeros


@pytest.mark.parametrize(
    "data, dtype",
    [([3, 1, 4], torch.int64), ([[1, 2], [3, 4]], torch.int32), ([0.5, 1.25], torch.float32),
     ([True, False], torch.bool), ([], torch.int64), ([2**63 - 1], torch.int64)],
)
def test_host_tensor_matches_torch_tensor(data, dtype):
    got = host_tensor(data, dtype, torch.device("cpu"))
    want = torch.tensor(data, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert host_tensor(data, dtype, "cpu").device.type == "cpu"


def test_host_tensor_refuses_what_torch_refuses():
    with pytest.raises(OverflowError):
        host_tensor([2**63], torch.int64, "cpu")


def test_on_device_returns_the_same_tensor_when_it_is_already_there():
    t = torch.arange(4)
    assert on_device(t, torch.device("cpu")) is t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_page_aligned_zeros_are_zeros_on_a_huge_page_boundary(dtype):
    t = page_aligned_zeros((2, 3, 5000, 32), dtype)
    assert t.shape == (2, 3, 5000, 32) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.view(torch.uint8).any()
    t[1, 2, 4999] = 1  # writable to its last row
    assert t.view(torch.uint8).count_nonzero() > 0


def test_page_aligned_zeros_take_memory_only_as_they_are_written():
    import gc

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = resident()
    t = page_aligned_zeros((64, 1 << 20), torch.float32)  # 256 MiB
    gc.collect()  # the mapping lives as long as the tensor, not its builder's locals
    assert resident() - before < (32 << 20) and not t[::4096].any()
    t[7].fill_(2.5)
    assert float(t[7].sum()) == 2.5 * (1 << 20) and float(t.sum()) == 2.5 * (1 << 20)
    del t
    gc.collect()


def test_the_cpu_kv_cache_starts_on_a_page(demo_model_path):
    from backend.model_runner import ModelRunner

    runner = ModelRunner(demo_model_path, num_blocks=8, block_size=16, device="cpu")
    for cache in (runner.k_cache, runner.v_cache):
        assert cache.data_ptr() % 4096 == 0 and not cache.any()

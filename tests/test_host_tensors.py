"""backend.host_tensors: the same tensors torch.tensor would build, on the CPU without a copy."""

from __future__ import annotations

import pytest
import torch

from backend.host_tensors import host_tensor, on_device


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

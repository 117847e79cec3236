"""Small index/parameter tensors built from Python lists without letting go of the GIL.

`torch.tensor(list)` releases the GIL for its final copy, and `.to(device)` releases it even
when the tensor is already there (then takes it back inside the op to fix the PyObject's
refcount). Each release lets another thread take the GIL, and the step loop waits to get it
back; inside tritonserver the llm stub's response threads are such threads. numpy builds the
array holding the GIL and `from_numpy` wraps it without a copy: 2.8 us for a 64-element index
tensor against 8.3 us for `torch.tensor` (6.4 us with `.to("cpu")`), about 15 of them a step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bool: np.bool_,
}


def host_tensor(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(data, dtype=dtype, device=device), holding the GIL throughout on the CPU."""
    t = torch.from_numpy(np.asarray(data, dtype=_NUMPY[dtype]))
    return t if torch.device(device).type == "cpu" else t.to(device)


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`, without the no-op `.to()` (and its GIL round trip) when it is already there."""
    return t if t.device == device else t.to(device)

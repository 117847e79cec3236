"""An engine stepped by hand, the device synchronized around each step and each forward pass,
so their times are the work's, not the launch's (bench/chunked_probe.py, bench/decode_probe.py)."""

from __future__ import annotations

import time
from typing import Any

import torch


class HandStepped:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.cuda = engine.model.device.type == "cuda"
        self.forward_ms: list[float] = []  # every forward pass since the caller last cleared it
        model_forward = engine.model.forward

        def timed_forward(batch: Any) -> torch.Tensor:
            self.sync()
            t = time.perf_counter()
            out = model_forward(batch)
            self.sync()
            self.forward_ms.append(1e3 * (time.perf_counter() - t))
            return out

        engine.model.forward = timed_forward

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def step(self) -> float:
        """One engine step; its wall time in ms."""
        self.sync()
        t = time.perf_counter()
        self.engine.step()
        self.sync()
        return 1e3 * (time.perf_counter() - t)

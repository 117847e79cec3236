"""Which engine requests a Triton request id names, for aborts that come as separate requests.

Cancelling an ensemble stream does not reach the llm model's running request in Triton 2.51,
so the frontend aborts a request by sending the llm model its Triton request id
(`abort_request_id`). Such an abort can overtake the request it names: the request may still
be in the ensemble's preprocessing step when the abort reaches the llm model. An abort that
finds nothing is therefore remembered for a while, and a request arriving under that id is
aborted as soon as it is added. An abort for an id whose request has already finished is a
no-op, as in SGLang: remembered, it would abort the next request a client sends under that id.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable


class TritonRequestIndex:
    def __init__(self, remember_s: float = 60.0, max_remembered: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._remember_s = remember_s
        self._max_remembered = max_remembered
        self._clock = clock
        self._lock = threading.Lock()
        self._engine_ids: dict[str, set[str]] = {}
        self._early_aborts: OrderedDict[str, float] = OrderedDict()  # triton id -> when
        self._finished: OrderedDict[str, float] = OrderedDict()  # triton id -> when its last request ended

    def add(self, triton_id: str, engine_id: str) -> bool:
        """Index a new engine request; True when an abort for its Triton id came first."""
        with self._lock:
            self._expire()
            if self._early_aborts.pop(triton_id, None) is not None:
                return True
            self._engine_ids.setdefault(triton_id, set()).add(engine_id)
            return False

    def forget(self, triton_id: str, engine_id: str) -> None:
        with self._lock:
            ids = self._engine_ids.get(triton_id)
            if ids is not None:
                ids.discard(engine_id)
                if not ids:
                    del self._engine_ids[triton_id]
                    self._remember(self._finished, triton_id)

    def abort(self, triton_id: str) -> set[str]:
        """The engine requests to abort for `triton_id`; none yet means remember the abort."""
        with self._lock:
            ids = self._engine_ids.pop(triton_id, None)
            if ids:
                return ids
            self._expire()
            if triton_id not in self._finished:
                self._remember(self._early_aborts, triton_id)
            return set()

    def _remember(self, table: OrderedDict[str, float], triton_id: str) -> None:
        table[triton_id] = self._clock()
        table.move_to_end(triton_id)
        while len(table) > self._max_remembered:
            table.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._engine_ids)

    def _expire(self) -> None:
        cutoff = self._clock() - self._remember_s
        for table in (self._early_aborts, self._finished):
            while table:
                triton_id, when = next(iter(table.items()))
                if when >= cutoff:
                    break
                del table[triton_id]

"""Which engine requests a Triton request id names, for aborts that come as separate requests.

Cancelling an ensemble stream does not reach the llm model's running request in Triton 2.51,
so the frontend aborts a request by sending the llm model its Triton request id
(`abort_request_id`). Such an abort can overtake the request it names: the request may still
be in the ensemble's preprocessing step when the abort reaches the llm model. An abort that
finds nothing is therefore remembered for a while, and a request arriving under that id is
aborted as soon as it is added. An abort for an id whose request has already finished is a
no-op, as in SGLang: remembered, it would abort the next request a client sends under that id.

The OpenAI frontend names its Triton requests `<client id>@<frontend id>.<suffix>`
(`client_of`), so a frontend can also abort by the id its client knows (SGLang's rid) without
holding the stream itself: its other worker processes, and replicas sharing its frontend id,
hold theirs (`abort_client`). Those aborts are not remembered: they take what is running.

A client that named its request (SGLang's `rid`) gets a suffix `rid-<hex>` (`NAMED_SUFFIX`):
such an id runs once at a time per frontend id. A second one while the first runs is refused
(`DuplicateRequestId`), whichever of the frontend's worker processes sent each; each process
also refuses its own duplicates before sending.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Iterable, Optional

from backend.sequence import sample_request_id


def client_of(triton_id: str) -> Optional[tuple[str, str]]:
    """(client id, frontend id) of a Triton request id `<client id>@<frontend id>.<suffix>`;
    None for an id not of that form. Parsed from the right: a client id may hold '@' and '.'."""
    head, dot, _ = triton_id.rpartition(".")
    client_id, at, frontend = head.rpartition("@")
    if not dot or not at or not frontend:
        return None
    return client_id, frontend


NAMED_SUFFIX = "rid-"
# After NAMED_SUFFIX (if both): prompt i of a batch named `<id>_<i>` or `<id>-<i>` by the frontend;
# only such a request answers an abort for `<id>` (a request its client named `job_1` is not job's).
BATCH_ITEM_SUFFIX = "b-"


class DuplicateRequestId(ValueError):
    """A client-named request id is already running (SGLang's "Duplicate request ID detected")."""

    def __init__(self, client_id: str) -> None:
        super().__init__(f"Duplicate request ID detected: {client_id}")


def named_client(triton_id: str) -> Optional[tuple[str, str]]:
    """(client id, frontend id) of a request its client named (suffix NAMED_SUFFIX), else None."""
    c = client_of(triton_id)
    return c if c is not None and triton_id.rpartition(".")[2].startswith(NAMED_SUFFIX) else None


def is_batch_item(triton_id: str) -> bool:
    return triton_id.rpartition(".")[2].removeprefix(NAMED_SUFFIX).startswith(BATCH_ITEM_SUFFIX)


def sample_of(rid: str, client_id: str) -> Optional[int]:
    """i when `rid` is `<client_id>_<i>`: with n > 1, sample i of the request `client_id` reports
    that id (meta_info.id), and an abort by it ends that sample only, as SGLang's parallel
    samples each have a rid of their own."""
    head, sep, tail = rid.rpartition("_")
    return int(tail) if sep and head == client_id and tail.isdigit() else None


def names_client(rid: str, client_id: str, batch_item: bool = True) -> bool:
    """Whether an abort for `rid` takes the request of `client_id`: the request itself, or, when
    it is a batch item, prompt i of the batch request `rid`, whose ids are `<rid>_<i>` on
    /generate (SGLang's naming) and `<rid>-<i>` on /v1/completions."""
    if client_id == rid:
        return True
    if not batch_item:
        return False
    tail = client_id[len(rid) + 1 :]
    return bool(rid) and client_id.startswith(rid) and client_id[len(rid) : len(rid) + 1] in ("_", "-") and tail.isdigit()


class TritonRequestIndex:
    def __init__(self, remember_s: float = 60.0, max_remembered: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._remember_s = remember_s
        self._max_remembered = max_remembered
        self._clock = clock
        self._lock = threading.Lock()
        self._engine_ids: dict[str, set[str]] = {}
        self._samples: dict[str, int] = {}  # engine id -> its n, when n > 1
        self._aborted_samples: dict[str, set[int]] = {}  # engine id -> samples abort_client ended
        # (name, frontend id) -> the running Triton id that goes by it: a client-named request's
        # id and, with n > 1, its samples' `<id>_<i>` (the frontend's _claims, across workers).
        self._named: dict[tuple[str, str], str] = {}
        self._claims: dict[str, set[tuple[str, str]]] = {}  # Triton id -> its names in _named
        self._early_aborts: OrderedDict[str, float] = OrderedDict()  # triton id -> when
        self._finished: OrderedDict[str, float] = OrderedDict()  # triton id -> when its last request ended

    def add(self, triton_id: str, engine_id: str, n: int = 1, chosen: bool = False) -> bool:
        """Index a new engine request; True when an abort for its Triton id came first. Raises
        DuplicateRequestId when its client named it and that name is running already.

        `chosen`: the client named it by a request parameter (`rid`, Triton HTTP clients), as
        SGLang's rid: a name runs once at a time, and an abort that found nothing running under
        it is not held against a later request (QA: a retry after aborting a refused request,
        or a mistyped abort, ended the next request of that name)."""
        with self._lock:
            self._expire()
            if chosen:
                if triton_id in self._engine_ids:
                    raise DuplicateRequestId(triton_id)
                self._early_aborts.pop(triton_id, None)
            named = named_client(triton_id)
            claims: list[tuple[str, str]] = []
            if named is not None:
                client_id, frontend = named
                # QA: the samples' names were reserved only by the frontend worker that ran the
                # request, so another worker sent a second request under `<id>_0`, and one abort
                # by that name ended both.
                names = [client_id] + ([f"{client_id}_{i}" for i in range(n)] if n > 1 else [])
                claims = [(name, frontend) for name in names]
                for claim in claims:
                    running = self._named.get(claim)
                    if running is not None and running != triton_id:
                        raise DuplicateRequestId(claim[0])
            if self._early_aborts.pop(triton_id, None) is not None:
                return True
            self._engine_ids.setdefault(triton_id, set()).add(engine_id)
            if n > 1:
                self._samples[engine_id] = n
            for claim in claims:
                self._named[claim] = triton_id
                self._claims.setdefault(triton_id, set()).add(claim)
            return False

    def forget(self, triton_id: str, engine_id: str) -> None:
        with self._lock:
            ids = self._engine_ids.get(triton_id)
            if ids is not None:
                ids.discard(engine_id)
                self._drop_samples((engine_id,))
                if not ids:
                    del self._engine_ids[triton_id]
                    self._unname(triton_id)
                    self._remember(self._finished, triton_id)

    def _unname(self, triton_id: str) -> None:
        for claim in self._claims.pop(triton_id, ()):
            if self._named.get(claim) == triton_id:
                del self._named[claim]

    def abort(self, triton_id: str) -> set[str]:
        """The engine requests to abort for `triton_id`; none yet means remember the abort."""
        with self._lock:
            ids = self._engine_ids.pop(triton_id, None)
            if ids:
                self._drop_samples(ids)
                self._unname(triton_id)
                # Ended here, so forget() will not see it end: a repeated abort must find it
                # finished, not be remembered as one that came first for the next request.
                self._remember(self._finished, triton_id)
                return ids
            self._expire()
            if triton_id not in self._finished:
                self._remember(self._early_aborts, triton_id)
            return set()

    def abort_client(self, frontend: str, rid: Optional[str]) -> tuple[int, set[str]]:
        """Every running request frontend `frontend` sent (for client `rid` only, see
        names_client, when given), or the one sample `rid` names (sample_of): how many Triton
        requests or samples, and the engine requests to end."""
        with self._lock:
            taken, samples = [], []
            for t, ids in self._engine_ids.items():
                c = client_of(t)
                if c is None or c[1] != frontend:
                    continue
                if rid is None or names_client(rid, c[0], is_batch_item(t)):
                    taken.append(t)
                elif (i := sample_of(rid, c[0])) is not None:
                    samples += [(e, i) for e in ids if i < self._samples.get(e, 0)]
            engine_ids: set[str] = set()
            for triton_id in taken:
                ids = self._engine_ids.pop(triton_id)
                self._drop_samples(ids)
                engine_ids |= ids
                self._unname(triton_id)
                self._remember(self._finished, triton_id)
            # A sample's request runs on for its siblings, so it stays indexed; a second abort of
            # the same sample finds nothing new to end.
            count = len(taken)
            for engine_id, i in samples:
                ended = self._aborted_samples.setdefault(engine_id, set())
                if i not in ended:
                    ended.add(i)
                    engine_ids.add(sample_request_id(engine_id, i, self._samples[engine_id]))
                    count += 1
            return count, engine_ids

    def _drop_samples(self, engine_ids: Iterable[str]) -> None:
        for engine_id in engine_ids:
            self._samples.pop(engine_id, None)
            self._aborted_samples.pop(engine_id, None)

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
